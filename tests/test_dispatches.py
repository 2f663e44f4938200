"""RecentDispatches: what the router sent since a worker's last load report."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.core.block_hash import prompt_block_hashes
from pdserve.core.workers import WorkerInfo
from pdserve.router.dispatches import MAX_DISPATCHED_HASHES, RecentDispatches
from pdserve.router.policy import CacheAwarePrefill, MostFreeDecode

BLOCK_SIZE = 16


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


def prefill(address: str, cached: list[str] | None = None, updated_at: float = 999.0):
    return WorkerInfo(
        worker_id=address,
        role="prefill",
        address=address,
        block_size=BLOCK_SIZE,
        cached_block_hashes=cached if cached is not None else [],
        updated_at=updated_at,
    )


def hashes_of(seed: int, num_tokens: int = 200) -> list[str]:
    return prompt_block_hashes([seed * 1000 + i for i in range(num_tokens)], BLOCK_SIZE)


def route(policy, dispatches, workers, hashes) -> str:
    """Rank, then record the dispatch to the first, as the router does."""
    first = policy.rank(dispatches.adjust(workers), hashes)[0]
    dispatches.record(first.address, block_hashes=hashes)
    return first.address


def test_a_burst_alternates_between_equal_workers_instead_of_piling_on_one():
    clock, policy = Clock(), MostFreeDecode()
    dispatches = RecentDispatches(clock=clock)
    workers = [decode("10.0.0.1:1"), decode("10.0.0.2:1")]  # the same stale snapshot throughout
    chosen = []
    for _ in range(6):
        first = policy.rank(dispatches.adjust(workers), num_blocks_needed=4)[0]
        dispatches.record(first.address, num_blocks=4)
        chosen.append(first.address)
        clock.now += 0.01
    assert chosen == ["10.0.0.1:1", "10.0.0.2:1"] * 3


def test_dispatches_the_snapshot_already_reflects_are_not_counted_again():
    clock = Clock()
    dispatches = RecentDispatches(clock=clock)
    dispatches.record("a:1", num_blocks=5)
    clock.now += 0.5
    dispatches.record("a:1", num_blocks=7)
    (before,) = dispatches.adjust([decode("a:1", updated_at=999.0)])
    assert (before.free_blocks, before.waiting) == (100 - 12, 2)
    (between,) = dispatches.adjust([decode("a:1", updated_at=1000.2)])  # saw the first only
    assert (between.free_blocks, between.waiting) == (100 - 7, 1)


def test_prompt_tokens_sent_since_a_report_join_the_workers_prefill_queue():
    # What the remote-or-colocated decision reads between heartbeats: a long prompt just
    # sent to a prefill worker is its queue before the worker's next report says so.
    clock = Clock()
    dispatches = RecentDispatches(clock=clock)
    dispatches.record("p:1", num_tokens=1500)
    clock.now += 0.5
    dispatches.record("p:1", num_tokens=40)
    reported = dataclasses.replace(prefill("p:1"), queued_prefill_tokens=100)
    (before,) = dispatches.adjust([reported])
    assert (before.queued_prefill_tokens, before.waiting) == (100 + 1540, 2)
    saw_the_first = dataclasses.replace(reported, updated_at=1000.2)
    (between,) = dispatches.adjust([saw_the_first])
    assert between.queued_prefill_tokens == 100 + 40


def test_old_dispatches_drop_out_after_the_horizon_and_others_are_untouched():
    clock = Clock()
    dispatches = RecentDispatches(horizon_s=2.0, clock=clock)
    dispatches.record("a:1", num_blocks=5)
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
        dispatches.record("a:1", num_blocks=blocks, num_tokens=3 * blocks)
        sent.append((clock.now, blocks))
        clock.now += 0.001
        if i % 250 == 0:
            # a worker that reported 0.4 s ago, and one whose report never moves
            for snapshot_at in (clock.now - 0.4, 0.0):
                (seen,) = dispatches.adjust([decode("a:1", updated_at=snapshot_at)])
                unseen = [b for at, b in sent if at > snapshot_at and at >= clock.now - 2.0]
                assert (seen.waiting, seen.free_blocks) == (len(unseen), 100 - sum(unseen)), i
                assert seen.queued_prefill_tokens == 3 * sum(unseen), i


def test_a_clock_that_steps_back_never_hides_a_dispatch():
    clock = Clock()
    dispatches = RecentDispatches(clock=clock)
    dispatches.record("a:1", num_blocks=3)
    clock.now -= 0.5  # NTP stepped the wall clock back
    dispatches.record("a:1", num_blocks=4)
    (seen,) = dispatches.adjust([decode("a:1", updated_at=999.9)])  # before both
    assert (seen.waiting, seen.free_blocks) == (2, 100 - 7)


def test_the_horizon_must_be_positive():
    with pytest.raises(ValueError, match="horizon_s"):
        RecentDispatches(horizon_s=0)


# -- block hashes ----------------------------------------------------------------------


def test_hashes_sent_to_a_worker_count_as_cached_there_at_once():
    dispatches = RecentDispatches(clock=Clock())
    hashes = hashes_of(1)
    dispatches.record("a:1", block_hashes=hashes)
    untouched = prefill("b:1")

    seen, same = dispatches.adjust([prefill("a:1", cached=["old"]), untouched])

    assert seen.cached_block_hashes[0] == "old"  # the worker's own report, then ours
    assert sorted(seen.cached_block_hashes[1:]) == sorted(hashes)
    assert seen.waiting == 1
    assert same is untouched


def test_hashes_count_even_against_a_newer_snapshot_that_lacks_them():
    """A heartbeat newer than the dispatch may predate its prefill: it says nothing."""
    clock = Clock()
    dispatches = RecentDispatches(clock=clock)
    hashes = hashes_of(1)
    dispatches.record("a:1", block_hashes=hashes)
    clock.now += 0.5

    (seen,) = dispatches.adjust([prefill("a:1", updated_at=clock.now - 0.1)])

    assert (sorted(seen.cached_block_hashes), seen.waiting) == (sorted(hashes), 0)


def test_hashes_expire_with_the_horizon():
    clock = Clock()
    dispatches = RecentDispatches(horizon_s=2.0, clock=clock)
    dispatches.record("a:1", block_hashes=hashes_of(1))
    clock.now += 1.5
    dispatches.record("a:1", block_hashes=hashes_of(2))
    clock.now += 1.0  # the first dispatch is past the horizon, the second is not
    stale = prefill("a:1", updated_at=clock.now)

    (seen,) = dispatches.adjust([stale])

    assert sorted(seen.cached_block_hashes) == sorted(hashes_of(2))
    clock.now += 1.5
    assert dispatches.adjust([stale])[0] is stale


def test_past_the_cap_the_oldest_hashes_go_and_a_repeated_prefix_is_new_again():
    dispatches = RecentDispatches(clock=Clock())
    shared = hashes_of(1)
    dispatches.record("a:1", block_hashes=shared)
    for seed in range(3, 303):  # 300 prompts of 12 blocks
        dispatches.record("a:1", block_hashes=hashes_of(seed))
    dispatches.record("a:1", block_hashes=shared)  # a hit: the newest again
    for seed in range(303, 353):  # 50 more: 12 * (1 + 300 + 50) is past the cap
        dispatches.record("a:1", block_hashes=hashes_of(seed))

    (seen,) = dispatches.adjust([prefill("a:1")])

    cached = set(seen.cached_block_hashes)
    assert len(cached) == MAX_DISPATCHED_HASHES
    assert set(shared) <= cached
    assert not set(hashes_of(3)) & cached  # the oldest, never repeated


def test_a_prompt_longer_than_the_cap_keeps_its_first_blocks():
    dispatches = RecentDispatches(clock=Clock())
    hashes = hashes_of(1, num_tokens=(MAX_DISPATCHED_HASHES + 10) * BLOCK_SIZE + 1)

    dispatches.record("a:1", block_hashes=hashes)

    (seen,) = dispatches.adjust([prefill("a:1")])
    assert set(seen.cached_block_hashes) == set(hashes[:MAX_DISPATCHED_HASHES])


def test_the_cached_view_is_one_list_until_a_dispatch_or_a_new_snapshot():
    """So the policy builds each worker's hash set once per change, not per request."""
    clock = Clock()
    dispatches = RecentDispatches(clock=clock)
    dispatches.record("a:1", block_hashes=hashes_of(1))
    snapshot = prefill("a:1", updated_at=clock.now + 0.1)
    first = dispatches.adjust([snapshot])[0].cached_block_hashes

    assert dispatches.adjust([snapshot])[0].cached_block_hashes is first
    assert (
        dispatches.adjust([prefill("a:1", updated_at=1000.1)])[0].cached_block_hashes is not first
    )
    dispatches.record("a:1", block_hashes=hashes_of(2))
    assert dispatches.adjust([snapshot])[0].cached_block_hashes is not first


