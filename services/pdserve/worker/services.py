"""A worker role's gRPC services: registered before the model loads, served after.

gRPC takes a server's handlers before it starts, and the server starts before the model
loads so that health can answer NOT_SERVING meanwhile. Each service is registered as a
`ServiceGate`; once the model is loaded and the `Worker` built, `WorkerServices.open`
makes the servicers on it and opens the gates. Until then every call gets UNAVAILABLE,
from this one place.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor

from pdserve.api.v1 import decode_pb2, kv_transfer_pb2, prefill_pb2
from pdserve.core.errors import UnavailableError
from pdserve.kv.transfer import ZERO_COPY_PARSERS
from pdserve.rpc.errors import abort
from pdserve.rpc.registration import Service
from pdserve.worker.decode import DecodeServicer, KVTransferServicer
from pdserve.worker.prefill import PrefillServicer
from pdserve.worker.worker import Worker

PREFILL = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"]
DECODE = decode_pb2.DESCRIPTOR.services_by_name["Decode"]
KV_TRANSFER = kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"]
SERVICES = {"prefill": (PREFILL,), "decode": (DECODE, KV_TRANSFER)}
SERVICES["both"] = SERVICES["prefill"] + SERVICES["decode"]


class ServiceGate:
    """Stands in for a service's servicer at registration; `open` lets calls through.

    Each of the service's methods is an attribute, as on a servicer: until `open`, it
    answers UNAVAILABLE; then it calls the servicer's method of that name.
    """

    def __init__(self, service: ServiceDescriptor):
        self.service = service
        self._handlers: dict[str, Callable] | None = None
        for method in service.methods:
            setattr(self, method.name, self._forwarder(method))

    def open(self, servicer) -> None:
        self._handlers = {m.name: getattr(servicer, m.name) for m in self.service.methods}

    async def _handler(self, name: str, context) -> Callable:
        if self._handlers is None:
            await abort(context, UnavailableError("worker is still loading its model"))
        return self._handlers[name]

    def _forwarder(self, method: MethodDescriptor) -> Callable:
        name = method.name
        if method.server_streaming:

            async def forward_stream(request, context):
                handler = await self._handler(name, context)
                async with contextlib.aclosing(handler(request, context)) as responses:
                    async for response in responses:
                        yield response

            return forward_stream

        async def forward(request, context):
            handler = await self._handler(name, context)
            return await handler(request, context)

        return forward


class WorkerServices:
    """The services of one worker role, as gates until `open` builds their servicers."""

    def __init__(self, role: str):
        self._gates = {descriptor: ServiceGate(descriptor) for descriptor in SERVICES[role]}
        self.services = [  # for `rpc.server.serve` to register before the server starts
            Service(gate, descriptor, ZERO_COPY_PARSERS if descriptor is KV_TRANSFER else {})
            for descriptor, gate in self._gates.items()
        ]
        self.decode: DecodeServicer | None = None  # for a role that serves it, once open
        self.prefill: PrefillServicer | None = None

    def open(self, worker: Worker) -> None:
        """The model is loaded: build the servicers on `worker` and let calls through."""
        if DECODE in self._gates:
            self.decode = DecodeServicer(worker)
            self._gates[DECODE].open(self.decode)
            self._gates[KV_TRANSFER].open(KVTransferServicer(worker))
        if PREFILL in self._gates:
            self.prefill = PrefillServicer(worker)
            self._gates[PREFILL].open(self.prefill)

    def drain(self) -> None:
        """The worker is draining: each Relay call ends once its requests have."""
        if self.decode is not None:
            self.decode.wake_relays()

    async def close(self) -> None:
        """After the server stopped: finish the KV hand-offs still running."""
        if self.prefill is not None:
            await self.prefill.close()
