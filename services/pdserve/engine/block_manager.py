"""Paged KV cache bookkeeping: a pool of ref-counted blocks with automatic prefix caching.

Only block ids live here; the model runner owns the KV tensors the ids index. A full block
is named by a hash chained from the hash of the block before it, so one hash names a
whole prefix. Freed blocks keep their hash until they are handed out again: they are the
prefix cache, evicted least recently freed first.

A request may be kept out of the prefix cache (`keep_private`): KV another process wrote
into its blocks (a decode worker's import) is then never found by another request, so
forged KV, if any, reaches only the request it came with.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

from pdserve.core.block_hash import hash_block_tokens, num_blocks_for
from pdserve.engine.request import Request


class BlockAccountingError(RuntimeError):
    """The caller broke the manager's bookkeeping (a bug, never a user error)."""


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    # set while the block is findable in the prefix cache, None otherwise
    block_hash: bytes | None = None
    # the tokens the hash was computed from, compared on every hit so a collision never
    # hands a request someone else's KV
    token_ids: tuple[int, ...] = ()


class BlockManager:
    """Hands out KV blocks to requests and finds cached prefixes.

    Invariant: a block is in the free list exactly when its ref_count is 0, and a block has
    a `block_hash` exactly when `_cached_blocks[block_hash]` is that block.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        # block ids with ref_count 0, least recently freed first: allocation pops the front
        self._free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached_blocks: dict[bytes, int] = {}
        # per request id: how many of its leading blocks cache_full_blocks has registered
        self._num_registered_blocks: dict[str, int] = {}
        # requests whose blocks are not registered, until they free them (`keep_private`)
        self._private_request_ids: set[str] = set()
        self.prefix_cache_queries = 0  # tokens of requests looked up in the prefix cache
        self.prefix_cache_hits = 0  # of those, tokens found cached

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached (evictable) ones included."""
        return len(self._free_block_ids)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return num_blocks_for(num_tokens, self.block_size)

    def cached_block_hashes(self) -> set[bytes]:
        return set(self._cached_blocks)

    def recent_block_hashes(self, limit: int) -> list[bytes]:
        """Up to `limit` cached hashes, most recently registered or hit last.

        Routers get this bounded summary; hits refresh a block's place, so the
        blocks of a hot shared prefix stay in it however much else is cached.
        """
        return list(itertools.islice(reversed(self._cached_blocks), limit))[::-1]

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Find the longest cached prefix of a request that holds no blocks yet.

        The block holding the last token never counts as a hit: the model must compute at
        least that token to get logits for the next one.

        Returns:
            The cached block ids, in order, and the number of tokens they hold. No
            references are taken; pass the ids to `allocate_slots`.
        """
        if request.block_ids:
            raise BlockAccountingError(f"request {request.request_id} already holds blocks")
        if not self.enable_prefix_caching:
            return [], 0
        hit_block_ids: list[int] = []
        for index in range((request.num_tokens - 1) // self.block_size):
            block_id = self._find_cached_block(request, index)
            if block_id is None:
                break
            hit_block_ids.append(block_id)
        num_computed_tokens = len(hit_block_ids) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_computed_tokens
        return hit_block_ids, num_computed_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> list[int] | None:
        """Grow the request's block table to cover `num_computed_tokens + num_new_tokens`.

        Args:
            computed_blocks: prefix-cache hits from `get_computed_blocks`, given on the
                first allocation only; the caller has set `request.num_computed_tokens` to
                the number of tokens they hold.

        Returns:
            The newly allocated block ids, or None when the pool is too small; then nothing
            has changed.
        """
        computed_blocks = computed_blocks or []
        self._check_allocation(request, num_new_tokens, computed_blocks)
        num_required = self.num_blocks_for(request.num_computed_tokens + num_new_tokens)
        num_new_blocks = max(0, num_required - len(request.block_ids) - len(computed_blocks))
        # a hit that sits in the free list leaves it, so it competes with the new blocks
        num_free_hits = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        if num_new_blocks + num_free_hits > self.num_free_blocks:
            return None
        # take the hits first: allocating first could evict the very blocks we just found
        for block_id in computed_blocks:
            self._acquire(block_id)
        new_block_ids = [self._allocate_free_block() for _ in range(num_new_blocks)]
        request.block_ids.extend(computed_blocks)
        request.block_ids.extend(new_block_ids)
        return new_block_ids

    def keep_private(self, request: Request) -> None:
        """Never make the blocks the request holds now findable by their hashes.

        For KV this process did not compute (imported, and not from a trusted peer): no
        other request shares it. It lasts until the request frees its blocks; a preempted
        request recomputes its KV here, and those blocks are cached as any others.
        """
        self._private_request_ids.add(request.request_id)

    def cache_full_blocks(self, request: Request) -> None:
        """Make every full, computed block of the request findable by its hash (unless the
        request is `keep_private`)."""
        if not self.enable_prefix_caching or request.request_id in self._private_request_ids:
            return
        start = self._num_registered_blocks.get(request.request_id, 0)
        end = request.num_computed_tokens // self.block_size
        for index in range(start, end):
            block_hash = self._block_hash(request, index)
            # another block may already hold this prefix (two requests computed it in the
            # same step): that one stays cached, this one stays anonymous
            if block_hash not in self._cached_blocks:
                block = self.blocks[request.block_ids[index]]
                block.block_hash = block_hash
                block.token_ids = self._block_tokens(request, index)
                self._cached_blocks[block_hash] = block.block_id
        self._num_registered_blocks[request.request_id] = max(start, end)

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first so tails are evicted first."""
        for block_id in reversed(request.block_ids):
            self._release(block_id)
        request.block_ids = []
        self._num_registered_blocks.pop(request.request_id, None)
        self._private_request_ids.discard(request.request_id)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix; blocks in use keep their contents."""
        for block_id in self._cached_blocks.values():
            self.blocks[block_id].block_hash = None
            self.blocks[block_id].token_ids = ()
        self._cached_blocks.clear()

    def _check_allocation(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int]
    ) -> None:
        if num_new_tokens < 0:
            raise BlockAccountingError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if computed_blocks and request.block_ids:
            raise BlockAccountingError(
                f"request {request.request_id} already holds blocks; "
                "computed_blocks are only for its first allocation"
            )
        num_hit_tokens = len(computed_blocks) * self.block_size
        if computed_blocks and request.num_computed_tokens != num_hit_tokens:
            raise BlockAccountingError(
                f"request {request.request_id}: num_computed_tokens is "
                f"{request.num_computed_tokens}, its computed blocks hold {num_hit_tokens}"
            )

    def _find_cached_block(self, request: Request, index: int) -> int | None:
        """The cached block holding the request's block `index`, checked token by token."""
        block_id = self._cached_blocks.get(self._block_hash(request, index))
        if block_id is None:
            return None
        if self.blocks[block_id].token_ids != self._block_tokens(request, index):
            return None
        block_hash = self.blocks[block_id].block_hash
        self._cached_blocks[block_hash] = self._cached_blocks.pop(block_hash)  # most recent
        return block_id

    def _block_hash(self, request: Request, index: int) -> bytes:
        """The chained hash of the request's block `index`, computed once and kept."""
        if index < len(request.block_hashes):
            return request.block_hashes[index]
        if index != len(request.block_hashes):
            raise BlockAccountingError(
                f"request {request.request_id}: block {index} hashed before block {index - 1}"
            )
        parent_hash = request.block_hashes[-1] if request.block_hashes else None
        # looked up in the module at each call so tests can force collisions
        block_hash = hash_block_tokens(parent_hash, self._block_tokens(request, index))
        request.block_hashes.append(block_hash)
        return block_hash

    def _block_tokens(self, request: Request, index: int) -> tuple[int, ...]:
        start = index * self.block_size
        return tuple(request.token_ids[start : start + self.block_size])

    def _allocate_free_block(self) -> int:
        block_id, _ = self._free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict: its old contents are about to be overwritten
            del self._cached_blocks[block.block_hash]
            block.block_hash = None
            block.token_ids = ()
        block.ref_count = 1
        return block_id

    def _acquire(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free_block_ids[block_id]
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise BlockAccountingError(f"block {block_id} freed with ref_count {block.ref_count}")
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free_block_ids[block_id] = None
