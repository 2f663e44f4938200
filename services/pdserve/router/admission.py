"""The router's admission queue: in front of its running-request limit, a bounded queue
with a wait deadline, so a burst waits its turn instead of being refused while the
workers have room.

A request takes a slot at once while fewer than `max_running` run; otherwise it waits,
lower `priority` first and then in arrival order, until a running request ends and hands
its slot straight to the first waiter. Refused only past the queue: when
`max_queued` already wait (`QueueFullError`), or when its wait reaches `queue_timeout_s`
(`QueueTimeoutError`); both are RESOURCE_EXHAUSTED with retry info at the gRPC edge. A
waiter whose client leaves (its task is cancelled) leaves the queue.

Invariant: requests wait only while `max_running` run, because a slot that frees up goes
to the first waiter before anyone else can take it. One event loop runs all of it, so
nothing here needs a lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from pdserve.core.errors import KVCapacityError
from pdserve.telemetry import metrics
from pdserve.telemetry.admission_metrics import AdmissionRefusal

# The queue's list is rebuilt once cancelled entries are this many times the live ones
# (and at least _MIN_COMPACT): leaving costs O(1), and the list stays O(max_queued).
_COMPACT_RATIO = 2
_MIN_COMPACT = 16


class QueueFullError(KVCapacityError):
    """The router runs all it may and its queue is full: retry later or elsewhere."""


class QueueTimeoutError(KVCapacityError):
    """A request waited its whole queue timeout without a slot freeing up."""


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """How many requests run and wait; the router's flags."""

    max_running: int  # --max-inflight
    max_queued: int  # --max-queued-requests; 0: no queue, refused at the limit
    queue_timeout_s: float  # --queue-timeout: the longest a request waits for a slot

    def __post_init__(self) -> None:
        if self.max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {self.max_running}")
        if self.max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {self.max_queued}")
        if self.queue_timeout_s <= 0:
            raise ValueError(f"queue_timeout_s must be > 0, got {self.queue_timeout_s}")


@dataclass(order=True, slots=True)
class _Waiter:
    priority: int
    arrival: int  # ties in priority go in arrival order
    granted: asyncio.Future = field(compare=False)


class AdmissionQueue:
    """Slots for running requests, and the queue for them (see the module's docstring)."""

    def __init__(self, limits: AdmissionLimits, clock: Callable[[], float] = time.monotonic):
        self.limits, self._clock = limits, clock
        self.num_running = 0
        self.num_waiting = 0  # live entries of _heap; the rest were cancelled or timed out
        self._heap: list[_Waiter] = []
        self._arrivals = itertools.count()

    @contextlib.asynccontextmanager
    async def slot(self, priority: int = 0) -> AsyncIterator[float]:
        """Hold a running slot for the body; yields the seconds spent waiting for it."""
        waited_s = await self.acquire(priority)
        try:
            yield waited_s
        finally:
            self.release()

    async def acquire(self, priority: int = 0) -> float:
        """Take a slot, waiting in the queue if need be; the seconds waited.

        Raises QueueFullError or QueueTimeoutError (nothing held), or CancelledError when
        the caller leaves while waiting (it leaves the queue; nothing held).
        """
        if self.num_running < self.limits.max_running:
            self.num_running += 1
            _record_wait(0.0)
            return 0.0
        if self.num_waiting >= self.limits.max_queued:
            _record_refusal(AdmissionRefusal.QUEUE_FULL)
            raise QueueFullError(self._full_message())
        started, loop = self._clock(), asyncio.get_running_loop()
        waiter = _Waiter(priority, next(self._arrivals), loop.create_future())
        heapq.heappush(self._heap, waiter)
        self.num_waiting += 1
        # A timer, not asyncio.wait_for: wait_for may swallow a cancel that comes as the
        # slot does, and the request would run on for a client that has gone.
        timer = loop.call_later(self.limits.queue_timeout_s, self._expire, waiter)
        try:
            await waiter.granted
        except asyncio.CancelledError:
            self._leave(waiter)
            raise
        finally:
            timer.cancel()
        waited_s = self._clock() - started
        _record_wait(waited_s)
        return waited_s

    def release(self) -> None:
        """A running request ended: its slot goes to the first waiter, if any."""
        while self._heap:
            waiter = heapq.heappop(self._heap)
            if not waiter.granted.done():  # else it left, or its wait expired
                self.num_waiting -= 1
                waiter.granted.set_result(None)  # the slot passes on: num_running unchanged
                return
        self.num_running -= 1

    def _expire(self, waiter: _Waiter) -> None:
        """A waiter's queue timeout came before a slot did: it is refused."""
        if waiter.granted.done():
            return
        _record_refusal(AdmissionRefusal.QUEUE_TIMEOUT)
        waiter.granted.set_exception(
            QueueTimeoutError(
                f"no slot came free in the router's queue timeout of "
                f"{self.limits.queue_timeout_s:g} s (--queue-timeout)"
            )
        )
        self.num_waiting -= 1
        self._compact()

    def _leave(self, waiter: _Waiter) -> None:
        """A waiter's client left: out of the queue, or its slot back if it came meanwhile."""
        granted = waiter.granted
        if granted.cancelled():  # left while waiting: release() skips it
            self.num_waiting -= 1
            self._compact()
        elif granted.exception() is None:  # the slot came in the same loop turn as the cancel
            self.release()
        # else its wait had expired: already out of the count

    def _compact(self) -> None:
        """Drop the entries of waiters gone, once they outnumber the live ones."""
        if len(self._heap) > max(_MIN_COMPACT, _COMPACT_RATIO * self.num_waiting):
            self._heap = [w for w in self._heap if not w.granted.done()]
            heapq.heapify(self._heap)

    def _full_message(self) -> str:
        limits = self.limits
        if limits.max_queued == 0:
            return f"router at its limit of {limits.max_running} running requests"
        return (
            f"router at its limit of {limits.max_running} running requests "
            f"(--max-inflight) and {limits.max_queued} queued (--max-queued-requests)"
        )


def _record_wait(seconds: float) -> None:
    if (recorder := metrics.admission()) is not None:
        recorder.waited(seconds)


def _record_refusal(reason: AdmissionRefusal) -> None:
    if (recorder := metrics.admission()) is not None:
        recorder.refuse(reason)
