"""The decode side's servicers: admit under a lease, receive KV, stream tokens; and the
colocated path. The leases themselves live in worker/leases.py, delivery in outbox.py."""

from __future__ import annotations

import asyncio
import time
import uuid

from google.rpc import code_pb2
from opentelemetry.trace import Span, SpanKind

from pdserve.api.v1 import decode_pb2, decode_pb2_grpc, kv_transfer_pb2, kv_transfer_pb2_grpc
from pdserve.core.errors import InvalidRequestError, PreconditionError
from pdserve.core.kv_chunk import KVLayerChunk
from pdserve.core.protocol import PROTOCOL_VERSION, check_peer
from pdserve.kv.lease import Lease
from pdserve.kv.transfer import receive_push
from pdserve.rpc.errors import rpc_errors, status_code
from pdserve.rpc.registration import UndecodableRequest
from pdserve.rpc.wire import sampling_params_from_proto
from pdserve.rpc.wire.worker import lease_renewal_to_proto, lease_to_proto, worker_load_to_proto
from pdserve.telemetry import metrics, tracing
from pdserve.telemetry.metrics import TransferSide
from pdserve.worker.orphans import Orphans
from pdserve.worker.outbox import Outbox, deliver_one
from pdserve.worker.relay import RelayCall
from pdserve.worker.worker import Worker

# The stream id of the one request on a Stream or Generate call (Relay's ids are the caller's).
ONE_REQUEST = 0


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, worker: Worker):
        self.worker = worker
        self.relays: set[RelayCall] = set()
        # what broken Relay calls left, for a router taking them over (worker/orphans.py)
        self.orphans = Orphans(worker, worker.config.orphan_timeout_s)

    @rpc_errors
    async def Admit(self, request, context):
        worker = self.worker
        worker.check_admitting()
        params = sampling_params_from_proto(request.sampling)
        await worker.compile_constraint(params)  # before any block is reserved
        with tracing.leaf_span("admit", request.request_id, kind=SpanKind.SERVER) as span:
            lease = worker.leases.admit(
                list(request.prompt_token_ids),
                params,
                request.request_id or uuid.uuid4().hex,
                request.lease_ttl_ms / 1000,  # 0: the worker's default
            )
            span.set_attribute("pdserve.lease.num_blocks", lease.num_blocks)
        return lease_to_proto(lease, worker.layout, kv_address=worker.kv_address)

    @rpc_errors
    async def Stream(self, request, context):
        outbox = Outbox(self.worker)
        attached = outbox.attach_lease(ONE_REQUEST, request.lease_id, request.stream_interval)
        async for delta in deliver_one(outbox, attached):
            yield delta

    @rpc_errors
    async def Release(self, request, context):
        released = await self.worker.leases.release(request.lease_id)
        return decode_pb2.ReleaseResponse(released=released)

    @rpc_errors
    async def Generate(self, request, context):
        outbox = Outbox(self.worker)
        attached = outbox.attach_generate(ONE_REQUEST, request, request.stream_interval)
        async for delta in deliver_one(outbox, attached):
            yield delta

    @rpc_errors
    async def GetLoad(self, request, context):
        return worker_load_to_proto(self.worker.info(num_block_hashes=0))

    @rpc_errors
    async def Relay(self, request_iterator, context):
        relay = RelayCall(self.worker, self.orphans)
        self.relays.add(relay)
        try:
            async for batch in relay.serve(request_iterator):
                yield batch
        finally:
            self.relays.discard(relay)

    def wake_relays(self) -> None:
        """For draining: a Relay call checks whether it is idle when woken."""
        for relay in self.relays:
            relay.wake()


