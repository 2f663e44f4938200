"""One request across the worker pools: admit on decode, prefill, stream; retried.

Generation is deterministic for a given request (greedy, or seeded per output
position; the router seeds unseeded requests), so a retry after a worker failed
regenerates the same tokens: the runner skips the ones already delivered and the
caller sees one uninterrupted stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_random_exponential

from pdserve.api.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from pdserve.core.block_hash import num_blocks_for, prompt_block_hashes
from pdserve.core.errors import KVCapacityError, UnavailableError
from pdserve.core.workers import WorkerInfo
from pdserve.router.discovery import Discovery
from pdserve.router.dispatches import RecentDispatches
from pdserve.router.policy import ColocationRule, DecodePolicy, PrefillPolicy, cached_prefix_blocks
from pdserve.router.relay import DecodeRelays
from pdserve.rpc.wire import drop_first_tokens

log = logging.getLogger(__name__)

# A failed attempt with these codes is retried from the start on other workers.
RETRYABLE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,  # worker down or draining
        grpc.StatusCode.ABORTED,  # KV push broke off (prefill worker died)
        grpc.StatusCode.FAILED_PRECONDITION,  # lease expired or refused mid-hand-off
        grpc.StatusCode.CANCELLED,  # a worker shut down under us
        grpc.StatusCode.INTERNAL,  # a worker's engine step failed
    }
)
FINISHED = common_pb2.FINISH_REASON_UNSPECIFIED
# Retries wait a random time, growing from 0.05 s up to 0.5 s: spread out, so the retries
# of the requests one dead worker held do not all arrive at once.
RETRY_BACKOFF_BASE_S = 0.05
RETRY_BACKOFF_MAX_S = 0.5
RELEASE_TIMEOUT_S = 5.0


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() in RETRYABLE_CODES


def _log_retry(state) -> None:
    exc = state.outcome.exception()
    log.info("attempt %d failed (%s), retrying", state.attempt_number, exc.code().name)


@dataclass
class Progress:
    """What the caller learns as the request moves (for Redis state and timings)."""

    phase: str = "queued"  # queued | prefilling | transferring | decoding
    prefill_worker: str = ""
    decode_worker: str = ""
    attempts: int = 0
    admitted_at: float = 0.0
    first_token_at: float = 0.0
    first_decode_at: float = 0.0
    cached_prompt_tokens: int = 0
    on_change: Callable[[Progress], None] | None = field(default=None, repr=False)

    def set(self, **fields) -> None:
        for name, value in fields.items():
            setattr(self, name, value)
        if self.on_change is not None:
            self.on_change(self)


class DeliveredTokens:
    """The tokens a caller has, so that a retry's regenerated stream adds only new ones."""

    def __init__(self) -> None:
        self.num_tokens = 0  # delivered, in all attempts
        self._num_seen = 0  # tokens of the current attempt so far

    def new_attempt(self) -> None:
        self._num_seen = 0

    def keep_new(self, delta: decode_pb2.TokenDelta) -> bool:
        """Strip the tokens (and their text) the caller has; False: nothing left to send."""
        num_tokens = len(delta.token_ids)
        num_old = min(max(self.num_tokens - self._num_seen, 0), num_tokens)
        self._num_seen += num_tokens
        if num_old:
            drop_first_tokens(delta, num_old)
            if not (delta.token_ids or delta.text) and delta.finish_reason == FINISHED:
                return False
        self.num_tokens = max(self.num_tokens, self._num_seen)
        return True


class ChannelPool:
    """One grpc.aio channel per worker address, reused by every request."""

    def __init__(self, options=None):
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._options = options or []

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = grpc.aio.insecure_channel(address, options=self._options)
            self._channels[address] = channel
        return channel

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


@dataclass
class RunnerConfig:
    block_size: int = 16
    lease_ttl_ms: int = 10_000
    max_attempts: int = 3
    stream_interval: int = 1  # tokens per decode message (see decode.proto StreamRequest)
    colocation: ColocationRule = field(default_factory=ColocationRule)


