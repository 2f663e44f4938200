"""Routing policy: exact rankings over crafted worker snapshots, and the router's block
hashes pinned to the ones a worker's BlockManager registers."""

from __future__ import annotations

import pytest

from pdserve.core.block_hash import hash_block_tokens, prompt_block_hashes
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.workers import WorkerInfo
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request
from pdserve.router.policy import (
    CacheAwarePrefill,
    CachedHashes,
    CachedHashSets,
    ColocationRule,
    LeastLoadedPrefill,
    MostFreeDecode,
    RoundRobinPrefill,
    cached_prefix_blocks,
    make_prefill_policy,
)

BLOCK_SIZE = 4
PROMPT = list(range(100, 113))  # 13 tokens: 3 full blocks and a tail of 1
HASHES = prompt_block_hashes(PROMPT, BLOCK_SIZE)


def worker(worker_id: str, **fields) -> WorkerInfo:
    fields.setdefault("address", f"{worker_id}:50051")
    fields.setdefault("block_size", BLOCK_SIZE)
    return WorkerInfo(worker_id=worker_id, role=fields.pop("role", "prefill"), **fields)


def ids(workers) -> list[str]:
    return [w.worker_id for w in workers]


# -- prompt hashes ---------------------------------------------------------------------


def test_prompt_hashes_chain_full_blocks_and_drop_the_tail():
    first = hash_block_tokens(None, PROMPT[0:4])
    second = hash_block_tokens(first, PROMPT[4:8])
    third = hash_block_tokens(second, PROMPT[8:12])

    assert [first.hex(), second.hex(), third.hex()] == HASHES


@pytest.mark.parametrize(
    ("num_tokens", "num_hashes"), [(0, 0), (1, 0), (4, 0), (5, 1), (8, 1), (9, 2)]
)
def test_prompt_hashes_never_include_the_block_holding_the_last_token(num_tokens, num_hashes):
    assert len(prompt_block_hashes(list(range(num_tokens)), BLOCK_SIZE)) == num_hashes


def test_prompt_hashes_reject_a_block_size_below_one():
    with pytest.raises(ValueError, match="block_size"):
        prompt_block_hashes([1, 2, 3], 0)


@pytest.mark.parametrize("num_tokens", [11, 12])
def test_prompt_hashes_are_the_hashes_a_worker_registers_and_reuses(num_tokens):
    tokens = list(range(7, 7 + num_tokens))
    manager = BlockManager(num_blocks=16, block_size=BLOCK_SIZE)
    first = Request("first", tokens, SamplingParams())
    assert manager.allocate_slots(first, first.num_tokens) is not None
    first.num_computed_tokens = first.num_tokens
    manager.cache_full_blocks(first)
    second = Request("second", tokens, SamplingParams())

    hashes = prompt_block_hashes(tokens, BLOCK_SIZE)
    registered = {block_hash.hex() for block_hash in manager.cached_block_hashes()}
    _, num_reused_tokens = manager.get_computed_blocks(second)

    assert set(hashes) <= registered
    assert hashes == [block_hash.hex() for block_hash in first.block_hashes[: len(hashes)]]
    assert num_reused_tokens == len(hashes) * BLOCK_SIZE


# -- cached prefix ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cached", "num_blocks"),
    [([], 0), (HASHES[:1], 1), (HASHES, 3), (HASHES[1:], 0), ([HASHES[0], HASHES[2]], 1)],
)
def test_cached_prefix_counts_leading_blocks_up_to_the_first_miss(cached, num_blocks):
    assert cached_prefix_blocks(worker("w", cached_block_hashes=list(cached)), HASHES) == num_blocks


def test_cached_hash_sets_rebuild_for_a_new_snapshot_of_the_same_worker():
    hash_sets = CachedHashSets()
    old = worker("w", cached_block_hashes=HASHES[:1])
    new = worker("w", cached_block_hashes=list(HASHES))

    assert cached_prefix_blocks(old, HASHES, hash_sets) == 1
    assert cached_prefix_blocks(new, HASHES, hash_sets) == 3
    assert cached_prefix_blocks(new, HASHES, hash_sets) == 3


def test_hashes_the_router_added_count_as_cached_with_the_reported_ones():
    view = CachedHashes(HASHES[:1], frozenset(HASHES[1:2]))

    assert list(view) == HASHES[:2]
    assert cached_prefix_blocks(worker("w", cached_block_hashes=view), HASHES) == 2
    assert (
        cached_prefix_blocks(worker("w", cached_block_hashes=view), HASHES, CachedHashSets()) == 2
    )


