"""What this router sent to each worker since that worker last reported its load.

Load snapshots (registry heartbeats, load polls) are up to a second or two old. Ranked
on the snapshot alone, a burst of requests all goes to whichever worker looked best
when the burst began: eight requests in one second land on one decode worker while its
twin idles. So the router counts what it dispatched after each worker's snapshot was
taken and ranks on the snapshot with those added, the way a worker's own numbers will
look once its next report arrives.

A dispatch counts while it is newer than the worker's ``updated_at`` and younger than
``horizon_s``. The horizon bounds the cost of a snapshot that never moves (a worker
whose clock runs ahead of ours, or one that stopped reporting), at which point the
dispatch counts twice at worst for a moment: a conservative error, never a lost one.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from collections.abc import Callable, Sequence

from pdserve.core.workers import WorkerInfo

# a heartbeat interval (1 s) plus a discovery refresh (0.5 s), with room to spare
DEFAULT_HORIZON_S = 3.0
COMPACT_AFTER = 1024  # expired dispatches kept before a worker's lists are trimmed


class _Sent:
    """One worker's dispatches within the horizon: their times, ascending, and running
    totals of their blocks, so what came after a snapshot is a bisection away, however
    many requests per second the router sends."""

    __slots__ = ("times", "totals", "base", "start")

    def __init__(self) -> None:
        self.times: list[float] = []
        self.totals: list[int] = []  # totals[i]: base + blocks of dispatches 0..i
        self.base = 0  # blocks of the dispatches trimmed off the front
        self.start = 0  # dispatches before it are past the horizon

    def add(self, at: float, blocks: int) -> None:
        # A wall clock may step back: keep the times sorted (a dispatch then counts as
        # a little later, never as seen before it was sent).
        self.times.append(max(at, self.times[-1]) if self.times else at)
        self.totals.append((self.totals[-1] if self.totals else self.base) + blocks)

    def expire(self, before: float) -> None:
        self.start = bisect.bisect_left(self.times, before, self.start)
        if self.start > COMPACT_AFTER and self.start * 2 > len(self.times):
            self.base = self.totals[self.start - 1]
            del self.times[: self.start], self.totals[: self.start]
            self.start = 0

    def since(self, at: float) -> tuple[int, int]:
        """(how many, their blocks) dispatched after `at`, within the horizon."""
        first = bisect.bisect_right(self.times, at, self.start)
        count = len(self.times) - first
        if not count:
            return 0, 0
        return count, self.totals[-1] - (self.totals[first - 1] if first else self.base)


class RecentDispatches:
    """Dispatches per worker address, for ``adjust`` to add onto load snapshots."""

    def __init__(
        self, horizon_s: float = DEFAULT_HORIZON_S, clock: Callable[[], float] = time.time
    ):
        if horizon_s <= 0:
            raise ValueError(f"horizon_s must be > 0, got {horizon_s}")
        self.horizon_s, self._clock = horizon_s, clock
        self._sent: dict[str, _Sent] = {}

    def record(self, address: str, blocks: int = 0) -> None:
        """A request was just sent to ``address`` and will hold ``blocks`` KV blocks there."""
        sent = self._sent.get(address)
        if sent is None:
            sent = self._sent[address] = _Sent()
        sent.add(self._clock(), blocks)

    def adjust(self, workers: Sequence[WorkerInfo]) -> list[WorkerInfo]:
        """``workers`` as they will report once they have seen what we sent since.

        Each dispatch newer than the worker's snapshot adds one waiting request and
        takes its blocks from ``free_blocks``. Workers with none come back unchanged
        (the same objects, so per-snapshot caches keyed on them keep working).
        """
        horizon = self._clock() - self.horizon_s
        adjusted = []
        for worker in workers:
            sent = self._sent.get(worker.address)
            if sent is not None:
                sent.expire(horizon)
                count, blocks = sent.since(worker.updated_at)
                if count:
                    worker = dataclasses.replace(
                        worker,
                        waiting=worker.waiting + count,
                        free_blocks=worker.free_blocks - blocks,
                    )
            adjusted.append(worker)
        return adjusted
