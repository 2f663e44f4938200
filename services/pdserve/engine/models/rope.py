"""Rotary position embeddings, including Llama 3's frequency scaling."""

from __future__ import annotations

import math

import torch

from pdserve.core.model_config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies after the configured scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        return _llama3_scaling(inv_freq, rope)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Long wavelengths (low frequencies) are slowed by `factor`, short ones kept,
    # and the band between them interpolated smoothly.
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin for every position up to max_positions."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, dtype: torch.dtype):
        super().__init__()
        inv_freq = inverse_frequencies(rope, head_dim)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        sin = emb.sin()
        half = head_dim // 2
        # The first half negated: HF rotates as x * cos + cat(-x2, x1) * sin, and
        # cat(x2, x1) * cat(-sin1, sin2) is bit for bit the same with one op fewer.
        sin[:, :half] = -sin[:, :half]
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("signed_sin", sin.to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin of each position, [T, 1, D]: gathered once per step, not per layer."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D] rotated in the HF (half-split) convention; cos/sin from `forward`."""
    half = x.shape[-1] // 2
    # In place where that is exact: HF's x * cos + rotated * sin, one temporary fewer.
    rotated = torch.cat((x[..., half:], x[..., :half]), dim=-1).mul_(signed_sin)
    return rotated.add_(x * cos)