def test_cached_hash_sets_build_the_reported_set_once_whatever_the_router_adds():
    hash_sets = CachedHashSets()
    reported = HASHES[:1]
    first = worker("w", cached_block_hashes=CachedHashes(reported, frozenset(HASHES[1:2])))
    second = worker("w", cached_block_hashes=CachedHashes(reported, frozenset(HASHES[1:])))

    reported_set, _ = hash_sets.of(first)

    assert hash_sets.of(second)[0] is reported_set
    assert cached_prefix_blocks(second, HASHES, hash_sets) == 3


# -- prefill policies ------------------------------------------------------------------


def test_cache_aware_ranks_by_prefill_saved_minus_prefill_queued_ahead():
    # 4 prompt blocks of 4 tokens (3 cacheable, and the one holding the last token)
    workers = [
        worker("idle"),  # 0 - 0 * 16 = 0, saving 0
        worker("warm", cached_block_hashes=HASHES[:2], running=1),  # 8 - 1 * 8 = 0, saving 8
        worker("hot", cached_block_hashes=list(HASHES), running=1, waiting=1),  # 12 - 2 * 4
        worker("busy", cached_block_hashes=list(HASHES), waiting=5),  # 12 - 5 * 4 = -8
        worker("cold", waiting=1),  # 0 - 1 * 16 = -16
    ]

    assert ids(CacheAwarePrefill().rank(workers, HASHES)) == ["hot", "warm", "idle", "busy", "cold"]


@pytest.mark.parametrize(
    ("holder_queue", "expected_first"),
    # saved 12 tokens against a wait of 4 per queued request (its uncached last block):
    # 12 - 4q against the idle worker's 0; at 3 the tie goes to the longer prefix
    [(0, "holder"), (1, "holder"), (2, "holder"), (3, "holder"), (4, "idle"), (9, "idle")],
)
def test_cache_aware_holder_keeps_a_repeat_until_its_queue_outweighs_the_saving(
    holder_queue, expected_first
):
    workers = [
        worker("holder", cached_block_hashes=list(HASHES), waiting=holder_queue),
        worker("idle"),
    ]

    assert ids(CacheAwarePrefill().rank(workers, HASHES))[0] == expected_first


def test_cache_aware_sends_a_prompt_cached_nowhere_to_the_shortest_queue():
    workers = [worker("a", running=2), worker("b"), worker("c", waiting=1)]

    assert ids(CacheAwarePrefill().rank(workers, HASHES)) == ["b", "c", "a"]
    assert ids(CacheAwarePrefill().rank(workers, [])) == ["b", "c", "a"]  # under one block


def test_cache_aware_breaks_ties_by_address_then_worker_id():
    workers = [
        worker("d", address="10.0.0.3:1"),
        worker("c", address="10.0.0.1:1"),
        worker("b", address="10.0.0.2:1"),
        worker("a", address="10.0.0.2:1"),  # a restarted worker, briefly listed twice
    ]

    assert ids(CacheAwarePrefill().rank(workers, HASHES)) == ["c", "a", "b", "d"]


def test_cache_aware_counts_tokens_in_the_workers_block_size():
    workers = [
        worker("small", cached_block_hashes=HASHES[:1], block_size=4),  # 4 - 0
        worker("large", cached_block_hashes=HASHES[:1], block_size=16, running=1),  # 16 - 48
        worker("large-idle", cached_block_hashes=HASHES[:1], block_size=16),  # 16 - 0
    ]

    assert ids(CacheAwarePrefill().rank(workers, HASHES)) == ["large-idle", "small", "large"]


def test_least_loaded_ranks_by_queue_then_free_blocks_then_address():
    workers = [
        worker("a", running=2, free_blocks=100),
        worker("b", running=1, waiting=1, free_blocks=50),
        worker("c", running=1, free_blocks=10),
        worker("d", waiting=1, free_blocks=20),
        worker("e", running=2, free_blocks=50),
    ]

    assert ids(LeastLoadedPrefill().rank(workers, HASHES)) == ["d", "c", "a", "b", "e"]


