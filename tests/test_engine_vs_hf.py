"""The engine against transformers on tiny random checkpoints of every architecture."""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from conftest import write_hf_checkpoint

from pdserve.core.model_config import ModelConfig
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.attention import AttentionMetadata, PrefillSpan
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loader import load_model

# transformers as the oracle: minutes of CPU (`make test-fast` skips it)
pytestmark = pytest.mark.slow

GREEDY_32 = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
GREEDY_8 = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def random_prompts(lengths, seed=0, vocab=1000):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def hf_model(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # run the full length, like ignore_eos
    return model


def hf_greedy(model, prompt, max_new_tokens=32):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def test_prefill_logits_match_transformers(hf_checkpoint):
    _, path = hf_checkpoint
    config = ModelConfig.from_dir(path)
    ours = load_model(path, config, 512, torch.device("cpu"), torch.float32)
    ids = torch.tensor(random_prompts([45])[0])
    kv = torch.zeros(config.num_layers, 2, 64, config.num_kv_heads, config.head_dim)
    meta = AttentionMetadata(torch.arange(len(ids)), [PrefillSpan(0, len(ids), None, None)], [])
    with torch.no_grad():
        logits = ours.compute_logits(ours(ids, torch.arange(len(ids)), kv, meta))
        reference = hf_model(path)(ids[None]).logits[0]
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)


def test_greedy_32_tokens_identical_to_transformers(hf_checkpoint):
    _, path = hf_checkpoint
    engine = LLMEngine.from_pretrained(path, num_kv_blocks=64)
    reference = hf_model(path)
    for prompt in random_prompts([1, 7, 16, 33], seed=1):
        [out] = engine.generate([prompt], GREEDY_32)
        assert out.token_ids == hf_greedy(reference, prompt), f"prompt length {len(prompt)}"
        assert out.finish_reason == "length"


def test_batch_of_mixed_lengths_equals_each_alone(hf_checkpoint):
    _, path = hf_checkpoint
    prompts = random_prompts([3, 17, 40, 64, 5, 29], seed=2)
    alone = [LLMEngine.from_pretrained(path).generate([p], GREEDY_32)[0] for p in prompts]
    batched = LLMEngine.from_pretrained(path).generate(prompts, GREEDY_32)
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    reference = hf_model(path)
    assert batched[2].token_ids == hf_greedy(reference, prompts[2])


def test_decodes_of_far_apart_contexts_in_separate_groups_equal_each_alone(hf_checkpoint):
    _, path = hf_checkpoint
    prompts = random_prompts([700, 12, 300, 9], seed=3)  # three groups: 9-12, 300, 700
    alone = [LLMEngine.from_pretrained(path).generate([p], GREEDY_32)[0] for p in prompts]
    batched = LLMEngine.from_pretrained(path).generate(prompts, GREEDY_32)
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    assert batched[0].token_ids == hf_greedy(hf_model(path), prompts[0])


def test_sliding_window_shorter_than_the_context_matches_transformers(demo_model_dir, tmp_path):
    # The window masks keys in the prompt's prefill and in every decode step, alone and in a
    # batch whose sequences have different lengths.
    path = write_hf_checkpoint(tmp_path / "mistral", "mistral", demo_model_dir, sliding_window=8)
    prompts = random_prompts([20, 5, 13], seed=9)
    outs = LLMEngine.from_pretrained(path).generate(prompts, GREEDY_32)
    reference = hf_model(path)
    assert [o.token_ids for o in outs] == [hf_greedy(reference, p) for p in prompts]


def test_chunked_prefill_equals_unchunked(demo_model_dir):
    prompts = random_prompts([150, 61, 9], seed=3)
    whole = LLMEngine.from_pretrained(demo_model_dir).generate(prompts, GREEDY_32)
    chunked = LLMEngine.from_pretrained(demo_model_dir, max_num_batched_tokens=24)
    outs = chunked.generate(prompts, GREEDY_32)
    assert [o.token_ids for o in outs] == [o.token_ids for o in whole]


def test_long_prompts_in_chunks_and_after_a_long_cached_prefix_match_transformers(hf_checkpoint):
    # 256-token chunks: from the fifth on, each attends to its 1,024 or more earlier tokens apart
    # from its own (attention.prefix_apart); so does a prompt after a 1,088-token cache hit.
    _, path = hf_checkpoint
    shared, tail, other_tail = random_prompts([1100, 300, 150], seed=10)
    engine = LLMEngine.from_pretrained(path, max_num_batched_tokens=256)
    reference = hf_model(path)
    for prompt in (shared + tail, shared + other_tail):
        [out] = engine.generate([prompt], GREEDY_8)
        assert out.token_ids == hf_greedy(reference, prompt, max_new_tokens=8)
    assert out.num_cached_tokens >= 1024


def test_prefix_cache_hits_equal_misses(demo_model_dir):
    shared = random_prompts([48], seed=4)[0]
    prompts = [shared + tail for tail in random_prompts([5, 20, 1], seed=5)]
    cold = [
        LLMEngine.from_pretrained(demo_model_dir, enable_prefix_caching=False).generate(
            [p], GREEDY_32
        )[0]
        for p in prompts
    ]
    engine = LLMEngine.from_pretrained(demo_model_dir)
    warm = [engine.generate([p], GREEDY_32)[0] for p in prompts]
    assert [o.token_ids for o in warm] == [o.token_ids for o in cold]
    assert warm[0].num_cached_tokens == 0
    assert [o.num_cached_tokens for o in warm[1:]] == [48, 48]
    assert engine.block_manager.prefix_cache_hits >= 96


def test_seeded_sampling_is_the_same_alone_and_in_a_batch_of_16(demo_model_dir):
    params = SamplingParams(
        temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24, ignore_eos=True
    )
    prompt = random_prompts([21], seed=6)[0]
    [alone] = LLMEngine.from_pretrained(demo_model_dir).generate([prompt], params)
    others = random_prompts([5 + 3 * i for i in range(15)], seed=7)
    mixed_params = [SamplingParams(temperature=1.0, seed=i, max_tokens=10 + i) for i in range(15)]
    batch = LLMEngine.from_pretrained(demo_model_dir).generate(
        others[:7] + [prompt] + others[7:], mixed_params[:7] + [params] + mixed_params[7:]
    )
    assert batch[7].token_ids == alone.token_ids
    different_seed = SamplingParams(
        temperature=0.9, top_p=0.95, top_k=50, seed=99, max_tokens=24, ignore_eos=True
    )
    [other] = LLMEngine.from_pretrained(demo_model_dir).generate([prompt], different_seed)
    assert other.token_ids != alone.token_ids


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_and_mostly_agrees(demo_model_dir, dtype):
    prompt = random_prompts([30], seed=8)[0]
    full = LLMEngine.from_pretrained(demo_model_dir).generate([prompt], GREEDY_32)[0]
    half = LLMEngine.from_pretrained(demo_model_dir, dtype=dtype).generate([prompt], GREEDY_32)[0]
    assert len(half.token_ids) == 32
    assert half.token_ids[:4] == full.token_ids[:4]
