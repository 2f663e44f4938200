"""The prefill side: run a prompt, return its first token, push its KV into a decode lease."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from typing import TypeVar

import grpc
from opentelemetry.trace import SpanKind

from pdserve.api.v1 import (
    decode_pb2,
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    prefill_pb2_grpc,
)
from pdserve.core.errors import InvalidRequestError
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.outputs import RequestOutput
from pdserve.kv.transfer import KVPusher, KVPushError, PushTotals
from pdserve.rpc.errors import rpc_errors
from pdserve.rpc.wire import sampling_params_from_proto
from pdserve.rpc.wire.worker import (
    prefill_response_to_proto,
    ttft_deadline_from_proto,
    worker_load_to_proto,
)
from pdserve.telemetry import metrics, propagation, tracing
from pdserve.telemetry.metrics import TransferSide
from pdserve.worker.decode_peers import DecodePeer, DecodePeers
from pdserve.worker.engine_loop import EXPORT_DONE, EngineFailedError, KVExport, Sink
from pdserve.worker.worker import Worker

log = logging.getLogger(__name__)
PREFILL_ID_SUFFIX = "/prefill"
# A lease is renewed every third of its TTL, so two renewals can fail before it ends.
RENEWALS_PER_TTL = 3
RENEW_RETRY_S = 0.5
RENEW_TIMEOUT_S = 5.0
PUSH_THREAD = "kv-push"  # each push's own thread (`on_own_thread`), feeding the pusher's loop
T = TypeVar("T")


async def keep_lease_open(
    kv: kv_transfer_pb2_grpc.KVTransferStub, lease_id: str, ttl_ms: int = 0
) -> None:
    """Renew the decode worker's lease until cancelled: while the prompt queues and
    computes here, and until its KV is committed. The first renewal comes a third of
    the lease's TTL (`ttl_ms`, as granted) after the call, or at once when it is unknown
    (0): a renewal during the prompt's compute competes with it for this process.

    A lease's TTL bounds how long a dead prefill worker can strand the decode worker's
    blocks; it must not also bound how long a prompt may wait here. Without renewals,
    prompts queued behind long ones outlived the router's 10 s leases, and the router
    prefilled them again from scratch. Stops quietly once the lease has ended (the push
    or the commit reports why) or when the decode worker cannot renew (UNIMPLEMENTED).
    """
    if ttl_ms:
        await asyncio.sleep(_renewal_interval_s(ttl_ms))
    while True:
        try:
            reply = await kv.RenewLease(
                kv_transfer_pb2.RenewLeaseRequest(lease_id=lease_id),
                timeout=RENEW_TIMEOUT_S,
                metadata=propagation.outgoing_metadata(),
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                return
            await asyncio.sleep(RENEW_RETRY_S)
            continue
        await asyncio.sleep(_renewal_interval_s(reply.ttl_ms))


def _renewal_interval_s(ttl_ms: int) -> float:
    return max(ttl_ms / 1000 / RENEWALS_PER_TTL, RENEW_RETRY_S / 10)


class PrefillAbandonedError(Exception):
    """Ends a KV push whose prefill failed or whose caller went away."""


def prefill_only(params: SamplingParams) -> SamplingParams:
    """The same sampling, stopped after the first token (decode carries on from there)."""
    return dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))


def exported_chunks(export: KVExport, timeout_s: float):
    """The export's (first_block, chunk) items until it is done; raises what ended it early."""
    while True:
        try:
            item = export.chunks.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError("prefill produced no KV in time") from None
        if item is EXPORT_DONE:
            return
        if isinstance(item, BaseException):
            raise item
        yield item


