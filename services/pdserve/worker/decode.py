"""The decode side: admit under a lease, receive KV, stream tokens; and the colocated path."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

from pdserve.api.v1 import decode_pb2, decode_pb2_grpc, kv_transfer_pb2, kv_transfer_pb2_grpc
from pdserve.core.errors import (
    LeaseAbortedError,
    LeaseExpiredError,
    LeaseNotFoundError,
    PreconditionError,
)
from pdserve.core.kv_chunk import KVLayerChunk
from pdserve.kv.lease import Lease, LeaseState
from pdserve.kv.transfer import receive_push
from pdserve.rpc.errors import rpc_errors
from pdserve.rpc.wire import sampling_params_from_proto
from pdserve.worker.engine_loop import Sink
from pdserve.worker.relay import RelayCall
from pdserve.worker.worker import Worker

log = logging.getLogger(__name__)
EXPIRY_CHECK_S = 0.05


@dataclass
class _Admitted:
    """A lease's request on this worker, from Admit until its stream (Stream or Relay) ends."""

    lease: Lease
    sink: Sink
    # Resolves when the KV is committed (None) or the lease ends without (an exception).
    ready: asyncio.Future = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    stream_attached: bool = False


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, worker: Worker):
        self.worker = worker
        self.admitted: dict[str, _Admitted] = {}  # by lease id
        self._expiry_task: asyncio.Task | None = None
        self.relays: set[RelayCall] = set()
        self._background: set[asyncio.Task] = set()

    def start(self) -> None:
        """Once the worker is attached: begin expiring leases."""
        self._expiry_task = asyncio.create_task(self._expire_leases())

    @rpc_errors
    async def Admit(self, request, context):
        worker = self.worker
        worker.check_admitting()
        request_id = request.request_id or uuid.uuid4().hex
        params = sampling_params_from_proto(request.sampling)
        prompt = list(request.prompt_token_ids)
        ttl = request.lease_ttl_ms / 1000 if request.lease_ttl_ms else worker.config.lease_ttl_s
        sink = worker.loop.open_sink(request_id)
        try:
            # Right here, not between engine steps: the engine takes a reservation while
            # its model runs, so Admit waits for no step (~one decode step off TTFT). With
            # no await until the lease exists, a caller that leaves strands nothing.
            block_ids = worker.engine.reserve_kv(prompt, params, request_id)
        except BaseException:
            worker.loop.close_sink(request_id)
            raise
        lease = worker.leases.issue(request_id, len(block_ids), ttl)
        self.admitted[lease.lease_id] = _Admitted(lease, sink)
        return decode_pb2.Lease(
            lease_id=lease.lease_id,
            num_blocks=lease.num_blocks,
            deadline_unix_ms=lease.deadline_unix_ms,
            layout=worker.layout,
        )

    @rpc_errors
    async def Stream(self, request, context):
        self.worker.check_ready()
        admitted = self.admitted.get(request.lease_id)
        if admitted is None or admitted.stream_attached:
            raise LeaseNotFoundError("unknown lease, or its stream is already attached")
        admitted.stream_attached = True
        try:
            await admitted.ready  # raises if the lease ended without its KV
            first_token_count = 1
            async for delta in self.worker.stream_deltas(
                admitted.lease.request_id,
                admitted.sink,
                first_token_count,
                request.stream_interval,
            ):
                yield delta
        finally:
            await self.close_lease(admitted, LeaseState.RELEASED, LeaseNotFoundError("closed"))

    @rpc_errors
    async def Release(self, request, context):
        self.worker.check_ready()
        admitted = self.admitted.get(request.lease_id)
        if admitted is None:
            return decode_pb2.ReleaseResponse(released=False)
        await self.close_lease(
            admitted, LeaseState.RELEASED, LeaseNotFoundError("lease released by its holder")
        )
        return decode_pb2.ReleaseResponse(released=True)

    @rpc_errors
    async def Generate(self, request, context):
        request_id = request.request_id or uuid.uuid4().hex
        sink = await self.worker.start_local(request, request_id)
        async for delta in self.worker.stream_deltas(
            request_id, sink, stream_interval=request.stream_interval
        ):
            yield delta

    @rpc_errors
    async def GetLoad(self, request, context):
        self.worker.check_ready()
        return self.worker.load()

    @rpc_errors
    async def Relay(self, request_iterator, context):
        self.worker.check_ready()
        relay = RelayCall(self)
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

    def spawn(self, coroutine) -> None:
        """Run a coroutine in the background, held until it ends (the loop holds tasks weakly)."""
        task = asyncio.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- leases ---------------------------------------------------------------------------

    async def commit(self, lease_id: str, first_token_id: int) -> None:
        lease = self.worker.leases.commit(lease_id)  # raises unless open, in time, complete
        admitted = self.admitted[lease_id]
        await self.worker.loop.call(self.worker.engine.commit_kv, lease.request_id, first_token_id)
        if not admitted.ready.done():
            admitted.ready.set_result(None)

    async def fail(self, lease_id: str, why: str) -> None:
        admitted = self.admitted.get(lease_id)
        if admitted is not None and admitted.lease.state is LeaseState.OPEN:
            await self.close_lease(admitted, LeaseState.FAILED, LeaseAbortedError(why))

    async def close_lease(self, admitted: _Admitted, state: LeaseState, reason: Exception) -> None:
        """End a lease for good: free its blocks (or abort its request) exactly once."""
        lease = self.worker.leases.close(admitted.lease.lease_id, state)
        if lease is None:
            return
        self.admitted.pop(lease.lease_id, None)
        if not admitted.ready.done():
            admitted.ready.set_exception(reason)
            admitted.ready.exception()  # retrieved here: a Stream may never await it
        self.worker.loop.close_sink(lease.request_id)
        await self.worker.abort_quietly(lease.request_id)

    async def _expire_leases(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_CHECK_S)
            for lease in self.worker.leases.expired():
                log.info("lease for request %s expired before its KV arrived", lease.request_id)
                reason = LeaseExpiredError("lease deadline passed before its KV arrived")
                await self.close_lease(self.admitted[lease.lease_id], LeaseState.EXPIRED, reason)
            # A committed request whose stream never attached would run unseen forever.
            now = time.monotonic()
            for admitted in list(self.admitted.values()):
                lease = admitted.lease
                overdue = now > lease.deadline + self.worker.config.lease_ttl_s
                if lease.state is LeaseState.COMMITTED and not admitted.stream_attached and overdue:
                    await self.close_lease(
                        admitted, LeaseState.RELEASED, LeaseExpiredError("no stream attached")
                    )

    async def close(self) -> None:
        if self._expiry_task is not None:
            self._expiry_task.cancel()
        if self._background:
            await asyncio.wait(list(self._background))
        for admitted in list(self.admitted.values()):
            shutdown = LeaseNotFoundError("shutdown")
            await self.close_lease(admitted, LeaseState.RELEASED, shutdown)


