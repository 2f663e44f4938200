"""Block arithmetic and the chained block hash that names a prefix.

The hash is what prefix caching looks up (`engine.block_manager`) and what routers
compare between workers (cache-aware routing), so it is stable across processes and
machines: blake2b over int32 little-endian token ids, never Python's `hash`.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BLOCK_HASH_BYTES = 16


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens (ceiling division)."""
    return -(-num_tokens // block_size)


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Hash one full block, chained to the hash of the block before it (None for the first).

    Stable across processes and machines (int32 little-endian, no Python `hash`), because
    routers compare these hashes between workers.
    """
    digest = hashlib.blake2b(digest_size=BLOCK_HASH_BYTES)
    if parent_hash is not None:
        digest.update(parent_hash)
    digest.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    return digest.digest()


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[str]:
    """Hex chained hashes of the prompt blocks a worker's prefix cache could serve.

    Exactly what `BlockManager.get_computed_blocks` looks up: full blocks only, and never
    the block holding the last token (the model must compute it to get the next token's
    logits), so `(len(token_ids) - 1) // block_size` hashes.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[str] = []
    parent_hash: bytes | None = None
    for start in range(0, (len(token_ids) - 1) // block_size * block_size, block_size):
        parent_hash = hash_block_tokens(parent_hash, token_ids[start : start + block_size])
        hashes.append(parent_hash.hex())
    return hashes