async def on_own_thread(name: str, fn: Callable[..., T], *args, **kwargs) -> T:
    """`fn(*args, **kwargs)` on a thread of its own (in this context), awaited.

    Not on the loop's shared executor, whose threads are few (min(32, cores + 4): 6 on
    two cores): a KV push waits on its thread for its prompt's layers while the prompt
    queues in the engine, so with six prompts queued the seventh one's push could not
    start until one of theirs ended, and a prompt the engine finished first (a short one,
    or one still on time) sat with its KV unsent, its decode with it, behind prompts
    that might not run for seconds. Cancelling the caller leaves the thread to finish
    (the push ends with its prompt), as `asyncio.to_thread` does.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()
    context = contextvars.copy_context()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.cancelled():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            outcome = (context.run(fn, *args, **kwargs), None)
        except BaseException as exc:  # handed to the awaiting task, raised there
            outcome = (None, exc)
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await future


async def push_kv(pusher: KVPusher, lease_id: str, chunks, *, request_id: str) -> PushTotals:
    """Push a prompt's KV into a lease (on a thread of its own: `push` blocks), in a span
    of its own and counted in the send side's metrics."""
    with tracing.span("kv_transfer send", request_id, kind=SpanKind.CLIENT) as span:
        layers: set[int] = set()
        if span.is_recording():
            chunks = _layers_of(chunks, layers)
        # explicitly: the pusher's calls run on its own loop, in a context of their own
        metadata = tuple(propagation.trace_carrier().items())
        try:
            totals = await on_own_thread(
                PUSH_THREAD, pusher.push, lease_id, chunks, metadata=metadata
            )
        except Exception as exc:
            metrics.kv_transfer_failed(TransferSide.SEND, _push_failure(exc))
            raise
        if span.is_recording():
            span.set_attributes(
                tracing.kv_transfer_attributes(len(layers), totals.chunks, totals.bytes)
            )
            span.set_attribute("pdserve.worker", pusher.target)
    metrics.kv_transferred(TransferSide.SEND, totals.bytes, totals.seconds)
    return totals


def _layers_of(chunks, layers: set[int]):
    """`chunks` as they are, noting each one's layer in `layers` (for the span)."""
    for first_block, chunk in chunks:
        layers.add(chunk.layer)
        yield first_block, chunk


def _push_failure(exc: Exception) -> str:
    """Why a push broke off, named as the status codes of the receiving side's failures."""
    if isinstance(exc, KVPushError):  # the decode worker ended it
        return exc.code.name
    if isinstance(exc, PrefillAbandonedError):
        return "CANCELLED"
    if isinstance(exc, TimeoutError):
        return "DEADLINE_EXCEEDED"
    return "INTERNAL"  # the engine failed


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, worker: Worker):
        self.worker = worker
        self.peers = DecodePeers(worker)
        self.transfers: set[asyncio.Task] = set()  # pushes still running after the reply

    @rpc_errors
    async def Prefill(self, request, context):
        self.worker.check_admitting()
        if not request.target.address or not request.target.lease_id:
            raise InvalidRequestError("target", "address and lease_id are required")
        with tracing.span("prefill", request.request_id, kind=SpanKind.SERVER) as span:
            started = time.monotonic()
            first, reason = await self._prefill(request)
            done = time.monotonic()
            if span.is_recording():
                span.set_attributes(prefill_attributes(first, started, done))
        return prefill_response_to_proto(first, reason, (done - started) * 1000)

    async def _prefill(self, request) -> tuple[RequestOutput, str | None]:
        """Run the prompt and start its KV hand-off: the first token, and why the request
        ends with it (None: it goes on at the decode worker)."""
        worker = self.worker
        ttft_deadline = ttft_deadline_from_proto(request.ttft_budget_ms, time.monotonic())
        # Its own id in this engine: on a `both` worker the decode side holds the
        # caller's request id for the same request (its lease).
        request_id = f"{request.request_id or uuid.uuid4().hex}{PREFILL_ID_SUFFIX}"
        params = sampling_params_from_proto(request.sampling)
        await worker.compile_constraint(params)  # off the engine thread, which finds it cached
        lease_id = request.target.lease_id
        peer = self.peers.acquire(request.target.address)
        try:
            await peer.check_role()
        except BaseException as exc:
            self.peers.release(peer, exc)
            raise
        export, push = KVExport(request_id), None
        keeper = asyncio.create_task(
            keep_lease_open(peer.kv, lease_id, request.target.lease_ttl_ms)
        )
        try:
            await peer.handshake(worker)
            sink = worker.loop.open_sink(request_id)
            await worker.loop.call(
                self._start,
                list(request.prompt_token_ids),
                params,
                request_id,
                export,
                request.priority,
                ttft_deadline,
            )
            chunks = exported_chunks(export, worker.config.lease_ttl_s)
            pushing = push_kv(peer.pusher, lease_id, chunks, request_id=request.request_id)
            push = asyncio.create_task(pushing)
            first: RequestOutput = await self._first_token(request_id, sink)
        except BaseException as exc:  # failed or cancelled by the caller: free both sides now
            keeper.cancel()
            abandon = self._abandon(request_id, export, push, peer, lease_id, error=exc)
            await asyncio.shield(abandon)
            raise
        reason = first_token_finish(first, params)
        task = asyncio.create_task(
            self._finish_transfer(push, keeper, peer, lease_id, first, reason)
        )
        self.transfers.add(task)
        task.add_done_callback(self.transfers.discard)
        return first, reason

    def _start(self, prompt, params, request_id, export, priority, ttft_deadline) -> None:
        """On the engine thread: queue the prompt and its layer-by-layer export together."""
        engine = self.worker.engine
        engine.add_request(prompt, prefill_only(params), request_id, priority, ttft_deadline)
        self.worker.loop.add_export(export)

    async def _first_token(self, request_id: str, sink: Sink) -> RequestOutput:
        try:
            item = await sink.queue.get()
        finally:
            self.worker.loop.close_sink(request_id)
        if isinstance(item, BaseException):
            raise item
        return item

    async def _abandon(self, request_id, export, push, peer, lease_id, *, error) -> None:
        """Stop the request here (if it started), give the lease back, then the peer."""
        worker = self.worker
        worker.loop.close_sink(request_id)

        def stop_on_engine_thread():
            worker.loop.drop_export(request_id, PrefillAbandonedError(request_id))
            if worker.engine.scheduler.get_request(request_id) is not None:
                worker.engine.abort(request_id)

        try:
            await worker.loop.call(stop_on_engine_thread)
            await self._release(peer, lease_id, push)
        finally:
            self.peers.release(peer, error)

    async def _finish_transfer(self, push, keeper, peer, lease_id, first, reason) -> None:
        """After the reply: wait for the KV push, then commit the lease (or give it back)."""
        error: Exception | None = None
        try:
            if reason is not None:  # the first token ended the request: decode is not needed
                await self._release(peer, lease_id, push)
                return
            await push
            await peer.kv.CommitKV(
                kv_transfer_pb2.CommitKVRequest(
                    lease_id=lease_id,
                    first_token_id=first.token_ids[0],
                ),
                timeout=self.worker.config.lease_ttl_s,
                metadata=propagation.outgoing_metadata(),
            )
        except Exception as exc:
            error = exc
            log.warning("KV hand-off for %s failed: %s", first.request_id, exc)
            await self._release(peer, lease_id, None)
        finally:
            keeper.cancel()
            self.peers.release(peer, error)

    async def _release(self, peer: DecodePeer, lease_id: str, push) -> None:
        """Give the decode lease back, once the push into it (if any) has ended."""
        if push is not None:
            await _push_ended(push)
        try:
            await peer.decode.Release(
                decode_pb2.ReleaseRequest(lease_id=lease_id),
                timeout=5,
                metadata=propagation.outgoing_metadata(),
            )
        except grpc.aio.AioRpcError as exc:
            log.warning("could not release lease: %s", exc.details())

    @rpc_errors
    async def GetLoad(self, request, context):
        return worker_load_to_proto(self.worker.info(num_block_hashes=0))

    async def close(self) -> None:
        if self.transfers:
            await asyncio.gather(*self.transfers, return_exceptions=True)
        await self.peers.close()


