"""Attention over the paged cache: new tokens after a prefix attend as one causal softmax
over the whole context, whichever way a span asks for it (engine/attention.py)."""

import pytest
import torch

from pdserve.engine.attention import (
    AttentionMetadata,
    DecodeBatch,
    PrefillSpan,
    paged_attention,
    prefix_apart,
)

SCALE = 0.125
HEAD_DIM = 16


def reference(q, keys, values, num_prefix):
    """Plain softmax attention in float64: new token i sees keys 0..num_prefix + i."""
    group = q.shape[1] // keys.shape[1]
    q, keys, values = (x.double() for x in (q, keys, values))
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * SCALE
    query_pos = torch.arange(len(q)).unsqueeze(1) + num_prefix
    scores.masked_fill_(torch.arange(len(keys)).unsqueeze(0) > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def scattered_cache(num_heads, num_kv_heads, num_prefix, num_new, dtype):
    """Random q/k/v for the new tokens and a cache holding the context at scattered slots
    (as blocks of a paged cache are); returns q, k, v, cache, context slots."""
    torch.manual_seed(num_prefix * 31 + num_new)
    context = num_prefix + num_new
    slots = torch.randperm(2 * context)[:context]
    cache = torch.randn(2, 2 * context, num_kv_heads, HEAD_DIM, dtype=dtype)
    q = torch.randn(num_new, num_heads, HEAD_DIM, dtype=dtype)
    k, v = cache[:, slots[num_prefix:]].clone().unbind(0)
    return q, k, v, cache, slots


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (4, 4), (4, 1)])
@pytest.mark.parametrize("num_prefix,num_new", [(1, 5), (37, 24), (1030, 70)])
@pytest.mark.parametrize("apart", [True, False], ids=["prefix-apart", "one-masked-call"])
def test_new_tokens_after_a_prefix_attend_as_one_causal_softmax(
    num_heads, num_kv_heads, num_prefix, num_new, apart
):
    q, k, v, cache, slots = scattered_cache(
        num_heads, num_kv_heads, num_prefix, num_new, torch.float32
    )
    if apart:  # the tokens before the new ones, unmasked
        span = PrefillSpan(0, num_new, slots[:num_prefix], mask=None)
    else:  # the whole context, under a bottom-right causal mask
        query_pos = torch.arange(num_prefix, num_prefix + num_new).unsqueeze(1)
        mask = torch.arange(num_prefix + num_new).unsqueeze(0) <= query_pos
        span = PrefillSpan(0, num_new, slots, mask)
    out = paged_attention(q, k, v, cache, AttentionMetadata(slots, [span], []), SCALE)
    keys, values = cache[:, slots].unbind(0)
    expected = reference(q, keys, values, num_prefix)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_prefix_apart_in_bfloat16_stays_in_bfloat16_and_close():
    q, k, v, cache, slots = scattered_cache(8, 2, 300, 40, torch.bfloat16)
    span = PrefillSpan(0, 40, slots[:300], mask=None)
    out = paged_attention(q, k, v, cache, AttentionMetadata(slots, [span], []), SCALE)
    assert out.dtype == torch.bfloat16
    keys, values = cache[:, slots].unbind(0)
    torch.testing.assert_close(out.double(), reference(q, keys, values, 300), atol=2e-2, rtol=0)


def test_only_a_long_prefix_before_enough_new_tokens_is_attended_apart_on_cpu():
    cpu = torch.device("cpu")
    assert prefix_apart(cpu, 1024, 64)  # a prompt's third 512-token chunk, a long cached prefix
    assert not prefix_apart(cpu, 1023, 512)  # its second: one masked call is as fast
    assert not prefix_apart(cpu, 4096, 63)  # a few new tokens: the extra calls cost more
    assert prefix_apart(torch.device("cuda"), 1, 1)  # bottom-right causal, in the kernel


@pytest.mark.parametrize("context", [1, 16, 37])
def test_a_decode_over_consecutive_blocks_attends_in_place_as_the_gather_does(context):
    block_size, num_kv_heads, first_block = 16, 2, 3
    torch.manual_seed(context)
    num_blocks = -(-context // block_size)
    cache = torch.randn(2, 8 * block_size, num_kv_heads, HEAD_DIM)
    q = torch.randn(1, 8, HEAD_DIM)
    table = torch.arange(first_block, first_block + num_blocks)
    buffer = cache.new_empty(2, num_blocks, block_size, num_kv_heads, HEAD_DIM)
    gathered = DecodeBatch(0, 1, context, table, None, buffer)
    in_place = DecodeBatch(0, 1, context, None, None, None, first_slot=first_block * block_size)
    outs = [
        paged_attention(q, None, None, cache, AttentionMetadata(None, [], [batch]), SCALE)
        for batch in (gathered, in_place)
    ]
    keys = cache[:, first_block * block_size :][:, :context]
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    torch.testing.assert_close(outs[1].double(), reference(q, *keys, context - 1))
