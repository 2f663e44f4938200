"""BlockManager: exact block ids, prefix-cache hits and LRU eviction, on CPU."""

from __future__ import annotations

import hashlib
import struct

import pytest

from pdserve.core.block_hash import hash_block_tokens
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine import block_manager as block_manager_module
from pdserve.engine.block_manager import BlockAccountingError, BlockManager
from pdserve.engine.request import Request

BLOCK_SIZE = 4


def make_request(request_id: str, token_ids) -> Request:
    return Request(request_id, list(token_ids), SamplingParams())


def prefill(manager: BlockManager, request: Request) -> list[int]:
    """Do what the scheduler does for a whole prompt: look up, allocate, compute, cache."""
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(request)
    request.num_computed_tokens = num_computed_tokens
    new_block_ids = manager.allocate_slots(
        request, request.num_tokens - num_computed_tokens, computed_blocks
    )
    assert new_block_ids is not None
    request.num_computed_tokens = request.num_tokens
    manager.cache_full_blocks(request)
    return new_block_ids


def decode(manager: BlockManager, request: Request, token_id: int) -> list[int] | None:
    """Append a sampled token and compute it, as one decode step does."""
    request.append_output_token(token_id)
    new_block_ids = manager.allocate_slots(request, 1)
    request.num_computed_tokens += 1
    manager.cache_full_blocks(request)
    return new_block_ids


def test_block_hash_is_blake2b_of_parent_and_int32_little_endian_tokens():
    first = hash_block_tokens(None, [1, 2, 3, 4])
    second = hash_block_tokens(first, [5, 6, 7, 8])

    assert first == hashlib.blake2b(struct.pack("<4i", 1, 2, 3, 4), digest_size=16).digest()
    assert (
        second == hashlib.blake2b(first + struct.pack("<4i", 5, 6, 7, 8), digest_size=16).digest()
    )


def test_block_hash_is_pinned_because_workers_compare_it():
    first = hash_block_tokens(None, [1, 2, 3, 4])

    assert first.hex() == "5c3887ef44b86da26265cb5c108a056b"
    assert hash_block_tokens(first, [5, 6, 7, 8]).hex() == "1664ccca28a32287142c2088ea54ac27"


def test_block_hash_depends_on_the_whole_prefix():
    assert hash_block_tokens(None, [5, 6, 7, 8]) != hash_block_tokens(
        hash_block_tokens(None, [1, 2, 3, 4]), [5, 6, 7, 8]
    )


def test_blocks_are_handed_out_lowest_id_first():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    first = make_request("a", range(10))
    second = make_request("b", range(100, 105))

    assert prefill(manager, first) == [0, 1, 2]
    assert prefill(manager, second) == [3, 4]
    assert first.block_ids == [0, 1, 2]
    assert manager.num_free_blocks == 3
    assert manager.usage == pytest.approx(5 / 8)


def test_decode_takes_a_new_block_only_when_crossing_a_block_boundary():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    request = make_request("a", range(7))
    prefill(manager, request)  # 7 tokens computed in [0, 1]

    assert decode(manager, request, 70) == []  # token 7 fills block 1
    assert decode(manager, request, 71) == [2]  # token 8 opens block 2
    assert decode(manager, request, 72) == []
    assert request.block_ids == [0, 1, 2]


def test_allocation_is_all_or_nothing():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    prefill(manager, make_request("a", range(24)))  # blocks 0..5
    too_big = make_request("b", range(100, 112))  # needs 3 blocks, 2 are free

    assert manager.allocate_slots(too_big, 12) is None
    assert too_big.block_ids == []
    assert manager.num_free_blocks == 2
    assert manager.allocate_slots(too_big, 8) == [6, 7]


