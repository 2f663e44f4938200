"""Router overhead and relay throughput, tiny demo model on CPU (issue 5).

Real `pdserve` processes on loopback: a private Redis, one `prefill` worker and one
or more `decode` workers (one torch thread each), and a `pdserve router` with static
discovery over them. This process is the client. With two cores or more, the router
is pinned to core 0 and everything else (workers, Redis, this client) to core 1, so
the router's core is its own (other users of the machine aside: the load average and
their CPU share are printed with the figures).

1. Router overhead. TTFT, from the call to the first delta, of one request at a time:
   through the router's `Generate` against `disaggregated_generate` (Admit, Stream,
   Prefill) called on the same prefill and decode workers directly, over channels
   opened beforehand. Short prompts of fresh random ids (shorter than a KV block, so
   no prefix-cache hit), a few new tokens, each request run to its end before the
   next. The two sides alternate (a b b a ...) after untimed warm-ups, so drift lands
   on both. The overhead is the difference of the medians (and of the p90s). For
   context: the median of the paired differences, the router's own TTFT (its
   `timings.ttft_ms`: handler entered -> Prefill returned), its CPU per request, and
   a unary round trip to it (ModelInfo: the extra hop alone).
2. Relay throughput. A second router over the prefill worker and every decode
   worker; many concurrent streams of long greedy generations (ignore_eos). The
   router's CPU time (utime + stime of its process, every thread, from /proc) over the
   timed window gives the tokens it relays per CPU-second: "per core", since its
   Python runs on one thread. Also: wall tokens/s, the router's CPU use (saturated or
   not) and every other process's CPU per token for context.

    .venv/bin/python bench/router_bench.py [--quick] [--model-dir DIR] [--profile PATH]
        [--stream-interval TOKENS]

`--stream-interval N` starts the routers with it: decode workers then send N tokens
per message (the first and last at once), and the router relays N at a time.
`--profile PATH` runs only the relay part with the router under cProfile (written to
PATH when it exits) and prints its top functions. Profiling slows the router; read it
for where the time goes, not for the throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pstats
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import grpc
import redis
from machine import cpu_model, machine_busy_seconds, others_line, process_cpu_seconds

from pdserve.api.v1 import (
    common_pb2,
    decode_pb2_grpc,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)
from pdserve.cluster.processes import ChildProcess, spawn, wait_ready
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.demo_model import write_demo_model
from pdserve.rpc.wire import sampling_params_to_proto
from pdserve.state.redis_server import PrivateRedis
from pdserve.worker.handoff import disaggregated_generate

# Prompt ids from the tiny demo tokenizer's range, past <unk>, <s>, </s>.
FIRST_PROMPT_ID, PROMPT_ID_LIMIT = 3, 1000
PROMPT_LEN = 8  # under one KV block (16): no prefix-cache hit, nothing cached to reuse
PROMPT_SEED = 0
NUM_KV_BLOCKS = 4096  # per worker: 64 streams of 8 + 256 tokens need 17 blocks each
MAX_NUM_SEQS = 128  # per decode worker: every stream joins one batch
ROUTER_CORE, OTHERS_CORE = 0, 1
OVERHEAD_TARGET_MS = 2.0
RELAY_TARGET_TOKENS_PER_CPU_S = 20_000
SATURATED_SHARE = 0.9  # of the router's CPU allowance (a core, or its quota): saturated
NOISY_SHARE = 0.05  # others' share of the machine above which the figures are noise
STOP_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class Workload:
    overhead_pairs: int  # timed requests per side
    overhead_new_tokens: int
    warmups: int  # untimed requests per side (and relay streams) first
    relay_decode_workers: int
    relay_streams: int  # concurrent client streams
    relay_new_tokens: int  # per stream
    relay_requests: int  # timed requests in all


FULL = Workload(
    overhead_pairs=80,
    overhead_new_tokens=4,
    warmups=8,
    relay_decode_workers=2,
    relay_streams=64,
    relay_new_tokens=256,
    relay_requests=384,
)
QUICK = Workload(
    overhead_pairs=8,
    overhead_new_tokens=4,
    warmups=2,
    relay_decode_workers=1,
    relay_streams=8,
    relay_new_tokens=64,
    relay_requests=16,
)


@dataclass(frozen=True, slots=True)
class Result:
    metric: str
    value: str
    target: str = "-"
    met: bool | None = None  # None: context, no target

    def row(self) -> str:
        met = "-" if self.met is None else ("yes" if self.met else "NO")
        return f"| {self.metric} | {self.value} | {self.target} | {met} |"


def random_prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(FIRST_PROMPT_ID, PROMPT_ID_LIMIT) for _ in range(PROMPT_LEN)]


def greedy(max_tokens: int) -> common_pb2.SamplingParams:
    return sampling_params_to_proto(
        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    )


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


# -- CPU accounting (Linux /proc) ------------------------------------------------------------


class CpuWindow:
    """CPU-seconds of named processes, and of everything else, between start and stop."""

    def __init__(self, pids: dict[str, int]):
        self.pids = pids

    def __enter__(self) -> CpuWindow:
        self._begin = self._sample()
        return self

    def __exit__(self, *exc_info) -> None:
        end = self._sample()
        self.wall_s = end["wall"] - self._begin["wall"]
        self.cpu_s = {name: end[name] - self._begin[name] for name in end if name != "wall"}
        self.cpu_s["others"] = max(
            0.0, self.cpu_s.pop("machine") - sum(self.cpu_s[name] for name in self.pids)
        )

    def _sample(self) -> dict[str, float]:
        sample = {name: process_cpu_seconds(pid) for name, pid in self.pids.items()}
        sample["machine"] = machine_busy_seconds()
        sample["wall"] = time.perf_counter()
        return sample

    def others_line(self) -> str:
        return others_line(self.cpu_s["others"], self.wall_s, NOISY_SHARE)


def pin(pid: int, core: int) -> None:
    """Pin every thread of the process (threads it starts later inherit the mask)."""
    if (os.cpu_count() or 1) < 2:
        return
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except ProcessLookupError:  # the thread ended meanwhile
            pass


@contextmanager
def cpu_quota(pid: int, share: float) -> Iterator[None]:
    """Cap the process at `share` of one core (a cgroup CPU quota), so that it is the
    bottleneck: its figures are then those of a saturated process.

    Needs a writable cgroup CPU controller (v1 `cpu` or v2); raises if there is none.
    """
    period_us = 100_000
    quota_us = max(1000, round(share * period_us))
    v1 = Path("/sys/fs/cgroup/cpu")
    group = (v1 if v1.is_dir() else Path("/sys/fs/cgroup")) / f"pdserve-bench-{pid}"
    group.mkdir()
    try:
        if v1.is_dir():
            (group / "cpu.cfs_period_us").write_text(str(period_us))
            (group / "cpu.cfs_quota_us").write_text(str(quota_us))
        else:
            (group / "cpu.max").write_text(f"{quota_us} {period_us}")
        (group / "cgroup.procs").write_text(str(pid))  # every thread of the process
        yield
    finally:
        parent = group.parent / "cgroup.procs"
        for member in (group / "cgroup.procs").read_text().split():
            try:
                parent.write_text(member)
            except OSError:  # it exited meanwhile
                pass
        group.rmdir()


# -- processes --------------------------------------------------------------------------------


@contextmanager
def started(child: ChildProcess, core: int) -> Iterator[ChildProcess]:
    """Wait for the child's ready line, pin it, and stop it (SIGTERM) at the end."""
    try:
        wait_ready(child)
        pin(child.proc.pid, core)
        yield child
    finally:
        child.stop(timeout_s=STOP_TIMEOUT_S)