class _ReceivedKV:
    """One PushKV stream's span: the request it brought KV for, its layers, its counts."""

    __slots__ = ("span", "layers")

    def __init__(self, span: Span | tracing.LeafSpan):
        self.span, self.layers = span, set()

    def add(self, lease: Lease, layer: int) -> None:
        if self.span.is_recording():
            if not self.layers:
                self.span.set_attribute(tracing.REQUEST_ID, lease.request_id)
            self.layers.add(layer)

    def end(self, result: kv_transfer_pb2.PushKVResult | None, error: Exception | None = None):
        if result is not None and self.span.is_recording():
            counts = tracing.kv_transfer_attributes(len(self.layers), result.chunks, result.bytes)
            self.span.set_attributes(counts)
        if error is not None:
            tracing.set_error(self.span, error)
        self.span.end()


async def _parse_errors(requests):
    """PushKV's messages, one that did not parse as the InvalidRequestError it makes
    (`receive_push` reads the rest of the stream before it fails)."""
    async for request in requests:
        if isinstance(request, UndecodableRequest):
            yield InvalidRequestError(request.field, request.message)
        else:
            yield request


class KVTransferServicer(kv_transfer_pb2_grpc.KVTransferServicer):
    def __init__(self, worker: Worker):
        self.worker = worker

    @rpc_errors
    async def Handshake(self, request, context):
        check_peer(request.protocol_version, f"prefill worker {request.sender or '?'}")
        ours, theirs = self.worker.layout, request.layout
        mismatched = [
            f"{f.name} (theirs {getattr(theirs, f.name)!r}, ours {getattr(ours, f.name)!r})"
            for f in kv_transfer_pb2.KVLayout.DESCRIPTOR.fields
            if getattr(theirs, f.name) != getattr(ours, f.name)
        ]
        if mismatched:
            raise PreconditionError("KV layout mismatch: " + "; ".join(mismatched))
        return kv_transfer_pb2.HandshakeResponse(
            layout=ours, receiver=self.worker.config.worker_id, protocol_version=PROTOCOL_VERSION
        )

    @rpc_errors
    async def PushKV(self, request_iterator, context):
        leases, leases_seen = self.worker.leases, set()
        first_chunk_at = 0.0  # time.monotonic(): the transfer's time starts with its KV
        span = tracing.leaf_span("kv_transfer receive", "", kind=SpanKind.SERVER)
        received = _ReceivedKV(span)

        def on_chunk(lease_id: str, first_block: int, chunk: KVLayerChunk) -> None:
            nonlocal first_chunk_at
            first_chunk_at = first_chunk_at or time.monotonic()
            leases_seen.add(lease_id)
            received.add(leases.import_chunk(lease_id, first_block, chunk), chunk.layer)

        try:
            result = await receive_push(_parse_errors(request_iterator), on_chunk)
        except asyncio.CancelledError:
            # The pusher went away mid-stream (its process died, or it gave up): its
            # leases can never complete, so fail them now rather than at their deadline.
            metrics.kv_transfer_failed(TransferSide.RECEIVE, "CANCELLED")
            span.end()
            for lease_id in leases_seen:
                await asyncio.shield(leases.fail(lease_id, "KV push broke off"))
            raise
        except Exception as exc:
            reason = code_pb2.Code.Name(status_code(exc))  # the status the sender gets
            metrics.kv_transfer_failed(TransferSide.RECEIVE, reason)
            received.end(None, exc)
            raise
        received.end(result)
        seconds = time.monotonic() - first_chunk_at if first_chunk_at else 0.0
        metrics.kv_transferred(TransferSide.RECEIVE, result.bytes, seconds)
        return result

    @rpc_errors
    async def RenewLease(self, request, context):
        return lease_renewal_to_proto(self.worker.leases.renew(request.lease_id))

    @rpc_errors
    async def CommitKV(self, request, context):
        # Imported KV is shared with other requests only from prefill workers we trust.
        shared = self.worker.config.shares_imported_kv
        await self.worker.leases.commit(request.lease_id, request.first_token_id, shared=shared)
        return kv_transfer_pb2.CommitKVResponse()