def test_allocation_with_hits_is_all_or_nothing():
    manager = BlockManager(num_blocks=4, block_size=BLOCK_SIZE)
    original = make_request("a", range(9))
    prefill(manager, original)  # [0, 1, 2], blocks 0 and 1 cached
    manager.free(original)
    longer = make_request("b", [*range(8), *range(100, 112)])  # 20 tokens: 5 blocks

    computed_blocks, num_computed_tokens = manager.get_computed_blocks(longer)
    longer.num_computed_tokens = num_computed_tokens

    assert (computed_blocks, num_computed_tokens) == ([0, 1], 8)
    assert manager.allocate_slots(longer, 12, computed_blocks) is None
    assert longer.block_ids == []
    assert [block.ref_count for block in manager.blocks] == [0, 0, 0, 0]
    assert manager.num_free_blocks == 4
    assert len(manager.cached_block_hashes()) == 2


def test_prefix_hit_shares_blocks_and_allocates_the_rest():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    prefill(manager, make_request("a", range(10)))  # [0, 1, 2]; 0 and 1 are full
    sharer = make_request("b", [*range(8), 50, 51])

    computed_blocks, num_computed_tokens = manager.get_computed_blocks(sharer)
    sharer.num_computed_tokens = num_computed_tokens
    new_block_ids = manager.allocate_slots(sharer, 2, computed_blocks)

    assert (computed_blocks, num_computed_tokens) == ([0, 1], 8)
    assert new_block_ids == [3]
    assert sharer.block_ids == [0, 1, 3]
    assert [manager.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]


def test_the_block_holding_the_last_token_never_hits():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    prefill(manager, make_request("a", range(8)))  # two full blocks, both cached
    same_prompt = make_request("b", range(8))

    assert manager.get_computed_blocks(same_prompt) == ([0], 4)


def test_lookup_stops_at_the_first_miss():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    prefill(manager, make_request("a", range(13)))  # blocks 0, 1, 2 cached
    # block 1 differs; block 2 is equal token for token but has another prefix
    differs_in_the_middle = make_request("b", [0, 1, 2, 3, 9, 9, 9, 9, 8, 9, 10, 11, 12])

    assert manager.get_computed_blocks(differs_in_the_middle) == ([0], 4)


def test_a_hash_collision_is_not_a_hit(monkeypatch):
    monkeypatch.setattr(block_manager_module, "hash_block_tokens", lambda parent, tokens: b"x")
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    prefill(manager, make_request("a", range(9)))  # block 0 cached under b"x"

    assert manager.get_computed_blocks(make_request("b", range(100, 109))) == ([], 0)
    # the same tokens still hit, so the miss above came from the token check
    assert manager.get_computed_blocks(make_request("c", range(9))) == ([0], 4)


def test_freed_cached_blocks_stay_findable():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    original = make_request("a", range(10))
    prefill(manager, original)
    manager.free(original)

    assert manager.num_free_blocks == 8
    assert manager.get_computed_blocks(make_request("b", range(10))) == ([0, 1], 8)


def test_free_puts_tail_blocks_first_in_eviction_order():
    manager = BlockManager(num_blocks=6, block_size=BLOCK_SIZE)
    original = make_request("a", range(13))
    prefill(manager, original)  # [0, 1, 2, 3]; 0, 1, 2 cached
    manager.free(original)  # free list: 4, 5, then 3, 2, 1, 0

    assert prefill(manager, make_request("b", range(100, 112))) == [4, 5, 3]
    assert manager.get_computed_blocks(make_request("c", range(13))) == ([0, 1, 2], 12)
    assert prefill(manager, make_request("d", range(200, 202))) == [2]  # evicts a's tail
    assert manager.get_computed_blocks(make_request("e", range(13))) == ([0, 1], 8)
    assert len(manager.cached_block_hashes()) == 5  # a's 0 and 1, b's three blocks


def test_eviction_order_is_least_recently_freed_first():
    manager = BlockManager(num_blocks=4, block_size=BLOCK_SIZE)
    first, second = make_request("a", range(5)), make_request("b", range(100, 105))
    prefill(manager, first)  # [0, 1]
    prefill(manager, second)  # [2, 3]
    manager.free(first)  # free list: 1, 0
    manager.free(second)  # free list: 1, 0, 3, 2

    assert prefill(manager, make_request("c", range(300, 305))) == [1, 0]
    assert manager.get_computed_blocks(make_request("d", range(5))) == ([], 0)
    assert manager.get_computed_blocks(make_request("e", range(100, 105))) == ([2], 4)


