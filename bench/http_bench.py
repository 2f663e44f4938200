"""The OpenAI HTTP gateway against the native gRPC API, side by side (the gateways issue).

The processes of `router_bench.py` (a private Redis, one prefill and decode workers
pinned to one core, the router alone on the other), with one router that serves both
APIs (`--http-port`). This process is the client of both, on one event loop: gRPC
through a `grpc.aio` channel, HTTP through kept-alive connections.

1. TTFT at low load: one request at a time, a short prompt of fresh random ids (no
   prefix-cache hit), a few greedy tokens, streamed; the sides rotate (a b c, b c a, ...)
   after warm-ups. HTTP's TTFT runs to the first `data:` event (it carries text); gRPC's
   to the first message. The gateway's cost is the difference of the medians against a
   lean HTTP client (`h11`, the HTTP/1.1 state machine httpx is built on, over asyncio
   streams: about as little client work as the gRPC client does), target at most 1 ms;
   the same through `httpx` (what the `openai` package uses) shows what its layers add.
2. Streaming throughput: 64 concurrent streams of long greedy generations (ignore_eos),
   over gRPC and as SSE through `/v1/completions` (each stream on a lean connection of
   its own), in windows that alternate between the sides (a b, b a: `--rounds` each);
   the router's CPU-seconds (every thread, from /proc) over each side's windows give its
   tokens per CPU-second (target for SSE: at least 10,000), and SSE's over gRPC's, from
   one run, is the figure a loaded machine moves least. An event carries several tokens
   when its client fell behind (as a gRPC message does); the tokens are counted from
   each stream's usage. A request answered 503 before any token (on a loaded machine,
   the router's Redis connect timing out) is retried, and the retries are printed.

    .venv/bin/python bench/http_bench.py [--quick] [--model-dir DIR] [--rounds N]
        [--stream-interval TOKENS] [--router-cpu-share FRACTION]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
import h11
import httpx
from router_bench import (
    FULL,
    NOISY_SHARE,
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
from pdserve.bench.component import Figure, alternate, p90, print_table, timed_stream
from pdserve.bench.machine import CpuWindow, cpu_quota, load_average, pin
from pdserve.core.flags import settings
from pdserve.router.config import RouterConfig

TTFT_TARGET_MS = 1.0
SSE_TARGET_TOKENS_PER_CPU_S = 10_000
COMPLETIONS_PATH = "/v1/completions"
READ_BYTES = 1 << 16
UNAVAILABLE = 503
RETRY_AFTER_S = 0.2
HTTP_PORT_SETTING = next(s for s in settings(RouterConfig) if s.field.name == "http_port")


@contextlib.contextmanager
def http_port_for_children() -> Iterator[None]:
    """Routers started meanwhile serve HTTP on a free port: `router_bench` starts them
    from its own settings, and every setting is also a `PDSERVE_*` variable."""
    name = HTTP_PORT_SETTING.env_names[0]
    os.environ[name] = "0"
    try:
        yield
    finally:
        del os.environ[name]


def completion_body(prompt_ids: list[int], max_tokens: int, *, usage: bool = False) -> dict:
    body = {
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    if usage:
        body["stream_options"] = {"include_usage": True}
    return body


def data_payloads(events: list[bytes]) -> Iterator[bytes]:
    """The payloads of SSE `data:` events, `[DONE]` left out."""
    for event in events:
        if event.startswith(b"data: ") and event != b"data: [DONE]":
            yield event[6:]


async def httpx_events(client: httpx.AsyncClient, body: dict) -> AsyncIterator[bytes]:
    """One streamed completion through httpx: its `data:` payloads."""
    async with client.stream("POST", COMPLETIONS_PATH, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            for payload in data_payloads([line.encode()]):
                yield payload


class Unavailable(RuntimeError):
    """A 503 before any event: the router could not start the request (on a loaded
    machine, its Redis connect timing out); the stream is retried."""


class LeanConnection:
    """One kept-alive HTTP/1.1 connection driven by `h11` alone: no pool, no middleware."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str):
        self.reader, self.writer, self.host = reader, writer, host
        self.h11 = h11.Connection(h11.CLIENT)

    @classmethod
    async def open(cls, address: str) -> LeanConnection:
        host, port = address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        return cls(reader, writer, host)

    async def events(self, body: dict) -> AsyncIterator[bytes]:
        """One streamed completion: its `data:` payloads, as they arrive."""
        payload = json.dumps(body).encode()
        headers = [("Host", self.host), ("Content-Type", "application/json")]
        headers.append(("Content-Length", str(len(payload))))
        conn = self.h11
        request = conn.send(h11.Request(method="POST", target=COMPLETIONS_PATH, headers=headers))
        self.writer.write(request + conn.send(h11.Data(data=payload)))
        conn.send(h11.EndOfMessage())
        pending, status = b"", 200
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await self.reader.read(READ_BYTES))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                *complete, pending = (pending + bytes(event.data)).split(b"\n\n")
                for data in data_payloads(complete):
                    yield data
            elif isinstance(event, h11.EndOfMessage):
                conn.start_next_cycle()
                if status != 200:
                    kind = Unavailable if status == UNAVAILABLE else RuntimeError
                    raise kind(f"HTTP {status}: {pending.decode(errors='replace')}")
                return

    def close(self) -> None:
        self.writer.close()


