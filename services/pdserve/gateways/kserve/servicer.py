"""inference.GRPCInferenceService on the router's gRPC port: thin handlers over the frontend.

Health and metadata answer from the router's own state (its served model, discovery);
ModelInfer and ModelStreamInfer are proto in -> `Frontend.generate` -> proto out, through
`infer`. Errors: a unary call's become statuses (`rpc_errors`: INVALID_ARGUMENT naming the
tensor, RESOURCE_EXHAUSTED when the router is full ...; NOT_FOUND for a model it does not
serve); a streamed request's are its last response's `error_message`, as Triton's, and
the stream goes on. The call's `x-slo-ttft-ms` metadata is each of its requests' TTFT
target.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc

from pdserve.api.inference import grpc_service_pb2 as pb
from pdserve.core.errors import InvalidRequestError
from pdserve.gateways.kserve.infer import (
    InferCall,
    InferResponses,
    error_response,
    mark_final,
    parse_request,
)
from pdserve.gateways.kserve.model import (
    MODEL_VERSION,
    model_config,
    model_metadata,
    server_metadata,
)
from pdserve.gateways.kserve.stream import InferStream
from pdserve.gateways.ttft_target import TTFT_SLO_HEADER, ttft_slo_ms_from_header
from pdserve.router.discovery import Discovery
from pdserve.router.frontend import Frontend
from pdserve.rpc.errors import rpc_errors, to_status
from pdserve.rpc.wire import is_final

SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]


class KServeServicer:
    """Every method of SERVICE (registered by its descriptor, `rpc.registration`)."""

    def __init__(self, frontend: Frontend, *, discovery: Discovery):
        self.frontend, self.discovery = frontend, discovery

    # -- health and metadata -------------------------------------------------------------

    @rpc_errors
    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    @rpc_errors
    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self._ready())

    @rpc_errors
    async def ModelReady(self, request, context):
        known = self._unknown_model(request.name, request.version) is None
        return pb.ModelReadyResponse(ready=known and self._ready())

    @rpc_errors
    async def ServerMetadata(self, request, context):
        return server_metadata()

    @rpc_errors
    async def ModelMetadata(self, request, context):
        await self._check_model(request.name, request.version, context)
        return model_metadata(self.frontend.model_name)

    @rpc_errors
    async def ModelConfig(self, request, context):
        await self._check_model(request.name, request.version, context)
        return model_config(self.frontend.model_name)

    def _ready(self) -> bool:
        """Whether a request can run now: a prefill and a decode worker are healthy (a
        colocated worker counts as both)."""
        return bool(self.discovery.workers("decode")) and bool(self.discovery.workers("prefill"))

    def _unknown_model(self, name: str, version: str) -> str | None:
        """Why no model by that name and version is served here; None: it is."""
        served = self.frontend.model_name
        if name != served:
            return f"unknown model {name!r}: this server serves {served!r}"
        if version not in ("", MODEL_VERSION):
            return f"model {name!r} has no version {version!r}: it has {MODEL_VERSION!r}"
        return None

    async def _check_model(self, name: str, version: str, context) -> None:
        problem = self._unknown_model(name, version)
        if problem is not None:
            await context.abort(grpc.StatusCode.NOT_FOUND, problem)

    # -- inference -----------------------------------------------------------------------

    @rpc_errors
    async def ModelInfer(self, request, context):
        await self._check_model(request.model_name, request.model_version, context)
        call = parse_request(request, streaming_call=False, ttft_slo_ms=_ttft_slo_ms(context))
        responses = [response async for response, _ in self._run(call, context)]
        return responses[-1]  # the one response of a request that does not stream

    @rpc_errors
    async def ModelStreamInfer(self, request_iterator, context):
        stream = InferStream(lambda request: self._stream_request(request, context))
        async for response in stream.responses(request_iterator):
            yield response

    async def _stream_request(
        self, request: pb.ModelInferRequest, context
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """One request of a stream: its responses, the last flagged final; or its error."""
        try:
            problem = self._unknown_model(request.model_name, request.model_version)
            if problem is not None:
                yield error_response(request, problem)
                return
            call = parse_request(request, streaming_call=True, ttft_slo_ms=_ttft_slo_ms(context))
            async for response, final in self._run(call, context):
                yield pb.ModelStreamInferResponse(infer_response=mark_final(response, final))
        except Exception as exc:  # the request's end, not the stream's: Triton's way
            yield error_response(request, to_status(exc).message)

    async def _run(
        self, call: InferCall, context
    ) -> AsyncIterator[tuple[pb.ModelInferResponse, bool]]:
        """(response, whether it is the last) for each of the request's messages."""
        responses = InferResponses(call, self.frontend.model_name, self._count_tokens)
        timeout_s = _shorter(context.time_remaining(), call.timeout_s)
        generate = self.frontend.generate(call.generate, timeout_s=timeout_s)
        try:
            async with contextlib.aclosing(generate) as messages:
                async for message in messages:
                    yield responses.response(message), is_final(message)
        except InvalidRequestError as exc:
            raise call.protocol_error(exc) from exc

    def _count_tokens(self, text: str) -> int:
        return len(self.frontend.tokenizer.encode(text))


def _ttft_slo_ms(context) -> int:
    """The call's `x-slo-ttft-ms` metadata (0: none)."""
    values = [value for key, value in context.invocation_metadata() or () if key == TTFT_SLO_HEADER]
    return ttft_slo_ms_from_header(values[-1] if values else None)


def _shorter(first: float | None, second: float | None) -> float | None:
    """The shorter of two timeouts; None is no limit."""
    return min((t for t in (first, second) if t is not None), default=None)
