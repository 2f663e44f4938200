"""pdserve's engine against transformers, same weights, float32, on CPU (issue 3).

Three workloads, each measured for both in one run:

1. batch-1 decode: one prompt, greedy, fixed length. Decode tokens/s counts the tokens
   after the first over the time after the first: the first token's time is the prefill
   (TTFT), measured in the same call for both (a step delta for the engine, a streamer
   callback for transformers), so neither side pays for the other's prefill.
2. 16 concurrent requests: the engine takes all of them and steps until done (continuous
   batching); transformers runs one static batch-16 `generate` (left padding, attention
   mask). Output tokens/s over the whole call, prefill included, for both.
3. prefill: a 512-token prompt. The engine runs a max_tokens=1 request end to end (it
   computes logits for the last token only and samples it); transformers runs one forward
   with `logits_to_keep=1`, which is what its own `generate` does for the prompt. Asking
   transformers for all 512 rows of logits would add a 512 x 32000 matmul that neither
   engine needs.

Every figure is the median of several timed runs after one untimed warm-up. Prompts are
random token ids from a fixed seed. The engine runs with prefix caching off, since the
repeats reuse one prompt and a cache hit would skip the work being measured.

    .venv/bin/python bench/engine_bench.py [--threads N] [--quick] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers.generation.streamers import BaseStreamer

from pdserve.engine.demo_model import write_demo_model
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams

# Prompt ids are drawn from the tokenizer's own range (the demo tokenizer has ~3.2k tokens
# in a 32000-row embedding), past <unk>, <s>, </s>, so the detokenizer sees real tokens.
FIRST_PROMPT_ID, PROMPT_ID_LIMIT = 3, 3000
PROMPT_SEED = 0
BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class Workload:
    decode_prompt_len: int
    decode_new_tokens: int
    batch_size: int
    batch_prompt_len: int
    batch_new_tokens: int
    prefill_len: int
    repeats: int  # timed runs per measurement; the median is reported


FULL = Workload(32, 128, 16, 128, 64, 512, repeats=5)
QUICK = Workload(16, 16, 4, 32, 8, 128, repeats=2)


@dataclass(frozen=True, slots=True)
class Result:
    metric: str
    ours: float
    theirs: float
    unit: str
    # ratio is ours / theirs; higher_is_better: the target is a floor, else a ceiling
    target: float | None  # None: reported for context, no target
    higher_is_better: bool

    @property
    def ratio(self) -> float:
        return self.ours / self.theirs

    @property
    def met(self) -> bool:
        if self.target is None:
            return True
        return self.ratio >= self.target if self.higher_is_better else self.ratio <= self.target

    def row(self) -> str:
        target, met = "-", "-"
        if self.target is not None:
            target = f"{'>=' if self.higher_is_better else '<='} {self.target:g}x"
            met = "yes" if self.met else "NO"
        return (
            f"| {self.metric} | {self.ours:.1f} {self.unit} | {self.theirs:.1f} {self.unit} "
            f"| {self.ratio:.2f}x | {target} | {met} |"
        )


# -- timing ---------------------------------------------------------------------------------


def median_of(repeats: int, run: Callable[[], float]) -> float:
    """One untimed warm-up, then the median of `repeats` timed runs (run returns a figure)."""
    run()
    return statistics.median(run() for _ in range(repeats))


class FirstTokenClock(BaseStreamer):
    """Notes when transformers emits its first new token; `generate` first puts the prompt."""

    def __init__(self) -> None:
        self.num_puts = 0
        self.first_token_at: float | None = None

    def put(self, value) -> None:
        self.num_puts += 1
        if self.num_puts == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


# -- the two sides --------------------------------------------------------------------------


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def engine_run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int):
    """Step the engine until every prompt is done.

    Returns (tokens per prompt, seconds to the first token of any prompt, total seconds).
    """
    start = time.perf_counter()
    ids = [engine.add_request(p, greedy(max_tokens)) for p in prompts]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    first_token_at = None
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.token_ids)
            if first_token_at is None and delta.token_ids:
                first_token_at = time.perf_counter()
    end = time.perf_counter()
    return [tokens[rid] for rid in ids], first_token_at - start, end - start


def hf_generate(model, prompts: list[list[int]], max_new_tokens: int):
    """Static-batch greedy `generate`, left-padded; same returns as `engine_run`."""
    input_ids, attention_mask = left_pad(prompts)
    clock = FirstTokenClock()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            streamer=clock,
        )
    end = time.perf_counter()
    new_tokens = out[:, input_ids.shape[1] :].tolist()
    return new_tokens, clock.first_token_at - start, end - start


def left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, L] ids and mask, padded on the left so every prompt ends at the last column."""
    length = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), length, dtype=torch.long)
    mask = torch.zeros(len(prompts), length, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, length - len(prompt) :] = torch.tensor(prompt)
        mask[row, length - len(prompt) :] = 1
    return ids, mask


def hf_prefill_seconds(model, prompt: list[int]) -> float:
    ids = torch.tensor([prompt])
    start = time.perf_counter()
    with torch.inference_mode():
        model(ids, logits_to_keep=1)
    return time.perf_counter() - start


# -- the three measurements -----------------------------------------------------------------


def decode_tokens_per_s(run, num_tokens: int) -> float:
    _, ttft, total = run()
    return (num_tokens - 1) / (total - ttft)