# -- 1. TTFT ------------------------------------------------------------------------------


def measure_ttft(grpc_address: str, http_address: str, w: Workload, rng: random.Random):
    """TTFTs in seconds, per side (gRPC, lean HTTP, httpx), rotated on one event loop."""
    sampling, n = greedy_proto(w.overhead_new_tokens), w.overhead_new_tokens
    inside: list[float] = []

    async def first_event(events) -> float:
        return (await timed_stream(lambda: events))[0]

    with asyncio.Runner() as runner:
        channel = grpc.aio.insecure_channel(grpc_address)
        stub = router_pb2_grpc.RouterStub(channel)
        client = httpx.AsyncClient(base_url=f"http://{http_address}", timeout=60)
        lean = runner.run(LeanConnection.open(http_address))
        runs = alternate(
            w.overhead_pairs,
            w.warmups,
            lambda: runner.run(router_ttft(stub, prompt(rng), sampling, inside)),
            lambda: runner.run(first_event(lean.events(completion_body(prompt(rng), n)))),
            lambda: runner.run(first_event(httpx_events(client, completion_body(prompt(rng), n)))),
        )
        lean.close()
        for closing in (client.aclose(), channel.close()):
            runner.run(closing)
    return runs


def ttft_figures(via_grpc: list[float], via_lean: list[float], via_httpx: list[float]):
    grpc_p50, lean_p50, httpx_p50 = (
        statistics.median(s) * 1e3 for s in (via_grpc, via_lean, via_httpx)
    )
    paired = statistics.median(h - g for g, h in zip(via_grpc, via_lean, strict=True)) * 1e3
    added = lean_p50 - grpc_p50
    return [
        Figure(
            f"HTTP gateway's addition to TTFT, p50 ({len(via_lean)} sequential requests a "
            "side; lean HTTP client)",
            f"{added:.2f} ms",
            f"<= {TTFT_TARGET_MS:g} ms",
            added <= TTFT_TARGET_MS,
        ),
        Figure(
            "TTFT p50: SSE (lean client) / SSE (httpx) / native gRPC",
            f"{lean_p50:.2f} / {httpx_p50:.2f} / {grpc_p50:.2f} ms",
        ),
        Figure("TTFT addition (lean client), median of paired differences", f"{paired:.2f} ms"),
        Figure(
            "TTFT p90: SSE (lean client) / SSE (httpx) / native gRPC",
            f"{p90(via_lean) * 1e3:.2f} / {p90(via_httpx) * 1e3:.2f} / "
            f"{p90(via_grpc) * 1e3:.2f} ms",
        ),
    ]


