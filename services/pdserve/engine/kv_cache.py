"""The preallocated paged KV cache tensor, and export/import of blocks as raw bytes.

Layout: ``[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]``.
A layer's slice is contiguous, so one layer's blocks can be exported as soon as
that layer has run, while later layers are still computing (the KV-transfer path
streams them layer by layer). Bytes are the tensor's own memory: never pickle.
"""

from __future__ import annotations

import math

import torch

from pdserve.core.errors import InvalidRequestError, KVChecksumError
from pdserve.core.kv_chunk import KVLayerChunk, crc32
from pdserve.core.model_config import ModelConfig
from pdserve.engine.config import CUDA_KV_CACHE_FRACTION, DEFAULT_CPU_KV_CACHE_BYTES

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


class KVCache:
    def __init__(self, model: ModelConfig, num_blocks: int, block_size: int, dtype, device):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dtype, self.device = dtype, torch.device(device)
        self.block_shape = (block_size, model.num_kv_heads, model.head_dim)
        self.blocks = torch.zeros(
            (model.num_layers, 2, num_blocks, *self.block_shape), dtype=dtype, device=device
        )
        # The same memory seen as flat token slots, which attention indexes.
        self.slots = self.blocks.view(
            model.num_layers, 2, num_blocks * block_size, *self.block_shape[1:]
        )

    @staticmethod
    def block_bytes(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        return model.kv_bytes_per_token * block_size * torch.finfo(dtype).bits // 8

    @classmethod
    def num_blocks_for(cls, model, block_size, dtype, device, budget_bytes=None) -> int:
        """How many blocks fit the budget (default: 1 GiB on CPU, most free memory on CUDA)."""
        if budget_bytes is None:
            if torch.device(device).type == "cuda":
                free, _ = torch.cuda.mem_get_info(torch.device(device))
                budget_bytes = int(free * CUDA_KV_CACHE_FRACTION)
            else:
                budget_bytes = DEFAULT_CPU_KV_CACHE_BYTES
        return max(1, budget_bytes // cls.block_bytes(model, block_size, dtype))

    def export_layer(self, layer: int, block_ids: list[int]) -> KVLayerChunk:
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        tensor = self.blocks[layer].index_select(1, index).cpu().contiguous()
        data = tensor.view(torch.uint8).numpy().tobytes()
        return KVLayerChunk(layer, _DTYPE_NAMES[self.dtype], tuple(tensor.shape), data, crc32(data))

    def import_layer(self, chunk: KVLayerChunk, block_ids: list[int]) -> None:
        """Write a chunk into our blocks ``block_ids`` (as many as the chunk holds).

        Raises InvalidRequestError naming the chunk's field at fault (dtype, shape, data
        size, or values that are not finite: NaN or infinite KV turns every later
        attention score it meets into NaN), KVChecksumError for damaged bytes. Nothing is
        written unless the whole chunk passes.
        """
        expected = (2, len(block_ids), *self.block_shape)
        if chunk.dtype != _DTYPE_NAMES[self.dtype]:
            raise InvalidRequestError(
                "kv_chunk.dtype",
                f"{chunk.dtype!r} in layer {chunk.layer}, expected {_DTYPE_NAMES[self.dtype]!r}",
            )
        if tuple(chunk.shape) != expected:
            raise InvalidRequestError(
                "kv_chunk.shape",
                f"{list(chunk.shape)} in layer {chunk.layer}, expected {list(expected)}",
            )
        expected_bytes = math.prod(expected) * self.blocks.element_size()
        if len(chunk.data) != expected_bytes:
            raise InvalidRequestError(
                "kv_chunk.data",
                f"layer {chunk.layer} holds {len(chunk.data)} bytes, expected {expected_bytes}",
            )
        if crc32(chunk.data) != chunk.checksum:
            raise KVChecksumError(f"KV chunk of layer {chunk.layer} fails its checksum")
        flat = torch.frombuffer(bytearray(chunk.data), dtype=torch.uint8)
        tensor = flat.view(_DTYPES[chunk.dtype]).view(expected).to(self.device)
        # Every value is finite exactly when the smallest and the largest are (NaN
        # propagates through both): one reduction, a fraction of the import's time, where
        # `isfinite(tensor).all()` writes a bool per value and cost as much as the import.
        if not bool(torch.isfinite(torch.stack(torch.aminmax(tensor))).all()):
            raise InvalidRequestError(
                "kv_chunk.data", f"layer {chunk.layer} holds NaN or infinite values"
            )
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        self.blocks[chunk.layer].index_copy_(1, index, tensor)
