"""The router's API as Python: what every front door (gRPC, OpenAI HTTP, KServe) drives.

A request comes in as the public API's `GenerateRequest` and its messages go out as
`GenerateResponse`s, whichever protocol the client speaks: the gateways translate to and
from these, so there is one path to the workers and one set of checks. Errors are the
domain's (`core.errors`); each edge maps them to its own statuses.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

import grpc

from pdserve.api.v1 import common_pb2, router_pb2
from pdserve.core.errors import AlreadyExistsError, InvalidRequestError, UnknownRequestError
from pdserve.core.model_config import ModelConfig
from pdserve.core.phase import RequestPhase
from pdserve.core.sampling_params import (
    RequestLimits,
    SamplingParams,
    check_prompt_token_ids,
    check_request,
)
from pdserve.engine.grammar import GrammarCompiler
from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.admission import AdmissionQueue
from pdserve.router.auth.caller import Caller, current_caller
from pdserve.router.auth.limits import KeyLimiter
from pdserve.router.cancel_bus import CancelBus
from pdserve.router.handoff import Attempt
from pdserve.router.runner import RequestRunner
from pdserve.router.session import RequestSession, retry_safe, sampling_from_record
from pdserve.rpc.wire import is_final, sampling_params_from_proto
from pdserve.rpc.wire.router import append_response, replay_response
from pdserve.state.checkpoint_reader import OwnerLostError
from pdserve.state.record import MAX_REQUEST_ID_BYTES, RequestRecord, request_digest
from pdserve.state.requests import RequestStore
from pdserve.telemetry.request import RequestTelemetry

# The sampling parameters' field path: as the engine names it, and in the public API.
_ENGINE_SAMPLING, PUBLIC_SAMPLING = "sampling_params", "sampling"
# Texts up to this long are tokenized on the event loop (about 1 us a character: under a
# millisecond), longer ones on TOKENIZE_THREADS threads so the loop serves other calls.
INLINE_TOKENIZE_CHARS = 2048
TOKENIZE_THREADS = 2


class ResumeOutOfRangeError(InvalidRequestError):
    """resume_from points past the end of a finished request's output."""

    out_of_range = True


def check_same_request(record: RequestRecord, digest: str) -> None:
    """A call reusing a request's id gets its output only if it asks what the request
    asked (`record.request_digest`), else AlreadyExistsError: the id alone is no proof of
    being its client."""
    if not hmac.compare_digest(record.request_digest.encode(), digest.encode()):
        raise id_taken(record.request_id)


def replayed_failure(record: RequestRecord) -> grpc.aio.AioRpcError:
    """A failed request's error, for a call that re-attaches to it: the status it
    failed with (UNKNOWN for a record that does not name one) and its message. Never
    an empty stream that looks finished."""
    code = grpc.StatusCode.__members__.get(record.error_code, grpc.StatusCode.UNKNOWN)
    details = f"the request failed: {record.error or 'no reason recorded'}"
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def id_taken(request_id: str) -> AlreadyExistsError:
    return AlreadyExistsError(
        "request_id",
        f"{request_id!r} is taken by a request with another prompt or other parameters",
    )