# -- 2. streaming throughput ----------------------------------------------------------------


async def sse_streams(address: str, w: Workload, num_requests: int, rng) -> tuple[int, int]:
    """Run num_requests streamed completions, w.relay_streams at a time, each stream on a
    lean connection of its own; (tokens, events with tokens) received."""
    remaining, tokens, events, retries = num_requests, 0, 0, 0

    async def stream() -> None:
        nonlocal remaining, tokens, events, retries
        conn = await LeanConnection.open(address)
        try:
            while remaining > 0:
                remaining -= 1
                body = completion_body(prompt(rng), w.relay_new_tokens, usage=True)
                last = b""
                try:
                    async for last in conn.events(body):  # noqa: B007 (usage: the last)
                        events += 1
                except Unavailable:
                    retries += 1
                    if retries > num_requests:  # more than one per request: not a busy machine
                        raise
                    remaining += 1
                    await asyncio.sleep(RETRY_AFTER_S)
                    continue
                tokens += json.loads(last)["usage"]["completion_tokens"]
                events -= 1  # the usage event carries no token
        finally:
            conn.close()

    await asyncio.gather(*(stream() for _ in range(w.relay_streams)))
    if retries:
        print(f"  SSE: {retries} requests answered 503 before any token, retried")
    return tokens, events


async def grpc_streams(address: str, w: Workload, rng: random.Random) -> tuple[int, int]:
    sampling = greedy_proto(w.relay_new_tokens)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        return await relay_streams(stub, w.relay_streams, w.relay_requests, sampling, rng)


@dataclass
class Side:
    """One side's throughput windows, summed: what it received and what the router spent."""

    tokens: int = 0
    messages: int = 0  # events or messages with tokens
    cpu_s: float = 0.0  # the router's, every thread
    wall_s: float = 0.0
    per_window: list[float] = field(default_factory=list)  # tokens per router CPU-second

    def add(self, tokens: int, messages: int, window: CpuWindow) -> None:
        cpu_s = window.cpu_s["router"]
        self.tokens, self.messages = self.tokens + tokens, self.messages + messages
        self.cpu_s, self.wall_s = self.cpu_s + cpu_s, self.wall_s + window.wall_s
        self.per_window.append(tokens / cpu_s)

    @property
    def per_cpu_s(self) -> float:
        return self.tokens / self.cpu_s


