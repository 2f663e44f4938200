"""What this router sent to each worker, and saw end there, since that worker last
reported its load.

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

What the router sees end goes the other way (``ended``): a stream it relayed to its last
token, a prompt whose first token came back, a worker's refusal. A report up to a second
old still counts those, so a decode worker that has just finished its only request would
look busy, and the remote-or-colocated decision would send the next short prompt through
the pool to spare a batch that no longer runs.

The same goes for prefix caches, as SGLang's router keeps an approximate tree of its
own dispatches: the block hashes of a prompt sent to a worker count as cached there
from the moment it is sent, so the next repeat finds its holder without waiting for a
heartbeat. They count for the whole horizon, even against a newer snapshot: a snapshot
taken after the dispatch may still predate its prefill (the request was queued, running,
or not yet arrived), so a hash missing from it says nothing. Hashes the worker has
reported anyway change nothing; the horizon bounds how long a claim outlives an eviction.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from collections import deque
from collections.abc import Callable, Sequence

from pdserve.core.workers import MAX_CACHED_BLOCK_HASHES, WorkerInfo
from pdserve.router.policy import CachedHashes

# a heartbeat interval (1 s) plus a discovery refresh (0.5 s), with room to spare
DEFAULT_HORIZON_S = 3.0
COMPACT_AFTER = 1024  # expired dispatches kept before a worker's lists are trimmed
# dispatched block hashes kept per worker, the newest: as many as a heartbeat carries
MAX_DISPATCHED_HASHES = MAX_CACHED_BLOCK_HASHES


class _SentHashes:
    """The block hashes dispatched to one worker within the horizon, at most
    MAX_DISPATCHED_HASHES, the most recently sent kept; frozen once per change."""

    __slots__ = ("latest", "order", "num_dispatches", "_frozen")

    def __init__(self) -> None:
        # hash -> number of the latest dispatch that carried it (not its time: two
        # dispatches may share a clock reading)
        self.latest: dict[str, int] = {}
        # (time, dispatch number, hash) per hash per dispatch, oldest first; an entry
        # not the hash's latest was superseded by a later dispatch of the same hash
        self.order: deque[tuple[float, int, str]] = deque()
        self.num_dispatches = 0
        self._frozen: frozenset[str] | None = None

    def add(self, at: float, block_hashes: Sequence[str]) -> None:
        number = self.num_dispatches = self.num_dispatches + 1
        # Past the cap a prompt keeps its first blocks: a prefix is only of use from its
        # start. (A prompt's hashes are chained, so all distinct.)
        for block_hash in block_hashes[:MAX_DISPATCHED_HASHES]:
            self.latest[block_hash] = number
            self.order.append((at, number, block_hash))
        self._frozen = None
        while len(self.latest) > MAX_DISPATCHED_HASHES:
            self._drop_oldest()
        if len(self.order) > 2 * MAX_DISPATCHED_HASHES:  # superseded entries piled up
            self.order = deque(entry for entry in self.order if self._is_latest(entry))

    def expire(self, before: float) -> None:
        while self.order and self.order[0][0] < before:
            self._drop_oldest()

    def _is_latest(self, entry: tuple[float, int, str]) -> bool:
        return self.latest.get(entry[2]) == entry[1]

    def _drop_oldest(self) -> None:
        entry = self.order.popleft()
        if self._is_latest(entry):
            del self.latest[entry[2]]
            self._frozen = None

    def frozen(self) -> frozenset[str]:
        if self._frozen is None:
            self._frozen = frozenset(self.latest)
        return self._frozen


class _Ledger:
    """Events at one worker within the horizon (dispatches, or endings): their times,
    ascending, and running totals of the requests, blocks and prompt tokens they moved,
    so what came after a snapshot is a bisection away, however many requests per second
    the router sends."""

    __slots__ = ("times", "totals", "base", "start")

    def __init__(self) -> None:
        self.times: list[float] = []
        # totals[i]: base + (requests, blocks, tokens) of events 0..i
        self.totals: list[tuple[int, int, int]] = []
        self.base = (0, 0, 0)  # the totals of the events trimmed off
        self.start = 0  # events before it are past the horizon

    @property
    def is_empty(self) -> bool:
        return self.start == len(self.times)

    def add(self, at: float, requests: int, num_blocks: int, num_tokens: int) -> None:
        # A wall clock may step back: keep the times sorted (an event then counts as a
        # little later, never as seen before it happened).
        at = max(at, self.times[-1]) if self.times else at
        last = self.totals[-1] if self.totals else self.base
        self.times.append(at)
        self.totals.append((last[0] + requests, last[1] + num_blocks, last[2] + num_tokens))

    def expire(self, before: float) -> None:
        self.start = bisect.bisect_left(self.times, before, self.start)
        if self.start > COMPACT_AFTER and self.start * 2 > len(self.times):
            self.base = self.totals[self.start - 1]
            del self.times[: self.start], self.totals[: self.start]
            self.start = 0

    def since(self, at: float) -> tuple[int, int, int]:
        """(requests, blocks, prompt tokens) of the events after `at`, within the horizon."""
        first = bisect.bisect_right(self.times, at, self.start)
        if first == len(self.times):
            return 0, 0, 0
        before = self.totals[first - 1] if first else self.base
        last = self.totals[-1]
        return last[0] - before[0], last[1] - before[1], last[2] - before[2]


class _Sent:
    """One worker's dispatches and endings within the horizon, and the block hashes the
    dispatches carried."""

    __slots__ = ("dispatched", "ended", "hashes", "_view")

    def __init__(self) -> None:
        self.dispatched = _Ledger()
        self.ended = _Ledger()
        self.hashes = _SentHashes()
        self._view: CachedHashes | None = None  # the last snapshot's view, for reuse

    @property
    def is_empty(self) -> bool:
        return self.dispatched.is_empty and self.ended.is_empty and not self.hashes.latest

    def add(self, at: float, num_blocks: int, block_hashes: Sequence[str], num_tokens: int) -> None:
        self.dispatched.add(at, 1, num_blocks, num_tokens)
        if block_hashes:
            self.hashes.add(at, block_hashes)

    def expire(self, before: float) -> None:
        self.dispatched.expire(before)
        self.ended.expire(before)
        self.hashes.expire(before)

    def cached_view(self, reported: list[str]) -> list[str]:
        """`reported` with the dispatched hashes added; the same object until either
        changes, so a policy's per-snapshot caches are not rebuilt on every ranking."""
        if not self.hashes.latest:
            return reported
        added, view = self.hashes.frozen(), self._view
        if view is None or view.reported is not reported or view.added is not added:
            view = self._view = CachedHashes(reported, added)
        return view

    def adjusted(self, worker: WorkerInfo) -> WorkerInfo:
        sent, sent_blocks, sent_tokens = self.dispatched.since(worker.updated_at)
        done, freed_blocks, done_tokens = self.ended.since(worker.updated_at)
        cached = self.cached_view(worker.cached_block_hashes)
        if not sent and not done and cached is worker.cached_block_hashes:
            return worker
        # what ended comes off what waits first, then off what runs; never below none
        waiting = worker.waiting + sent - done
        running = worker.running + min(waiting, 0)
        running, waiting = max(running, 0), max(waiting, 0)
        return dataclasses.replace(
            worker,
            running=running,
            waiting=waiting,
            free_blocks=min(
                worker.free_blocks - sent_blocks + freed_blocks,
                max(worker.total_blocks, worker.free_blocks),
            ),
            queued_prefill_tokens=max(worker.queued_prefill_tokens + sent_tokens - done_tokens, 0),
            # nothing left running there: no output to protect (router/disaggregation.py)
            shortest_running_output=worker.shortest_running_output if running else 0,
            cached_block_hashes=cached,
        )