def bench_batch1(engine, model, w: Workload, prompt: list[int]) -> tuple[list[Result], bool]:
    n = w.decode_new_tokens
    ours_tokens = engine_run(engine, [prompt], n)[0][0]
    theirs_tokens = hf_generate(model, [prompt], n)[0][0]
    same = ours_tokens == theirs_tokens
    agree = next((i for i, (a, b) in enumerate(zip(ours_tokens, theirs_tokens)) if a != b), n)
    print(f"batch-1 greedy outputs identical: {same} ({agree}/{n} tokens before any difference)")

    ours = median_of(w.repeats, lambda: decode_tokens_per_s(lambda: engine_run(engine, [prompt], n), n))
    theirs = median_of(w.repeats, lambda: decode_tokens_per_s(lambda: hf_generate(model, [prompt], n), n))
    ours_e2e = median_of(w.repeats, lambda: n / engine_run(engine, [prompt], n)[2])
    theirs_e2e = median_of(w.repeats, lambda: n / hf_generate(model, [prompt], n)[2])
    return [
        Result(f"batch-1 decode tokens/s (prompt {w.decode_prompt_len}, {n} new)",
               ours, theirs, "tok/s", 1.5, higher_is_better=True),
        Result("batch-1 whole-call tokens/s (prefill included)",
               ours_e2e, theirs_e2e, "tok/s", None, higher_is_better=True),
    ], same  # fmt: skip


def bench_concurrent(engine, model, w: Workload, prompts: list[list[int]]) -> Result:
    n, total_tokens = w.batch_new_tokens, w.batch_size * w.batch_new_tokens
    ours_out, theirs_out = engine_run(engine, prompts, n)[0], hf_generate(model, prompts, n)[0]
    num_same = sum(a == b for a, b in zip(ours_out, theirs_out))
    print(f"batch-{w.batch_size} greedy outputs identical: {num_same}/{len(prompts)} requests")
    ours = median_of(w.repeats, lambda: total_tokens / engine_run(engine, prompts, n)[2])
    theirs = median_of(w.repeats, lambda: total_tokens / hf_generate(model, prompts, n)[2])
    return Result(
        f"{w.batch_size} concurrent output tokens/s (prompt {w.batch_prompt_len}, {n} new)",
        ours, theirs, "tok/s", 1.5, higher_is_better=True,
    )  # fmt: skip


def bench_prefill(engine, model, w: Workload, prompt: list[int]) -> Result:
    ours = median_of(w.repeats, lambda: engine_run(engine, [prompt], 1)[2] * 1e3)
    theirs = median_of(w.repeats, lambda: hf_prefill_seconds(model, prompt) * 1e3)
    return Result(f"prefill {w.prefill_len} tokens, time to first token",
                  ours, theirs, "ms", 1.1, higher_is_better=False)  # fmt: skip


# -- setup and report -----------------------------------------------------------------------


def random_prompts(num: int, length: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(FIRST_PROMPT_ID, PROMPT_ID_LIMIT) for _ in range(length)]
            for _ in range(num)]  # fmt: skip


def build_engine(model_dir: Path, w: Workload) -> LLMEngine:
    longest = max(w.decode_prompt_len + w.decode_new_tokens, w.prefill_len + 1,
                  w.batch_prompt_len + w.batch_new_tokens)  # fmt: skip
    blocks_per_request = -(-longest // BLOCK_SIZE)
    return LLMEngine.from_pretrained(
        model_dir,
        device="cpu",
        dtype="float32",
        block_size=BLOCK_SIZE,
        num_kv_blocks=w.batch_size * blocks_per_request,
        max_num_seqs=w.batch_size,
        # every prompt of the concurrent batch prefills in one step, as transformers does
        max_num_batched_tokens=max(w.batch_size * w.batch_prompt_len, w.prefill_len),
        enable_prefix_caching=False,
    )


def build_hf_model(model_dir: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None  # fixed lengths, like ignore_eos
    return model


def machine_line(threads: int, model) -> str:
    cpu = platform.processor() or "unknown CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines()
                 if ln.startswith("model name")]  # fmt: skip
        cpu = names[0] if names else cpu
    return (
        f"{cpu}; torch {torch.__version__}, transformers {transformers.__version__} "
        f"(attention: {model.config._attn_implementation}); {threads} threads"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="torch threads for both sides")
    parser.add_argument("--quick", action="store_true", help="small smoke version")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="reuse or create the demo model here (default: a temp dir)")  # fmt: skip
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    w = QUICK if args.quick else FULL
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-") as tmp:
        model_dir = args.model_dir or Path(tmp) / "demo-small"
        if not (model_dir / "config.json").is_file():
            write_demo_model(model_dir, size="small", seed=0)
        engine, model = build_engine(model_dir, w), build_hf_model(model_dir)
        print(machine_line(args.threads, model))
        rng = random.Random(PROMPT_SEED)
        batch1, identical = bench_batch1(engine, model, w, random_prompts(1, w.decode_prompt_len, rng)[0])
        results = batch1 + [
            bench_concurrent(engine, model, w, random_prompts(w.batch_size, w.batch_prompt_len, rng)),
            bench_prefill(engine, model, w, random_prompts(1, w.prefill_len, rng)[0]),
        ]
    print("\n| metric | pdserve | transformers | ratio | target | met? |")
    print("| --- | --- | --- | --- | --- | --- |")
    for result in results:
        print(result.row())
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