def measure_throughput(router, w: Workload, rounds: int, rng: random.Random) -> dict[str, Side]:
    """Per side, its windows summed, after a warm-up each: the sides' windows alternate
    (a b, b a, ...), `rounds` each, of w.relay_requests / rounds requests, so that a
    machine whose load drifts weighs on both alike."""
    address = router.http_address
    per_window = max(w.relay_streams, w.relay_requests // rounds)
    grpc_w = replace(w, relay_requests=per_window)
    sides = {
        "native gRPC": lambda: grpc_streams(router.address, grpc_w, rng),
        "SSE (/v1/completions)": lambda: sse_streams(address, w, per_window, rng),
    }
    asyncio.run(grpc_streams(router.address, replace(w, relay_requests=w.relay_streams), rng))
    asyncio.run(sse_streams(address, w, w.relay_streams, rng))  # warm-ups

    def window(name: str):
        def run() -> tuple[int, int, CpuWindow]:
            with CpuWindow({"router": router.proc.pid}) as cpu:
                tokens, messages = asyncio.run(sides[name]())
            if tokens != per_window * w.relay_new_tokens:
                raise RuntimeError(f"{name}: {tokens} tokens, expected {per_window} streams' worth")
            print(
                f"  {name}: {tokens / cpu.cpu_s['router']:,.0f} tokens per router CPU-s; "
                f"load average {load_average()}"
            )
            return tokens, messages, cpu

        return run

    runs = alternate(rounds, 0, *(window(name) for name in sides))
    results = {name: Side() for name in sides}
    for name, side_runs in zip(sides, runs, strict=True):
        for tokens, messages, cpu in side_runs:
            results[name].add(tokens, messages, cpu)
    return results


def throughput_figures(results: dict[str, Side], w: Workload) -> list[Figure]:
    figures = []
    for name, side in results.items():
        is_sse = name.startswith("SSE")
        figures += [
            Figure(
                f"{name}: tokens per router CPU-second ({w.relay_streams} concurrent streams "
                f"of {w.relay_new_tokens} tokens, {len(side.per_window)} windows)",
                f"{side.per_cpu_s:,.0f} tokens/s",
                f">= {SSE_TARGET_TOKENS_PER_CPU_S:,}" if is_sse else "-",
                side.per_cpu_s >= SSE_TARGET_TOKENS_PER_CPU_S if is_sse else None,
            ),
            Figure(
                f"{name}: router CPU per token; tokens per event; router core use",
                f"{side.cpu_s / side.tokens * 1e6:.1f} µs; {side.tokens / side.messages:.2f}; "
                f"{side.cpu_s / side.wall_s:.0%}",
            ),
        ]
    grpc_side, sse_side = results.values()
    pairs = [s / g for g, s in zip(grpc_side.per_window, sse_side.per_window, strict=True)]
    figures.append(
        Figure(
            "SSE / native gRPC tokens per router CPU-second, this run (per round)",
            f"{sse_side.per_cpu_s / grpc_side.per_cpu_s:.2f}x "
            f"({', '.join(f'{pair:.2f}' for pair in pairs)})",
        )
    )
    return figures


def parse_args(argv: list[str] | None) -> tuple[Options, Path | None, int]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small smoke version")
    parser.add_argument(
        "--model-dir", type=Path, help="reuse or create the tiny demo model here (default: temp)"
    )
    parser.add_argument(
        "--router-cpu-share",
        type=float,
        metavar="FRACTION",
        help="cap the router at this share of one core in the throughput part (a cgroup CPU "
        "quota), so that it, not the workers, is the bottleneck",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        metavar="N",
        help="throughput windows per side, alternating with the other side's (default 2)",
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        metavar="TOKENS",
        help="the router's --stream-interval: tokens per decode-worker message (default 1)",
    )
    args = parser.parse_args(argv)
    w = QUICK if args.quick else FULL
    options = Options(w, args.stream_interval, None, args.router_cpu_share)
    return options, args.model_dir, args.rounds


def main(argv: list[str] | None = None) -> int:
    o, model_dir, rounds = parse_args(argv)
    w, rng, began = o.workload, random.Random(PROMPT_SEED), time.perf_counter()
    pin(os.getpid(), OTHERS_CORE)
    print(machine_line())
    print(f"load average at start: {load_average()}")
    with tempfile.TemporaryDirectory(prefix="pdserve-http-bench-") as tmp:
        model_dir = model_dir or Path(tmp) / "demo-tiny"
        with processes(model_dir, w.relay_decode_workers, Path(tmp)) as p:
            with http_port_for_children():
                router = p.start_router("router-http", p.decodes, o)
            try:
                with CpuWindow(p.pids(router, p.decodes)) as window:
                    ttfts = measure_ttft(router.address, router.http_address, w, rng)
                    share = o.router_cpu_share
                    with cpu_quota(router.proc.pid, share) if share else contextlib.nullcontext():
                        results = measure_throughput(router, w, rounds, rng)
            finally:
                router.stop(timeout_s=STOP_TIMEOUT_S)
    print(f"whole run: {time.perf_counter() - began:.0f} s; {window.others_line(NOISY_SHARE)}")
    print(f"load average at the end: {load_average()}")
    print_table(Figure.HEADER, ttft_figures(*ttfts) + throughput_figures(results, w))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
