"""A long prompt in chunks: its attention to the tokens before each chunk, and its whole cost.

A prompt's later chunks (and a prompt after a cached prefix) attend to every token before
them in full and to their own causally. SDPA's causal mask is aligned top-left, so one
call over both takes an explicit mask, which the CPU kernel computes in full; on CPU the
engine attends to a long prefix in a call of its own instead and merges the two by their
log-sum-exps (`engine/attention.py`, `prefix_apart`). This measures, one torch thread:

1. attention alone, one layer of the model's shape: `paged_attention` over the prefix
   apart against one masked call over the whole context, in turn (median of ROUNDS);
   the target, where `prefix_apart` chooses apart: no slower;
2. the engine alone: the same prompts in 512-token chunks and in one step (two engines
   in one process, prompts in turn, median of PROMPTS each): what chunking costs.

    .venv/bin/python bench/chunked_prefill_bench.py --model /tmp/small
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import sys
import time
from collections.abc import Iterator

import torch

from pdserve.bench.component import Ratio, alternate, greedy, print_table, random_prompt
from pdserve.bench.machine import describe, load_average
from pdserve.core.model_config import ModelConfig
from pdserve.engine.attention import AttentionMetadata, PrefillSpan, paged_attention, prefix_apart
from pdserve.engine.huge_pages import use_huge_pages
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kv.transfer import keep_freed_memory

# (tokens before, new tokens): a 512-token chunk after 1-3 others, shorter last chunks,
# a chunk after a long cached prefix, and sizes below `prefix_apart`'s bounds.
SHAPES = ((512, 512), (1024, 512), (1536, 512), (1536, 128), (3072, 256), (1024, 32), (256, 256))
ROUNDS, PROMPTS = 7, 6
HEADER = ("shape", "apart", "one masked call", "apart / masked", "target", "met")
ENGINE_HEADER = ("prompt", "512-token chunks", "one step", "chunks / one step", "target", "met")


def spans(num_prefix: int, num_new: int) -> tuple[PrefillSpan, PrefillSpan]:
    """The same new tokens as a span with the prefix apart, and as one masked span."""
    query_pos = torch.arange(num_prefix, num_prefix + num_new).unsqueeze(1)
    mask = torch.arange(num_prefix + num_new).unsqueeze(0) <= query_pos
    apart = PrefillSpan(0, num_new, torch.arange(num_prefix), mask=None)
    return apart, PrefillSpan(0, num_new, torch.arange(num_prefix + num_new), mask)


def attention_row(config: ModelConfig, num_prefix: int, num_new: int) -> Ratio:
    heads, kv_heads, dim = config.num_heads, config.num_kv_heads, config.head_dim
    cache = torch.randn(2, num_prefix + num_new, kv_heads, dim)
    q = torch.randn(num_new, heads, dim)
    k, v = cache[:, num_prefix:].clone().unbind(0)
    slots = torch.arange(num_prefix, num_prefix + num_new)
    calls = max(3, 4_000_000 // (num_new * (num_prefix + num_new)))

    def timed(span: PrefillSpan):
        meta = AttentionMetadata(slots, [span], [])
        start = time.perf_counter()
        for _ in range(calls):
            paged_attention(q, k, v, cache, meta, dim**-0.5)
        return (time.perf_counter() - start) / calls * 1e3

    apart, masked = spans(num_prefix, num_new)
    runs = alternate(ROUNDS, 1, lambda: timed(apart), lambda: timed(masked))
    chosen = prefix_apart(torch.device("cpu"), num_prefix, num_new)
    label = f"{num_new} new after {num_prefix}" + ("" if chosen else " (not chosen)")
    medians = [statistics.median(r) for r in runs]
    return Ratio(label, *medians, "ms", 1.0 if chosen else None, higher_is_better=False)


def prefill_ms(engine: LLMEngine, prompts: Iterator[list[int]]) -> float:
    """The next prompt's time to its first token, alone in the engine."""
    engine.add_request(next(prompts), greedy(1))
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return (time.perf_counter() - start) * 1e3


def engine_rows(model: str, lengths: list[int]) -> list[Ratio]:
    engines = [LLMEngine.from_pretrained(model, max_num_batched_tokens=n) for n in (512, 2048)]
    rng, rows = random.Random(0), []
    for length in lengths:
        prompts = [random_prompt(length, rng, 3000) for _ in range(PROMPTS + 1)]  # 1 warm-up
        sides = [functools.partial(prefill_ms, e, iter(prompts)) for e in engines]
        runs = alternate(PROMPTS, 1, *sides)  # the same prompts on both, in turn
        medians = [statistics.median(r) for r in runs]
        rows.append(Ratio(f"{length} tokens", *medians, "ms", None, higher_is_better=False))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a model directory (pdserve demo-model)")
    parser.add_argument("--prompts", default="1040,1700,2040", help="prompt lengths for part 2")
    args = parser.parse_args(argv)
    keep_freed_memory()  # as a worker process runs its engine
    use_huge_pages()
    torch.set_num_threads(1)
    print(describe(f"torch {torch.__version__}"))
    print(f"load average at start: {load_average()}")
    config = ModelConfig.load(args.model)
    with torch.inference_mode():
        print_table(HEADER, [attention_row(config, *shape) for shape in SHAPES])
    lengths = [int(n) for n in args.prompts.split(",")]
    print_table(ENGINE_HEADER, engine_rows(args.model, lengths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
