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

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.state.registry import WorkerInfo

# a heartbeat interval (1 s) plus a discovery refresh (0.5 s), with room to spare
DEFAULT_HORIZON_S = 3.0


@dataclass(frozen=True, slots=True)
class Dispatch:
    at: float  # unix seconds, comparable with WorkerInfo.updated_at
    address: str
    blocks: int


class RecentDispatches:
    """Dispatches per worker address, for ``adjust`` to add onto load snapshots."""

    def __init__(self, horizon_s: float = DEFAULT_HORIZON_S,
                 clock: Callable[[], float] = time.time):  # fmt: skip
        if horizon_s <= 0:
            raise ValueError(f"horizon_s must be > 0, got {horizon_s}")
        self.horizon_s, self._clock = horizon_s, clock
        self._dispatches: deque[Dispatch] = deque()  # oldest first

    def record(self, address: str, blocks: int = 0) -> None:
        """A request was just sent to ``address`` and will hold ``blocks`` KV blocks there."""
        self._dispatches.append(Dispatch(self._clock(), address, blocks))

    def adjust(self, workers: Sequence[WorkerInfo]) -> list[WorkerInfo]:
        """``workers`` as they will report once they have seen what we sent since.

        Each dispatch newer than the worker's snapshot adds one waiting request and
        takes its blocks from ``free_blocks``. Workers with none come back unchanged
        (the same objects, so per-snapshot caches keyed on them keep working).
        """
        now = self._clock()
        while self._dispatches and self._dispatches[0].at < now - self.horizon_s:
            self._dispatches.popleft()
        if not self._dispatches:
            return list(workers)
        by_address: dict[str, list[Dispatch]] = {}
        for dispatch in self._dispatches:
            by_address.setdefault(dispatch.address, []).append(dispatch)
        adjusted = []
        for worker in workers:
            unseen = [d for d in by_address.get(worker.address, ()) if d.at > worker.updated_at]
            if unseen:
                worker = dataclasses.replace(
                    worker,
                    waiting=worker.waiting + len(unseen),
                    free_blocks=worker.free_blocks - sum(d.blocks for d in unseen),
                )
            adjusted.append(worker)
        return adjusted
