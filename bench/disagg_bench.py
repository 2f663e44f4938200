"""Disaggregated prefill -> decode on CPU, small demo model, float32 (issue 4).

Two measurements, in one run, against real `pdserve serve` worker processes on loopback.
Every torch side runs one thread, so each compute has the same one core.

1. Exposed KV transfer, 2,048-token prompt. This process is the prefill side: an
   LLMEngine and a KVPusher (the prefill worker's defaults for streams and message size)
   to a real `decode` worker, into a lease from its Admit. Two ways, alternated:
   - layer-wise overlap: `step()` with an `on_layer_done` that exports each finished
     layer (`export_kv`) into a queue a pushing thread drains, as the prefill worker does;
   - without overlap: `step()`, then export every layer and push.
   Compute ends when `step()` returns (first token sampled); the push is done when
   `KVPusher.push` returns, i.e. the decode worker has verified and imported every chunk.
   The exposed transfer is the time between the two (0 when the push ends first). For
   context: the time from the last layer's KV being in the cache to the push's end, and
   the CPU time of the engine thread during `step()` (work, as against waiting for the
   GIL or a core). Each run then commits the lease (which succeeds only if every layer's
   blocks arrived), releases it and waits until the decode worker is idle.
2. TTFT, 512-token prompt: `disaggregated_generate` through a `prefill` and a `decode`
   worker (Admit, Prefill, first delta) against `Generate` on a colocated `both` worker,
   from the client's call to its first delta, over connections opened beforehand.
   Each request then runs to its end (a few tokens) before the next starts.

Both sides of each measurement alternate (a, b, b, a, ...) after untimed warm-ups, so a
slow spell of the machine lands on both; prompts are fresh random ids for every run, so
no prefix cache hit skips work. Medians are reported; for TTFT also p90, the best run,
and the median of the paired ratios (runs i of both sides saw the same machine).

    .venv/bin/python bench/disagg_bench.py [--quick] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import queue
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
import torch
from machine import cpu_model, machine_busy_seconds, others_line, process_cpu_seconds

from pdserve.api.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    prefill_pb2_grpc,
)
from pdserve.cluster.processes import ChildProcess, spawn, wait_ready
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.demo_model import write_demo_model
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kv.transfer import KVPusher, PushTotals, keep_freed_memory
from pdserve.rpc.wire import sampling_params_to_proto
from pdserve.worker.handoff import disaggregated_generate
from pdserve.worker.worker import WorkerConfig

THREADS = 1  # torch threads of every engine, here and in the workers
BLOCK_SIZE = 16
# Prompt ids from the demo tokenizer's own range, past <unk>, <s>, </s>.
FIRST_PROMPT_ID, PROMPT_ID_LIMIT = 3, 3000
PROMPT_SEED = 0
# Enough blocks for one 2,048-token prompt plus its few new tokens, with room to spare.
NUM_KV_BLOCKS = 160
# Two tokens: the request outlives the prefill step, so its KV can still be exported
# after `step()` returns (the no-overlap baseline), and a hand-off has something to decode.
HANDOFF_TOKENS = 2
TTFT_NEW_TOKENS = 4
IDLE_TIMEOUT_S = 10.0
NOISY_SHARE = 0.05  # others' share of the machine above which the figures are noise

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Workload:
    transfer_prompt_len: int
    ttft_prompt_len: int
    transfer_repeats: int  # timed runs per side; medians reported
    ttft_repeats: int
    warmups: int  # untimed runs per side first


FULL = Workload(2048, 512, transfer_repeats=7, ttft_repeats=15, warmups=2)
QUICK = Workload(256, 64, transfer_repeats=2, ttft_repeats=3, warmups=1)


@dataclass(frozen=True, slots=True)
class Result:
    metric: str
    value: float
    baseline: float
    unit: str
    target: float | None  # a ceiling on value / baseline; None: context, no target

    @property
    def ratio(self) -> float:
        return self.value / self.baseline

    @property
    def met(self) -> bool:
        return self.target is None or self.ratio <= self.target

    def row(self) -> str:
        target, met = "-", "-"
        if self.target is not None:
            target, met = f"<= {self.target:g}x", "yes" if self.met else "NO"
        return (
            f"| {self.metric} | {self.value:.1f} {self.unit} | {self.baseline:.1f} {self.unit} "
            f"| {self.ratio:.2f}x | {target} | {met} |"
        )


def alternate(repeats: int, warmups: int, a: Callable[[], T], b: Callable[[], T]):
    """`repeats` timed runs of each side in the order a b b a a b ..., after warm-ups."""
    for _ in range(warmups):
        a(), b()
    a_runs, b_runs = [], []
    for i in range(repeats):
        pair = [(a, a_runs), (b, b_runs)]
        for run, runs in pair if i % 2 == 0 else reversed(pair):
            runs.append(run())
    return a_runs, b_runs


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


def random_prompt(length: int, rng: random.Random) -> list[int]:
    return [rng.randrange(FIRST_PROMPT_ID, PROMPT_ID_LIMIT) for _ in range(length)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


# -- worker processes -----------------------------------------------------------------------


@contextmanager
def worker_processes(roles: list[str], model_dir: Path, log_dir: Path):
    """Start `pdserve serve ROLE` for every role at once; yield them when all are ready."""
    with ExitStack() as stack:
        children = []
        for i, role in enumerate(roles):
            child = spawn(
                f"{role}-{i}",
                [
                    "serve",
                    role,
                    "--model",
                    str(model_dir),
                    "--port",
                    "0",
                    "--device",
                    "cpu",
                    "--threads",
                    str(THREADS),
                    "--num-kv-blocks",
                    str(NUM_KV_BLOCKS),
                ],
                str(log_dir),
            )
            stack.callback(child.stop)
            children.append(child)
        yield [wait_ready(child) for child in children]


def wait_idle(decode: decode_pb2_grpc.DecodeStub) -> None:
    """Until the decode worker runs nothing, holds no lease and has every block free."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while time.monotonic() < deadline:
        load = decode.GetLoad(decode_pb2.GetLoadRequest(), timeout=5)
        busy = load.running or load.waiting or load.open_leases
        if not busy and load.free_blocks == load.total_blocks:
            return
        time.sleep(0.01)
    raise RuntimeError(f"decode worker not idle after {IDLE_TIMEOUT_S} s: {load}")