class KVTransferServicer(kv_transfer_pb2_grpc.KVTransferServicer):
    def __init__(self, worker: Worker, decode: DecodeServicer):
        self.worker, self.decode = worker, decode

    @rpc_errors
    async def Handshake(self, request, context):
        self.worker.check_ready()
        ours, theirs = self.worker.layout, request.layout
        mismatched = [
            f"{f.name} (theirs {getattr(theirs, f.name)!r}, ours {getattr(ours, f.name)!r})"
            for f in kv_transfer_pb2.KVLayout.DESCRIPTOR.fields
            if getattr(theirs, f.name) != getattr(ours, f.name)
        ]
        if mismatched:
            raise PreconditionError("KV layout mismatch: " + "; ".join(mismatched))
        return kv_transfer_pb2.HandshakeResponse(layout=ours, receiver=self.worker.config.worker_id)

    @rpc_errors
    async def PushKV(self, request_iterator, context):
        self.worker.check_ready()
        leases_seen: set[str] = set()

        def on_chunk(lease_id: str, first_block: int, chunk: KVLayerChunk) -> None:
            leases_seen.add(lease_id)
            self._import_chunk(lease_id, first_block, chunk)

        try:
            return await receive_push(request_iterator, on_chunk)
        except asyncio.CancelledError:
            # The pusher went away mid-stream (its process died, or it gave up): its
            # leases can never complete, so fail them now rather than at their deadline.
            for lease_id in leases_seen:
                await asyncio.shield(self.decode.fail(lease_id, "KV push broke off"))
            raise

    def _import_chunk(self, lease_id: str, first_block: int, chunk: KVLayerChunk) -> None:
        # Check the chunk's place (a lease only ever writes into its own blocks), write
        # it (the cache verifies shape, size and checksum), and only then count it.
        leases = self.worker.leases
        lease = leases.check_chunk(lease_id, chunk.layer, first_block, chunk.num_blocks)
        self.worker.engine.import_kv(lease.request_id, chunk, first_block)
        leases.mark_received(lease, chunk.layer, first_block, chunk.num_blocks, len(chunk.data))

    @rpc_errors
    async def RenewLease(self, request, context):
        self.worker.check_ready()
        lease = self.worker.leases.renew(request.lease_id)
        return kv_transfer_pb2.RenewLeaseResponse(
            deadline_unix_ms=lease.deadline_unix_ms, ttl_ms=round(lease.ttl_s * 1000)
        )

    @rpc_errors
    async def CommitKV(self, request, context):
        self.worker.check_ready()
        await self.decode.commit(request.lease_id, request.first_token_id)
        return kv_transfer_pb2.CommitKVResponse()
