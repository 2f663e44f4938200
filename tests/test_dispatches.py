"""RecentDispatches: what the router sent since a worker's last load report."""

from __future__ import annotations

import pytest

from pdserve.core.workers import WorkerInfo
from pdserve.router.dispatches import RecentDispatches
from pdserve.router.policy import MostFreeDecode


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def decode(address: str, free_blocks: int = 100, updated_at: float = 999.0) -> WorkerInfo:
    return WorkerInfo(
        worker_id=address,
        role="decode",
        address=address,
        free_blocks=free_blocks,
        total_blocks=100,
        updated_at=updated_at,
    )


def test_a_burst_alternates_between_equal_workers_instead_of_piling_on_one():
    clock, policy = Clock(), MostFreeDecode()
    dispatches = RecentDispatches(clock=clock)
    workers = [decode("10.0.0.1:1"), decode("10.0.0.2:1")]  # the same stale snapshot throughout
    chosen = []
    for _ in range(6):
        first = policy.rank(dispatches.adjust(workers), num_blocks_needed=4)[0]
        dispatches.record(first.address, blocks=4)
        chosen.append(first.address)
        clock.now += 0.01
    assert chosen == ["10.0.0.1:1", "10.0.0.2:1"] * 3


def test_dispatches_the_snapshot_already_reflects_are_not_counted_again():
    clock = Clock()
    dispatches = RecentDispatches(clock=clock)
    dispatches.record("a:1", blocks=5)
    clock.now += 0.5
    dispatches.record("a:1", blocks=7)
    (before,) = dispatches.adjust([decode("a:1", updated_at=999.0)])
    assert (before.free_blocks, before.waiting) == (100 - 12, 2)
    (between,) = dispatches.adjust([decode("a:1", updated_at=1000.2)])  # saw the first only
    assert (between.free_blocks, between.waiting) == (100 - 7, 1)


def test_old_dispatches_drop_out_after_the_horizon_and_others_are_untouched():
    clock = Clock()
    dispatches = RecentDispatches(horizon_s=2.0, clock=clock)
    dispatches.record("a:1", blocks=5)
    untouched = decode("b:1")
    assert dispatches.adjust([untouched])[0] is untouched
    clock.now += 2.5  # a snapshot that never moved (a stopped or fast-clocked worker)
    stale = decode("a:1", updated_at=0.0)
    assert dispatches.adjust([stale])[0] is stale


def test_thousands_of_dispatches_count_exactly_across_expiry_and_trimming():
    """Against a plain recount, while old dispatches expire and the lists get trimmed."""
    clock = Clock()
    dispatches = RecentDispatches(horizon_s=2.0, clock=clock)
    sent: list[tuple[float, int]] = []  # every dispatch to a:1, as (time, blocks)
    for i in range(6000):
        blocks = i % 7
        dispatches.record("a:1", blocks=blocks)
        sent.append((clock.now, blocks))
        clock.now += 0.001
        if i % 250 == 0:
            # a worker that reported 0.4 s ago, and one whose report never moves
            for snapshot_at in (clock.now - 0.4, 0.0):
                (seen,) = dispatches.adjust([decode("a:1", updated_at=snapshot_at)])
                unseen = [b for at, b in sent if at > snapshot_at and at >= clock.now - 2.0]
                assert (seen.waiting, seen.free_blocks) == (len(unseen), 100 - sum(unseen)), i


def test_a_clock_that_steps_back_never_hides_a_dispatch():
    clock = Clock()
    dispatches = RecentDispatches(clock=clock)
    dispatches.record("a:1", blocks=3)
    clock.now -= 0.5  # NTP stepped the wall clock back
    dispatches.record("a:1", blocks=4)
    (seen,) = dispatches.adjust([decode("a:1", updated_at=999.9)])  # before both
    assert (seen.waiting, seen.free_blocks) == (2, 100 - 7)


def test_the_horizon_must_be_positive():
    with pytest.raises(ValueError, match="horizon_s"):
        RecentDispatches(horizon_s=0)
