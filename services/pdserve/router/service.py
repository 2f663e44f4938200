"""The public Router service: thin handlers over sessions, the store and discovery.

Generate is proto in -> `RequestSession` -> proto out: the session owns the request's
life (record, attempts, deltas, end); the handler validates and follows it.
"""

from __future__ import annotations

import logging
import time
import uuid

from pdserve.api.v1 import common_pb2, router_pb2, router_pb2_grpc
from pdserve.core.errors import InvalidRequestError, KVCapacityError, UnknownRequestError
from pdserve.core.model_config import ModelConfig
from pdserve.core.sampling_params import SamplingParams, check_prompt_token_ids, check_request
from pdserve.core.workers import WorkerInfo
from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.cancel_bus import CancelBus
from pdserve.router.discovery import Discovery
from pdserve.router.handoff import Attempt
from pdserve.router.runner import RequestRunner
from pdserve.router.session import RequestSession, retry_safe
from pdserve.rpc.errors import rpc_errors
from pdserve.rpc.wire import sampling_params_from_proto
from pdserve.rpc.wire.router import (
    append_response,
    replay_response,
    request_info_to_proto,
    worker_status_to_proto,
)
from pdserve.state.requests import RequestStore
from pdserve.telemetry.request import served_model_name

log = logging.getLogger(__name__)
# The sampling parameters' field path: as the engine names it, and in the public API.
_ENGINE_SAMPLING, PUBLIC_SAMPLING = "sampling_params", "sampling"


class ResumeOutOfRangeError(InvalidRequestError):
    """resume_from points past the end of a finished request's output."""

    out_of_range = True


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
        self.model_name = served_model_name(model_dir)  # in spans and log lines
        self.fingerprint, self.max_model_len = fingerprint, max_model_len
        self.runner, self.store, self.discovery = runner, store, discovery
        self.cancel_bus = cancel_bus
        self.router_id, self.max_inflight = router_id, max_inflight
        self.sessions: dict[str, RequestSession] = {}  # the requests running here

    # -- Generate ---------------------------------------------------------------------------

    @rpc_errors
    async def Generate(self, request, context):
        received_at = time.monotonic()
        prompt = self._prompt(request)
        params = self._checked_params(request.sampling, prompt)
        request_id = request.request_id or uuid.uuid4().hex
        offset = request.resume_from if request.HasField("resume_from") else 0
        if request.request_id and await self.store.get(request_id) is not None:
            async for message in self._replay(request_id, offset, request.stream):
                yield message
            return
        if request.HasField("resume_from"):
            raise UnknownRequestError(request_id)
        if len(self.sessions) >= self.max_inflight:
            raise KVCapacityError(f"router at its limit of {self.max_inflight} running requests")
        remaining = context.time_remaining()
        attempt = Attempt(
            request_id,
            prompt,
            retry_safe(request.sampling, params),
            deadline=None if remaining is None else received_at + remaining,
        )
        session = RequestSession(
            attempt,
            runner=self.runner,
            store=self.store,
            router_id=self.router_id,
            received_at=received_at,
            model=self.model_name,
        )
        if not await session.open(start_first=not request.request_id):
            async for message in self._replay(request_id, offset, request.stream):
                yield message  # another call won the race for the id: follow it
            return
        self.sessions[request_id] = session
        try:
            async for message in session.responses(request.stream):
                yield message
        finally:
            self.sessions.pop(request_id, None)

    async def _replay(self, request_id: str, offset: int, stream: bool):
        """Re-attach to a request (any router's) from `offset`, following it to its end."""
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

    # -- the rest of the API ----------------------------------------------------------------

    @rpc_errors
    async def Cancel(self, request, context):
        session = self.sessions.get(request.request_id)
        if session is not None:
            session.cancel()
            return router_pb2.CancelResponse(cancelled=True)
        record = await self.store.get(request.request_id)
        if record is None:
            raise UnknownRequestError(request.request_id)
        if record.status.is_terminal:
            return router_pb2.CancelResponse(cancelled=False)
        await self.cancel_bus.publish(request.request_id)  # the router running it cancels it
        return router_pb2.CancelResponse(cancelled=True)

    async def cancel_local(self, request_id: str) -> None:
        """Another router asked (through Redis) to cancel a request running here."""
        session = self.sessions.get(request_id)
        if session is not None:
            session.cancel()

    @rpc_errors
    async def GetRequest(self, request, context):
        record = await self.store.get(request.request_id)
        if record is None:
            raise UnknownRequestError(request.request_id)
        return request_info_to_proto(record)

    @rpc_errors
    async def ListWorkers(self, request, context):
        workers: dict[str, WorkerInfo] = {}  # a "both" worker is listed for either role
        for role in ("prefill", "decode"):
            for worker in self.discovery.workers(role):
                workers.setdefault(worker.address, worker)
        return router_pb2.ListWorkersResponse(
            workers=[worker_status_to_proto(worker) for worker in workers.values()]
        )

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

    def _checked_params(
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
