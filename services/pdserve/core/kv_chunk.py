"""A KV chunk as it crosses processes: one layer's K and V of some blocks, as raw bytes.

The checksum is crc32, computed by ISA-L: one function for every place that writes or
checks it (the engine's export and import, the codec's split pieces, the receiver's
check), so they cannot disagree. ISA-L's crc32 is zlib's (same polynomial, same values,
same ``crc32(data, start)`` form), so a checksum from either verifies with the other; it
runs at ~50 GB/s on x86-64 where zlib 1.2's runs at ~4, which made crc32 a third of the
receiving worker's CPU time in the KV transfer benchmark.
"""

from __future__ import annotations

from dataclasses import dataclass

from isal.isal_zlib import crc32

__all__ = ["KVLayerChunk", "crc32"]


@dataclass(frozen=True, slots=True)
class KVLayerChunk:
    """K and V of some blocks of one layer: ``data`` holds a ``shape`` tensor of ``dtype``.

    shape = (2, num_blocks, block_size, num_kv_heads, head_dim).
    """

    layer: int
    dtype: str
    shape: tuple[int, ...]
    data: bytes
    checksum: int  # crc32 of data

    @property
    def num_blocks(self) -> int:
        return self.shape[1]
