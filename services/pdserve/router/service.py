"""The public Router service: thin handlers over the runner, the store and discovery."""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from dataclasses import dataclass

from pdserve.api.v1 import common_pb2, router_pb2, router_pb2_grpc
from pdserve.api.v1.decode_pb2 import TokenDelta
from pdserve.core.errors import InvalidRequestError, KVCapacityError, UnknownRequestError
from pdserve.core.model_config import ModelConfig
from pdserve.core.phase import RequestPhase
from pdserve.core.sampling_params import check_prompt_token_ids, check_request
from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.cancel_bus import CancelBus
from pdserve.router.discovery import Discovery
from pdserve.router.runner import Progress, RequestRunner
from pdserve.rpc.errors import rpc_errors
from pdserve.rpc.wire import FINISH_REASON_NAMES, FINISH_REASONS, sampling_params_from_proto
from pdserve.state.requests import RequestRecord, RequestStore

log = logging.getLogger(__name__)
_PHASES = {
    "prefilling": RequestPhase.PREFILLING,
    "transferring": RequestPhase.TRANSFERRING,
    "decoding": RequestPhase.DECODING,
}
# The sampling parameters' field path: as the engine names it, and in the public API.
_ENGINE_SAMPLING, PUBLIC_SAMPLING = "sampling_params", "sampling"
TERMINAL = frozenset({RequestPhase.FINISHED, RequestPhase.FAILED, RequestPhase.CANCELLED})


class ResumeOutOfRangeError(InvalidRequestError):
    """resume_from points past the end of a finished request's output."""

    out_of_range = True


