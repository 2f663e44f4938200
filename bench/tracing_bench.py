"""What tracing costs: identical clusters in one run, half of them traced (issues 11, 39).

Real `pdserve` processes on loopback, as in `router_bench.py`: each cluster is a private
Redis, one prefill and two decode workers (one torch thread each) and a router with
static discovery over them, routers pinned to core 0 and everything else to core 1.
Two clusters per side (`--clusters-per-side`), started traced, untraced, untraced,
traced: identical clusters differ by about a millisecond of TTFT p50 from one start to
the next (an A/A/A run: 20.8-21.5 ms; A/A runs with one cluster a side: 0.4-1.8 ms), as
much as the target, so one cluster per side cannot resolve it; the start order lands
on both sides.
The traced side's processes export every span (`OTEL_EXPORTER_OTLP_ENDPOINT`, the SDK's
default sampler: every request, or `--sampler-ratio R`:
`parentbased_traceidratio`) over OTLP/gRPC to a bare span sink in this process (a
grpcio `TraceService` that counts what it receives); the other side has no OTEL_*
variable, so nothing is installed there. Only one side works at a time.

1. Relay: windows (half the router bench's requests each) of concurrent streams of long
   greedy generations, the sides in turn (a b, b a, ...) so that the machine's drift
   lands on both. Per side: the router's CPU
   per token (every thread of it: the span exporter's included), split into its event
   loop's thread and its other threads (the batch span processor's, which encodes and
   exports, and gRPC's), the whole cluster's CPU per token (router, workers, Redis), and
   wall tokens/s.
2. TTFT: short requests one at a time, the clusters in turn request by request; p50 per
   side, and the median of the rounds' differences (traced minus untraced, each round's
   clusters in turn).

    .venv/bin/python bench/tracing_bench.py [--quick] [--sampler-ratio R] [--control]
        [--untraced-first] [--clusters-per-side N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from router_bench import (
    FULL,
    OTHERS_CORE,
    PROMPT_SEED,
    QUICK,
    STOP_TIMEOUT_S,
    Options,
    Workload,
    greedy_proto,
    machine_line,
    processes,
    prompt,
    relay_streams,
    router_ttft,
)

from pdserve.api.v1 import router_pb2_grpc
from pdserve.bench.component import Ratio, print_table
from pdserve.bench.machine import CpuWindow, load_average, pin

HEADER = ("metric", "traced", "untraced", "traced / untraced", "target", "met")
TTFT_TOKENS = 4


@dataclass(frozen=True)
class Targets:
    """What tracing may add (issue 39): to TTFT p50, and to the router's CPU per token."""

    ttft_ms: float
    router_cpu: float  # traced / untraced, at most


EVERY_REQUEST = Targets(ttft_ms=2.0, router_cpu=1.05)
SAMPLED = Targets(ttft_ms=1.0, router_cpu=1.02)  # one request in ten or fewer


def targets_for(sampler_ratio: float | None) -> Targets:
    return SAMPLED if sampler_ratio is not None and sampler_ratio <= 0.1 else EVERY_REQUEST


def thread_cpu_s(pid: int) -> tuple[float, float]:
    """CPU-seconds of a process's main thread (a router's event loop) and of its other
    threads together, from the scheduler's nanosecond counters (/proc/PID/task/*/schedstat)."""
    main = others = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            run_ns = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
        if int(tid) == pid:
            main = run_ns
        else:
            others += run_ns
    return main / 1e9, others / 1e9


