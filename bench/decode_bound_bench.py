"""A decode step against this machine's floor: every byte read once, every FLOP at peak.

A decode step reads every weight and each running sequence's KV, and does two FLOPs per
weight per sequence. No kernel makes it shorter than the larger of bytes / read bandwidth
and FLOPs / matmul peak, both measured here on one torch thread, as a worker runs: the
bandwidth from a sum over a tensor far larger than the caches, the peak from a square
matmul. For each batch size this prints the engine's decode step, its linear layers alone
(the model's own modules, one row per sequence), their floors, and the ratios: what a
faster kernel could still win, and how much of the step is not the linear layers.

    .venv/bin/python bench/decode_bound_bench.py --model /tmp/small
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from pdserve.bench.component import greedy, random_prompt
from pdserve.bench.machine import describe, load_average
from pdserve.engine.huge_pages import use_huge_pages
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.models.cpu_linear import PrepackedLinear
from pdserve.kv.transfer import keep_freed_memory

READ_BYTES = 1 << 30  # the bandwidth's tensor: past any L3 a worker's core shares
SQUARE = 2048  # the peak's matmul: n x n by n x n
STEPS, WARMUP = 24, 4
HEADER = (
    "sequences",
    "decode step (ms)",
    "its floor (ms): read / FLOPs",
    "step / floor",
    "linears alone (ms)",
    "their floor (ms)",
    "linears / floor",
    "linears' share of the step",
)


def median_s(fn: Callable[[], object], runs: int) -> float:
    """The median of `runs` timed calls of `fn`, after one untimed (seconds)."""
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@dataclass(frozen=True, slots=True)
class Machine:
    """What one thread of this machine reads and computes per second, at best."""

    read_bytes_per_s: float
    flops_per_s: float

    @classmethod
    def measure(cls, dtype: torch.dtype) -> Machine:
        big = torch.ones(READ_BYTES // 4)
        read = READ_BYTES / median_s(big.sum, 5)
        del big
        a, b = torch.randn(SQUARE, SQUARE, dtype=dtype), torch.randn(SQUARE, SQUARE, dtype=dtype)
        return cls(read, 2 * SQUARE**3 / median_s(lambda: a @ b, 5))

    def floor_ms(self, nbytes: float, flops: float) -> tuple[float, float]:
        """(read-bound, FLOP-bound) times in ms; the floor is their max."""
        return nbytes / self.read_bytes_per_s * 1e3, flops / self.flops_per_s * 1e3


def linear_modules(engine: LLMEngine) -> list[nn.Module]:
    """Every linear layer a decode step runs, in order (lm_head last)."""
    linear = (nn.Linear, PrepackedLinear)
    return [m for m in engine.runner.model.modules() if isinstance(m, linear)]


def linears_ms(engine: LLMEngine, num_rows: int) -> float:
    """The model's own linear modules, in order, `num_rows` rows each (median, ms)."""
    dtype = engine.config.torch_dtype
    modules = linear_modules(engine)
    inputs = [torch.randn(num_rows, m.in_features, dtype=dtype) for m in modules]

    def run() -> None:
        for module, x in zip(modules, inputs, strict=True):
            module(x)

    with torch.inference_mode():
        return median_s(run, STEPS) * 1e3


def step_ms(engine: LLMEngine, num_seqs: int, context: int, rng: random.Random) -> float:
    """The median decode step with `num_seqs` sequences of about `context` tokens (ms)."""
    limit = engine.model_config.vocab_size
    for _ in range(num_seqs):
        engine.add_request(random_prompt(context, rng, limit), greedy(WARMUP + STEPS + 2))
    for _ in range(WARMUP):  # the prefill, then decode steps
        engine.step()
    step = median_s(engine.step, STEPS)
    while engine.has_unfinished_requests():
        engine.step()
    return step * 1e3


def row(
    engine: LLMEngine, machine: Machine, num_seqs: int, context: int, rng: random.Random
) -> str:
    """One table row: the step and the linears at `num_seqs` sequences, against their floors."""
    config, itemsize = engine.model_config, engine.config.torch_dtype.itemsize
    weight_params = sum(m.in_features * m.out_features for m in linear_modules(engine))
    keys = num_seqs * (context + WARMUP + STEPS // 2)  # each sequence's context, mid-run
    kv_bytes = keys * config.num_layers * 2 * config.num_kv_heads * config.head_dim * itemsize
    attention_flops = 4 * keys * config.num_layers * config.num_heads * config.head_dim
    linear_flops = 2 * num_seqs * weight_params
    linear_floor = max(machine.floor_ms(weight_params * itemsize, linear_flops))
    read, compute = machine.floor_ms(
        weight_params * itemsize + kv_bytes, linear_flops + attention_flops
    )
    step, linears = step_ms(engine, num_seqs, context, rng), linears_ms(engine, num_seqs)
    floor = max(read, compute)
    return (
        f"| {num_seqs} x {context} tokens | {step:.1f} | {floor:.1f}: {read:.1f} / {compute:.1f} "
        f"| {step / floor:.2f}x | {linears:.1f} | {linear_floor:.1f} "
        f"| {linears / linear_floor:.2f}x | {linears / step:.0%} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a model directory (pdserve demo-model)")
    parser.add_argument("--batches", default="1,4,8,16,24,32", help="sequences per step")
    parser.add_argument("--context", type=int, default=128, help="each sequence's prompt")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args(argv)
    keep_freed_memory()
    use_huge_pages()  # as a worker does, before its first tensor
    torch.set_num_threads(1)
    engine = LLMEngine.from_pretrained(args.model, max_num_batched_tokens=8192, dtype=args.dtype)
    machine = Machine.measure(engine.config.torch_dtype)
    print(describe(f"torch {torch.__version__}"))
    print(f"load average at start: {load_average()}")
    print(
        f"one thread: reads {machine.read_bytes_per_s / 1e9:.1f} GB/s, "
        f"{args.dtype} matmul peak {machine.flops_per_s / 1e9:.0f} GFLOP/s"
    )
    rng = random.Random(0)
    rows = [row(engine, machine, int(n), args.context, rng) for n in args.batches.split(",")]
    print("\n| " + " | ".join(HEADER) + " |")
    print("|" + " --- |" * len(HEADER))
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