# -- 1. exposed KV transfer -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TransferRun:
    """perf_counter() times of one prefill and its KV push."""

    start: float  # step() called
    last_layer_done: float  # the last layer's KV was in the cache (and, overlapped, queued)
    compute_end: float  # step() returned: the first token is sampled
    pushed: float  # KVPusher.push returned: the decode worker imported every chunk
    compute_cpu_s: float  # CPU time of this (the engine's) thread during step()
    totals: PushTotals

    @property
    def compute_s(self) -> float:
        return self.compute_end - self.start

    @property
    def exposed_s(self) -> float:
        # 0 when the push finished first: the final norm, logits and sampling after the
        # last layer take some ms, which can hide the last layer's push.
        return max(0.0, self.pushed - self.compute_end)

    @property
    def after_last_layer_s(self) -> float:
        return self.pushed - self.last_layer_done

    @property
    def kv_ready_s(self) -> float:
        return self.pushed - self.start


class PrefillSide:
    """This process as a prefill worker: an engine and a pusher into a decode worker."""

    def __init__(self, model_dir: Path, decode_address: str):
        config = WorkerConfig(role="prefill", model=str(model_dir))  # the worker's defaults
        self.engine = LLMEngine.from_pretrained(
            model_dir,
            device="cpu",
            dtype="float32",
            block_size=BLOCK_SIZE,
            num_kv_blocks=NUM_KV_BLOCKS,
            enable_prefix_caching=False,
        )
        self.num_layers = self.engine.model_config.num_layers
        self.pusher = KVPusher(
            decode_address,
            num_streams=config.kv_streams,
            max_message_bytes=config.max_message_bytes,
        )
        self.channel = grpc.insecure_channel(decode_address)
        self.decode = decode_pb2_grpc.DecodeStub(self.channel)
        self.kv = kv_transfer_pb2_grpc.KVTransferStub(self.channel)
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="push")

    def close(self) -> None:
        self.pool.shutdown()
        self.pusher.close()
        self.channel.close()

    def overlapped(self, prompt: list[int]) -> TransferRun:
        """Each layer is exported as soon as it is computed and pushed by another thread."""
        lease_id, request_id = self._begin(prompt)
        chunks: queue.SimpleQueue = queue.SimpleQueue()
        last_layer_done = 0.0

        def export_layer(layer: int, plan) -> None:
            nonlocal last_layer_done
            is_last = layer == self.num_layers - 1
            if is_last:
                last_layer_done = time.perf_counter()
            chunks.put((0, self.engine.export_kv(request_id, layer, len(prompt))))
            if is_last:
                chunks.put(None)  # the end, as the worker's EXPORT_DONE

        push = self.pool.submit(self._timed_push, lease_id, iter(chunks.get, None))
        start, cpu_start = time.perf_counter(), time.thread_time()
        first = self._first_token(self.engine.step(export_layer))
        compute_end, cpu_s = time.perf_counter(), time.thread_time() - cpu_start
        pushed_at, totals = push.result()
        self._end(lease_id, request_id, first)
        return TransferRun(start, last_layer_done, compute_end, pushed_at, cpu_s, totals)

    def serial(self, prompt: list[int]) -> TransferRun:
        """Compute the whole prompt, then export layer after layer and push."""
        lease_id, request_id = self._begin(prompt)
        start, cpu_start = time.perf_counter(), time.thread_time()
        first = self._first_token(self.engine.step())
        compute_end, cpu_s = time.perf_counter(), time.thread_time() - cpu_start
        chunks = (
            (0, self.engine.export_kv(request_id, layer, len(prompt)))
            for layer in range(self.num_layers)
        )
        pushed_at, totals = self._timed_push(lease_id, chunks)
        self._end(lease_id, request_id, first)
        # Nothing leaves before step() returns: the push starts from its end.
        return TransferRun(start, compute_end, compute_end, pushed_at, cpu_s, totals)

    def _begin(self, prompt: list[int]) -> tuple[str, str]:
        lease = self.decode.Admit(
            decode_pb2.AdmitRequest(
                prompt_token_ids=prompt,
                sampling=sampling_params_to_proto(greedy(HANDOFF_TOKENS)),
            ),
            timeout=10,
        )
        return lease.lease_id, self.engine.add_request(prompt, greedy(HANDOFF_TOKENS))

    def _timed_push(self, lease_id: str, chunks: Iterator) -> tuple[float, PushTotals]:
        totals = self.pusher.push(lease_id, chunks, timeout=60)
        return time.perf_counter(), totals

    @staticmethod
    def _first_token(deltas) -> int:
        (delta,) = deltas  # the prompt fits one step, so it yields its first token
        return delta.token_ids[0]

    def _end(self, lease_id: str, request_id: str, first_token: int) -> None:
        """Commit (it fails unless every layer arrived), give everything back, settle."""
        self.engine.abort(request_id)
        commit = kv_transfer_pb2.CommitKVRequest(lease_id=lease_id, first_token_id=first_token)
        self.kv.CommitKV(commit, timeout=10)
        self.decode.Release(decode_pb2.ReleaseRequest(lease_id=lease_id), timeout=10)
        wait_idle(self.decode)


