"""Disaggregated prefill -> decode on CPU, small demo model, float32 (issue 4).

Two measurements, in one run, against real `pdserve serve` worker processes on loopback
(a `LocalCluster` without its router). Every torch side runs one thread, so each compute
has the same one core.

1. Exposed KV transfer, 2,048-token prompt. This process is the prefill side: an
   LLMEngine and a KVPusher (the prefill worker's defaults for streams and message size)
   to a real `decode` worker, into a lease from its Admit. Two ways, alternated:
   - layer-wise overlap: `step()` with an `on_layer_done` that exports each finished
     layer (`LLMEngine.export_layer`) into a queue a pushing thread drains, as the
     prefill worker does;
   - without overlap: `step()`, then export every layer and push.
   Compute ends when `step()` returns (first token sampled); the push is done when
   `KVPusher.push` returns, i.e. the decode worker has verified and imported every chunk.
   The exposed transfer is the time between the two (0 when the push ends first). For
   context: the time from the last layer's KV being in the cache to the push's end, and
   the CPU time of the engine thread during `step()` (work, as against waiting for the
   GIL or a core). Each run then commits the lease (which succeeds only if every layer's
   blocks arrived), releases it and waits until the decode worker is idle.
2. TTFT, 512-token prompt: the router's hand-off client (`router.handoff.HandOff`)
   through a `prefill` and a `decode` worker (Admit, Prefill, first delta) against
   `Generate` on a colocated `both` worker, from the client's call to its first delta,
   over connections opened beforehand.
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
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from pdserve.api.v1 import decode_pb2, decode_pb2_grpc, kv_transfer_pb2, kv_transfer_pb2_grpc
from pdserve.bench.component import (
    Ratio,
    alternate,
    greedy,
    handoff_ttft,
    p90,
    print_table,
    random_prompt,
    timed_stream,
)
from pdserve.bench.machine import CpuWindow, describe
from pdserve.cluster.load import is_idle, wait_idle
from pdserve.cluster.local import ClusterShape, LocalCluster
from pdserve.cluster.processes import ChildProcess
from pdserve.engine.config import EngineConfig
from pdserve.engine.demo_model import write_demo_model
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kv.transfer import KVPusher, PushTotals, keep_freed_memory
from pdserve.router.handoff import ChannelPool, HandOff
from pdserve.rpc.wire import sampling_params_to_proto
from pdserve.worker.config import WorkerConfig

THREADS = 1  # torch threads of every engine, here and in the workers
BLOCK_SIZE = 16
PROMPT_ID_LIMIT = 3000  # the demo tokenizer's own range
PROMPT_SEED = 0
# Enough blocks for one 2,048-token prompt plus its few new tokens, with room to spare.
NUM_KV_BLOCKS = 160
# Two tokens: the request outlives the prefill step, so its KV can still be exported
# after `step()` returns (the no-overlap baseline), and a hand-off has something to decode.
HANDOFF_TOKENS = 2
TTFT_NEW_TOKENS = 4
IDLE_TIMEOUT_S = 10.0
NOISY_SHARE = 0.05  # others' share of the machine above which the figures are noise
EXPOSED_TARGET = 0.25  # exposed transfer, overlapped / not: a ceiling
TTFT_TARGET = 1.15  # TTFT, disaggregated / colocated: a ceiling


@dataclass(frozen=True, slots=True)
class Workload:
    transfer_prompt_len: int
    ttft_prompt_len: int
    transfer_repeats: int  # timed runs per side; medians reported
    ttft_repeats: int
    warmups: int  # untimed runs per side first


FULL = Workload(2048, 512, transfer_repeats=7, ttft_repeats=15, warmups=2)
QUICK = Workload(256, 64, transfer_repeats=2, ttft_repeats=3, warmups=1)


def ms_ratio(metric: str, value_s: float, baseline_s: float, target: float | None = None):
    """A row of the table: `value_s` against `baseline_s`, in ms; `target` is a ceiling."""
    return Ratio(metric, value_s * 1e3, baseline_s * 1e3, "ms", target, higher_is_better=False)


# -- worker processes -----------------------------------------------------------------------


def workers(model_dir: Path, log_dir: Path) -> LocalCluster:
    """A prefill, a decode and a colocated worker, on CPU; no router, no Redis."""
    return LocalCluster(
        str(model_dir),
        ClusterShape(prefill=1, decode=1, colocated=1),
        log_dir,
        threads=THREADS,
        worker_args=["--device", "cpu", "--num-kv-blocks", str(NUM_KV_BLOCKS)],
        with_router=False,
    )


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
        # the worker's defaults for KV streams and message size
        config = WorkerConfig("prefill", EngineConfig(str(model_dir), device="cpu"))
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
        self.decode_address = decode_address
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
            chunks.put(self._export(layer, plan, request_id))
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
        plans = []  # the step's plan, to export its layers by once it is over
        start, cpu_start = time.perf_counter(), time.thread_time()
        first = self._first_token(self.engine.step(lambda layer, plan: plans.append(plan)))
        compute_end, cpu_s = time.perf_counter(), time.thread_time() - cpu_start
        chunks = (self._export(layer, plans[0], request_id) for layer in range(self.num_layers))
        pushed_at, totals = self._timed_push(lease_id, chunks)
        self._end(lease_id, request_id, first)
        # Nothing leaves before step() returns: the push starts from its end.
        return TransferRun(start, compute_end, compute_end, pushed_at, cpu_s, totals)

    def _export(self, layer: int, plan, request_id: str):
        """(first block, chunk) of the request's whole prompt in `layer`, for the pusher."""
        [export] = self.engine.export_layer(layer, plan, {request_id: 0})
        return export.first_block, export.chunk

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
        load = wait_idle(self.decode_address, "decode", IDLE_TIMEOUT_S)
        if not is_idle(load):
            raise RuntimeError(f"decode worker not idle after {IDLE_TIMEOUT_S} s: {load}")


