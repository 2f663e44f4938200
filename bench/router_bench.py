"""Router overhead and relay throughput, tiny demo model on CPU (issue 5).

Real `pdserve` processes on loopback: a private Redis, one `prefill` worker and one
or more `decode` workers (one torch thread each, a `LocalCluster` without its router),
and a `pdserve router` with static discovery over them. This process is the client.
With two cores or more, the router is pinned to core 0 and everything else (workers,
Redis, this client) to core 1, so the router's core is its own (other users of the
machine aside: the load average and their CPU share are printed with the figures).

1. Router overhead. TTFT, from the call to the first delta, of one request at a time:
   through the router's `Generate` against the router's own hand-off client
   (`router.handoff.HandOff`: Admit, Relay, Prefill) called on the same prefill and
   decode workers directly, over channels opened beforehand. Short prompts of fresh
   random ids (shorter than a KV block, so no prefix-cache hit), a few new tokens, each
   request run to its end before the next. The two sides alternate (a b b a ...) after
   untimed warm-ups, so drift lands on both. The overhead is the difference of the
   medians (and of the p90s). For context: the median of the paired differences, the
   router's own TTFT (its `timings.ttft_ms`: handler entered -> Prefill returned), its
   CPU per request, and a unary round trip to it (ModelInfo: the extra hop alone).
2. Relay throughput. A second router over the prefill worker and every decode
   worker; many concurrent streams of long greedy generations (ignore_eos). The
   router's CPU time (utime + stime of its process, every thread, from /proc) over the
   timed window gives the tokens it relays per CPU-second: "per core", since its
   Python runs on one thread. Also: wall tokens/s, the router's CPU use (saturated or
   not) and every other process's CPU per token for context.

    .venv/bin/python bench/router_bench.py [--quick] [--model-dir DIR] [--profile PATH]
        [--stream-interval TOKENS] [--router-cpu-share FRACTION]

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
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import grpc
import redis

from pdserve.api.v1 import router_pb2, router_pb2_grpc
from pdserve.bench.component import (
    Figure,
    alternate,
    greedy,
    handoff_ttft,
    p90,
    print_table,
    random_prompt,
    timed_stream,
)
from pdserve.bench.machine import CpuWindow, cpu_quota, describe, load_average, pin
from pdserve.cluster.local import ClusterShape, LocalCluster
from pdserve.cluster.processes import ChildProcess, router_args, spawn, wait_ready
from pdserve.engine.demo_model import write_demo_model
from pdserve.router.config import DiscoveryKind
from pdserve.router.disaggregation import PlacementMode
from pdserve.router.handoff import ChannelPool, HandOff
from pdserve.rpc.wire import sampling_params_to_proto
from pdserve.state.redis_server import PrivateRedis

PROMPT_ID_LIMIT = 1000  # the tiny demo tokenizer's range
PROMPT_LEN = 8  # under one KV block (16): no prefix-cache hit, nothing cached to reuse
PROMPT_SEED = 0
NUM_KV_BLOCKS = 4096  # per worker: 64 streams of 8 + 256 tokens need 17 blocks each
MAX_NUM_SEQS = 128  # per decode worker: every stream joins one batch
ROUTER_MAX_INFLIGHT = 1024
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


# the fields in their order above
FULL = Workload(80, 4, 8, 2, 64, 256, 384)
QUICK = Workload(8, 4, 2, 1, 8, 64, 16)


@dataclass(frozen=True, slots=True)
class Options:
    """What the command line sets, passed whole."""

    workload: Workload
    stream_interval: int  # the routers' --stream-interval
    profile: Path | None  # only the relay part, its router under cProfile writing here
    router_cpu_share: float | None  # the relay router's CPU quota, a share of one core


def prompt(rng: random.Random) -> list[int]:
    return random_prompt(PROMPT_LEN, rng, PROMPT_ID_LIMIT)


def greedy_proto(max_tokens: int):
    return sampling_params_to_proto(greedy(max_tokens))


# -- processes --------------------------------------------------------------------------------


@dataclass
class Processes:
    """Redis and the workers, all pinned to OTHERS_CORE; routers are started per part."""

    model_dir: Path
    log_dir: Path
    redis_url: str
    redis_pid: int
    prefill: ChildProcess
    decodes: list[ChildProcess]

    def start_router(self, name: str, decodes: list[ChildProcess], o: Options) -> ChildProcess:
        """A router with static discovery over the prefill worker and `decodes`, pinned to
        ROUTER_CORE; under cProfile for the relay part when profiling."""
        args = router_args(
            str(self.model_dir),
            self.redis_url,
            port=0,
            discovery=DiscoveryKind.STATIC,
            prefill=[self.prefill.address],
            decode=[d.address for d in decodes],
            max_inflight=ROUTER_MAX_INFLIGHT,
            stream_interval=o.stream_interval,
            # the disaggregated path is what is measured: every prompt crosses over
            prefill_placement=PlacementMode.REMOTE,
        )
        profiled = o.profile is not None and name == "router-relay"
        python_args = ["-m", "cProfile", "-o", str(o.profile)] if profiled else []
        router = spawn(name, args, str(self.log_dir), python_args=python_args)
        try:
            wait_ready(router)
            pin(router.proc.pid, ROUTER_CORE)
        except BaseException:
            router.stop(timeout_s=STOP_TIMEOUT_S)
            raise
        return router

    def pids(self, router: ChildProcess, decodes: list[ChildProcess]) -> dict[str, int]:
        """The processes whose CPU a part reports: the router, the workers, Redis, this client."""
        pids = {"router": router.proc.pid, "prefill": self.prefill.proc.pid}
        pids |= {"redis": self.redis_pid, "client": os.getpid()}
        return pids | {f"decode-{i}": d.proc.pid for i, d in enumerate(decodes)}


@contextmanager
def processes(model_dir: Path, num_decode_workers: int, log_dir: Path) -> Iterator[Processes]:
    """A private Redis (the routers' request store), one prefill and `num_decode_workers`
    decode workers (a `LocalCluster` without its router), all pinned to OTHERS_CORE."""
    if not (model_dir / "config.json").is_file():
        write_demo_model(model_dir, size="tiny", seed=0)
    cluster = LocalCluster(
        str(model_dir),
        ClusterShape(prefill=1, decode=num_decode_workers),
        log_dir,
        threads=1,
        worker_args=["--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-num-seqs", str(MAX_NUM_SEQS)],
        with_router=False,
    )
    redis_server = PrivateRedis().start()
    try:
        with cluster:
            redis_pid = redis.Redis.from_url(redis_server.url).info("server")["process_id"]
            for pid in [redis_pid, *(child.proc.pid for child in cluster.children)]:
                pin(pid, OTHERS_CORE)
            prefill, *decodes = cluster.children  # in the shape's order: prefill first
            yield Processes(model_dir, log_dir, redis_server.url, redis_pid, prefill, decodes)
    finally:
        redis_server.stop()


# -- 1. router overhead ---------------------------------------------------------------------


async def router_ttft(
    router: router_pb2_grpc.RouterStub, prompt_ids: list[int], sampling, inside: list[float]
) -> float:
    """The client's TTFT; appends the router's own (its `timings.ttft_ms`) to `inside`."""
    request = router_pb2.GenerateRequest(
        token_ids=router_pb2.TokenIds(ids=prompt_ids), sampling=sampling, stream=True
    )
    ttft, last = await timed_stream(lambda: router.Generate(request))
    inside.append(last.timings.ttft_ms / 1e3)  # the final message carries the timings
    return ttft


async def unary_round_trip(router: router_pb2_grpc.RouterStub) -> float:
    """One ModelInfo call: a client -> router -> client hop and no other work."""
    start = time.perf_counter()
    await router.ModelInfo(router_pb2.ModelInfoRequest())
    return time.perf_counter() - start


@dataclass(frozen=True, slots=True)
class OverheadRuns:
    """Seconds, per request: TTFT via the router and direct, the router's own TTFT."""

    via_router: list[float]
    direct: list[float]
    inside: list[float]  # warm-ups included: only the timed runs' median is reported
    round_trips: list[float]
    router_cpu_s: float  # while the TTFTs were measured, warm-ups included


def measure_overhead(router: ChildProcess, prefill: str, decode: str, w: Workload, rng):
    """Both sides alternated, on one event loop: channels stay open across the runs."""
    sampling = greedy_proto(w.overhead_new_tokens)
    inside: list[float] = []
    with asyncio.Runner() as runner:
        channel = grpc.aio.insecure_channel(router.address)
        stub = router_pb2_grpc.RouterStub(channel)
        channels = ChannelPool()  # the router's hand-off client, its channels kept warm
        handoff = HandOff(channels)
        with CpuWindow({"router": router.proc.pid}) as window:
            via_router, direct = alternate(
                w.overhead_pairs,
                w.warmups,
                lambda: runner.run(router_ttft(stub, prompt(rng), sampling, inside)),
                lambda: runner.run(handoff_ttft(handoff, prefill, decode, prompt(rng), sampling)),
            )
        round_trips = [runner.run(unary_round_trip(stub)) for _ in range(w.overhead_pairs)]
        for closing in (handoff.close(), channels.close(), channel.close()):
            runner.run(closing)
    return OverheadRuns(via_router, direct, inside, round_trips, window.cpu_s["router"])


def bench_overhead(router: ChildProcess, prefill: str, decode: str, w: Workload, rng):
    runs = measure_overhead(router, prefill, decode, w, rng)
    via_router, direct = runs.via_router, runs.direct
    print("TTFT via router ms: " + ", ".join(f"{s * 1e3:.1f}" for s in via_router))
    print("TTFT direct ms:     " + ", ".join(f"{s * 1e3:.1f}" for s in direct))
    router_p50, direct_p50 = (statistics.median(s) * 1e3 for s in (via_router, direct))
    router_p90, direct_p90 = (p90(s) * 1e3 for s in (via_router, direct))
    overhead = router_p50 - direct_p50
    # The i-th runs of the two sides ran next to each other: their differences see the
    # same state of the machine.
    paired = statistics.median(r - d for r, d in zip(via_router, direct, strict=True)) * 1e3
    inside_p50 = statistics.median(runs.inside[-len(via_router) :]) * 1e3
    router_cpu_ms = runs.router_cpu_s / (w.warmups + w.overhead_pairs) * 1e3
    n = w.overhead_pairs
    return [
        Figure(
            f"router overhead on TTFT, p50 ({n} sequential requests per side, "
            f"{PROMPT_LEN}-token prompts)",
            f"{overhead:.2f} ms",
            f"< {OVERHEAD_TARGET_MS:g} ms",
            overhead < OVERHEAD_TARGET_MS,
        ),
        Figure(
            "TTFT p50: via router / direct to the workers",
            f"{router_p50:.2f} / {direct_p50:.2f} ms",
        ),
        Figure("router overhead on TTFT, median of paired differences", f"{paired:.2f} ms"),
        Figure(
            "router overhead on TTFT, p90 (TTFT p90 via router / direct)",
            f"{router_p90 - direct_p90:.2f} ms ({router_p90:.2f} / {direct_p90:.2f} ms)",
        ),
        Figure(
            "TTFT p50 inside the router (Generate called -> Prefill returned; its "
            "`timings.ttft_ms`)",
            f"{inside_p50:.2f} ms",
        ),
        Figure(
            f"router CPU per request ({PROMPT_LEN}-token prompt, "
            f"{w.overhead_new_tokens} tokens; all of its threads)",
            f"{router_cpu_ms:.2f} ms",
        ),
        Figure(
            "unary round trip client -> router -> client (ModelInfo), p50",
            f"{statistics.median(runs.round_trips) * 1e3:.2f} ms",
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
                token_ids=router_pb2.TokenIds(ids=prompt(rng)), sampling=sampling, stream=True
            )
            async for message in router.Generate(request):
                received += len(message.token_ids)
                num_messages += 1

    await asyncio.gather(*(client() for _ in range(num_streams)))
    return received, num_messages


async def measure_relay(address: str, pids: dict[str, int], w: Workload, rng: random.Random):
    """(tokens, messages) of the timed streams, and the CPU window they ran in."""
    sampling = greedy_proto(w.relay_new_tokens)
    async with grpc.aio.insecure_channel(address) as channel:
        router = router_pb2_grpc.RouterStub(channel)
        await relay_streams(router, w.relay_streams, w.relay_streams, sampling, rng)  # warm-up
        with CpuWindow(pids) as window:
            tokens, num_messages = await relay_streams(
                router, w.relay_streams, w.relay_requests, sampling, rng
            )
    expected = w.relay_requests * w.relay_new_tokens
    if tokens != expected:
        raise RuntimeError(f"relayed {tokens} tokens, expected {expected}")
    return tokens, num_messages, window


def bench_relay(
    address: str, pids: dict[str, int], w: Workload, rng: random.Random, cpu_allowance: float
) -> tuple[list[Figure], CpuWindow]:
    tokens, num_messages, window = asyncio.run(measure_relay(address, pids, w, rng))
    router_cpu = window.cpu_s["router"]
    per_cpu_s = tokens / router_cpu
    share = router_cpu / window.wall_s
    saturated = "saturated" if share >= SATURATED_SHARE * cpu_allowance else "not saturated"
    allowance = "one core" if cpu_allowance == 1.0 else f"one core, capped at {cpu_allowance:.0%}"
    cpu_by_process = {**window.cpu_s, "others": window.others_s or 0.0}
    breakdown = ", ".join(
        f"{name} {cpu / tokens * 1e6:.0f}" for name, cpu in cpu_by_process.items()
    )
    return [
        Figure(
            f"relay: tokens per router CPU-second ({w.relay_streams} concurrent streams of "
            f"{w.relay_new_tokens} tokens, {w.relay_decode_workers} decode workers)",
            f"{per_cpu_s:,.0f} tokens/s",
            f">= {RELAY_TARGET_TOKENS_PER_CPU_S:,}",
            per_cpu_s >= RELAY_TARGET_TOKENS_PER_CPU_S,
        ),
        Figure("relay: router CPU per token", f"{router_cpu / tokens * 1e6:.1f} µs"),
        Figure(
            "relay: wall tokens/s (whole cluster on 2 cores)",
            f"{tokens / window.wall_s:,.0f} tokens/s ({tokens:,} tokens in {window.wall_s:.1f} s)",
        ),
        Figure("relay: router core use", f"{share:.0%} of one core ({allowance}: {saturated})"),
        # several per message when the router or its client falls behind (coalesced)
        Figure("relay: tokens per message to the client", f"{tokens / num_messages:.2f}"),
        Figure("relay: CPU µs per token, by process", breakdown),
    ], window


# -- the run --------------------------------------------------------------------------------


def machine_line() -> str:
    pinned = "no pinning (one core)"
    if (os.cpu_count() or 1) >= 2:
        pinned = f"router pinned to core {ROUTER_CORE}, the rest to core {OTHERS_CORE}"
    return describe(f"grpcio {grpc.__version__}", pinned)


def print_profile(path: Path, tokens: int) -> None:
    stats = pstats.Stats(str(path))
    print(f"\nrouter profile ({path}), {tokens:,} tokens relayed; per token = tottime / tokens")
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)


def overhead_part(p: Processes, o: Options, rng: random.Random) -> list[Figure]:
    """A router over the prefill worker and the first decode worker, against both direct."""
    decode = p.decodes[0]
    router = p.start_router("router-overhead", [decode], o)
    try:
        with CpuWindow(p.pids(router, [decode])) as window:
            results = bench_overhead(router, p.prefill.address, decode.address, o.workload, rng)
    finally:
        router.stop(timeout_s=STOP_TIMEOUT_S)
    print(f"overhead part: {window.others_line(NOISY_SHARE)}")
    return results


def relay_part(p: Processes, o: Options, rng: random.Random) -> list[Figure]:
    """A router over every worker, its CPU capped when asked, relaying many streams."""
    router = p.start_router("router-relay", p.decodes, o)
    share = o.router_cpu_share
    try:
        with cpu_quota(router.proc.pid, share) if share else nullcontext():
            pids = p.pids(router, p.decodes)
            results, window = bench_relay(router.address, pids, o.workload, rng, share or 1.0)
    finally:
        router.stop(timeout_s=STOP_TIMEOUT_S)  # a profiled router writes its profile now
    print(f"relay part: {window.others_line(NOISY_SHARE)}")
    return results


def parse_args(argv: list[str] | None) -> tuple[Options, Path | None]:
    """The options, and the demo model's directory when given."""
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
    return Options(w, args.stream_interval, args.profile, args.router_cpu_share), args.model_dir


def main(argv: list[str] | None = None) -> int:
    o, model_dir = parse_args(argv)
    w, rng, began = o.workload, random.Random(PROMPT_SEED), time.perf_counter()
    pin(os.getpid(), OTHERS_CORE)
    print(machine_line())
    print(f"routers run with --stream-interval {o.stream_interval}")
    print(f"load average at start: {load_average()}")
    results: list[Figure] = []
    with tempfile.TemporaryDirectory(prefix="pdserve-router-bench-") as tmp:
        model_dir = model_dir or Path(tmp) / "demo-tiny"
        with processes(model_dir, w.relay_decode_workers, Path(tmp)) as p:
            if o.profile is None:
                results += overhead_part(p, o, rng)
            print(f"load average after the overhead part: {load_average()}")
            results += relay_part(p, o, rng)
            print(f"load average at the end: {load_average()}")
    print(f"whole run: {time.perf_counter() - began:.0f} s")
    print_table(Figure.HEADER, results)
    if o.profile is not None:
        # the warm-up streams ran on the profiled router too
        print_profile(o.profile, (w.relay_streams + w.relay_requests) * w.relay_new_tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
