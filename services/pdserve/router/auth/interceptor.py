"""API keys on the router's gRPC port: one server interceptor in front of every service.

A call to any method but grpc.health.v1's (which Kubernetes probes call without
credentials) must carry `authorization: Bearer KEY` metadata. Without a valid key it is
refused with UNAUTHENTICATED and one message whatever was wrong; reflection is behind the
key too. A call to a metered method (a generation: Router/Generate, KServe's ModelInfer
and ModelStreamInfer) is then admitted under its key's limits, or refused with
RESOURCE_EXHAUSTED carrying google.rpc.RetryInfo (when to try again) and QuotaFailure
(which limit). A metered call holds its concurrency slot until it ends.

How the handler learns its caller: the interceptor wraps the method's behavior so that
it binds the caller (`caller.bind_caller`, a context variable) before the servicer runs;
grpc.aio runs each call in a task of its own, so the binding is that call's alone, and
handlers read it with `caller.current_caller()`. (Invocation metadata cannot carry it:
what an interceptor changes there never reaches the handler's context.)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health
from grpc_status import rpc_status

from pdserve.core.errors import StateUnavailableError
from pdserve.router.auth.caller import Caller, bind_caller
from pdserve.router.auth.gate import AuthenticationError, Gate
from pdserve.router.auth.limits import NO_SLOT, RateLimitedError, Slot
from pdserve.rpc.errors import abort

AUTHORIZATION = "authorization"
EXEMPT_SERVICES = (health.SERVICE_NAME,)  # what answers without a key
_HANDLERS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Authenticates every call but health's; admits the `metered` methods (full method
    names, `/package.Service/Method`) under their key's limits."""

    def __init__(self, gate: Gate, *, metered: Collection[str]):
        self.gate, self.metered = gate, frozenset(metered)
        self._exempt = tuple(f"/{service}/" for service in EXEMPT_SERVICES)

    async def intercept_service(
        self, continuation: Callable, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or details.method.startswith(self._exempt):
            return handler
        try:
            caller = self.gate.authenticate(_metadata(details, AUTHORIZATION))
        except AuthenticationError as exc:
            return _refusing(handler, str(exc))
        gate = self.gate if details.method in self.metered else None
        return _bound(handler, caller, gate)


def _metadata(details: grpc.HandlerCallDetails, name: str) -> str | None:
    for key, value in details.invocation_metadata or ():
        if key == name:
            return value if isinstance(value, str) else None
    return None


def _refusing(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the method's shape that answers UNAUTHENTICATED and runs nothing."""

    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_streaming(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # never reached (abort raises): makes this an async generator

    return _like(handler, refuse_streaming if handler.response_streaming else refuse)


def _bound(handler: grpc.RpcMethodHandler, caller: Caller, gate: Gate | None):
    """The method's handler, run with `caller` bound, admitted through `gate` if metered."""
    behavior = _behavior(handler)

    async def call(request, context):
        bind_caller(caller)
        slot = await _admitted(gate, caller, context)
        try:
            response = behavior(request, context)
            return await response if inspect.isawaitable(response) else response
        finally:
            slot.release()

    async def call_streaming(request, context):
        bind_caller(caller)
        slot = await _admitted(gate, caller, context)
        try:
            responses = behavior(request, context)
            if inspect.isawaitable(responses):
                responses = await responses
            if hasattr(responses, "__aiter__"):
                async for response in responses:
                    yield response
            else:
                for response in responses:
                    yield response
        finally:
            slot.release()

    return _like(handler, call_streaming if handler.response_streaming else call)


async def _admitted(gate: Gate | None, caller: Caller, context) -> Slot:
    if gate is None:
        return NO_SLOT
    try:
        return await gate.admit(caller)
    except RateLimitedError as exc:
        await context.abort_with_status(rpc_status.to_status(rate_limited_status(exc)))
    except StateUnavailableError as exc:
        await abort(context, exc)  # UNAVAILABLE, with RetryInfo
    raise AssertionError("unreachable: abort raises")


def rate_limited_status(exc: RateLimitedError) -> status_pb2.Status:
    """RESOURCE_EXHAUSTED with RetryInfo (the wait) and QuotaFailure (the limit)."""
    delay = duration_pb2.Duration()
    delay.FromNanoseconds(int(exc.retry_after_s * 1e9))
    violation = error_details_pb2.QuotaFailure.Violation(
        subject=f"api_key:{exc.key_id}", description=exc.kind.name.lower()
    )
    details = [
        error_details_pb2.RetryInfo(retry_delay=delay),
        error_details_pb2.QuotaFailure(violations=[violation]),
    ]
    packed = []
    for detail in details:
        holder = any_pb2.Any()
        holder.Pack(detail)
        packed.append(holder)
    return status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message=str(exc), details=packed)


def _behavior(handler: grpc.RpcMethodHandler):
    kinds = (handler.unary_unary, handler.unary_stream, handler.stream_unary)
    return next((behavior for behavior in kinds if behavior is not None), handler.stream_stream)


def _like(handler: grpc.RpcMethodHandler, behavior) -> grpc.RpcMethodHandler:
    make = _HANDLERS[(handler.request_streaming, handler.response_streaming)]
    return make(
        behavior,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