def print_transfer_runs(side: PrefillSide, n: int, overlapped, serial) -> None:
    totals = {run.totals for run in overlapped + serial}
    pusher = side.pusher
    print(
        f"KV per {n}-token prompt: {totals}; pushed over {pusher.num_streams} stream(s), "
        f"messages up to {pusher.max_message_bytes >> 20} MiB"
    )
    for name, runs in (("overlapped", overlapped), ("without overlap", serial)):
        times = ", ".join(
            f"({r.compute_s * 1e3:.0f}, {r.exposed_s * 1e3:.1f}, {r.after_last_layer_s * 1e3:.1f})"
            for r in runs
        )
        print(f"{name} runs, ms (compute, exposed, last layer -> pushed): {times}")


def bench_transfer(side: PrefillSide, w: Workload, rng: random.Random) -> list[Ratio]:
    n = w.transfer_prompt_len
    overlapped, serial = alternate(
        w.transfer_repeats,
        w.warmups,
        lambda: side.overlapped(random_prompt(n, rng, PROMPT_ID_LIMIT)),
        lambda: side.serial(random_prompt(n, rng, PROMPT_ID_LIMIT)),
    )
    print_transfer_runs(side, n, overlapped, serial)

    def row(metric: str, figure: Callable[[TransferRun], float], target=None) -> Ratio:
        value, baseline = (
            statistics.median(figure(r) for r in runs) for runs in (overlapped, serial)
        )
        return ms_ratio(metric, value, baseline, target)

    return [
        row(
            f"KV transfer exposed after prefill compute ends, {n}-token prompt "
            "(layer-wise overlap vs none)",
            lambda r: r.exposed_s,
            target=EXPOSED_TARGET,
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


async def colocated_ttft(both: decode_pb2_grpc.DecodeStub, prompt: list[int], sampling) -> float:
    request = decode_pb2.LocalGenerateRequest(prompt_token_ids=prompt, sampling=sampling)
    ttft, _ = await timed_stream(lambda: both.Generate(request))
    return ttft


def measure_ttft(prefill: str, decode: str, both: str, w: Workload, rng: random.Random):
    """TTFTs (seconds) disaggregated and colocated, alternated on one event loop: the
    channels stay open across runs. The i-th runs of both sides get the same fresh prompt;
    each worker sees it once."""
    sampling = sampling_params_to_proto(greedy(TTFT_NEW_TOKENS))
    prompts = [
        random_prompt(w.ttft_prompt_len, rng, PROMPT_ID_LIMIT)
        for _ in range(w.warmups + w.ttft_repeats)
    ]
    disaggregated_prompts, colocated_prompts = iter(prompts), iter(prompts)
    with asyncio.Runner() as runner:
        channels = ChannelPool()  # the router's hand-off client, its channels kept warm
        handoff = HandOff(channels)
        both_stub = decode_pb2_grpc.DecodeStub(channels.get(both))
        disaggregated, colocated = alternate(
            w.ttft_repeats,
            w.warmups,
            lambda: runner.run(
                handoff_ttft(handoff, prefill, decode, next(disaggregated_prompts), sampling)
            ),
            lambda: runner.run(colocated_ttft(both_stub, next(colocated_prompts), sampling)),
        )
        runner.run(handoff.close())
        runner.run(channels.close())
    return disaggregated, colocated


def bench_ttft(workers: dict[str, ChildProcess], w: Workload, rng: random.Random) -> list[Ratio]:
    n = w.ttft_prompt_len
    disaggregated, colocated = measure_ttft(
        workers["prefill"].address, workers["decode"].address, workers["both"].address, w, rng
    )
    print("TTFT disaggregated ms: " + ", ".join(f"{s * 1e3:.0f}" for s in disaggregated))
    print("TTFT colocated ms:     " + ", ".join(f"{s * 1e3:.0f}" for s in colocated))
    # Runs i of the two sides ran next to each other and saw the same state of the machine.
    paired = statistics.median(d / c for d, c in zip(disaggregated, colocated, strict=True))
    print(f"TTFT ratio, median of the paired ratios: {paired:.2f}x")
    return [
        ms_ratio(
            f"TTFT, {n}-token prompt, median (prefill + decode workers vs one `both` worker)",
            statistics.median(disaggregated),
            statistics.median(colocated),
            target=TTFT_TARGET,
        ),
        ms_ratio(f"TTFT, {n}-token prompt, p90", p90(disaggregated), p90(colocated)),
        ms_ratio(
            f"TTFT, {n}-token prompt, best of {w.ttft_repeats}", min(disaggregated), min(colocated)
        ),
    ]


# -- the run --------------------------------------------------------------------------------


def machine_line() -> str:
    return describe(
        f"torch {torch.__version__}, grpcio {grpc.__version__}",
        f"{THREADS} torch thread per engine",
    )


def run_all(model_dir: Path, w: Workload, log_dir: Path) -> list[Ratio]:
    """Both measurements against one set of workers, and how quiet the machine was."""
    rng = random.Random(PROMPT_SEED)
    with workers(model_dir, log_dir) as cluster:
        by_role = {child.fields["role"]: child for child in cluster.children}
        print(machine_line())
        pids = {"bench": os.getpid()} | {role: c.proc.pid for role, c in by_role.items()}
        with CpuWindow(pids) as window:
            side = PrefillSide(model_dir, by_role["decode"].address)
            try:
                results = bench_transfer(side, w, rng)
            finally:
                side.close()
            results += bench_ttft(by_role, w, rng)
        print(window.others_line(NOISY_SHARE))
    return results


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
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pdserve-disagg-bench-") as tmp:
        model_dir = args.model_dir or Path(tmp) / "demo-small"
        if not (model_dir / "config.json").is_file():
            write_demo_model(model_dir, size="small", seed=0)
        results = run_all(model_dir, w, Path(tmp))
    print(f"whole run: {time.perf_counter() - began:.0f} s")
    print_table(("metric", "value", "baseline", "ratio", "target", "met?"), results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