def spawn_worker(role: str, model_dir: Path, log_dir: Path, index: int) -> ChildProcess:
    return spawn(
        f"{role}-{index}",
        [
            "serve",
            role,
            "--model",
            str(model_dir),
            "--port",
            "0",
            "--threads",
            "1",
            "--num-kv-blocks",
            str(NUM_KV_BLOCKS),
            "--max-num-seqs",
            str(MAX_NUM_SEQS),
        ],
        str(log_dir),
    )


def spawn_router(
    name: str,
    model_dir: Path,
    redis_url: str,
    prefill: list[str],
    decode: list[str],
    log_dir: Path,
    profile: Path | None = None,
    stream_interval: int = 1,
):
    args = [
        "router",
        "--model",
        str(model_dir),
        "--redis-url",
        redis_url,
        "--port",
        "0",
        "--discovery",
        "static",
        "--prefill",
        ",".join(prefill),
        "--decode",
        ",".join(decode),
        "--max-inflight",
        "1024",
        "--stream-interval",
        str(stream_interval),
    ]
    if profile is None:
        return spawn(name, args, str(log_dir))
    # spawn() runs `python -m pdserve`; the profiled router runs under `-m cProfile`.
    log_path = log_dir / f"{name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cProfile", "-o", str(profile), "-m", "pdserve", *args],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    return ChildProcess(name, proc, str(log_path))