def test_workers_that_left_are_forgotten_once_their_dispatches_expire():
    clock = Clock()
    dispatches = RecentDispatches(horizon_s=2.0, clock=clock)
    dispatches.record("gone:1", block_hashes=hashes_of(1))
    dispatches.record("here:1", block_hashes=hashes_of(2))
    clock.now += 2.5
    dispatches.record("here:1", block_hashes=hashes_of(3))

    dispatches.adjust([prefill("here:1")])  # the departed worker is never listed again

    assert len(dispatches) == 1


# -- with the cache-aware prefill policy -----------------------------------------------


@pytest.mark.parametrize("heartbeat_has_it", [False, True], ids=["at-once", "after-a-pause"])
def test_repeats_one_at_a_time_stay_on_the_worker_holding_the_prefix(heartbeat_has_it):
    """Two idle prefill workers whose snapshots do not move while the repeats run: the
    router counts its own finished dispatches as still queued, and still keeps them."""
    clock, policy = Clock(), CacheAwarePrefill()
    dispatches = RecentDispatches(clock=clock)
    hashes = hashes_of(1)
    first = route(policy, dispatches, [prefill("10.0.0.1:1"), prefill("10.0.0.2:1")], hashes)
    if heartbeat_has_it:  # the holder reported its cache; our dispatch is past the horizon
        clock.now += 5.0
    holder_cache = hashes if heartbeat_has_it else []
    workers = [prefill("10.0.0.1:1", holder_cache, clock.now), prefill("10.0.0.2:1")]

    chosen = []
    for _ in range(4):
        clock.now += 0.2
        chosen.append(route(policy, dispatches, workers, hashes))

    assert chosen == [first] * 4


def test_a_burst_of_distinct_prompts_still_alternates_between_prefill_workers():
    clock, policy = Clock(), CacheAwarePrefill()
    dispatches = RecentDispatches(clock=clock)
    workers = [prefill("10.0.0.1:1"), prefill("10.0.0.2:1")]

    chosen = [route(policy, dispatches, workers, hashes_of(seed)) for seed in range(6)]

    assert chosen == ["10.0.0.1:1", "10.0.0.2:1"] * 3