def prefill_attributes(first: RequestOutput, started: float, done: float) -> dict:
    """The prefill span's: prompt and cached tokens, the wait for the engine (from the call
    to the first scheduling) and the compute to the first token, as vLLM names them."""
    scheduled = first.scheduled_time or started
    return {
        "gen_ai.usage.input_tokens": len(first.prompt_token_ids),
        "pdserve.prefill.cached_tokens": first.num_cached_tokens,
        "gen_ai.latency.time_in_queue": max(scheduled - started, 0.0),
        "gen_ai.latency.time_in_model_prefill": max(done - scheduled, 0.0),
    }


def first_token_finish(first: RequestOutput, params: SamplingParams) -> str | None:
    """Why the request ends at its first token under its real parameters, or None."""
    if first.finish_reason == "stop":  # EOS, a stop token or a stop string
        return "stop"
    # The engine admitted prompt + max_tokens within the context window, so only
    # max_tokens itself can end the request by length here.
    return "length" if params.max_tokens == 1 else None


async def _push_ended(push: asyncio.Task) -> None:
    """Wait for a push whose lease goes back anyway, and say how it ended."""
    try:
        await push
    except (PrefillAbandonedError, EngineFailedError, TimeoutError, KVPushError) as exc:
        # The prefill was abandoned or failed, or the decode worker ended the lease.
        log.debug("KV push ended early: %r", exc)
    except Exception:
        log.warning("KV push failed unexpectedly", exc_info=True)
