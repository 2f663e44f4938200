"""One attempt at a request across the worker pools: pick workers, hand off, stream.

The runner decides where an attempt goes (cache-aware prefill, the decode worker with
room, or both on one worker when colocating pays) and moves on to the next candidate
when a worker refuses. Retrying a whole attempt is the session's (`router.session`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import grpc

from pdserve.api.v1 import decode_pb2, prefill_pb2
from pdserve.core.errors import KVCapacityError, PreconditionError, UnavailableError
from pdserve.core.workers import WorkerInfo
from pdserve.router.breaker import BreakerSettings
from pdserve.router.colocation import FirstTokenTimer, LiveColocation
from pdserve.router.disaggregation import Decision
from pdserve.router.discovery import Discovery
from pdserve.router.discovery.guarded import GuardedDiscovery
from pdserve.router.dispatches import RecentDispatches
from pdserve.router.handoff import (
    Admission,
    Attempt,
    AttemptHistory,
    ChannelPool,
    Deadlines,
    HandOff,
    Orphan,
    WorkerTimeout,
    error_text,
)
from pdserve.router.policy import DecodePolicy, PrefillPolicy, cached_prefix_blocks
from pdserve.rpc.wire import is_final
from pdserve.rpc.wire.router import prefill_response_to_delta
from pdserve.telemetry import metrics, tracing
from pdserve.telemetry.metrics import COLOCATED_POLICY, RoutingOutcome
from pdserve.telemetry.request import placement_event

T = TypeVar("T")
# How often a running Prefill call checks that discovery still lists its worker (its
# heartbeat or poll): a worker frozen mid-call is left within about the registry's TTL.
PREFILL_WATCH_INTERVAL_S = 0.5
# A worker failing with these counts against its circuit breaker: unreachable, or hung
# past one of the router's deadlines (`WorkerTimeout`). Other codes are the request's
# (INVALID_ARGUMENT), the pool's (RESOURCE_EXHAUSTED), the lease's, or the client's own
# deadline (DEADLINE_EXCEEDED), and say nothing against the worker.
_WORKER_FAILURES = frozenset({grpc.StatusCode.UNAVAILABLE})


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

    def on_failover(self, worker: str, error: BaseException) -> None:
        """`worker` refused or was unreachable; the attempt moves on to the next candidate."""

    def on_reattached(self, orphan: Orphan) -> None:
        """The request streams from where a lost router left it running."""


@dataclass(slots=True)
class RunnerConfig:
    """What the runner takes of `RouterConfig`, which holds the defaults (none here)."""

    lease_ttl_s: float
    max_attempts: int  # per request, the first included (the session retries)
    stream_interval: int  # tokens per decode message (see decode.proto StreamRequest)
    colocation: LiveColocation  # where each prompt is prefilled (router/disaggregation.py)
    stream_progress_timeout_s: float  # a decode worker silent this long counts as dead
    deadlines: Deadlines  # the router's own deadlines on Admit and Prefill
    breaker: BreakerSettings  # when a worker's circuit breaker opens, how it closes


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


def route_attributes(policy: str, ranked: Sequence[WorkerInfo], cached_tokens: int) -> dict:
    """A routing decision's span attributes: the policy, its choice, the cache-hit estimate
    (prompt tokens the chosen worker holds in its prefix cache, as it last reported)."""
    return {
        "pdserve.route.policy": policy,
        "pdserve.route.num_candidates": len(ranked),
        "pdserve.route.worker": ranked[0].address,
        "pdserve.route.cached_tokens": cached_tokens,
    }


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
        # every worker the runner sees is filtered by its breaker (and so is ListWorkers,
        # which reads this `discovery`)
        self.discovery = GuardedDiscovery.over(discovery, config.breaker, channels.get)
        self.config = config
        self.prefill_policy, self.decode_policy = prefill_policy, decode_policy
        self.dispatches = RecentDispatches()
        self.handoff = HandOff(
            channels,
            lease_ttl_s=config.lease_ttl_s,
            stream_interval=config.stream_interval,
            stream_progress_timeout_s=config.stream_progress_timeout_s,
            deadlines=config.deadlines,
        )

    async def run(self, attempt: Attempt, events: AttemptEvents) -> None:
        """One attempt, to the request's final delta; raises what ended it otherwise
        (`grpc.aio.AioRpcError` from a worker, or a domain error). Once the request has
        seen more than one worker fail, the error names each (attempt, role, worker,
        error): the status the client gets when the session gives up."""
        history = attempt.history
        history.num_attempts += 1
        try:
            await self._run(attempt, events)
        except grpc.aio.AioRpcError as exc:
            if len(history.failures) < 2:
                raise
            details = f"{exc.details()}; {self._gave_up(history)}"
            raise grpc.aio.AioRpcError(
                exc.code(), grpc.aio.Metadata(), grpc.aio.Metadata(), details
            ) from exc
        except (UnavailableError, KVCapacityError) as exc:
            if not history.failures:
                raise
            raise type(exc)(f"{exc}; {self._gave_up(history)}") from exc

    def _gave_up(self, history: AttemptHistory) -> str:
        return (
            f"{history.num_attempts} attempt(s) of at most {self.config.max_attempts} "
            f"(--max-attempts): {history.summary()}"
        )

    async def _run(self, attempt: Attempt, events: AttemptEvents) -> None:
        decode_workers = self.discovery.workers("decode")
        if not decode_workers:
            raise UnavailableError("no healthy decode worker")
        pool = Pool(decode_workers, self.discovery.workers("prefill"))
        attempt = attempt.for_block_size(pool.block_size)
        decodes, placement = self._route_decode(pool, attempt)
        placement_event(placement.attributes())
        if placement.colocated:
            await self._colocated(decodes[0], attempt, events, placement)
            return
        failures, asked = len(attempt.history.failures), time.perf_counter()
        admission = await self._admit(decodes, attempt, events)
        stream = self.handoff.attach(admission, attempt)
        try:
            response = await self._prefill(pool.prefill, admission, attempt, events)
            if len(attempt.history.failures) == failures:  # no refusal on the way: the hop
                waited_ms = (time.perf_counter() - asked) * 1000
                self.config.colocation.hop.observe(waited_ms, response.prefill_ms)
                self.config.colocation.errors.observe(placement, waited_ms)
            cached_tokens = response.usage.cached_prompt_tokens
            hit = RoutingOutcome.CACHE_HIT if cached_tokens else RoutingOutcome.CACHE_MISS
            metrics.routing_decision(self.prefill_policy.name, hit, placement.reason)
            head = prefill_response_to_delta(response)
            events.on_first_token(head, cached_tokens)
            if not is_final(head):
                await self._call(
                    "decode",
                    admission.decode_address,
                    attempt,
                    stream.deliver(events.deliver_decoded),
                )
        finally:
            stream.cancel()  # no-op when it ended; frees the decode side when we stop early
            self.dispatches.ended(
                admission.decode_address, requests=1, num_blocks=attempt.num_blocks_needed
            )

    async def reattach(
        self, orphan: Orphan, from_token: int, attempt: Attempt, events: AttemptEvents
    ) -> None:
        """Stream a request a lost router left running on its decode worker, from its
        token `from_token` on, to its final delta; raises what ended it otherwise (NOT_FOUND
        or OUT_OF_RANGE: the worker no longer holds it, or not from there)."""
        stream = self.handoff.reattach(orphan, from_token, attempt)
        try:
            events.on_reattached(orphan)
            deliver = stream.deliver(events.deliver_decoded)
            await self._call("decode", orphan.decode_address, attempt, deliver)
        finally:
            stream.cancel()  # no-op when it ended; else the worker aborts it

    async def _call(self, role: str, address: str, attempt: Attempt, call: Awaitable[T]) -> T:
        """Await a call to a worker: its failure goes into the request's history and, if
        the worker's fault (unreachable, or hung past a deadline), against its breaker."""
        try:
            result = await call
        except grpc.aio.AioRpcError as exc:
            attempt.history.failed(role, address, exc)
            if exc.code() in _WORKER_FAILURES:
                self.discovery.record_failure(address, error_text(exc))
            raise
        self.discovery.record_success(address)
        return result

    def _route_decode(self, pool: Pool, attempt: Attempt) -> tuple[list[WorkerInfo], Decision]:
        """The decode workers in the order to try them, and where to prefill (colocated:
        on the first)."""
        with tracing.leaf_span("route decode", attempt.request_id) as span:
            decodes = self.decode_policy.rank(
                self.dispatches.adjust(pool.decode), attempt.num_blocks_needed
            )
            prefills = self.dispatches.adjust(pool.prefill)
            placement = self.config.colocation.decide(
                decodes[0],
                prefills,
                attempt.block_hashes,
                len(attempt.prompt),
                attempt.ttft_budget_ms(),
            )
            if span.is_recording():
                cached = placement.snapshot.decode.cached_tokens
                span.set_attributes(route_attributes(self.decode_policy.name, decodes, cached))
                span.set_attribute("pdserve.route.colocated", placement.colocated)
                span.set_attributes(placement.attributes())
        return decodes, placement

    async def _admit(
        self, decodes: list[WorkerInfo], attempt: Attempt, events: AttemptEvents
    ) -> Admission:
        """Admit on the first decode worker with room; RESOURCE_EXHAUSTED moves on, and so
        does UNAVAILABLE (a dead worker, or one past --admit-timeout: a hung one)."""
        num_exhausted = 0
        for worker in decodes:
            # Recorded before the call: requests that arrive while it is in flight must
            # already see this one (a refused one makes a full worker look fuller: harmless).
            self.dispatches.record(worker.address, attempt.num_blocks_needed)
            admit = self.handoff.admit(worker.address, attempt)
            try:
                admission = await self._call("decode", worker.address, attempt, admit)
            except BaseException as exc:
                self.dispatches.ended(
                    worker.address, requests=1, num_blocks=attempt.num_blocks_needed
                )
                if not isinstance(exc, grpc.aio.AioRpcError):
                    raise
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    events.on_failover(worker.address, exc)
                    num_exhausted += 1
                    continue
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    events.on_failover(worker.address, exc)
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
        """Prefill on the best prefill worker; UNAVAILABLE moves on (the lease stays open).
        A worker that hung (past --prefill-timeout, or its heartbeat stopped) ends the
        attempt instead: it may resume and push into the lease, so the retry takes a new one."""
        with tracing.leaf_span("route prefill", attempt.request_id) as span:
            prefills = self.prefill_policy.rank(
                self.dispatches.adjust(prefill_workers), attempt.block_hashes
            )
            if span.is_recording() and prefills:
                blocks = cached_prefix_blocks(prefills[0], attempt.block_hashes)
                policy = self.prefill_policy.name
                span.set_attributes(route_attributes(policy, prefills, blocks * attempt.block_size))
        if not prefills:
            raise UnavailableError("no healthy prefill worker")
        last_error: Exception | None = None
        for worker in prefills:
            events.on_prefill_worker(worker.address)
            # what the worker will hold in its prefix cache, before its next report says so
            self.dispatches.record(
                worker.address,
                block_hashes=attempt.block_hashes,
                num_tokens=len(attempt.prompt),
            )
            prefill = self._watched_prefill(worker.address, admission, attempt)
            try:
                return await self._call("prefill", worker.address, attempt, prefill)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                events.on_failover(worker.address, exc)
                self.discovery.mark_unhealthy(worker.address)
                if isinstance(exc, WorkerTimeout):
                    raise
                last_error = exc  # the lease is still open: the next worker pushes into it
            finally:  # its first token came back, or it failed there: off that worker's queue
                self.dispatches.ended(worker.address, requests=1, num_tokens=len(attempt.prompt))
        raise last_error

    async def _watched_prefill(
        self, address: str, admission: Admission, attempt: Attempt
    ) -> prefill_pb2.PrefillResponse:
        """Prefill, given up (WorkerTimeout) once discovery stops listing the worker: its
        heartbeat stopped, or its breaker opened. A long queue there is no reason, so the
        call itself only has the generous --prefill-timeout."""
        call = asyncio.ensure_future(self.handoff.prefill(address, admission, attempt))
        try:
            while True:
                done, _ = await asyncio.wait({call}, timeout=PREFILL_WATCH_INTERVAL_S)
                if done:
                    return call.result()
                if not self._listed(address, "prefill"):
                    raise WorkerTimeout(address, "Prefill", "stopped heartbeating (or failed)")
        finally:
            call.cancel()  # no-op once done

    def _listed(self, address: str, role: str) -> bool:
        return any(worker.address == address for worker in self.discovery.workers(role))

    async def _colocated(
        self, worker: WorkerInfo, attempt: Attempt, events: AttemptEvents, placement: Decision
    ) -> None:
        num_tokens = len(attempt.prompt)
        self.dispatches.record(
            worker.address,
            attempt.num_blocks_needed,
            block_hashes=attempt.block_hashes,
            num_tokens=num_tokens,
        )
        events.on_admitted(worker.address)
        events.on_prefill_worker(worker.address)
        metrics.routing_decision(COLOCATED_POLICY, RoutingOutcome.COLOCATED, placement.reason)

        def computed() -> None:  # its first token: the prompt has left the queue there
            self.dispatches.ended(worker.address, num_tokens=num_tokens)

        errors = self.config.colocation.errors
        first_token = FirstTokenTimer(events.deliver_decoded, errors, placement, computed)
        stream = self.handoff.colocated(worker.address, attempt)
        try:
            deliver = stream.deliver(first_token)
            await self._call("decode", worker.address, attempt, deliver)
        finally:
            stream.cancel()
            self.dispatches.ended(
                worker.address,
                requests=1,
                num_blocks=attempt.num_blocks_needed,
                num_tokens=0 if first_token.seen else num_tokens,
            )

    async def close(self) -> None:
        await self.handoff.close()