@contextmanager
def cluster(model_dir: Path, num_decode_workers: int, log_dir: Path):
    """Yield (model dir, Redis, its pid, prefill worker, decode workers), all pinned."""
    if not (model_dir / "config.json").is_file():
        write_demo_model(model_dir, size="tiny", seed=0)
    with ExitStack() as stack:
        redis_server = PrivateRedis().start()
        stack.callback(redis_server.stop)
        redis_pid = redis.Redis.from_url(redis_server.url).info("server")["process_id"]
        pin(redis_pid, OTHERS_CORE)
        # Start every worker at once (each loads its model), then wait for each.
        children = [spawn_worker("prefill", model_dir, log_dir, 0)] + [
            spawn_worker("decode", model_dir, log_dir, i) for i in range(num_decode_workers)
        ]
        for child in children:
            stack.callback(child.stop, STOP_TIMEOUT_S)
        for child in children:
            wait_ready(child)
            pin(child.proc.pid, OTHERS_CORE)
        yield model_dir, redis_server, redis_pid, children[0], children[1:]


# -- 1. router overhead ---------------------------------------------------------------------


async def router_ttft(
    router: router_pb2_grpc.RouterStub, prompt: list[int], sampling, inside: list[float]
) -> float:
    """The client's TTFT; appends the router's own (its `timings.ttft_ms`) to `inside`."""
    request = router_pb2.GenerateRequest(
        token_ids=router_pb2.TokenIds(ids=prompt), sampling=sampling, stream=True
    )
    start = time.perf_counter()
    first_at, last = None, None
    async for last in router.Generate(request):  # noqa: B007 (the last one is used below)
        first_at = first_at or time.perf_counter()
    inside.append(last.timings.ttft_ms / 1e3)  # the final message carries the timings
    return first_at - start


async def unary_round_trip(router: router_pb2_grpc.RouterStub) -> float:
    """One ModelInfo call: a client -> router -> client hop and no other work."""
    start = time.perf_counter()
    await router.ModelInfo(router_pb2.ModelInfoRequest())
    return time.perf_counter() - start


async def direct_ttft(prefill, decode, decode_address: str, prompt: list[int], sampling) -> float:
    start = time.perf_counter()
    first_at = None
    async for _ in disaggregated_generate(prefill, decode, decode_address, prompt, sampling):
        first_at = first_at or time.perf_counter()
    return first_at - start


Timed = Callable[[], Awaitable[float]]


async def alternate(repeats: int, warmups: int, a: Timed, b: Timed):
    """`repeats` timed runs of each side in the order a b b a a b ..., after warm-ups."""
    for _ in range(warmups):
        await a()
        await b()
    a_runs: list[float] = []
    b_runs: list[float] = []
    for i in range(repeats):
        pair = [(a, a_runs), (b, b_runs)]
        for run, runs in pair if i % 2 == 0 else reversed(pair):
            runs.append(await run())
    return a_runs, b_runs


