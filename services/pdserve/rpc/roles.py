"""Who may call what on a worker: one table from method (or service) to the certificate
roles allowed, checked by one server interceptor.

With mTLS a worker's TLS handshake already refuses a caller without a certificate of the
cluster's CA; this says what each certificate may do once connected:

- the decode worker's KV plane (KVTransfer) takes only prefill and colocated (`both`)
  workers: no router, and no other decode worker, can write KV into a lease;
- Admit, Relay, Stream, Generate and GetLoad on decode workers, and everything on prefill
  workers (Prefill names the decode worker it pushes to), take only the router;
- Release takes the router and the KV senders: a prefill worker gives back a lease whose
  prompt it gave up on, as the router does one whose Admit it abandoned;
- health and reflection take any certificate of the cluster.

A call without a client certificate (a port serving without client authentication) is
UNAUTHENTICATED; one whose certificate holds another role, or none, PERMISSION_DENIED
naming the roles the method takes. A method the table does not name is refused too.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from pdserve.api.v1 import decode_pb2, kv_transfer_pb2, prefill_pb2
from pdserve.core.tls_config import Role
from pdserve.rpc.tls import peer_certificate_pem, role_of_pem

ANY_ROLE = frozenset(Role)
ROUTER = frozenset({Role.ROUTER})
KV_SENDERS = frozenset({Role.PREFILL, Role.BOTH})

_DECODE = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name
_KV = kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name
_PREFILL = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name
_HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
_REFLECTION = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"].full_name

# A method's entry ("/service/Method") wins over its service's ("service").
CALLERS: Mapping[str, frozenset[Role]] = {
    f"/{_DECODE}/Admit": ROUTER,
    f"/{_DECODE}/Relay": ROUTER,
    f"/{_DECODE}/Stream": ROUTER,
    f"/{_DECODE}/Generate": ROUTER,
    f"/{_DECODE}/GetLoad": ROUTER,
    f"/{_DECODE}/Release": ROUTER | KV_SENDERS,
    _KV: KV_SENDERS,
    _PREFILL: ROUTER,
    _HEALTH: ANY_ROLE,
    _REFLECTION: ANY_ROLE,
    "grpc.reflection.v1.ServerReflection": ANY_ROLE,
}


def allowed_roles(method: str, table: Mapping[str, frozenset[Role]] = CALLERS) -> frozenset[Role]:
    """The roles that may call `method` ("/package.Service/Method"); none if unlisted."""
    if method in table:
        return table[method]
    service = method.lstrip("/").partition("/")[0]
    return table.get(service, frozenset())


def refusal(context, method: str, allowed: frozenset[Role]) -> tuple[grpc.StatusCode, str] | None:
    """Why this call's caller may not call `method` (a status and its message); None: it may."""
    pem = peer_certificate_pem(context)
    if pem is None:
        return (
            grpc.StatusCode.UNAUTHENTICATED,
            f"{method} needs a client certificate signed by the cluster's CA",
        )
    role = role_of_pem(pem)
    if role in allowed:
        return None
    needed = " or ".join(sorted(r.value for r in allowed)) or "no role (not served)"
    held = role.value if role is not None else "none"
    return (
        grpc.StatusCode.PERMISSION_DENIED,
        f"{method} is for {needed} certificates; the caller's role (Subject OU) is {held}",
    )


class RoleCheck(grpc.aio.ServerInterceptor):
    """Refuses each call whose client certificate's role the table does not allow."""

    def __init__(self, table: Mapping[str, frozenset[Role]] = CALLERS):
        self.table = table

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:  # not served here: gRPC answers UNIMPLEMENTED
            return None
        method = handler_call_details.method
        return _guarded(handler, method, allowed_roles(method, self.table))


def _guarded(handler: grpc.RpcMethodHandler, method: str, allowed: frozenset[Role]):
    """`handler` with the role check before its behaviour; same (de)serializers."""
    kinds = (
        ("unary_unary", grpc.unary_unary_rpc_method_handler),
        ("unary_stream", grpc.unary_stream_rpc_method_handler),
        ("stream_unary", grpc.stream_unary_rpc_method_handler),
        ("stream_stream", grpc.stream_stream_rpc_method_handler),
    )
    for kind, make in kinds:
        behaviour = getattr(handler, kind)
        if behaviour is not None:
            return make(
                _checked(behaviour, method, allowed),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    return handler


def _checked(behaviour, method: str, allowed: frozenset[Role]):
    """`behaviour` (a coroutine function, or an async generator function for streamed
    responses) run only after the caller passed the check."""
    if inspect.isasyncgenfunction(behaviour):

        async def checked_stream(request, context):
            await _check(context, method, allowed)
            async for response in behaviour(request, context):
                yield response

        return checked_stream

    async def checked(request, context):
        await _check(context, method, allowed)
        return await behaviour(request, context)

    return checked


async def _check(context, method: str, allowed: frozenset[Role]) -> None:
    refused = refusal(context, method, allowed)
    if refused is not None:
        await context.abort(*refused)
