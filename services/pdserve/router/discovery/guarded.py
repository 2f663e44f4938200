"""Discovery with each worker's circuit breaker applied (`pdserve.router.breaker`).

`GuardedDiscovery` wraps the router's discovery: `workers(role)` leaves out the workers
whose breaker is open or half-open, as the inner one leaves out workers whose heartbeat
stopped, so the policies never see them and `ListWorkers` does not show them as healthy.
Listing is also what starts the probes: a listed worker whose cool-down has ended gets
one `GetLoad` (its own short deadline) in a task; it is routed to again once that passes.

A breaker takes a worker out only while another can take its requests: when every
listed worker of a role has its breaker open, the breakers are set aside for that role
and all of them are routed to (Envoy calls this panic routing). Breakers open on every
worker at once when load, not a fault, passed the router's deadlines (one worker left
to carry a frozen one's requests, on a busy machine); refusing every request then
would turn a slow cluster into a dead one, while a worker that is really down still
fails its calls, and its heartbeat stopping takes it out of the listing anyway.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from pdserve.api.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2_grpc
from pdserve.core.workers import WorkerInfo
from pdserve.router.breaker import Breakers, BreakerSettings
from pdserve.router.discovery.pool import Discovery

log = logging.getLogger(__name__)
# an open breaker of an address not listed for this long is dropped (a pod gone for good)
FORGET_UNLISTED_S = 600.0


class GetLoadProbe:
    """A worker passes when its `GetLoad` answers within `timeout_s`, over the router's
    own channel to it (`channel_for`: address -> grpc.aio.Channel; its TLS included)."""

    def __init__(self, channel_for: Callable[[str], grpc.aio.Channel], timeout_s: float):
        self.channel_for, self.timeout_s = channel_for, timeout_s

    async def __call__(self, address: str, role: str) -> bool:
        channel = self.channel_for(address)
        stub_type = (
            prefill_pb2_grpc.PrefillStub if role == "prefill" else decode_pb2_grpc.DecodeStub
        )
        try:
            await stub_type(channel).GetLoad(decode_pb2.GetLoadRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            log.info("worker %s failed its health probe: %s", address, exc.code().name)
            return False
        return True


class GuardedDiscovery:
    """`inner`'s workers minus those whose breaker is not closed (see the module docstring)."""

    def __init__(
        self,
        inner: Discovery,
        breakers: Breakers,
        probe: Callable[[str, str], asyncio.Future | object],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.inner, self.breakers, self.probe, self._clock = inner, breakers, probe, clock
        self._probes: set[asyncio.Task] = set()
        self._listed_at: dict[str, float] = {}  # address -> last time inner listed it
        self._panicking: set[str] = set()  # roles whose every listed worker is open

    @classmethod
    def over(
        cls,
        inner: Discovery,
        settings: BreakerSettings,
        channel_for: Callable[[str], grpc.aio.Channel],
    ) -> GuardedDiscovery:
        return cls(inner, Breakers(settings), GetLoadProbe(channel_for, settings.probe_timeout_s))

    async def start(self) -> None:
        await self.inner.start()

    async def stop(self) -> None:
        for task in list(self._probes):
            task.cancel()
        await self.inner.stop()

    async def refresh(self) -> None:
        await self.inner.refresh()

    def workers(self, role: str) -> list[WorkerInfo]:
        listed = self.inner.workers(role)
        if not self.breakers.settings.enabled:
            return listed
        now = self._clock()
        for worker in listed:
            self._listed_at[worker.address] = now
        blocked = [w for w in listed if not self.breakers.routable(w.address)]
        if blocked:
            self._start_probes(blocked)
            self._forget_unlisted(now)
        routable = [w for w in listed if self.breakers.routable(w.address)]
        if listed and not routable:
            self._set_panic(role, len(listed))
            return listed
        self._set_panic(role, 0)
        return routable

    def _set_panic(self, role: str, num_listed: int) -> None:
        """Log when a role starts (num_listed > 0) or stops being routed despite breakers."""
        if num_listed and role not in self._panicking:
            self._panicking.add(role)
            log.warning(
                "every %s worker's circuit is open (%d listed): routing to all of them "
                "until one passes its probe",
                role,
                num_listed,
            )
        elif not num_listed and role in self._panicking:
            self._panicking.discard(role)
            log.info("%s workers: breakers apply again", role)

    def mark_unhealthy(self, address: str) -> None:
        self.inner.mark_unhealthy(address)

    def record_failure(self, address: str, why: str) -> None:
        """A call to the worker failed or passed the router's deadline."""
        self.breakers.record_failure(address, why)

    def record_success(self, address: str) -> None:
        self.breakers.record_success(address)

    def _start_probes(self, blocked: list[WorkerInfo]) -> None:
        due = set(self.breakers.probes_due([w.address for w in blocked]))
        for worker in blocked:
            if worker.address in due:
                task = asyncio.ensure_future(self._probe(worker.address, worker.role))
                self._probes.add(task)
                task.add_done_callback(self._probes.discard)

    async def _probe(self, address: str, role: str) -> None:
        passed = False
        try:
            passed = bool(await self.probe(address, role))
        except Exception:  # a broken probe leaves the worker out, not the router down
            log.exception("health probe of %s failed", address)
        finally:
            self.breakers.end_probe(address, passed)

    def _forget_unlisted(self, now: float) -> None:
        gone = {a for a, at in self._listed_at.items() if now - at > FORGET_UNLISTED_S}
        for address in gone:
            del self._listed_at[address]
        if gone:
            self.breakers.forget({a for a in self._listed_at})