class RecentDispatches:
    """Dispatches and endings per worker address, for ``adjust`` to add onto load
    snapshots."""

    def __init__(
        self, horizon_s: float = DEFAULT_HORIZON_S, clock: Callable[[], float] = time.time
    ):
        if horizon_s <= 0:
            raise ValueError(f"horizon_s must be > 0, got {horizon_s}")
        self.horizon_s, self._clock = horizon_s, clock
        self._sent: dict[str, _Sent] = {}
        self._swept_at = -float("inf")

    def __len__(self) -> int:
        """Workers with dispatches or endings remembered (departed ones are forgotten in
        time)."""
        return len(self._sent)

    def record(
        self,
        address: str,
        num_blocks: int = 0,
        block_hashes: Sequence[str] = (),
        num_tokens: int = 0,
    ) -> None:
        """A request was just sent to ``address``.

        Args:
            num_blocks: KV blocks it will hold there.
            block_hashes: its prompt's hex block hashes (``prompt_block_hashes``), when
                the worker computes the prompt and so will have them in its prefix cache.
            num_tokens: the prompt tokens it brings the worker to compute (a prefill or a
                colocated prompt): its queue as the next report will say, which the
                remote-or-colocated decision reads between heartbeats.
        """
        self._at(address).add(self._clock(), num_blocks, block_hashes, num_tokens)

    def ended(
        self, address: str, *, requests: int = 0, num_blocks: int = 0, num_tokens: int = 0
    ) -> None:
        """What the router just saw leave ``address``, the mirror of ``record``: a prompt
        computed (its ``num_tokens`` leave the queue: a prefill's reply, a colocated
        prompt's first token), a request gone (``requests=1`` and the ``num_blocks`` it
        held: its stream ended, or the worker refused or failed it).

        A worker's report counts a request until its next one, a second or more after
        the router relayed its last token: without this, a decode worker that finished
        its only request looks busy, and a short prompt that could have been prefilled
        there at once is sent through the pool instead. An ending counts against the
        snapshots taken before it; a request that ends before the worker ever reported
        it comes off a report that never held it, which the next report puts right."""
        self._at(address).ended.add(self._clock(), requests, num_blocks, num_tokens)

    def _at(self, address: str) -> _Sent:
        sent = self._sent.get(address)
        if sent is None:
            sent = self._sent[address] = _Sent()
        return sent

    def adjust(self, workers: Sequence[WorkerInfo]) -> list[WorkerInfo]:
        """``workers`` as they will report once they have seen what we sent since.

        Each dispatch newer than the worker's snapshot adds one waiting request and
        takes its blocks from ``free_blocks`` (its prompt tokens join the queue); each
        ending newer than it takes them off again; the block hashes of every dispatch
        within the horizon join ``cached_block_hashes``. Workers with none come back
        unchanged (the same objects, so per-snapshot caches keyed on them keep working).
        """
        now = self._clock()
        before = now - self.horizon_s
        self._forget_departed(now, before)
        adjusted = []
        for worker in workers:
            sent = self._sent.get(worker.address)
            if sent is not None:
                sent.expire(before)
                worker = sent.adjusted(worker)
            adjusted.append(worker)
        return adjusted

    def _forget_departed(self, now: float, before: float) -> None:
        """Once per horizon, drop the workers whose dispatches all expired: a worker
        that left is never adjusted again, and would keep its hashes for good."""
        if self._swept_at <= now < self._swept_at + self.horizon_s:
            return  # (a clock that stepped back sweeps at once rather than never)
        self._swept_at = now
        for sent in self._sent.values():
            sent.expire(before)
        for address in [a for a, sent in self._sent.items() if sent.is_empty]:
            del self._sent[address]