def test_a_hit_leaves_the_free_list_before_new_blocks_are_taken():
    manager = BlockManager(num_blocks=4, block_size=BLOCK_SIZE)
    original = make_request("a", range(9))
    prefill(manager, original)  # [0, 1, 2]; 0 and 1 cached
    manager.free(original)  # free list: 3, 2, 1, 0
    longer = make_request("b", [*range(8), *range(100, 108)])  # 16 tokens: 4 blocks

    assert prefill(manager, longer) == [3, 2]
    assert longer.block_ids == [0, 1, 3, 2]
    assert manager.num_free_blocks == 0


def test_decode_filled_blocks_are_cached():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    request = make_request("a", range(6))
    prefill(manager, request)  # only block 0 is full
    decode(manager, request, 6)
    decode(manager, request, 7)  # tokens 0..7 computed: block 1 full

    assert manager.get_computed_blocks(make_request("b", range(9))) == ([0, 1], 8)


def test_a_prefix_computed_twice_stays_cached_in_its_first_block():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    first, second = make_request("a", range(5)), make_request("b", range(5))
    for request in (first, second):  # both admitted before either was cached
        request.num_computed_tokens = 0
        manager.allocate_slots(request, 5)
    for request in (first, second):
        request.num_computed_tokens = 5
        manager.cache_full_blocks(request)

    assert first.block_ids == [0, 1] and second.block_ids == [2, 3]
    assert manager.blocks[2].block_hash is None
    assert manager.get_computed_blocks(make_request("c", range(5))) == ([0], 4)


def test_cache_full_blocks_hashes_each_block_once(monkeypatch):
    calls = []

    def counting_hash(parent, tokens):
        calls.append(tuple(tokens))
        return hash_block_tokens(parent, tokens)

    monkeypatch.setattr(block_manager_module, "hash_block_tokens", counting_hash)
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    request = make_request("a", range(7))
    prefill(manager, request)
    for token_id in range(7, 12):
        decode(manager, request, token_id)

    assert calls == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]
    assert len(request.block_hashes) == 3


def test_prefix_cache_counters_count_tokens():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    prefill(manager, make_request("a", range(10)))  # 10 queried, 0 hit
    prefill(manager, make_request("b", range(10)))  # 10 queried, 8 hit

    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (20, 8)


def test_without_prefix_caching_nothing_is_cached_or_found():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    prefill(manager, make_request("a", range(10)))

    assert manager.get_computed_blocks(make_request("b", range(10))) == ([], 0)
    assert manager.cached_block_hashes() == set()


def test_reset_prefix_cache_forgets_every_prefix():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    prefill(manager, make_request("a", range(10)))
    manager.reset_prefix_cache()

    assert manager.cached_block_hashes() == set()
    assert manager.get_computed_blocks(make_request("b", range(10))) == ([], 0)


def test_free_returns_every_block_and_clears_the_table():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    first, sharer = make_request("a", range(10)), make_request("b", range(10))
    prefill(manager, first)
    prefill(manager, sharer)
    manager.free(first)
    manager.free(sharer)

    assert first.block_ids == [] and sharer.block_ids == []
    assert manager.num_free_blocks == 8
    assert all(block.ref_count == 0 for block in manager.blocks)


def test_freeing_a_free_block_is_an_error():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    forged = make_request("a", range(4))
    forged.block_ids = [0]

    with pytest.raises(BlockAccountingError, match="block 0"):
        manager.free(forged)


def test_computed_blocks_must_match_num_computed_tokens():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    prefill(manager, make_request("a", range(10)))
    request = make_request("b", range(10))
    computed_blocks, _ = manager.get_computed_blocks(request)

    with pytest.raises(BlockAccountingError, match="num_computed_tokens"):
        manager.allocate_slots(request, 10, computed_blocks)


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (8, 0)])
def test_pool_shape_is_validated(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockManager(num_blocks=num_blocks, block_size=block_size)