async def bench_overhead(
    router_address: str,
    router_pid: int,
    prefill_address: str,
    decode_address: str,
    w: Workload,
    rng: random.Random,
) -> list[Result]:
    sampling = greedy(w.overhead_new_tokens)
    async with (
        grpc.aio.insecure_channel(router_address) as router_channel,
        grpc.aio.insecure_channel(prefill_address) as prefill_channel,
        grpc.aio.insecure_channel(decode_address) as decode_channel,
    ):
        router = router_pb2_grpc.RouterStub(router_channel)
        prefill = prefill_pb2_grpc.PrefillStub(prefill_channel)
        decode = decode_pb2_grpc.DecodeStub(decode_channel)
        inside: list[float] = []  # warm-ups included: only its median is reported
        with CpuWindow({"router": router_pid}) as window:
            via_router, direct = await alternate(
                w.overhead_pairs,
                w.warmups,
                lambda: router_ttft(router, random_prompt(rng), sampling, inside),
                lambda: direct_ttft(prefill, decode, decode_address, random_prompt(rng), sampling),
            )
        router_cpu_ms = window.cpu_s["router"] / (w.warmups + w.overhead_pairs) * 1e3
        round_trips = [await unary_round_trip(router) for _ in range(w.overhead_pairs)]
    print("TTFT via router ms: " + ", ".join(f"{s * 1e3:.1f}" for s in via_router))
    print("TTFT direct ms:     " + ", ".join(f"{s * 1e3:.1f}" for s in direct))
    router_p50, direct_p50 = (statistics.median(s) * 1e3 for s in (via_router, direct))
    router_p90, direct_p90 = (p90(s) * 1e3 for s in (via_router, direct))
    overhead = router_p50 - direct_p50
    # The i-th runs of the two sides ran next to each other: their differences see the
    # same state of the machine.
    paired = statistics.median(r - d for r, d in zip(via_router, direct, strict=True)) * 1e3
    inside_p50 = statistics.median(inside[-len(via_router) :]) * 1e3
    n = w.overhead_pairs
    return [
        Result(
            f"router overhead on TTFT, p50 ({n} sequential requests per side, "
            f"{PROMPT_LEN}-token prompts)",
            f"{overhead:.2f} ms",
            f"< {OVERHEAD_TARGET_MS:g} ms",
            overhead < OVERHEAD_TARGET_MS,
        ),
        Result(
            "TTFT p50: via router / direct to the workers",
            f"{router_p50:.2f} / {direct_p50:.2f} ms",
        ),
        Result("router overhead on TTFT, median of paired differences", f"{paired:.2f} ms"),
        Result(
            "router overhead on TTFT, p90 (TTFT p90 via router / direct)",
            f"{router_p90 - direct_p90:.2f} ms ({router_p90:.2f} / {direct_p90:.2f} ms)",
        ),
        Result(
            "TTFT p50 inside the router (Generate called -> Prefill returned; its "
            "`timings.ttft_ms`)",
            f"{inside_p50:.2f} ms",
        ),
        Result(
            f"router CPU per request ({PROMPT_LEN}-token prompt, "
            f"{w.overhead_new_tokens} tokens; all of its threads)",
            f"{router_cpu_ms:.2f} ms",
        ),
        Result(
            "unary round trip client -> router -> client (ModelInfo), p50",
            f"{statistics.median(round_trips) * 1e3:.2f} ms",
        ),
    ]


# -- 2. relay throughput --------------------------------------------------------------------


async def relay_streams(
    router: router_pb2_grpc.RouterStub,
    num_streams: int,
    num_requests: int,
    sampling,
    rng: random.Random,
) -> tuple[int, int]:
    """Run num_requests streaming requests, num_streams at a time; (tokens, messages) received."""
    remaining = num_requests
    received = num_messages = 0

    async def client() -> None:
        nonlocal remaining, received, num_messages
        while remaining > 0:
            remaining -= 1
            request = router_pb2.GenerateRequest(
                token_ids=router_pb2.TokenIds(ids=random_prompt(rng)),
                sampling=sampling,
                stream=True,
            )
            async for message in router.Generate(request):
                received += len(message.token_ids)
                num_messages += 1

    await asyncio.gather(*(client() for _ in range(num_streams)))
    return received, num_messages


async def bench_relay(
    router_address: str,
    pids: dict[str, int],
    w: Workload,
    rng: random.Random,
    cpu_allowance: float = 1.0,
) -> tuple[list[Result], CpuWindow]:
    sampling = greedy(w.relay_new_tokens)
    async with grpc.aio.insecure_channel(router_address) as channel:
        router = router_pb2_grpc.RouterStub(channel)
        await relay_streams(router, w.relay_streams, w.relay_streams, sampling, rng)  # warm-up
        with CpuWindow(pids) as window:
            tokens, num_messages = await relay_streams(
                router, w.relay_streams, w.relay_requests, sampling, rng
            )
    expected = w.relay_requests * w.relay_new_tokens
    if tokens != expected:
        raise RuntimeError(f"relayed {tokens} tokens, expected {expected}")
    router_cpu = window.cpu_s["router"]
    per_cpu_s = tokens / router_cpu
    share = router_cpu / window.wall_s
    saturated = "saturated" if share >= SATURATED_SHARE * cpu_allowance else "not saturated"
    allowance = "one core" if cpu_allowance == 1.0 else f"one core, capped at {cpu_allowance:.0%}"
    breakdown = ", ".join(f"{name} {cpu / tokens * 1e6:.0f}" for name, cpu in window.cpu_s.items())
    return [
        Result(
            f"relay: tokens per router CPU-second ({w.relay_streams} concurrent streams of "
            f"{w.relay_new_tokens} tokens, {w.relay_decode_workers} decode workers)",
            f"{per_cpu_s:,.0f} tokens/s",
            f">= {RELAY_TARGET_TOKENS_PER_CPU_S:,}",
            per_cpu_s >= RELAY_TARGET_TOKENS_PER_CPU_S,
        ),
        Result("relay: router CPU per token", f"{router_cpu / tokens * 1e6:.1f} µs"),
        Result(
            "relay: wall tokens/s (whole cluster on 2 cores)",
            f"{tokens / window.wall_s:,.0f} tokens/s ({tokens:,} tokens in {window.wall_s:.1f} s)",
        ),
        Result("relay: router core use", f"{share:.0%} of one core ({allowance}: {saturated})"),
        # several per message when the router or its client falls behind (coalesced)
        Result("relay: tokens per message to the client", f"{tokens / num_messages:.2f}"),
        Result("relay: CPU µs per token, by process", breakdown),
    ], window