def bench_transfer(side: PrefillSide, w: Workload, rng: random.Random) -> list[Result]:
    n = w.transfer_prompt_len
    overlapped, serial = alternate(
        w.transfer_repeats,
        w.warmups,
        lambda: side.overlapped(random_prompt(n, rng)),
        lambda: side.serial(random_prompt(n, rng)),
    )
    totals = {run.totals for run in overlapped + serial}
    pusher = side.pusher
    print(
        f"KV per {n}-token prompt: {totals}; pushed over {pusher.num_streams} stream(s), "
        f"messages up to {pusher.max_message_bytes >> 20} MiB"
    )
    for name, runs in (("overlapped", overlapped), ("without overlap", serial)):
        print(
            f"{name} runs, ms (compute, exposed, last layer -> pushed): "
            + ", ".join(
                f"({r.compute_s * 1e3:.0f}, {r.exposed_s * 1e3:.1f}, {r.after_last_layer_s * 1e3:.1f})"
                for r in runs
            )
        )

    def row(metric: str, figure: Callable[[TransferRun], float], target=None) -> Result:
        value, baseline = (
            statistics.median(figure(r) for r in runs) * 1e3 for runs in (overlapped, serial)
        )
        return Result(metric, value, baseline, unit="ms", target=target)

    return [
        row(
            f"KV transfer exposed after prefill compute ends, {n}-token prompt "
            "(layer-wise overlap vs none)",
            lambda r: r.exposed_s,
            target=0.25,
        ),
        row(
            "KV transfer after the last layer is computed (overlap vs none)",
            lambda r: r.after_last_layer_s,
        ),
        row(
            f"prefill compute, {n}-token prompt (exporting each layer during it vs not)",
            lambda r: r.compute_s,
        ),
        row(
            "prefill compute, CPU time of the engine thread (the same two)",
            lambda r: r.compute_cpu_s,
        ),
        row(
            "prefill start to prompt KV on the decode worker (overlap vs none)",
            lambda r: r.kv_ready_s,
        ),
    ]