@dataclass
class _Running:
    """A request this router is running now."""

    task: asyncio.Task
    progress: Progress


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(
        self,
        *,
        model_dir: str,
        tokenizer: Tokenizer,
        model_config: ModelConfig,
        fingerprint: str,
        max_model_len: int,
        runner: RequestRunner,
        store: RequestStore,
        discovery: Discovery,
        cancel_bus: CancelBus,
        router_id: str,
        max_inflight: int,
    ):
        self.model_dir, self.tokenizer, self.model_config = model_dir, tokenizer, model_config
        self.fingerprint, self.max_model_len = fingerprint, max_model_len
        self.runner, self.store, self.discovery = runner, store, discovery
        self.cancel_bus = cancel_bus
        self.router_id, self.max_inflight = router_id, max_inflight
        self.running: dict[str, _Running] = {}

    # -- Generate ---------------------------------------------------------------------------

    @rpc_errors
    async def Generate(self, request, context):
        received = time.monotonic()
        prompt = self._prompt(request)
        params = self._checked_params(request.sampling, prompt)
        request_id = request.request_id or uuid.uuid4().hex
        offset = request.resume_from if request.HasField("resume_from") else 0
        if request.request_id:
            existing = await self.store.get(request_id)
            if existing is not None:
                async for message in self._replay(request_id, offset, request.stream):
                    yield message
                return
        if request.HasField("resume_from"):
            raise UnknownRequestError(request_id)
        if len(self.running) >= self.max_inflight:
            raise KVCapacityError(f"router at its limit of {self.max_inflight} running requests")
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(request.sampling)
        if params.temperature > 0 and params.seed is None:
            # A seed makes a retry on another worker regenerate the same tokens.
            sampling.seed = random.getrandbits(63)
        record = RequestRecord(
            request_id=request_id,
            status=RequestPhase.QUEUED,
            prompt_tokens=len(prompt),
            router_id=self.router_id,
            created_at=time.time(),
            updated_at=time.time(),
        )
        progress = Progress(on_change=lambda p: self._record_progress(request_id, p))
        queue: asyncio.Queue = asyncio.Queue()

        def start() -> asyncio.Task:
            return asyncio.create_task(
                self._pump(request_id, prompt, sampling, progress, context.time_remaining(), queue)
            )

        # An id of our making cannot be taken already: the request starts while Redis
        # records it, so the record's round trip overlaps admission instead of adding to
        # TTFT (its deltas wait in the queue). A client's id may be (a retry racing its
        # original): that request starts only once the record is ours.
        task = None if request.request_id else start()
        try:
            created = await self.store.create(record)
        except BaseException:  # Redis down, or the client left: stop what started
            if task is not None:
                task.cancel()
            raise
        if not created:  # another call won the race: follow it
            async for message in self._replay(request_id, offset, request.stream):
                yield message
            return
        async for message in self._run(
            request_id, task or start(), progress, queue, received, request.stream
        ):
            yield message

    async def _run(self, request_id, task, progress, queue, received, stream):
        self.running[request_id] = _Running(task, progress)
        offset, collected = 0, router_pb2.GenerateResponse(request_id=request_id)
        try:
            finished = False
            while not finished:
                delta, error = _take_waiting(await queue.get(), queue)
                if delta is not None:
                    message = self._response(request_id, offset, delta, received, progress)
                    offset += len(delta.token_ids)
                    if stream:
                        yield message
                    else:
                        _merge(collected, message)
                    finished = message.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                if error is not None:
                    raise error
            if not stream:
                yield collected
        except (asyncio.CancelledError, GeneratorExit):  # the client went away (mid-send: exit)
            await asyncio.shield(self.store.finish(request_id, RequestPhase.CANCELLED, "abort"))
            raise
        except Exception as exc:
            await self.store.finish(
                request_id, RequestPhase.FAILED, "", error=f"{type(exc).__name__}: {exc}"
            )
            raise
        finally:
            task.cancel()
            self.running.pop(request_id, None)

    async def _pump(self, request_id, prompt, sampling, progress, timeout, queue) -> None:
        """Run the request and hand each delta (or the final error) to the handler."""
        try:
            await self.runner.run(request_id, prompt, sampling, progress, queue.put_nowait, timeout)
        except asyncio.CancelledError:
            # Cancel RPC (or client gone): tell the handler the request ended as aborted.
            queue.put_nowait(_aborted())
            raise
        except BaseException as exc:
            queue.put_nowait(exc)

    def _response(self, request_id, offset, delta, received, progress):
        message = router_pb2.GenerateResponse(
            request_id=request_id,
            offset=offset,
            token_ids=delta.token_ids,
            text=delta.text,
            logprobs=delta.logprobs,
            finish_reason=delta.finish_reason,
        )
        self.store.append_tokens(request_id, delta.token_ids, delta.text)
        if delta.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            message.usage.CopyFrom(delta.usage)
            message.usage.completion_tokens = offset + len(delta.token_ids)
            message.usage.cached_prompt_tokens = progress.cached_prompt_tokens
            _fill_timings(message.timings, received, progress)
            aborted = delta.finish_reason == common_pb2.FINISH_REASON_ABORT
            asyncio.create_task(
                self.store.finish(
                    request_id,
                    RequestPhase.CANCELLED if aborted else RequestPhase.FINISHED,
                    FINISH_REASON_NAMES[delta.finish_reason] or "",
                    completion_tokens=message.usage.completion_tokens,
                    cached_prompt_tokens=progress.cached_prompt_tokens,
                )
            )
        return message

    def _record_progress(self, request_id: str, progress: Progress) -> None:
        # A Redis write per phase change would cost the router more CPU per request than
        # its tokens: the brief ones ride the next checkpoint; "decoding" (which worker
        # holds the request from now on) goes out at once, without waiting.
        status = _PHASES.get(progress.phase)
        if status is not None:
            self.store.update_later(
                request_id,
                status=status,
                prefill_worker=progress.prefill_worker,
                decode_worker=progress.decode_worker,
                soon=status is RequestPhase.DECODING,
            )

    async def _replay(self, request_id: str, offset: int, stream: bool):
        """Re-attach to a request (any router's) from `offset`, following it to its end."""
        collected = router_pb2.GenerateResponse(request_id=request_id, offset=offset)
        position = offset
        try:
            async for token_ids, text, final in self.store.follow(request_id, offset):
                message = router_pb2.GenerateResponse(
                    request_id=request_id, offset=position, token_ids=token_ids, text=text
                )
                position += len(token_ids)
                if final is not None:
                    message.finish_reason = FINISH_REASONS.get(final.finish_reason or None, 0)
                    message.usage.prompt_tokens = final.prompt_tokens
                    message.usage.completion_tokens = final.completion_tokens
                    message.usage.cached_prompt_tokens = final.cached_prompt_tokens
                if stream:
                    yield message
                else:
                    _merge(collected, message)
        except ValueError as exc:
            raise ResumeOutOfRangeError("resume_from", str(exc)) from exc
        if not stream:
            yield collected

    # -- the rest of the API ----------------------------------------------------------------

    @rpc_errors
    async def Cancel(self, request, context):
        running = self.running.get(request.request_id)
        if running is not None:
            running.task.cancel()
            return router_pb2.CancelResponse(cancelled=True)
        record = await self.store.get(request.request_id)
        if record is None:
            raise UnknownRequestError(request.request_id)
        if record.status in TERMINAL:
            return router_pb2.CancelResponse(cancelled=False)
        await self.cancel_bus.publish(request.request_id)  # the router running it cancels it
        return router_pb2.CancelResponse(cancelled=True)

    async def cancel_local(self, request_id: str) -> None:
        """Another router asked (through Redis) to cancel a request running here."""
        running = self.running.get(request_id)
        if running is not None:
            running.task.cancel()

    @rpc_errors
    async def GetRequest(self, request, context):
        record = await self.store.get(request.request_id)
        if record is None:
            raise UnknownRequestError(request.request_id)
        info = router_pb2.RequestInfo(
            request_id=record.request_id,
            status=record.status.value,
            prefill_worker=record.prefill_worker,
            decode_worker=record.decode_worker,
            finish_reason=FINISH_REASONS.get(record.finish_reason or None, 0),
            error=record.error,
            created_at=record.created_at,
            updated_at=record.updated_at,
        )
        info.usage.prompt_tokens = record.prompt_tokens
        info.usage.completion_tokens = record.completion_tokens
        info.usage.cached_prompt_tokens = record.cached_prompt_tokens
        return info

    @rpc_errors
    async def ListWorkers(self, request, context):
        seen, workers = set(), []
        for role in ("prefill", "decode"):
            for w in self.discovery.workers(role):
                if w.address in seen:
                    continue
                seen.add(w.address)
                workers.append(
                    router_pb2.WorkerStatus(
                        worker_id=w.worker_id,
                        role=w.role,
                        address=w.address,
                        healthy=w.healthy,
                        free_blocks=w.free_blocks,
                        total_blocks=w.total_blocks,
                        running=w.running,
                        waiting=w.waiting,
                        updated_at=w.updated_at,
                    )
                )
        return router_pb2.ListWorkersResponse(workers=workers)

    @rpc_errors
    async def Tokenize(self, request, context):
        return router_pb2.TokenizeResponse(token_ids=self.tokenizer.encode(request.text))

    @rpc_errors
    async def Detokenize(self, request, context):
        ids = list(request.token_ids)
        if ids:
            check_prompt_token_ids(ids, self.model_config.vocab_size, field="token_ids")
        return router_pb2.DetokenizeResponse(text=self.tokenizer.decode(ids))

    @rpc_errors
    async def ModelInfo(self, request, context):
        cfg = self.model_config
        return router_pb2.ModelInfoResponse(
            model=self.model_dir,
            architecture=cfg.architecture,
            vocab_size=cfg.vocab_size,
            max_model_len=self.max_model_len,
            model_fingerprint=self.fingerprint,
            eos_token_ids=sorted(self.tokenizer.eos_token_ids),
        )

    def _checked_params(self, sampling: common_pb2.SamplingParams, prompt: list[int]):
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

    def _prompt(self, request) -> list[int]:
        which = request.WhichOneof("prompt")
        if which == "text":
            if not request.text:
                raise InvalidRequestError("prompt.text", "must not be empty")
            return self.tokenizer.encode(request.text)
        if which == "token_ids":
            return check_prompt_token_ids(
                request.token_ids.ids, self.model_config.vocab_size, field="prompt.token_ids"
            )
        raise InvalidRequestError("prompt", "set prompt.text or prompt.token_ids")


