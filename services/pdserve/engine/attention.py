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
from torch.nn.attention.bias import causal_lower_right

# On CPU a prefix this long, before this many new tokens, is attended apart: `prefix_apart`.
MERGE_MIN_PREFIX_TOKENS = 1024
MERGE_MIN_NEW_TOKENS = 64


@dataclass(slots=True)
class PrefillSpan:
    """One sequence's new tokens in a step that may attend to cached tokens too."""

    token_start: int  # first row of this sequence in the flattened batch
    num_new_tokens: int
    # Rows of the cache to gather and attend to: with `mask`, the whole context
    # [context_len]; without, the tokens before the new ones [start], which every new
    # token sees in full (a later chunk of a prompt, or a prompt after its cached
    # prefix). None when the context is exactly the new tokens (a fresh prompt): their
    # K/V are used directly with a causal mask and nothing is gathered.
    key_slots: torch.Tensor | None
    # [num_new_tokens, context_len] bool, True = may attend (a sliding window that cuts
    # into the context); None = causal among the new tokens, after the prefix if any.
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
    # None with `first_slot`.
    block_table: torch.Tensor | None
    # [num_seqs, 1, 1, max_context] bool, True = may attend; None when every sequence
    # attends to all max_context keys (no padding, no window), as at batch 1.
    mask: torch.Tensor | None
    # [2, num_seqs * max_blocks, block_size, kv_heads, head_dim]: where each layer gathers
    # its K and V. Layers run one after another, so one buffer per step serves them all.
    # None with `first_slot`.
    kv_buffer: torch.Tensor | None
    # One sequence whose blocks follow each other in the cache (as a lone request's do):
    # its keys are slots [first_slot, first_slot + max_context), attended in place as a
    # view, nothing gathered. None: gather by `block_table`.
    first_slot: int | None = None


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
    if not meta.prefills and len(meta.decodes) == 1:  # a decode step: no copy into `out`
        return _decode_attention(q, layer_cache, meta.decodes[0], scale)
    out = torch.empty_like(q)
    for span in meta.prefills:
        rows = slice(span.token_start, span.token_start + span.num_new_tokens)
        if span.key_slots is None:
            out[rows] = _sdpa(q[rows], k[rows], v[rows], None, scale)
            continue
        keys, values = layer_cache.index_select(1, span.key_slots).unbind(0)
        if span.mask is not None:
            out[rows] = _sdpa(q[rows], keys, values, span.mask, scale)
        else:
            out[rows] = _prefix_then_causal(q[rows], k[rows], v[rows], keys, values, scale)
    for batch in meta.decodes:
        rows = slice(batch.token_start, batch.token_start + batch.num_seqs)
        out[rows] = _decode_attention(q[rows], layer_cache, batch, scale)
    return out


def _decode_attention(q, layer_cache, batch: DecodeBatch, scale: float) -> torch.Tensor:
    """q: [num_seqs, heads, head_dim], the batch's rows -> their attention, same shape."""
    if batch.first_slot is not None:  # [2, 1, max_context, kv_heads, head_dim], a view
        kv = layer_cache[:, None, batch.first_slot : batch.first_slot + batch.max_context]
    else:
        blocks = layer_cache.view(2, -1, *batch.kv_buffer.shape[2:])
        kv = torch.index_select(blocks, 1, batch.block_table, out=batch.kv_buffer)
        # K and V of every sequence: [2, num_seqs, max_context, kv_heads, head_dim]
        kv = kv.view(2, batch.num_seqs, -1, *kv.shape[3:])[:, :, : batch.max_context]
    return _decode_sdpa(q, kv[0], kv[1], batch.mask, scale)


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
    """q: [Lq, H, D], k/v: [Lk, KVH, D] -> [Lq, H, D]; `mask` None: causal (top-left).
    Passed with a batch dimension: without one, the CPU kernel is not used."""
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)


def prefix_apart(device: torch.device, num_prefix: int, num_new: int) -> bool:
    """Whether new tokens attend to the tokens before them in a call of their own
    (`PrefillSpan` without a mask) rather than in one masked call over the whole context.

    SDPA's causal mask is aligned top-left (query i sees keys 0..i), so one call over
    prefix and new keys together takes a bottom-right mask, which CUDA's kernels apply
    natively and the CPU kernel computes in full. On CPU, attending apart (`_merged_on_cpu`)
    took 0.80x-0.92x the masked call's time with 1,024-3,072 tokens before 128-512 new ones
    (each 512-token chunk of a long prompt from its third on), the same with 512, and up to
    twice it with short prefixes or few new tokens, where its extra calls cost more than
    the mask (bench/chunked_prefill_bench.py; docs/benchmarks.md, issue 16, seventeenth
    session).
    """
    if device.type != "cpu":
        return True
    return num_prefix >= MERGE_MIN_PREFIX_TOKENS and num_new >= MERGE_MIN_NEW_TOKENS


def _prefix_then_causal(q, k, v, prefix_k, prefix_v, scale):
    """q, k, v: the new tokens' [Lq, H or KVH, D]; prefix_k/v: [P, KVH, D], the tokens
    before them, which every new token sees -> [Lq, H, D] (see `prefix_apart`)."""
    if q.device.type == "cpu":
        return _merged_on_cpu(q, k, v, prefix_k, prefix_v, scale)
    keys, values = torch.cat((prefix_k, k)), torch.cat((prefix_v, v))
    return _sdpa(q, keys, values, causal_lower_right(len(q), len(keys)), scale)


def _merged_on_cpu(q, k, v, prefix_k, prefix_v, scale):
    """The prefix without a mask (the query heads that share a KV head passed as its
    query rows, as in `_decode_sdpa`), the new tokens causally among themselves, merged
    by their log-sum-exps: the softmax over both parts."""
    num_new, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    heads_first = q.transpose(0, 1).unsqueeze(0)  # [1, H, Lq, D]
    grouped = heads_first.reshape(1, k.shape[1], group * num_new, head_dim)
    before, before_lse = _flash_cpu(grouped, prefix_k, prefix_v, False, scale)
    new_k, new_v = (x.repeat_interleave(group, dim=1) for x in (k, v))
    among, among_lse = _flash_cpu(heads_first, new_k, new_v, True, scale)
    before = before.reshape(num_heads, num_new, head_dim)
    share = torch.sigmoid(before_lse.reshape(num_heads, num_new) - among_lse[0]).unsqueeze(-1)
    out = among[0] + (before - among[0]) * share
    return out.transpose(0, 1).to(q.dtype)


def _flash_cpu(q, k, v, is_causal: bool, scale: float):
    """q: [1, heads, Lq, D], k/v: [Lk, heads, D] -> (out [1, heads, Lq, D], log-sum-exp
    [1, heads, Lq]): the CPU kernel SDPA runs, called for its log-sum-exp too."""
    k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, scale=scale
    )