# -- 2. TTFT --------------------------------------------------------------------------------


async def disaggregated_ttft(prefill, decode, decode_address: str, prompt: list[int]) -> float:
    sampling = sampling_params_to_proto(greedy(TTFT_NEW_TOKENS))
    start = time.perf_counter()
    first_at = None
    async for _ in disaggregated_generate(prefill, decode, decode_address, prompt, sampling):
        first_at = first_at or time.perf_counter()
    return first_at - start


async def colocated_ttft(both: decode_pb2_grpc.DecodeStub, prompt: list[int]) -> float:
    request = decode_pb2.LocalGenerateRequest(
        prompt_token_ids=prompt, sampling=sampling_params_to_proto(greedy(TTFT_NEW_TOKENS))
    )
    start = time.perf_counter()
    first_at = None
    async for _ in both.Generate(request):
        first_at = first_at or time.perf_counter()
    return first_at - start


def bench_ttft(
    prefill: ChildProcess,
    decode: ChildProcess,
    both: ChildProcess,
    w: Workload,
    rng: random.Random,
) -> list[Result]:
    n = w.ttft_prompt_len
    with asyncio.Runner() as runner:  # one loop: the channels stay open across runs
        channels = [grpc.aio.insecure_channel(p.address) for p in (prefill, decode, both)]
        prefill_stub = prefill_pb2_grpc.PrefillStub(channels[0])
        decode_stub = decode_pb2_grpc.DecodeStub(channels[1])
        both_stub = decode_pb2_grpc.DecodeStub(channels[2])
        # The i-th run of each side gets the same fresh prompt; each worker sees it once.
        prompts = [random_prompt(n, rng) for _ in range(w.warmups + w.ttft_repeats)]
        disaggregated_prompts, colocated_prompts = iter(prompts), iter(prompts)
        disaggregated, colocated = alternate(
            w.ttft_repeats,
            w.warmups,
            lambda: runner.run(
                disaggregated_ttft(
                    prefill_stub, decode_stub, decode.address, next(disaggregated_prompts)
                )
            ),
            lambda: runner.run(colocated_ttft(both_stub, next(colocated_prompts))),
        )
        for channel in channels:
            runner.run(channel.close())
    print("TTFT disaggregated ms: " + ", ".join(f"{s * 1e3:.0f}" for s in disaggregated))
    print("TTFT colocated ms:     " + ", ".join(f"{s * 1e3:.0f}" for s in colocated))
    # Runs i of the two sides ran next to each other and saw the same state of the machine.
    paired = statistics.median(d / c for d, c in zip(disaggregated, colocated, strict=True))
    print(f"TTFT ratio, median of the paired ratios: {paired:.2f}x")
    return [
        Result(
            f"TTFT, {n}-token prompt, median (prefill + decode workers vs one `both` worker)",
            statistics.median(disaggregated) * 1e3,
            statistics.median(colocated) * 1e3,
            unit="ms",
            target=1.15,
        ),
        Result(
            f"TTFT, {n}-token prompt, p90",
            p90(disaggregated) * 1e3,
            p90(colocated) * 1e3,
            unit="ms",
            target=None,
        ),
        Result(
            f"TTFT, {n}-token prompt, best of {w.ttft_repeats}",
            min(disaggregated) * 1e3,
            min(colocated) * 1e3,
            unit="ms",
            target=None,
        ),
    ]


