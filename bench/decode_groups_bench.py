"""A decode step with one long context among short ones: grouped by length vs one padded batch.

The engine batches a step's decode sequences into padded attention calls. With one call
for all of them, every sequence gathers and attends over the longest one's keys; with the
calls grouped by context length (`engine/model_runner.py`, `decode_groups`), the short
ones pad only to each other. This runs the same engine both ways, in turn, one torch
thread: one 2,047-token prompt and N 60-token ones, all decoding, and times a decode step
(median of STEPS, best of ROUNDS per side).

    .venv/bin/python bench/decode_groups_bench.py --model /tmp/small
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

from pdserve.bench.component import Ratio, print_table
from pdserve.bench.machine import describe, load_average
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine import model_runner
from pdserve.engine.llm_engine import LLMEngine

LONG, SHORT = 2047, 60
STEPS, ROUNDS = 40, 2
HEADER = (
    "decoding together",
    "grouped",
    "one padded batch",
    "grouped / one batch",
    "target",
    "met",
)


def step_ms(model: str, num_short: int, grouped: bool) -> float:
    """A decode step's median time (ms) with one LONG and `num_short` SHORT contexts."""
    real = model_runner.decode_groups
    if not grouped:
        model_runner.decode_groups = lambda lens: [range(len(lens))] if lens else []
    try:
        engine = LLMEngine.from_pretrained(model, max_num_batched_tokens=4096)
        rng = random.Random(0)
        params = SamplingParams(max_tokens=STEPS + 8, temperature=0.0, ignore_eos=True)
        for length in (LONG, *[SHORT] * num_short):
            engine.add_request([rng.randrange(100, 30000) for _ in range(length)], params)
        for _ in range(3):  # the prefills, then a decode step or two
            engine.step()
        times = []
        for _ in range(STEPS):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3
    finally:
        model_runner.decode_groups = real


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a model directory (pdserve demo-model)")
    parser.add_argument(
        "--short", default="0,3,7", help="how many short contexts, comma-separated runs"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(describe(f"torch {torch.__version__}"))
    print(f"load average at start: {load_average()}")
    rows = []
    for num_short in (int(n) for n in args.short.split(",")):
        grouped, padded = [], []
        for _ in range(ROUNDS):  # in turn, so that drift lands on both
            padded.append(step_ms(args.model, num_short, grouped=False))
            grouped.append(step_ms(args.model, num_short, grouped=True))
        label = f"1 x {LONG} + {num_short} x {SHORT} tokens"
        rows.append(Ratio(label, min(grouped), min(padded), "ms", None, higher_is_better=False))
    print_table(HEADER, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
