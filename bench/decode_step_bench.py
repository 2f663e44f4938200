"""Decode steps of two or more engines side by side: trees, settings or thread counts.

Each side is an engine in a process of its own, `label=tree[:key=value,...]`: `tree` is a
checkout whose `services/` the process imports pdserve from (the tree before a change: a
`git worktree`), the keys are EngineConfig fields and `threads` (torch's intra-op
threads). Every side decodes the same prompts; the parent takes turns, a few steps of one
side at a time (round i starts at side i mod n), while the others wait on their pipe and
use no CPU. A slow spell of the machine so lands on every side, and the ratios hold where
single timings would not.

    git worktree add /tmp/before HEAD
    .venv/bin/python bench/decode_step_bench.py --model $M \\
        --side before=/tmp/before --side after=. --batches 1,16 --dtype bfloat16

The key `constraint=json` puts every request of its side under a JSON schema (structured
outputs: an array of at least 50 objects, so no request completes it within the steps
timed), against a side without it:

    .venv/bin/python bench/decode_step_bench.py --model $M --dtype float32 --batches 16 \\
        --side free=. --side constrained=.:constraint=json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

KV_CACHE_BYTES = 512 << 20  # a batch of 16 at 256 tokens needs a third of it in float32
WARMUP_STEPS = 4  # the prefill, then decode steps the timings leave out
# `constraint=json`: JSON with keys, integers and strings, long enough to outlast the steps
BENCH_SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "name": {"type": "string"}},
        "required": ["id", "name"],
    },
    "minItems": 50,
}


@dataclass(frozen=True, slots=True)
class Side:
    label: str
    tree: Path
    overrides: dict[str, object]

    @classmethod
    def parse(cls, spec: str) -> Side:
        label, _, rest = spec.partition("=")
        tree, _, settings = rest.partition(":")
        overrides = {}
        for item in filter(None, settings.split(",")):
            key, _, value = item.partition("=")
            overrides[key] = (
                json.loads(value)
                if value[:1].isdigit()
                or value
                in (
                    "true",
                    "false",
                )
                else value
            )
        if not label or not tree:
            raise argparse.ArgumentTypeError(f"expected label=tree[:key=value,...], got {spec!r}")
        return cls(label, Path(tree).resolve(), overrides)


class Child:
    """One side's engine process, driven line by line over its stdin and stdout."""

    def __init__(self, side: Side, args: argparse.Namespace):
        env = dict(os.environ, PYTHONPATH=str(side.tree / "services"))
        config = dict(side.overrides, model=args.model, dtype=args.dtype)
        command = [sys.executable, __file__, "--child", json.dumps(config)]
        self.side = side
        self.proc = subprocess.Popen(
            command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.started = self.ask({"ready": True})["startup_s"]

    def ask(self, message: dict) -> dict:
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"side {self.side.label} exited ({self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def child_main(config_json: str) -> int:
    """The engine side: answers the parent's messages until its stdin closes."""
    began = time.perf_counter()
    from pdserve.engine.huge_pages import use_huge_pages

    use_huge_pages()  # as a worker does, before its first tensor
    import torch

    from pdserve.bench.component import greedy, random_prompt
    from pdserve.core.structured_output import Constraint, ConstraintKind
    from pdserve.engine.llm_engine import LLMEngine

    config = json.loads(config_json)
    torch.set_num_threads(config.pop("threads", 1))
    constraint = None
    if config.pop("constraint", None) == "json":
        constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(BENCH_SCHEMA))
    engine = LLMEngine.from_pretrained(
        config.pop("model"), kv_cache_bytes=KV_CACHE_BYTES, max_num_batched_tokens=8192, **config
    )
    for line in sys.stdin:
        message, reply = json.loads(line), {}
        if "ready" in message:
            reply["startup_s"] = time.perf_counter() - began
        elif "batch" in message:
            rng = random.Random(message["seed"])
            limit = engine.model_config.vocab_size
            for _ in range(message["batch"]):
                prompt = random_prompt(message["context"], rng, limit)
                params = greedy(message["max_tokens"])
                params.constraint = constraint
                engine.add_request(prompt, params)
            for _ in range(WARMUP_STEPS):
                engine.step()
        elif "steps" in message:
            times, cpu, tokens = [], [], []
            for _ in range(message["steps"]):
                start, start_cpu = time.perf_counter(), time.process_time()
                deltas = engine.step()
                times.append(time.perf_counter() - start)
                cpu.append(time.process_time() - start_cpu)  # every thread of the process
                tokens.append(sorted((d.request_id, d.token_ids) for d in deltas))
            reply = {"times": times, "cpu": cpu, "tokens": tokens}
        elif "finish" in message:
            while engine.has_unfinished_requests():
                engine.step()
        print(json.dumps(reply), flush=True)
    return 0


def compare(children: list[Child], args: argparse.Namespace, batch: int) -> list[list[float]]:
    """Each side's decode-step times (s) at `batch` sequences, taken in rotation: wall
    clock, or with `--cpu` the process's CPU time (all its threads), which a machine
    shared with other work stretches far less."""
    max_tokens = WARMUP_STEPS + args.rounds * args.steps + 1
    setup = {"batch": batch, "seed": batch, "context": args.context, "max_tokens": max_tokens}
    for child in children:
        child.ask(setup)
    times: list[list[float]] = [[] for _ in children]
    tokens: list[list] = [[] for _ in children]
    for i in range(args.rounds):
        for j in range(len(children)):
            k = (i + j) % len(children)
            reply = children[k].ask({"steps": args.steps})
            times[k].extend(reply["cpu" if args.cpu else "times"])
            tokens[k].extend(reply["tokens"])
    for child in children:
        child.ask({"finish": True})
    for child, theirs in zip(children[1:], tokens[1:], strict=True):
        same = sum(a == b for a, b in zip(tokens[0], theirs, strict=True))
        print(
            f"  batch {batch}: {child.side.label} made the same tokens as "
            f"{children[0].side.label} in {same} of {len(theirs)} steps"
        )
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model directory or GGUF")
    parser.add_argument("--side", action="append", type=Side.parse, default=[], help=Side.__doc__)
    parser.add_argument("--batches", default="1,16", help="sequences per step")
    parser.add_argument("--context", type=int, default=256, help="each sequence's prompt")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--rounds", type=int, default=8, help="turns of every side")
    parser.add_argument("--steps", type=int, default=4, help="steps per turn")
    parser.add_argument("--cpu", action="store_true", help="time steps in process CPU time")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        return child_main(args.child)
    if len(args.side) < 2 or not args.model:
        parser.error("--model and two --side at least")
    from pdserve.bench.machine import describe, load_average

    print(describe(f"{args.dtype}, prompts of {args.context} tokens"))
    print(f"load average at start: {load_average()}")
    children = [Child(side, args) for side in args.side]
    for child in children:
        print(
            f"  {child.side.label}: {child.side.tree} {child.side.overrides} "
            f"(ready in {child.started:.1f} s)"
        )
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        times = compare(children, args, batch)
        base = statistics.median(times[0])
        for child, runs in zip(children, times, strict=True):
            median = statistics.median(runs)
            rows.append(
                f"| {batch} | {child.side.label} | {median * 1e3:.1f} "
                f"| {min(runs) * 1e3:.1f} | {median / base:.2f}x |"
            )
    for child in children:
        child.close()
    print(f"load average at end: {load_average()}")
    clock = "CPU" if args.cpu else "wall"
    header = f"step median, {clock} (ms) | fastest (ms) | vs {args.side[0].label}"
    print(f"\n| sequences | side | {header} |")
    print("| --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    random.seed(0)
    sys.exit(main())
