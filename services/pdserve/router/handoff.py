"""The router's hand-off client: admit on a decode worker, prefill into its lease, stream.

One client for every caller. The runner drives it for each request (choosing workers,
moving on when one refuses); tests and benchmarks drive it on workers they name, so
what they exercise is the code the router runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import grpc
from opentelemetry.trace import SpanKind

from pdserve.api.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from pdserve.core.block_hash import num_blocks_for, prompt_block_hashes
from pdserve.router.breaker import DEFAULT_ADMIT_TIMEOUT_S, DEFAULT_PREFILL_TIMEOUT_S
from pdserve.router.relay import DEFAULT_STREAM_PROGRESS_TIMEOUT_S, DecodeRelays, RelayStream
from pdserve.rpc.tls import ChannelTls
from pdserve.rpc.wire import is_final
from pdserve.rpc.wire.router import prefill_response_to_delta
from pdserve.telemetry import propagation, tracing

log = logging.getLogger(__name__)
RELEASE_TIMEOUT_S = 5.0
DEFAULT_LEASE_TTL_S = 10.0
MAX_ERROR_CHARS = 160  # of one failure's text in a request's final status


@dataclass(frozen=True, slots=True)
class Deadlines:
    """The router's own deadlines on its calls to workers (`RouterConfig.deadlines`);
    a call gets the shorter of this and what is left of the client's."""

    admit_s: float = DEFAULT_ADMIT_TIMEOUT_S
    prefill_s: float = DEFAULT_PREFILL_TIMEOUT_S

    def __post_init__(self) -> None:
        for name in ("admit_s", "prefill_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


class WorkerTimeout(grpc.aio.AioRpcError):
    """A worker call passed the router's deadline (or its worker stopped heartbeating
    while it ran): UNAVAILABLE, so that it fails over as for a dead worker."""

    def __init__(self, worker: str, method: str, why: str):
        details = f"worker {worker} {why} during {method}"
        super().__init__(
            grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details
        )
        self.worker, self.method = worker, method


@dataclass(frozen=True, slots=True)
class WorkerFailure:
    """One worker failing one attempt of a request, as its final status names it."""

    attempt: int  # from 1
    role: str  # "prefill" or "decode"
    worker: str
    error: str  # `CODE: details`, shortened

    def __str__(self) -> str:
        return f"#{self.attempt} {self.role} {self.worker}: {self.error}"


def error_text(error: BaseException) -> str:
    """`CODE: details` of a gRPC error (else `Type: message`), at most MAX_ERROR_CHARS."""
    if isinstance(error, grpc.aio.AioRpcError):
        text = f"{error.code().name}: {error.details()}"
    else:
        text = f"{type(error).__name__}: {error}"
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


class AttemptHistory:
    """Every attempt of one request and what failed in each: shared by all its `Attempt`s
    (`dataclasses.replace` keeps the same object), kept by the runner."""

    __slots__ = ("num_attempts", "failures")

    def __init__(self) -> None:
        self.num_attempts = 0
        self.failures: list[WorkerFailure] = []

    def failed(self, role: str, worker: str, error: BaseException) -> None:
        self.failures.append(WorkerFailure(self.num_attempts, role, worker, error_text(error)))

    def summary(self, max_listed: int = 8) -> str:
        listed = "; ".join(str(f) for f in self.failures[:max_listed])
        more = len(self.failures) - max_listed
        return listed + (f"; and {more} more" if more > 0 else "")


@dataclass(frozen=True, slots=True)
class Attempt:
    """One try at running a request on the workers: everything each call needs, passed whole."""

    request_id: str
    prompt: list[int]
    sampling: common_pb2.SamplingParams
    deadline: float | None = None  # time.monotonic() by which the client wants its answer
    # the pool's KV block size, and the prompt's chained block hashes at it (what
    # cache-aware routing compares); 0 and () until `for_block_size`
    block_size: int = 0
    block_hashes: list[str] = field(default_factory=list)
    priority: int = 0  # the public request's: lower runs first on the workers
    # time.monotonic() by which the client wants its first token (its `ttft_slo_ms`)
    ttft_deadline: float | None = None
    # what failed in this request's attempts so far (one object for all of them)
    history: AttemptHistory = field(default_factory=AttemptHistory, compare=False, repr=False)

    def for_block_size(self, block_size: int) -> Attempt:
        """This attempt on a pool whose workers use `block_size`."""
        if block_size == self.block_size:
            return self
        hashes = prompt_block_hashes(self.prompt, block_size)
        return replace(self, block_size=block_size, block_hashes=hashes)

    @property
    def num_blocks_needed(self) -> int:
        """KV blocks the request holds on its decode worker at its longest."""
        return num_blocks_for(len(self.prompt) + self.sampling.max_tokens, self.block_size)

    def ttft_slo_ms(self, received_at: float) -> int:
        """The client's TTFT target, for a request received at `received_at`; 0: none."""
        return 0 if self.ttft_deadline is None else round((self.ttft_deadline - received_at) * 1000)

    def ttft_budget_ms(self) -> int:
        """What is left of the client's TTFT target, for a worker call's `ttft_budget_ms`:
        at least 1 ms (a target already missed is still one), 0 without a target."""
        if self.ttft_deadline is None:
            return 0
        return max(1, round((self.ttft_deadline - time.monotonic()) * 1000))

    def time_left(self) -> float | None:
        """Seconds to the deadline (a call's timeout), None without one."""
        if self.deadline is None:
            return None
        return max(self.deadline - time.monotonic(), 0.0)

    def timeout(self, cap_s: float) -> tuple[float, bool]:
        """A call's timeout: the shorter of `cap_s` (the router's deadline) and the
        client's time left; and whether the router's is the shorter (its expiry then
        means the worker is hung, not that the client gave up)."""
        left = self.time_left()
        if left is None or cap_s < left:
            return cap_s, True
        return left, False


@dataclass(frozen=True, slots=True)
class Orphan:
    """Where a request whose router was lost may still run: its decode worker and its
    name there (from its record)."""

    decode_address: str
    request_id: str


@dataclass(frozen=True, slots=True)
class Admission:
    """A lease on a decode worker: where the prefill worker pushes the prompt's KV."""

    decode_address: str
    lease: decode_pb2.Lease


class ChannelPool:
    """One grpc.aio channel per worker address, reused by every request; mTLS with `tls`.

    Once the TLS files change, the next `get` of an address opens a channel with the new
    ones; the old channel keeps the calls it carries (a Relay call lives long) and is
    closed with the pool.
    """

    def __init__(self, options=None, tls: ChannelTls | None = None):
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._options = options or []
        self._tls = tls or ChannelTls()
        self._generation = self._tls.generation
        self._retired: list[grpc.aio.Channel] = []  # of older TLS files

    def get(self, address: str) -> grpc.aio.Channel:
        if self._tls.generation != self._generation:
            self._generation = self._tls.generation
            self._retired.extend(self._channels.values())
            self._channels.clear()
        channel = self._channels.get(address)
        if channel is None:
            channel = self._tls.aio_channel(address, self._options)
            self._channels[address] = channel
        return channel

    async def close(self) -> None:
        for channel in [*self._channels.values(), *self._retired]:
            await channel.close()
        self._channels.clear()
        self._retired.clear()


class HandOff:
    """Admit, prefill and stream on named workers; each call raises the worker's
    `grpc.aio.AioRpcError` as it came (callers decide what is worth another worker).

    Decode tokens arrive over the router's one Relay call per decode worker.
    """

    def __init__(
        self,
        channels: ChannelPool,
        *,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
        stream_interval: int = 1,
        stream_progress_timeout_s: float | None = DEFAULT_STREAM_PROGRESS_TIMEOUT_S,
        deadlines: Deadlines | None = None,
    ):
        self.channels = channels
        self.deadlines = deadlines or Deadlines()
        self.lease_ttl_ms = round(lease_ttl_s * 1000)
        self.stream_interval = stream_interval  # tokens per decode message (decode.proto)
        self.relays = DecodeRelays(channels.get, progress_timeout_s=stream_progress_timeout_s)
        self._releases: set[asyncio.Future] = set()  # abandoned leases being given back

    async def admit(self, decode_address: str, attempt: Attempt) -> Admission:
        """Reserve the attempt's KV blocks on a decode worker (RESOURCE_EXHAUSTED: no room)."""
        stub = decode_pb2_grpc.DecodeStub(self.channels.get(decode_address))
        request = decode_pb2.AdmitRequest(
            request_id=attempt.request_id,
            prompt_token_ids=attempt.prompt,
            sampling=attempt.sampling,
            lease_ttl_ms=self.lease_ttl_ms,
        )
        with tracing.span("admit", attempt.request_id, kind=SpanKind.CLIENT) as span:
            span.set_attribute("pdserve.worker", decode_address)
            timeout, ours = attempt.timeout(self.deadlines.admit_s)
            admit = stub.Admit(request, timeout=timeout, metadata=propagation.outgoing_metadata())
            admitting = asyncio.ensure_future(admit)
            try:
                lease = await asyncio.shield(admitting)
            except asyncio.CancelledError:
                # We stop here, but the worker may admit all the same: give that lease back
                # at once rather than leave its blocks reserved until it expires.
                admitting.add_done_callback(lambda done: self._give_back(stub, done))
                raise
            except grpc.aio.AioRpcError as exc:
                if ours and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    why = f"did not answer within {timeout:g} s (--admit-timeout)"
                    raise WorkerTimeout(decode_address, "Admit", why) from exc
                raise
            span.set_attribute("pdserve.lease.num_blocks", lease.num_blocks)
        return Admission(decode_address, lease)

    def attach(self, admission: Admission, attempt: Attempt) -> RelayStream:
        """The lease's decode tokens (after the first), from before prefill starts, so
        that no token waits on us. Cancelling the stream frees the lease."""
        attach = decode_pb2.RelayAttach(
            lease_id=admission.lease.lease_id,
            stream_interval=self.stream_interval,
            trace_context=propagation.trace_carrier(),
        )
        return self.relays.open(admission.decode_address, attach, attempt.time_left())

    async def prefill(
        self, prefill_address: str, admission: Admission, attempt: Attempt
    ) -> prefill_pb2.PrefillResponse:
        """Compute the prompt on a prefill worker, which pushes its KV into the lease;
        returns with the first token, while the push goes on."""
        stub = prefill_pb2_grpc.PrefillStub(self.channels.get(prefill_address))
        # the decode worker's KVTransfer: its own port (--kv-port) when the lease names one
        kv_address = admission.lease.kv_address or admission.decode_address
        target = prefill_pb2.KVTarget(
            address=kv_address,
            lease_id=admission.lease.lease_id,
            lease_ttl_ms=admission.lease.ttl_ms,
        )
        request = prefill_pb2.PrefillRequest(
            request_id=attempt.request_id,
            prompt_token_ids=attempt.prompt,
            sampling=attempt.sampling,
            target=target,
            priority=attempt.priority,
            ttft_budget_ms=attempt.ttft_budget_ms(),
        )
        with tracing.span("prefill", attempt.request_id, kind=SpanKind.CLIENT) as span:
            span.set_attribute("pdserve.worker", prefill_address)
            timeout, ours = attempt.timeout(self.deadlines.prefill_s)
            try:
                return await stub.Prefill(
                    request, timeout=timeout, metadata=propagation.outgoing_metadata()
                )
            except grpc.aio.AioRpcError as exc:
                if ours and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    why = f"did not answer within {timeout:g} s (--prefill-timeout)"
                    raise WorkerTimeout(prefill_address, "Prefill", why) from exc
                raise

    def reattach(self, orphan: Orphan, from_token: int, attempt: Attempt) -> RelayStream:
        """A request a lost router ran, still running on its decode worker: its tokens
        from `from_token` (counted from 0) on. NOT_FOUND or OUT_OF_RANGE when the worker
        no longer holds it, or not from there (see decode.proto RelayReattach)."""
        reattach = decode_pb2.RelayReattach(request_id=orphan.request_id, from_token=from_token)
        attach = decode_pb2.RelayAttach(
            stream_interval=self.stream_interval,
            reattach=reattach,
            trace_context=propagation.trace_carrier(),
        )
        return self.relays.open(orphan.decode_address, attach, attempt.time_left())

    def colocated(self, address: str, attempt: Attempt) -> RelayStream:
        """Prefill and decode on one worker, no KV transfer: every token on the stream."""
        generate = decode_pb2.LocalGenerateRequest(
            request_id=attempt.request_id,
            prompt_token_ids=attempt.prompt,
            sampling=attempt.sampling,
            priority=attempt.priority,
            ttft_budget_ms=attempt.ttft_budget_ms(),
        )
        attach = decode_pb2.RelayAttach(
            stream_interval=self.stream_interval,
            generate=generate,
            trace_context=propagation.trace_carrier(),
        )
        return self.relays.open(address, attach, attempt.time_left())

    async def generate(
        self, prefill_address: str, decode_address: str, attempt: Attempt
    ) -> AsyncIterator[decode_pb2.TokenDelta]:
        """One disaggregated request on the workers named: the first token (from prefill)
        as soon as it exists, then the decode worker's deltas; the final one carries the
        usage, `cached_prompt_tokens` as the prefill worker found them. No retries."""
        admission = await self.admit(decode_address, attempt)
        stream = self.attach(admission, attempt)
        deltas: asyncio.Queue = asyncio.Queue()
        delivering = None
        try:
            response = await self.prefill(prefill_address, admission, attempt)
            yield prefill_response_to_delta(response)
            if is_final(response):
                return
            delivering = asyncio.ensure_future(stream.deliver(deltas.put_nowait))
            delivering.add_done_callback(lambda _: deltas.put_nowait(None))
            while (delta := await deltas.get()) is not None:
                if is_final(delta):
                    delta.usage.cached_prompt_tokens = response.usage.cached_prompt_tokens
                yield delta
            await delivering  # the stream's error, if it ended in one
        finally:
            stream.cancel()  # no-op once it ended; else frees the lease on the decode side
            if delivering is not None:
                delivering.cancel()

    async def close(self) -> None:
        """End every Relay call (aborting what still streams on them)."""
        await self.relays.close()

    async def __aenter__(self) -> HandOff:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    def _give_back(self, stub: decode_pb2_grpc.DecodeStub, admitting: asyncio.Future) -> None:
        if admitting.cancelled() or admitting.exception() is not None:
            return
        release = stub.Release(
            decode_pb2.ReleaseRequest(lease_id=admitting.result().lease_id),
            timeout=RELEASE_TIMEOUT_S,
            metadata=propagation.outgoing_metadata(),
        )
        task = asyncio.ensure_future(release)
        self._releases.add(task)
        task.add_done_callback(self._released)

    def _released(self, task: asyncio.Future) -> None:
        self._releases.discard(task)
        if not task.cancelled() and task.exception() is not None:  # it expires in the end
            log.info("giving back an abandoned lease failed: %s", task.exception())