def test_round_robin_leads_with_each_worker_in_turn_whatever_the_listing_order():
    policy = RoundRobinPrefill()
    workers = [worker("b"), worker("c"), worker("a")]

    rankings = [ids(policy.rank(workers[::step], HASHES)) for step in (1, -1, 1, -1)]

    assert rankings == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def test_round_robin_continues_after_the_last_leader_as_workers_join_and_leave():
    policy = RoundRobinPrefill()
    a, b, c, d = worker("a"), worker("b"), worker("c"), worker("d")

    leaders = [
        policy.rank([a, b], HASHES)[0],
        policy.rank([a, b, c, d], HASHES)[0],  # after a: b
        policy.rank([a, c, d], HASHES)[0],  # b left: c
        policy.rank([a, b], HASHES)[0],  # after c, wrapping: a
    ]

    assert ids(leaders) == ["a", "b", "c", "a"]
    assert policy.rank([], HASHES) == []


@pytest.mark.parametrize(
    "policy",
    [CacheAwarePrefill(), LeastLoadedPrefill(), RoundRobinPrefill()],
    ids=lambda policy: type(policy).__name__,
)
def test_prefill_policies_drop_unhealthy_workers(policy):
    workers = [
        worker("sick", cached_block_hashes=list(HASHES), healthy=False),
        worker("well", running=9),
    ]

    assert ids(policy.rank(workers, HASHES)) == ["well"]


def test_make_prefill_policy_builds_each_named_policy():
    assert isinstance(make_prefill_policy(), CacheAwarePrefill)
    assert isinstance(make_prefill_policy("cache_aware"), CacheAwarePrefill)
    assert isinstance(make_prefill_policy("least_loaded"), LeastLoadedPrefill)
    assert isinstance(make_prefill_policy("round_robin"), RoundRobinPrefill)


def test_make_prefill_policy_names_the_valid_choices_for_an_unknown_name():
    with pytest.raises(ValueError, match="cache_aware, least_loaded, round_robin") as info:
        make_prefill_policy("random")

    assert "'random'" in str(info.value)


# -- decode policy ---------------------------------------------------------------------


def test_most_free_decode_ranks_fitting_workers_by_free_blocks_then_running():
    workers = [
        worker("a", role="decode", free_blocks=40, running=3),
        worker("b", role="decode", free_blocks=80, running=9),
        worker("c", role="decode", free_blocks=40, running=1),
        worker("d", role="decode", free_blocks=40, running=1, address="0.0.0.0:1"),
    ]

    assert ids(MostFreeDecode().rank(workers, num_blocks_needed=10)) == ["b", "d", "c", "a"]


def test_most_free_decode_puts_workers_that_cannot_fit_last_but_keeps_them():
    workers = [
        worker("tight", role="decode", free_blocks=9),
        worker("roomy", role="decode", free_blocks=10, running=50),
        worker("tighter", role="decode", free_blocks=2),
        worker("sick", role="decode", free_blocks=100, healthy=False),
    ]

    assert ids(MostFreeDecode().rank(workers, num_blocks_needed=10)) == [
        "roomy",
        "tight",
        "tighter",
    ]


# -- colocation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_prompt_tokens", "num_cached_tokens", "colocate"),
    [
        (255, 0, True),  # shorter than max_prompt_tokens
        (256, 0, False),
        (1000, 900, True),  # uncached fraction 0.1, the maximum
        (1000, 899, False),
        (1000, 1000, True),
    ],
)
def test_colocation_rule_keeps_short_or_mostly_cached_prompts_on_the_decode_worker(
    num_prompt_tokens, num_cached_tokens, colocate
):
    rule = ColocationRule(enabled=True, max_prompt_tokens=256, max_uncached_fraction=0.1)

    assert rule.should_colocate(num_prompt_tokens, num_cached_tokens) is colocate


def test_colocation_is_off_by_default():
    rule = ColocationRule()

    assert rule.should_colocate(1, 0) is False
    assert rule.should_colocate(1000, 1000) is False


@pytest.mark.parametrize(
    "fields",
    [{"max_prompt_tokens": -1}, {"max_uncached_fraction": 1.5}, {"max_uncached_fraction": -0.1}],
)
def test_colocation_rule_rejects_out_of_range_settings(fields):
    with pytest.raises(ValueError, match=next(iter(fields))):
        ColocationRule(**fields)


def test_colocation_rule_rejects_more_cached_than_prompt_tokens():
    with pytest.raises(ValueError, match="num_cached_tokens"):
        ColocationRule(enabled=True).should_colocate(10, 11)