def _aborted() -> TokenDelta:
    return TokenDelta(finish_reason=common_pb2.FINISH_REASON_ABORT)


def _take_waiting(first, queue: asyncio.Queue) -> tuple[TokenDelta | None, BaseException | None]:
    """`first` merged with the deltas already waiting behind it, up to a final one or an
    error (returned, to raise once the merged delta went out).

    One message for all of them: when the client falls behind, it pays per message.
    """
    if isinstance(first, BaseException):
        return None, first
    while first.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED and not queue.empty():
        part = queue.get_nowait()
        if isinstance(part, BaseException):
            return first, part
        first.token_ids.extend(part.token_ids)
        first.text += part.text
        first.logprobs.extend(part.logprobs)
        first.finish_reason = part.finish_reason
        if part.HasField("usage"):
            first.usage.CopyFrom(part.usage)
    return first, None


def _merge(into: router_pb2.GenerateResponse, part: router_pb2.GenerateResponse) -> None:
    into.token_ids.extend(part.token_ids)
    into.text += part.text
    into.logprobs.extend(part.logprobs)
    if part.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
        into.finish_reason = part.finish_reason
        into.usage.CopyFrom(part.usage)
        into.timings.CopyFrom(part.timings)


def _fill_timings(timings: router_pb2.Timings, received: float, progress: Progress) -> None:
    now = time.monotonic()

    def ms(start: float, end: float) -> float:
        return max(0.0, (end - start) * 1000) if start and end else 0.0

    timings.queue_ms = ms(received, progress.admitted_at)
    timings.ttft_ms = ms(received, progress.first_token_at)
    timings.transfer_ms = ms(progress.first_token_at, progress.first_decode_at)
    timings.decode_ms = ms(progress.first_token_at, now)
    timings.total_ms = ms(received, now)
