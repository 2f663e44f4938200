"""Attention over the paged KV cache.

KV cache layout, per layer: ``[2, num_blocks * block_size, num_kv_heads, head_dim]``
(K then V; a token's slot is ``block_id * block_size + offset``). The whole
cache is one tensor ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``
so one layer's blocks can be exported while later layers still compute.

This is the gather-by-block-table + SDPA path that runs anywhere. A CUDA paged
attention kernel replaces `paged_attention` alone; the metadata stays.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSpan:
    """One sequence's new tokens in a step that may attend to cached tokens too."""

    token_start: int  # first row of this sequence in the flattened batch
    num_new_tokens: int
    # Rows of the cache to attend to, [context_len], or None when the context is
    # exactly the new tokens (fresh prompt, no window): then the new K/V are used
    # directly with a causal mask and nothing is gathered.
    key_slots: torch.Tensor | None
    # [num_new_tokens, context_len] bool, True = may attend; None = plain causal.
    mask: torch.Tensor | None


@dataclass(slots=True)
class DecodeBatch:
    """Sequences that each add one token, batched into one padded SDPA call (a step has
    one per group of similar context lengths: `model_runner.decode_groups`)."""

    token_start: int
    num_seqs: int
    max_context: int  # keys per sequence after padding
    # [num_seqs * max_blocks]: each sequence's first max_blocks blocks (padding: block 0).
    # Whole blocks are gathered, not slots: one contiguous copy per block is far cheaper.
    block_table: torch.Tensor
    # [num_seqs, 1, 1, max_context] bool, True = may attend; None when every sequence
    # attends to all max_context keys (no padding, no window), as at batch 1.
    mask: torch.Tensor | None
    # [2, num_seqs * max_blocks, block_size, kv_heads, head_dim]: where each layer gathers
    # its K and V. Layers run one after another, so one buffer per step serves them all.
    kv_buffer: torch.Tensor


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens]: cache slot each new token's K/V goes to
    prefills: list[PrefillSpan]
    decodes: list[DecodeBatch]  # the decode rows, group by group; [] when none


def write_kv(layer_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor):
    """Store new K/V ([T, kv_heads, head_dim]) at their slots of one layer's cache."""
    layer_cache[0].index_copy_(0, slots, k)
    layer_cache[1].index_copy_(0, slots, v)


def paged_attention(
    q: torch.Tensor,  # [T, heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim], already written to the cache
    v: torch.Tensor,
    layer_cache: torch.Tensor,  # [2, num_slots, kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, heads, head_dim]
    out = torch.empty_like(q)
    for span in meta.prefills:
        rows = slice(span.token_start, span.token_start + span.num_new_tokens)
        if span.key_slots is None:
            keys, values = k[rows], v[rows]
        else:
            keys, values = layer_cache.index_select(1, span.key_slots).unbind(0)
        out[rows] = _sdpa(
            q[rows].unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), span.mask, scale
        )[0]
    for batch in meta.decodes:
        rows = slice(batch.token_start, batch.token_start + batch.num_seqs)
        blocks = layer_cache.view(2, -1, *batch.kv_buffer.shape[2:])
        kv = torch.index_select(blocks, 1, batch.block_table, out=batch.kv_buffer)
        # K and V of every sequence: [2, num_seqs, max_context, kv_heads, head_dim]
        kv = kv.view(2, batch.num_seqs, -1, *kv.shape[3:])[:, :, : batch.max_context]
        out[rows] = _decode_sdpa(q[rows], kv[0], kv[1], batch.mask, scale)
    return out


def _decode_sdpa(q, k, v, mask, scale):
    """q: [B, H, D], k/v: [B, Lk, KVH, D] -> [B, H, D], one query token per sequence.

    The query heads that share a KV head are passed as that head's query rows (GQA's
    heads are grouped consecutively, as in HF's repeat_kv): SDPA then reads each K/V
    once instead of once per query head, twice as fast as `enable_gqa` on CPU.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    q = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(
        q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale
    )
    return out.view(num_seqs, num_heads, head_dim)


def _sdpa(q, k, v, mask, scale):
    """q: [B, Lq, H, D], k/v: [B, Lk, KVH, D] -> [B, Lq, H, D]."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.transpose(1, 2)
