"""One attempt at a request across the worker pools: pick workers, hand off, stream.

The runner decides where an attempt goes (cache-aware prefill, the decode worker with
room, or both on one worker when colocating pays) and moves on to the next candidate
when a worker refuses. Retrying a whole attempt is the session's (`router.session`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from pdserve.api.v1 import decode_pb2, prefill_pb2
from pdserve.core.errors import KVCapacityError, PreconditionError, UnavailableError
from pdserve.core.workers import WorkerInfo
from pdserve.router.discovery import Discovery
from pdserve.router.dispatches import RecentDispatches
from pdserve.router.handoff import DEFAULT_LEASE_TTL_S, Admission, Attempt, ChannelPool, HandOff
from pdserve.router.policy import ColocationRule, DecodePolicy, PrefillPolicy, cached_prefix_blocks
from pdserve.rpc.wire import is_final
from pdserve.rpc.wire.router import prefill_response_to_delta


class AttemptEvents(Protocol):
    """What the runner tells the request's owner as an attempt moves on."""

    def on_admitted(self, decode_worker: str) -> None:
        """A decode worker holds the request's blocks: prefill comes next."""

    def on_prefill_worker(self, prefill_worker: str) -> None:
        """The prompt goes to this worker (the next one, after a refusal)."""

    def on_first_token(self, delta: decode_pb2.TokenDelta, cached_prompt_tokens: int) -> None:
        """The prefill worker returned the first token; its KV moves to the decode worker."""

    def deliver_decoded(self, delta: decode_pb2.TokenDelta) -> None:
        """A delta from the decode stream; called from the relay's reader: must not block."""


@dataclass(slots=True)
class RunnerConfig:
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S
    max_attempts: int = 3  # per request, the first included (the session retries)
    stream_interval: int = 1  # tokens per decode message (see decode.proto StreamRequest)
    colocation: ColocationRule = field(default_factory=ColocationRule)


@dataclass(frozen=True, slots=True)
class Pool:
    """The candidate workers of one attempt, as discovery lists them now."""

    decode: list[WorkerInfo]
    prefill: list[WorkerInfo]

    @property
    def block_size(self) -> int:
        """The KV block size the candidates share; they must agree, since the router
        hashes the prompt and counts its blocks in one size for all of them."""
        sizes = {worker.block_size for worker in (*self.decode, *self.prefill)}
        if len(sizes) != 1:
            raise PreconditionError(_disagreement(self.decode + self.prefill))
        return sizes.pop()


def _disagreement(workers: Sequence[WorkerInfo]) -> str:
    listed = ", ".join(f"{w.address} ({w.role}) {w.block_size}" for w in workers)
    return (
        f"the workers disagree on the KV block size ({listed}): start them all with "
        "the same --block-size"
    )


class RequestRunner:
    """Runs attempts: picks the workers for each and drives the hand-off across them."""

    def __init__(
        self,
        discovery: Discovery,
        prefill_policy: PrefillPolicy,
        decode_policy: DecodePolicy,
        channels: ChannelPool,
        config: RunnerConfig,
    ):
        self.discovery, self.config = discovery, config
        self.prefill_policy, self.decode_policy = prefill_policy, decode_policy
        self.dispatches = RecentDispatches()
        self.handoff = HandOff(
            channels, lease_ttl_s=config.lease_ttl_s, stream_interval=config.stream_interval
        )

    async def run(self, attempt: Attempt, events: AttemptEvents) -> None:
        """One attempt, to the request's final delta; raises what ended it otherwise
        (`grpc.aio.AioRpcError` from a worker, or a domain error)."""
        decode_workers = self.discovery.workers("decode")
        if not decode_workers:
            raise UnavailableError("no healthy decode worker")
        pool = Pool(decode_workers, self.discovery.workers("prefill"))
        attempt = attempt.for_block_size(pool.block_size)
        decodes = self.decode_policy.rank(
            self.dispatches.adjust(pool.decode), attempt.num_blocks_needed
        )
        first_choice = decodes[0]
        cached = cached_prefix_blocks(first_choice, attempt.block_hashes) * attempt.block_size
        if self.config.colocation.should_colocate(len(attempt.prompt), cached):
            await self._colocated(first_choice, attempt, events)
            return
        admission = await self._admit(decodes, attempt, events)
        stream = self.handoff.attach(admission, attempt)
        try:
            response = await self._prefill(pool.prefill, admission, attempt, events)
            head = prefill_response_to_delta(response)
            events.on_first_token(head, response.usage.cached_prompt_tokens)
            if not is_final(head):
                await stream.deliver(events.deliver_decoded)
        finally:
            stream.cancel()  # no-op when it ended; frees the decode side when we stop early

    async def _admit(
        self, decodes: list[WorkerInfo], attempt: Attempt, events: AttemptEvents
    ) -> Admission:
        """Admit on the first decode worker with room; RESOURCE_EXHAUSTED moves on."""
        num_exhausted = 0
        for worker in decodes:
            # Recorded before the call: requests that arrive while it is in flight must
            # already see this one (a refused one makes a full worker look fuller: harmless).
            self.dispatches.record(worker.address, attempt.num_blocks_needed)
            try:
                admission = await self.handoff.admit(worker.address, attempt)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    num_exhausted += 1
                    continue
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    self.discovery.mark_unhealthy(worker.address)
                    continue
                raise
            events.on_admitted(worker.address)
            return admission
        if num_exhausted:
            raise KVCapacityError(f"no decode worker has room ({num_exhausted} full)")
        raise UnavailableError("no decode worker reachable")

    async def _prefill(
        self,
        prefill_workers: list[WorkerInfo],
        admission: Admission,
        attempt: Attempt,
        events: AttemptEvents,
    ) -> prefill_pb2.PrefillResponse:
        """Prefill on the best prefill worker; UNAVAILABLE moves on (the lease stays open)."""
        prefills = self.prefill_policy.rank(
            self.dispatches.adjust(prefill_workers), attempt.block_hashes
        )
        if not prefills:
            raise UnavailableError("no healthy prefill worker")
        last_error: Exception | None = None
        for worker in prefills:
            events.on_prefill_worker(worker.address)
            # what the worker will hold in its prefix cache, before its next report says so
            self.dispatches.record(worker.address, block_hashes=attempt.block_hashes)
            try:
                return await self.handoff.prefill(worker.address, admission, attempt)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                self.discovery.mark_unhealthy(worker.address)
                last_error = exc  # the lease is still open: the next worker pushes into it
        raise last_error

    async def _colocated(self, worker: WorkerInfo, attempt: Attempt, events: AttemptEvents) -> None:
        self.dispatches.record(
            worker.address, attempt.num_blocks_needed, block_hashes=attempt.block_hashes
        )
        events.on_admitted(worker.address)
        events.on_prefill_worker(worker.address)
        stream = self.handoff.colocated(worker.address, attempt)
        try:
            await stream.deliver(events.deliver_decoded)
        finally:
            stream.cancel()

    async def close(self) -> None:
        await self.handoff.close()