class SpanSink(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver that keeps nothing but the count."""

    def __init__(self) -> None:
        self.spans = 0

    def Export(self, request, context):
        self.spans += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@contextlib.contextmanager
def span_sink() -> Iterator[tuple[str, SpanSink]]:
    """The sink on a free loopback port: (its endpoint URL, the sink)."""
    sink, server = SpanSink(), grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"http://127.0.0.1:{port}", sink
    finally:
        server.stop(grace=None)


@contextlib.contextmanager
def environment(variables: dict[str, str]) -> Iterator[None]:
    """`variables` in os.environ while children are started (they inherit it)."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@dataclass
class Side:
    """One cluster, and what its timed windows added up to."""

    name: str
    traced: bool
    address: str  # its router
    pids: dict[str, int]  # its router, workers and Redis, and this process ("client")
    tokens: int = 0
    wall_s: float = 0.0
    router_cpu_s: float = 0.0
    router_loop_cpu_s: float = 0.0  # its main thread: the event loop
    router_others_cpu_s: float = 0.0  # its other threads: span exporter, gRPC
    cluster_cpu_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)

    def relay_window(self, w: Workload, rng: random.Random) -> None:
        num_requests = w.relay_requests // 2
        loop0, others0 = thread_cpu_s(self.pids["router"])
        with CpuWindow(self.pids) as window:
            tokens, _ = asyncio.run(self.streams(w, num_requests, rng))
        loop1, others1 = thread_cpu_s(self.pids["router"])
        if tokens != num_requests * w.relay_new_tokens:
            raise RuntimeError(f"{self.name}: relayed {tokens} tokens")
        self.tokens += tokens
        self.wall_s += window.wall_s
        # the router's threads from their nanosecond counters (its process's clock ticks
        # are 10 ms apart), so that the whole and its two parts add up
        self.router_loop_cpu_s += loop1 - loop0
        self.router_others_cpu_s += others1 - others0
        self.router_cpu_s = self.router_loop_cpu_s + self.router_others_cpu_s
        # not this process: it is the client, and the span sink (a collector runs elsewhere)
        self.cluster_cpu_s += sum(cpu for name, cpu in window.cpu_s.items() if name != "client")

    async def streams(self, w: Workload, num_requests: int, rng: random.Random):
        """`num_requests` long greedy generations, `w.relay_streams` at a time."""
        sampling = greedy_proto(w.relay_new_tokens)
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            return await relay_streams(stub, w.relay_streams, num_requests, sampling, rng)


async def ttft_rounds(sides: list[Side], rounds: int, rng: random.Random) -> list[float]:
    """One short request at a time, each round every cluster once, starting one further
    on each round (a b c d, b c d a, ...); returns each round's traced-minus-untraced
    difference of the sides' mean TTFT."""
    sampling = greedy_proto(TTFT_TOKENS)
    channels = [grpc.aio.insecure_channel(side.address) for side in sides]
    stubs = [router_pb2_grpc.RouterStub(channel) for channel in channels]
    differences = []
    try:
        for i in range(rounds + 4):  # the first 4 rounds warm up
            ttfts: dict[bool, list[float]] = {True: [], False: []}
            for j in range(len(sides)):
                k = (i + j) % len(sides)
                ttft = await router_ttft(stubs[k], prompt(rng), sampling, [])
                if i >= 4:
                    sides[k].ttft_s.append(ttft)
                    ttfts[sides[k].traced].append(ttft)
            if i >= 4:
                differences.append(statistics.fmean(ttfts[True]) - statistics.fmean(ttfts[False]))
    finally:
        for channel in channels:
            await channel.close()
    return differences


def merged(name: str, sides: list[Side]) -> Side:
    """The clusters of one side as one: their windows' sums, their TTFTs together."""
    whole = Side(name, sides[0].traced, "", {})
    for side in sides:
        whole.tokens += side.tokens
        whole.wall_s += side.wall_s
        whole.router_cpu_s += side.router_cpu_s
        whole.router_loop_cpu_s += side.router_loop_cpu_s
        whole.router_others_cpu_s += side.router_others_cpu_s
        whole.cluster_cpu_s += side.cluster_cpu_s
        whole.ttft_s.extend(side.ttft_s)
    return whole


def figures(traced: Side, untraced: Side, targets: Targets) -> list[Ratio]:
    def per_token(side: Side, cpu_s: float) -> float:
        return cpu_s / side.tokens * 1e6

    return [
        Ratio(
            "router CPU per relayed token",
            per_token(traced, traced.router_cpu_s),
            per_token(untraced, untraced.router_cpu_s),
            "µs",
            targets.router_cpu,
            higher_is_better=False,
        ),
        Ratio(
            "  of which its event loop's thread",
            per_token(traced, traced.router_loop_cpu_s),
            per_token(untraced, untraced.router_loop_cpu_s),
            "µs",
            None,
        ),
        Ratio(
            "  of which its other threads (span exporter, gRPC)",
            per_token(traced, traced.router_others_cpu_s),
            per_token(untraced, untraced.router_others_cpu_s),
            "µs",
            None,
        ),
        Ratio(
            "cluster CPU per token (router, workers, Redis)",
            per_token(traced, traced.cluster_cpu_s),
            per_token(untraced, untraced.cluster_cpu_s),
            "µs",
            None,  # context: issue 39's target is the router's
        ),
        Ratio(
            "wall tokens/s while relaying",
            traced.tokens / traced.wall_s,
            untraced.tokens / untraced.wall_s,
            "tokens/s",
            None,
        ),
        Ratio(
            "TTFT p50 through the router",
            statistics.median(traced.ttft_s) * 1e3,
            statistics.median(untraced.ttft_s) * 1e3,
            "ms",
            None,
        ),
    ]