# -- machine --------------------------------------------------------------------------------


class CpuWatch:
    """CPU time other processes took while we ran (this one and the workers excluded).

    From /proc (Linux only). On a 2-core machine one busy neighbour takes a whole core
    from the three computing threads here and makes every figure noise.
    """

    def __init__(self, pids: list[int]) -> None:
        self.pids = [os.getpid(), *pids]
        self.start = (self._others_seconds(), time.perf_counter())

    def report(self) -> str:
        others0, wall0 = self.start
        others1 = self._others_seconds()
        if others0 is None or others1 is None:
            return "CPU use of other processes: unknown (no /proc)"
        others = max(0.0, others1 - others0)
        return others_line(others, time.perf_counter() - wall0, NOISY_SHARE)

    def _others_seconds(self) -> float | None:
        busy = machine_busy_seconds()
        if busy is None:
            return None
        return busy - sum(process_cpu_seconds(pid) or 0.0 for pid in self.pids)


def machine_line() -> str:
    return (
        f"{os.cpu_count()} cores, {cpu_model()}; Python {sys.version.split()[0]}, "
        f"torch {torch.__version__}, grpcio {grpc.__version__}; {THREADS} torch thread per engine"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small smoke version")
    parser.add_argument(
        "--model-dir", type=Path, help="reuse or create the demo model here (default: a temp dir)"
    )
    args = parser.parse_args(argv)
    w = QUICK if args.quick else FULL
    torch.set_num_threads(THREADS)
    keep_freed_memory()  # as the workers do: KV messages are MBs each
    rng = random.Random(PROMPT_SEED)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pdserve-disagg-bench-") as tmp:
        model_dir = args.model_dir or Path(tmp) / "demo-small"
        if not (model_dir / "config.json").is_file():
            write_demo_model(model_dir, size="small", seed=0)
        roles = ["decode", "prefill", "both"]
        with worker_processes(roles, model_dir, Path(tmp)) as (decode, prefill, both):
            print(machine_line())
            watch = CpuWatch([p.proc.pid for p in (decode, prefill, both)])
            side = PrefillSide(model_dir, decode.address)
            try:
                results = bench_transfer(side, w, rng)
            finally:
                side.close()
            results += bench_ttft(prefill, decode, both, w, rng)
            print(watch.report())
    print(f"whole run: {time.perf_counter() - began:.0f} s")
    print("\n| metric | value | baseline | ratio | target | met? |")
    print("| --- | --- | --- | --- | --- | --- |")
    for result in results:
        print(result.row())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