# -- the run --------------------------------------------------------------------------------


def machine_line() -> str:
    pinned = "no pinning (one core)"
    if (os.cpu_count() or 1) >= 2:
        pinned = f"router pinned to core {ROUTER_CORE}, the rest to core {OTHERS_CORE}"
    return (
        f"{os.cpu_count()} cores, {cpu_model()}; Python {sys.version.split()[0]}, "
        f"grpcio {grpc.__version__}; {pinned}"
    )


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


def print_profile(path: Path, tokens: int) -> None:
    stats = pstats.Stats(str(path))
    print(f"\nrouter profile ({path}), {tokens:,} tokens relayed; per token = tottime / tokens")
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small smoke version")
    parser.add_argument(
        "--model-dir",
        type=Path,
        help="reuse or create the tiny demo model here (default: a temp dir)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="PATH",
        help="only the relay part, its router under cProfile writing PATH",
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        metavar="TOKENS",
        help="the routers' --stream-interval: tokens per decode-worker message (default 1)",
    )
    parser.add_argument(
        "--router-cpu-share",
        type=float,
        metavar="FRACTION",
        help="cap the relay part's router at this share of one core (a cgroup CPU quota), "
        "so that it, not the workers, is the bottleneck",
    )
    args = parser.parse_args(argv)
    w = QUICK if args.quick else FULL
    rng = random.Random(PROMPT_SEED)
    began = time.perf_counter()
    pin(os.getpid(), OTHERS_CORE)
    print(machine_line())
    print(f"routers run with --stream-interval {args.stream_interval}")
    print(f"load average at start: {loadavg()}")
    with (
        tempfile.TemporaryDirectory(prefix="pdserve-router-bench-") as tmp,
        cluster(args.model_dir or Path(tmp) / "demo-tiny", w.relay_decode_workers, Path(tmp)) as (
            model_dir,
            redis_server,
            redis_pid,
            prefill,
            decodes,
        ),
    ):

        def router(name: str, decode_addresses: list[str], profile: Path | None = None):
            child = spawn_router(
                name,
                model_dir,
                redis_server.url,
                [prefill.address],
                decode_addresses,
                Path(tmp),
                profile,
                args.stream_interval,
            )
            return started(child, ROUTER_CORE)

        results: list[Result] = []
        if args.profile is None:
            with router("router-overhead", [decodes[0].address]) as r:
                pids = {
                    "router": r.proc.pid,
                    "prefill": prefill.proc.pid,
                    "redis": redis_pid,
                    "client": os.getpid(),
                    "decode-0": decodes[0].proc.pid,
                }
                with CpuWindow(pids) as window:
                    results += asyncio.run(
                        bench_overhead(
                            r.address, r.proc.pid, prefill.address, decodes[0].address, w, rng
                        )
                    )
            print(f"overhead part: {window.others_line()}")
        print(f"load average after the overhead part: {loadavg()}")
        share = args.router_cpu_share
        with (
            router("router-relay", [d.address for d in decodes], args.profile) as r,
            cpu_quota(r.proc.pid, share) if share else nullcontext(),
        ):
            pids = {
                "router": r.proc.pid,
                "prefill": prefill.proc.pid,
                "redis": redis_pid,
                "client": os.getpid(),
            }
            pids.update({f"decode-{i}": d.proc.pid for i, d in enumerate(decodes)})
            relay, window = asyncio.run(bench_relay(r.address, pids, w, rng, share or 1.0))
            results += relay
        print(f"relay part: {window.others_line()}")
        print(f"load average at the end: {loadavg()}")
    print(f"whole run: {time.perf_counter() - began:.0f} s")
    print("\n| metric | value | target | met? |")
    print("| --- | --- | --- | --- |")
    for result in results:
        print(result.row())
    if args.profile is not None:
        # the warm-up streams ran on the profiled router too
        print_profile(args.profile, (w.relay_streams + w.relay_requests) * w.relay_new_tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