def traced_variables(endpoint: str, sampler_ratio: float | None) -> dict[str, str]:
    """The traced side's OTEL_* variables: export to `endpoint`, every request or a ratio."""
    variables = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}
    if sampler_ratio is not None:
        variables["OTEL_TRACES_SAMPLER"] = "parentbased_traceidratio"
        variables["OTEL_TRACES_SAMPLER_ARG"] = str(sampler_ratio)
    return variables


def start_side(
    stack, name: str, traced: bool, variables: dict[str, str], o: Options, tmp: Path
) -> Side:
    """A whole cluster and its router, started with `variables` in their environment."""
    log_dir = tmp / name
    log_dir.mkdir()
    with environment(variables):
        p = stack.enter_context(processes(tmp / "demo-tiny", 2, log_dir))
        router = p.start_router("router-relay", p.decodes, o)
    stack.callback(router.stop, timeout_s=STOP_TIMEOUT_S)
    return Side(name, traced, router.address, p.pids(router, p.decodes))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument(
        "--sampler-ratio",
        type=float,
        metavar="R",
        help="trace this share of requests (parentbased_traceidratio); default: all",
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="an A/A run: the 'traced' side gets no OTEL_* variable either, so the table "
        "shows what tells the two clusters apart besides tracing",
    )
    parser.add_argument(
        "--untraced-first",
        action="store_true",
        help="start an untraced cluster first (untraced, traced, traced, untraced)",
    )
    parser.add_argument(
        "--clusters-per-side",
        type=int,
        default=2,
        metavar="N",
        help="clusters per side (default 2), started in turn from the first side's "
        "(a b b a a b ...)",
    )
    args = parser.parse_args(argv)
    o = Options(QUICK if args.quick else FULL, 1, None, None)
    if args.clusters_per_side < 1:
        parser.error("--clusters-per-side must be at least 1")
    windows, rounds = (1, 8) if args.quick else (2, 60)
    rng = random.Random(PROMPT_SEED)
    pin(os.getpid(), OTHERS_CORE)
    print(machine_line())
    print(f"load average at start: {load_average()}")
    with (
        tempfile.TemporaryDirectory(prefix="pdserve-tracing-bench-") as tmp,
        span_sink() as (endpoint, sink),
        contextlib.ExitStack() as stack,
    ):
        traced_env = {} if args.control else traced_variables(endpoint, args.sampler_ratio)
        sides = []
        for i in range(2 * args.clusters_per_side):
            traced = (i % 4 in (0, 3)) != args.untraced_first  # a b b a ...
            name = f"{'traced' if traced else 'untraced'}-{i}"
            sides.append(
                start_side(stack, name, traced, traced_env if traced else {}, o, Path(tmp))
            )
        w = o.workload
        for side in sides:  # warm-up, untimed
            asyncio.run(side.streams(w, w.relay_streams, rng))
        for i in range(windows):
            for j in range(len(sides)):
                sides[(i + j) % len(sides)].relay_window(w, rng)
        differences = asyncio.run(ttft_rounds(sides, rounds, rng))
        time.sleep(6)  # the batch span processors' last exports (every 5 s)
        print(f"spans received from the traced side: {sink.spans:,}")
    print(f"load average at the end: {load_average()}")
    sampled = "every request" if args.sampler_ratio is None else f"ratio {args.sampler_ratio}"
    sampled = "not traced either (--control)" if args.control else sampled
    first = "untraced" if args.untraced_first else "traced"
    print(
        f"traced side: {sampled}; {args.clusters_per_side} clusters per side, a {first} one "
        f"started first; {windows} relay windows per cluster"
    )
    traced = merged("traced", [side for side in sides if side.traced])
    untraced = merged("untraced", [side for side in sides if not side.traced])
    targets = targets_for(args.sampler_ratio)
    print_table(HEADER, figures(traced, untraced, targets))
    added_ms = (statistics.median(traced.ttft_s) - statistics.median(untraced.ttft_s)) * 1e3
    paired_ms = statistics.median(differences) * 1e3
    print(
        f"TTFT p50 added by tracing: {added_ms:+.2f} ms; median of the rounds' differences: "
        f"{paired_ms:+.2f} ms (target: at most {targets.ttft_ms:g} ms)"
    )
    for side in sides:
        print(f"  {side.name}: TTFT p50 {statistics.median(side.ttft_s) * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
