"""The router's API as Python: what every front door (gRPC, OpenAI HTTP, KServe) drives.

A request comes in as the public API's `GenerateRequest` and its messages go out as
`GenerateResponse`s, whichever protocol the client speaks: the gateways translate to and
from these, so there is one path to the workers and one set of checks. Errors are the
domain's (`core.errors`); each edge maps them to its own statuses.
"""

from __future__ import annotations

import hmac
import time
import uuid
from collections.abc import AsyncIterator

from pdserve.api.v1 import common_pb2, router_pb2
from pdserve.core.errors import (
    AlreadyExistsError,
    InvalidRequestError,
    KVCapacityError,
    UnknownRequestError,
)
from pdserve.core.model_config import ModelConfig
from pdserve.core.sampling_params import SamplingParams, check_prompt_token_ids, check_request
from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.cancel_bus import CancelBus
from pdserve.router.handoff import Attempt
from pdserve.router.runner import RequestRunner
from pdserve.router.session import RequestSession, retry_safe
from pdserve.rpc.wire import sampling_params_from_proto
from pdserve.rpc.wire.router import append_response, replay_response
from pdserve.state.record import RequestRecord, request_digest
from pdserve.state.requests import RequestStore

# The sampling parameters' field path: as the engine names it, and in the public API.
_ENGINE_SAMPLING, PUBLIC_SAMPLING = "sampling_params", "sampling"


class ResumeOutOfRangeError(InvalidRequestError):
    """resume_from points past the end of a finished request's output."""

    out_of_range = True


def check_same_request(record: RequestRecord, digest: str) -> None:
    """A call reusing a request's id gets its output only if it asks what the request
    asked (`record.request_digest`), else AlreadyExistsError: the id alone is no proof of
    being its client."""
    if not hmac.compare_digest(record.request_digest.encode(), digest.encode()):
        raise AlreadyExistsError(
            "request_id",
            f"{record.request_id!r} is taken by a request with another prompt or other parameters",
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
        max_inflight: int,
    ):
        self.model_name = model_name  # what clients ask for; in spans, metrics and logs
        self.tokenizer, self.model_config = tokenizer, model_config
        self.max_model_len = max_model_len
        self.runner, self.store, self.cancel_bus = runner, store, cancel_bus
        self.router_id, self.max_inflight = router_id, max_inflight
        self.sessions: dict[str, RequestSession] = {}  # the requests running here

    async def generate(
        self, request: router_pb2.GenerateRequest, *, timeout_s: float | None = None
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        """The request's messages (one without `request.stream`), to its final one.

        A known `request_id` re-attaches to that request (any router's) from
        `resume_from` if the call asks for the same (prompt and sampling), and is
        AlreadyExistsError otherwise; `timeout_s` is how long the client waits for the
        whole answer.
        """
        received_at = time.monotonic()
        prompt = self.prompt_ids(request)
        params = self.checked_params(request.sampling, prompt)
        digest = request_digest(prompt, params)  # what the client asked: before retry_safe
        request_id = request.request_id or uuid.uuid4().hex
        offset = request.resume_from if request.HasField("resume_from") else 0
        if request.request_id and (record := await self.store.get(request_id)) is not None:
            async for message in self._replay(request_id, record, digest, offset, request.stream):
                yield message
            return
        if request.HasField("resume_from"):
            raise UnknownRequestError(request_id)
        if len(self.sessions) >= self.max_inflight:
            raise KVCapacityError(f"router at its limit of {self.max_inflight} running requests")
        attempt = Attempt(
            request_id,
            prompt,
            retry_safe(request.sampling, params),
            deadline=None if timeout_s is None else received_at + timeout_s,
        )
        session = RequestSession(
            attempt,
            runner=self.runner,
            store=self.store,
            request_digest=digest,
            router_id=self.router_id,
            received_at=received_at,
            model=self.model_name,
        )
        if not await session.open(start_first=not request.request_id):
            record = await self.store.get(request_id)  # another call won the race for the id
            async for message in self._replay(request_id, record, digest, offset, request.stream):
                yield message  # follow it, if it asked the same
            return
        self.sessions[request_id] = session
        try:
            async for message in session.responses(request.stream):
                yield message
        finally:
            self.sessions.pop(request_id, None)

    async def _replay(
        self, request_id: str, record: RequestRecord | None, digest: str, offset: int, stream: bool
    ):
        """Re-attach to a request (any router's) from `offset`, following it to its end,
        if this call (its `digest`) asks what the request asked (`check_same_request`)."""
        if record is None:  # gone (expired) since the call that found it taken
            raise UnknownRequestError(request_id)
        check_same_request(record, digest)
        collected = router_pb2.GenerateResponse(request_id=request_id, offset=offset)
        position = offset
        try:
            async for token_ids, text, final in self.store.follow(request_id, offset):
                message = replay_response(request_id, position, token_ids, text, final)
                position += len(token_ids)
                if stream:
                    yield message
                else:
                    append_response(collected, message)
        except ValueError as exc:
            raise ResumeOutOfRangeError("resume_from", str(exc)) from exc
        if not stream:
            yield collected

    async def cancel(self, request_id: str) -> bool:
        """Cancel a running request, here or on another router; False if it had ended."""
        session = self.sessions.get(request_id)
        if session is not None:
            session.cancel()
            return True
        record = await self.store.get(request_id)
        if record is None:
            raise UnknownRequestError(request_id)
        if record.status.is_terminal:
            return False
        await self.cancel_bus.publish(request_id)  # the router running it cancels it
        return True

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

    def prompt_ids(self, request: router_pb2.GenerateRequest) -> list[int]:
        """The prompt's token ids: the text's, tokenized, or the ids given, checked."""
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