class Frontend:
    """Runs, replays and cancels requests; knows the model the router serves."""

    def __init__(
        self,
        *,
        model_name: str,
        tokenizer: Tokenizer,
        model_config: ModelConfig,
        max_model_len: int,
        runner: RequestRunner,
        store: RequestStore,
        cancel_bus: CancelBus,
        router_id: str,
        limits: RequestLimits,
        admission: AdmissionQueue,
        limiter: KeyLimiter | None = None,
    ):
        self.model_name = model_name  # what clients ask for; in spans, metrics and logs
        self.tokenizer, self.model_config = tokenizer, model_config
        self.max_model_len = max_model_len
        self.runner, self.store, self.cancel_bus = runner, store, cancel_bus
        self.router_id = router_id
        self.limits, self.admission = limits, admission  # what a request may hold; slots
        self._tokenize_pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="tokenize")
        # structured outputs: each request's constraint compiled here first (cached), so a
        # bad one is refused before any worker reserves KV for it
        self.grammars = GrammarCompiler(
            tokenizer,
            model_config.vocab_size,
            {*tokenizer.eos_token_ids, *model_config.eos_token_ids},
        )
        self.sessions: dict[str, RequestSession] = {}  # the requests running here
        self.limiter = limiter  # counts API keys' tokens per minute; None: no keys

    async def generate(
        self,
        request: router_pb2.GenerateRequest,
        *,
        timeout_s: float | None = None,
        caller: Caller | None = None,
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        """The request's messages (one without `request.stream`), to its final one.

        A known `request_id` re-attaches to that request (any router's) from
        `resume_from` if the call asks for the same (prompt and sampling), and is
        AlreadyExistsError otherwise; `timeout_s` is how long the client waits for the
        whole answer. `caller` (default: the gRPC call's, `current_caller()`) owns the id:
        the router stores and runs it in the caller's key's namespace (`Caller.scoped_id`),
        so another key's same id is another request; its tokens count against its key.
        """
        caller = caller or current_caller()
        num_tokens = 0  # what the caller's tokens per minute count: prompt and output
        try:
            async for message in self._generate(request, timeout_s, caller):
                message.request_id = caller.client_id(message.request_id)
                num_tokens += len(message.token_ids)
                if is_final(message):
                    num_tokens = message.usage.prompt_tokens + message.usage.completion_tokens
                yield message
        except UnknownRequestError as exc:
            raise UnknownRequestError(caller.client_id(exc.request_id)) from None
        except AlreadyExistsError:
            raise id_taken(request.request_id) from None
        finally:
            if self.limiter is not None:
                self.limiter.count_tokens(caller, num_tokens)

    async def _generate(
        self, request: router_pb2.GenerateRequest, timeout_s: float | None, caller: Caller
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        received_at = time.monotonic()
        self.check_limits(request)
        prompt = await self.prompt_ids(request)
        params = self.checked_params(request.sampling, prompt)
        await self.check_constraint(params)
        digest = request_digest(prompt, params)  # what the client asked: before retry_safe
        request_id = caller.scoped_id(request.request_id or uuid.uuid4().hex)
        offset = request.resume_from if request.HasField("resume_from") else 0
        deadline = None if timeout_s is None else received_at + timeout_s
        ttft_deadline = received_at + request.ttft_slo_ms / 1000 if request.ttft_slo_ms else None
        new_attempt = functools.partial(  # what each try needs but its sampling
            Attempt,
            request_id,
            prompt,
            deadline=deadline,
            priority=request.priority,
            ttft_deadline=ttft_deadline,
        )

        def take_over(lost: RequestRecord) -> RequestSession:  # its router died: run it here
            sampling = sampling_from_record(lost, request.sampling)
            attempt = new_attempt(sampling)
            return self._session(attempt, digest, time.monotonic())

        replay = functools.partial(self._replay, request_id, digest=digest, offset=offset)
        replay = functools.partial(replay, stream=request.stream, take_over=take_over)
        if request.request_id and (record := await self.store.get(request_id)) is not None:
            async for message in replay(record):
                yield message
            return
        if request.HasField("resume_from"):
            raise UnknownRequestError(request_id)
        async with self.admission.slot(request.priority):  # may wait in the queue
            sampling = retry_safe(request.sampling, params)
            attempt = new_attempt(sampling)
            session = self._session(attempt, digest, received_at)
            if not await session.open(start_first=not request.request_id):
                record = await self.store.get(request_id)  # another call won the race for the id
                async for message in replay(record):
                    yield message  # follow it, if it asked the same
                return
            async for message in self._run_here(session, request.stream):
                yield message

    def _session(self, attempt: Attempt, digest: str, received_at: float) -> RequestSession:
        telemetry = RequestTelemetry(
            attempt.request_id,
            attempt.sampling,
            model=self.model_name,
            prompt_tokens=len(attempt.prompt),
            priority=attempt.priority,
            ttft_slo_ms=attempt.ttft_slo_ms(received_at),
        )
        return RequestSession(
            attempt,
            runner=self.runner,
            store=self.store,
            request_digest=digest,
            router_id=self.router_id,
            received_at=received_at,
            telemetry=telemetry,
        )

    async def _run_here(self, session: RequestSession, stream: bool):
        self.sessions[session.request_id] = session
        try:
            async for message in session.responses(stream):
                yield message
        finally:
            self.sessions.pop(session.request_id, None)

    async def _replay(
        self,
        request_id: str,
        record: RequestRecord | None,
        *,
        digest: str,
        offset: int,
        stream: bool,
        take_over: Callable[[RequestRecord], RequestSession],
    ):
        """Re-attach to a request (any router's) from `offset`, following it to its end,
        if this call (its `digest`) asks what the request asked (`check_same_request`)."""
        if record is None:  # gone (expired) since the call that found it taken
            raise UnknownRequestError(request_id)
        check_same_request(record, digest)
        collected = router_pb2.GenerateResponse(request_id=request_id, offset=offset)
        async for message in self._follow(request_id, offset, take_over):
            if stream:
                yield message
            else:
                append_response(collected, message)
        if not stream:
            yield collected

    async def _follow(self, request_id: str, offset: int, take_over):
        """The request's messages from `offset` as its router checkpoints them. If that
        router is lost (its record stopped moving), or the request failed asking its
        client to try again (`RequestRecord.may_run_again`), this router takes the
        request over and runs it on from where its client stands
        (`RequestSession.take_over`). Any other failure is raised as it was."""
        position = offset
        while True:
            stopped: RequestRecord | None = None  # a run that ended before its request
            token_ids, text = [], ""  # what landed since the follow's last read
            try:
                async for ids, delta_text, final in self.store.follow(request_id, position):
                    failed = final is not None and final.status is RequestPhase.FAILED
                    if ids or delta_text or not failed:
                        end = None if failed else final
                        yield replay_response(request_id, position, ids, delta_text, end)
                    position += len(ids)
                    if failed and not final.may_run_again:
                        raise replayed_failure(final)
                    stopped = final if failed else None
            except ValueError as exc:
                raise ResumeOutOfRangeError("resume_from", str(exc)) from exc
            except OwnerLostError as lost:
                stopped = lost.record
                token_ids, text = await self.store.read_tokens(request_id, position)
            if stopped is None:
                return
            session = take_over(stopped)
            if await session.take_over(stopped, position + len(token_ids)) is None:
                continue  # another router took it over first: follow that one
            if token_ids or text:
                yield replay_response(request_id, position, token_ids, text, None)
            async for message in self._run_here(session, stream=True):
                yield message
            return

    async def cancel(self, request_id: str, *, caller: Caller | None = None) -> bool:
        """Cancel `caller`'s running request, here or on another router; False if it had
        ended. UnknownRequestError for an id that is not `caller`'s."""
        stored_id = (caller or current_caller()).scoped_id(request_id)
        session = self.sessions.get(stored_id)
        if session is not None:
            session.cancel()
            return True
        record = await self.store.get(stored_id)
        if record is None:
            raise UnknownRequestError(request_id)
        if record.status.is_terminal:
            return False
        await self.cancel_bus.publish(stored_id)  # the router running it cancels it
        return True

    async def get(self, request_id: str, *, caller: Caller | None = None) -> RequestRecord:
        """`caller`'s request as Redis has it, under the id the caller knows;
        UnknownRequestError for an id that is not `caller`'s."""
        record = await self.store.get((caller or current_caller()).scoped_id(request_id))
        if record is None:
            raise UnknownRequestError(request_id)
        return dataclasses.replace(record, request_id=request_id)

    async def cancel_local(self, request_id: str) -> None:
        """Another router asked (through Redis) to cancel a request running here."""
        session = self.sessions.get(request_id)
        if session is not None:
            session.cancel()

    def checked_params(
        self, sampling: common_pb2.SamplingParams, prompt: list[int]
    ) -> SamplingParams:
        """The request's sampling parameters, validated; errors name the public field."""
        try:
            params = sampling_params_from_proto(sampling)
            check_request(prompt, params, self.model_config.vocab_size, self.max_model_len)
        except InvalidRequestError as exc:
            # The engine names SamplingParams' fields; callers know them as `sampling`.
            if not exc.field.startswith(_ENGINE_SAMPLING):
                raise
            field = PUBLIC_SAMPLING + exc.field.removeprefix(_ENGINE_SAMPLING)
            raise InvalidRequestError(field, exc.message) from exc
        return params

    async def check_constraint(self, params: SamplingParams) -> None:
        """Compile the request's constraint, if it has one, on a thread (a compile takes up
        to the compiler's bound): InvalidRequestError naming `sampling.<kind>`."""
        if params.constraint is not None:
            field = f"{PUBLIC_SAMPLING}.{params.constraint.kind.value}"
            check = functools.partial(self.grammars.check, params.constraint, field)
            await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, check)

    def check_limits(self, request: router_pb2.GenerateRequest) -> None:
        """What the request holds, within the router's limits, before any of it is
        tokenized (InvalidRequestError naming the field and the limit)."""
        if len(request.request_id.encode()) > MAX_REQUEST_ID_BYTES:
            raise InvalidRequestError(
                "request_id", f"exceeds the limit of {MAX_REQUEST_ID_BYTES} bytes (UTF-8)"
            )
        self.limits.check_stop(request.sampling.stop, PUBLIC_SAMPLING + ".stop")
        if request.WhichOneof("prompt") == "token_ids":
            self.limits.check_num_tokens(len(request.token_ids.ids), "prompt.token_ids")

    async def tokenize(
        self, text: str, *, field: str = "prompt.text", add_special_tokens: bool = True
    ) -> list[int]:
        """`text`'s token ids, if it is within --max-prompt-bytes (InvalidRequestError
        naming `field` otherwise). A long text is tokenized on a thread of the router's
        tokenizer pool (the tokenizer lets go of the GIL), so the event loop serves other
        calls meanwhile: a 1 MB text takes about a second."""
        self.limits.check_text(text, field)
        encode = functools.partial(
            self.tokenizer.encode, text, add_special_tokens=add_special_tokens
        )
        if len(text) <= INLINE_TOKENIZE_CHARS:
            return encode()
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, encode)

    def close(self) -> None:
        """No more tokenizing (what is being tokenized finishes on its thread)."""
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    async def prompt_ids(self, request: router_pb2.GenerateRequest) -> list[int]:
        """The prompt's token ids: the text's, tokenized, or the ids given, checked."""
        which = request.WhichOneof("prompt")
        if which == "text":
            if not request.text:
                raise InvalidRequestError("prompt.text", "must not be empty")
            return await self.tokenize(request.text)
        if which == "token_ids":
            return check_prompt_token_ids(
                request.token_ids.ids, self.model_config.vocab_size, field="prompt.token_ids"
            )
        raise InvalidRequestError("prompt", "set prompt.text or prompt.token_ids")