class RequestRunner:
    def __init__(
        self,
        discovery: Discovery,
        prefill_policy: PrefillPolicy,
        decode_policy: DecodePolicy,
        channels: ChannelPool,
        config: RunnerConfig,
    ):
        self.discovery, self.channels, self.config = discovery, channels, config
        self.prefill_policy, self.decode_policy = prefill_policy, decode_policy
        self.dispatches = RecentDispatches()
        self.relays = DecodeRelays(channels.get)
        self._releases: set[asyncio.Future] = set()  # abandoned leases being given back

    async def run(
        self,
        request_id: str,
        prompt: list[int],
        sampling: common_pb2.SamplingParams,
        progress: Progress,
        deliver: Callable[[decode_pb2.TokenDelta], None],
        timeout: float | None = None,
    ) -> None:
        """Run the request to its end, handing each delta to `deliver` exactly once,
        across retries. Decode deltas are delivered from the relay's reader, as they
        arrive: `deliver` must not block."""
        delivered = DeliveredTokens()

        def deliver_new(delta: decode_pb2.TokenDelta) -> None:
            if delivered.keep_new(delta):
                deliver(delta)

        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.config.max_attempts),
            wait=wait_random_exponential(multiplier=RETRY_BACKOFF_BASE_S, max=RETRY_BACKOFF_MAX_S),
            retry=retry_if_exception(_retryable),
            before_sleep=_log_retry,
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                progress.set(attempts=progress.attempts + 1)
                delivered.new_attempt()
                await self._attempt(request_id, prompt, sampling, progress, timeout, deliver_new)

    async def _attempt(self, request_id, prompt, sampling, progress, timeout, deliver) -> None:
        blocks_needed = num_blocks_for(len(prompt) + sampling.max_tokens, self.config.block_size)
        decodes = self.decode_policy.rank(
            self.dispatches.adjust(self.discovery.workers("decode")), blocks_needed
        )
        if not decodes:
            raise UnavailableError("no healthy decode worker")
        hashes = prompt_block_hashes(prompt, self.config.block_size)
        first_choice = decodes[0]
        cached = cached_prefix_blocks(first_choice, hashes) * self.config.block_size
        if self.config.colocation.should_colocate(len(prompt), cached):
            self.dispatches.record(first_choice.address, blocks_needed)
            await self._colocated(
                first_choice, request_id, prompt, sampling, progress, timeout, deliver
            )
            return
        decode, lease = await self._admit(
            decodes, blocks_needed, request_id, prompt, sampling, progress, timeout
        )
        # Attached before prefill runs, so that no token waits on us.
        stream = self.relays.open(
            decode.address,
            decode_pb2.RelayAttach(
                lease_id=lease.lease_id,
                stream_interval=self.config.stream_interval,
            ),
            timeout,
        )
        try:
            first = await self._prefill(
                hashes, request_id, prompt, sampling, decode, lease, progress, timeout
            )
            deliver(first)
            if first.finish_reason != FINISHED:
                return
            await stream.deliver(_marking_decoding(progress, deliver))
        finally:
            stream.cancel()  # no-op when it ended; frees the decode side when we stop early

    async def _admit(
        self,
        decodes: list[WorkerInfo],
        blocks_needed: int,
        request_id,
        prompt,
        sampling,
        progress,
        timeout,
    ):
        """Admit on the first decode worker with room; RESOURCE_EXHAUSTED moves on."""
        exhausted = 0
        for worker in decodes:
            stub = decode_pb2_grpc.DecodeStub(self.channels.get(worker.address))
            # Recorded before the call: requests that arrive while it is in flight must
            # already see this one (a refused one makes a full worker look fuller: harmless).
            self.dispatches.record(worker.address, blocks_needed)
            admitting = asyncio.ensure_future(
                stub.Admit(
                    decode_pb2.AdmitRequest(
                        request_id=request_id,
                        prompt_token_ids=prompt,
                        sampling=sampling,
                        lease_ttl_ms=self.config.lease_ttl_ms,
                    ),
                    timeout=timeout,
                )
            )
            try:
                lease = await asyncio.shield(admitting)
            except asyncio.CancelledError:
                # We stop here, but the worker may admit all the same: give that lease
                # back at once rather than leave its blocks reserved until it expires.
                admitting.add_done_callback(lambda done, s=stub: self._give_back(s, done))
                raise
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    exhausted += 1
                    continue
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    self.discovery.mark_unhealthy(worker.address)
                    continue
                raise
            progress.set(
                phase="prefilling", decode_worker=worker.address, admitted_at=time.monotonic()
            )
            return worker, lease
        if exhausted:
            raise KVCapacityError(f"no decode worker has room ({exhausted} full)")
        raise UnavailableError("no decode worker reachable")

    def _give_back(self, stub: decode_pb2_grpc.DecodeStub, admitting: asyncio.Future) -> None:
        if admitting.cancelled() or admitting.exception() is not None:
            return
        release = stub.Release(
            decode_pb2.ReleaseRequest(lease_id=admitting.result().lease_id),
            timeout=RELEASE_TIMEOUT_S,
        )
        task = asyncio.ensure_future(release)
        self._releases.add(task)
        task.add_done_callback(self._released)

    def _released(self, task: asyncio.Future) -> None:
        self._releases.discard(task)
        if not task.cancelled() and task.exception() is not None:  # it expires in the end
            log.info("giving back an abandoned lease failed: %s", task.exception())

    async def _prefill(
        self, hashes, request_id, prompt, sampling, decode, lease, progress, timeout
    ) -> decode_pb2.TokenDelta:
        prefills = self.prefill_policy.rank(
            self.dispatches.adjust(self.discovery.workers("prefill")), hashes
        )
        if not prefills:
            raise UnavailableError("no healthy prefill worker")
        last_error: Exception | None = None
        for worker in prefills:
            stub = prefill_pb2_grpc.PrefillStub(self.channels.get(worker.address))
            progress.set(prefill_worker=worker.address)
            self.dispatches.record(worker.address)
            try:
                response = await stub.Prefill(
                    prefill_pb2.PrefillRequest(
                        request_id=request_id,
                        prompt_token_ids=prompt,
                        sampling=sampling,
                        target=prefill_pb2.KVTarget(
                            address=decode.address, lease_id=lease.lease_id
                        ),
                    ),
                    timeout=timeout,
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                self.discovery.mark_unhealthy(worker.address)
                last_error = exc  # the lease is still open: the next worker pushes into it
                continue
            progress.set(
                phase="transferring",
                first_token_at=time.monotonic(),
                cached_prompt_tokens=response.usage.cached_prompt_tokens,
            )
            head = decode_pb2.TokenDelta(
                token_ids=[response.first_token_id],
                text=response.text,
                finish_reason=response.finish_reason,
            )
            if response.HasField("logprobs"):
                head.logprobs.append(response.logprobs)
            if response.finish_reason != FINISHED:
                head.usage.CopyFrom(response.usage)
            return head
        raise last_error

    async def _colocated(
        self, worker, request_id, prompt, sampling, progress, timeout, deliver
    ) -> None:
        progress.set(
            phase="prefilling",
            prefill_worker=worker.address,
            decode_worker=worker.address,
            admitted_at=time.monotonic(),
        )
        stream = self.relays.open(
            worker.address,
            decode_pb2.RelayAttach(
                stream_interval=self.config.stream_interval,
                generate=decode_pb2.LocalGenerateRequest(
                    request_id=request_id, prompt_token_ids=prompt, sampling=sampling
                ),
            ),
            timeout,
        )
        try:
            await stream.deliver(_marking_decoding(progress, deliver, first_token_here=True))
        finally:
            stream.cancel()


def _marking_decoding(progress: Progress, deliver, first_token_here: bool = False):
    """`deliver`, after marking the request as decoding at its first decode delta."""

    def deliver_and_mark(delta: decode_pb2.TokenDelta) -> None:
        if progress.phase != "decoding":
            now = time.monotonic()
            if first_token_here:  # colocated: the first token comes with the decode stream
                progress.first_token_at = now
            progress.set(phase="decoding", first_decode_at=now)
        deliver(delta)

    return deliver_and_mark
