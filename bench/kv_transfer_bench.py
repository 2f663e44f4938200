"""KV transfer throughput between two processes on loopback: gRPC PushKV vs raw TCP (issue 4).

A receiver process serves three ends at once: a plain TCP socket that reads into one
reused buffer (``recv_into``) and counts, and two grpc.aio KVTransfer servers whose
PushKV is ``receive_push`` (every crc32 verified, bytes counted), one registered with
``add_servicer`` with PushKV's zero-copy parser and one with the generated function
(protobuf parsing). This process sends the same bytes to each: the KV of prompts of
the ~55M benchmark model (8 layers, 2 KV heads, head_dim 64, block 16, float32). A
2,048-token prompt is 128 blocks: 2 x 2048 x 2 x 64 x 4 bytes = 2 MiB per layer
(``--prompt-tokens 4096`` for 4 MiB layers).

- raw TCP: every layer's bytes with ``sendall`` on one connection, timed until the
  receiver acknowledges the count. No framing, no checksum: the ceiling.
- gRPC: one ``KVPusher.push`` per prompt, prompts one after another, timed until the
  last push returns (the receiver has verified and counted everything).

The headline runs the three in rotation so that a slow spell of the machine lands on
all of them, and reports medians and the CPU time both processes spent per GB (on a
2-core machine that, more than latency, sets the ceiling). A sweep of message size
and stream count (shorter runs) shows why the defaults are what they are. Both
processes call ``keep_freed_memory()`` as the workers should (``--no-keep-freed-memory``
to see without). crc32 is ``pdserve.core.kv_chunk``'s (ISA-L), as in the workers.

    .venv/bin/python bench/kv_transfer_bench.py [--quick] [--rounds N] [--prompt-tokens N]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import platform
import socket
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np

from pdserve.api.v1 import kv_transfer_pb2
from pdserve.api.v1.kv_transfer_pb2_grpc import add_KVTransferServicer_to_server
from pdserve.bench.component import alternate
from pdserve.bench.machine import CpuWindow, describe, process_cpu_seconds
from pdserve.core.block_hash import num_blocks_for
from pdserve.core.kv_chunk import KVLayerChunk, crc32
from pdserve.kv.transfer import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_NUM_STREAMS,
    ZERO_COPY_PARSERS,
    KVPusher,
    channel_options,
    keep_freed_memory,
    receive_push,
)
from pdserve.rpc.registration import add_servicer

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 2, 64, 16
PROMPT_TOKENS = 2048  # 128 blocks: 2 MiB of K and V per layer in float32
TARGET_RATIO = 0.5
MiB, GiB = 1 << 20, 1 << 30
SWEEP_MESSAGE_BYTES = (1 * MiB, 2 * MiB, 4 * MiB)
SWEEP_STREAMS = (1, 2, 4)
RAW_TCP_BUFFER_BYTES = 4 * MiB
NOISY_SHARE = 0.10  # others' CPU share of the machine above which figures are noise


# -- the receiver process -------------------------------------------------------------------


class _CountingServicer:
    """KVTransfer with only PushKV: verify (in receive_push) and count."""

    def __init__(self) -> None:
        self.bytes = 0

    async def PushKV(self, request_iterator, context):  # noqa: N802 (gRPC's method name)
        return await receive_push(request_iterator, self._on_chunk)

    def _on_chunk(self, lease_id: str, first_block: int, chunk: KVLayerChunk) -> None:
        self.bytes += len(chunk.data)

    async def Handshake(self, request, context):  # noqa: N802
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not in the benchmark")

    CommitKV = RenewLease = Handshake


def _zero_copy(servicer, server) -> None:
    """KVTransfer on pdserve's one registration path, PushKV parsed without copies."""
    service = kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"]
    add_servicer(servicer, service, server, parsers=ZERO_COPY_PARSERS)


def _raw_tcp_receiver(listener: socket.socket) -> None:
    buffer = memoryview(bytearray(RAW_TCP_BUFFER_BYTES))
    while True:
        connection, _ = listener.accept()
        with connection:
            received = 0
            while count := connection.recv_into(buffer):
                received += count
            connection.sendall(received.to_bytes(8, "little"))


async def _serve_grpc(ports, raw_port: int) -> None:
    """Two KVTransfer servers: PushKV registered zero-copy, and by the generated function."""
    servers, grpc_ports = [], []
    for register in (_zero_copy, add_KVTransferServicer_to_server):
        server = grpc.aio.server(options=channel_options(max(SWEEP_MESSAGE_BYTES)))
        register(_CountingServicer(), server)
        grpc_ports.append(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        servers.append(server)
    ports.send((raw_port, *grpc_ports))
    # Serve until the parent closes its end of the pipe.
    await asyncio.get_running_loop().run_in_executor(None, _wait_closed, ports)
    for server in servers:
        await server.stop(grace=None)


def _wait_closed(connection) -> None:
    try:
        connection.recv()
    except EOFError:
        pass


def receiver_main(ports, keep_memory: bool) -> None:
    if keep_memory:
        keep_freed_memory()
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_raw_tcp_receiver, args=(listener,), daemon=True).start()
    asyncio.run(_serve_grpc(ports, listener.getsockname()[1]))


# -- the sending side -----------------------------------------------------------------------


def make_layers(prompt_tokens: int, seed: int = 0) -> list[KVLayerChunk]:
    """One prompt's KV, as the engine's export_layer makes it (bytes and crc32)."""
    shape = (2, num_blocks_for(prompt_tokens, BLOCK_SIZE), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    rng = np.random.default_rng(seed)
    layers = []
    for layer in range(NUM_LAYERS):
        data = rng.standard_normal(shape, dtype=np.float32).tobytes()
        layers.append(KVLayerChunk(layer, "float32", shape, data, crc32(data)))
    return layers


def raw_tcp_send(port: int, layers: list[KVLayerChunk], num_prompts: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as connection:
        for _ in range(num_prompts):
            for layer in layers:
                connection.sendall(layer.data)
        connection.shutdown(socket.SHUT_WR)
        received = int.from_bytes(connection.recv(8), "little")
    expected = num_prompts * sum(len(layer.data) for layer in layers)
    if received != expected:
        raise RuntimeError(f"raw TCP receiver counted {received} bytes, expected {expected}")


def grpc_push(pusher: KVPusher, layers: list[KVLayerChunk], num_prompts: int) -> None:
    for prompt in range(num_prompts):
        totals = pusher.push(f"lease-{prompt}", ((0, layer) for layer in layers))
        if totals.bytes != sum(len(layer.data) for layer in layers):
            raise RuntimeError(f"gRPC receiver counted {totals.bytes} bytes for one prompt")


@dataclass(frozen=True, slots=True)
class Run:
    seconds: float
    cpu_seconds: float  # both processes


class Clock:
    """Wall time and the CPU time of both processes (this one and the receiver)."""

    def __init__(self, receiver_pid: int) -> None:
        self.receiver_pid = receiver_pid

    def cpu_seconds(self) -> float:
        return time.process_time() + (process_cpu_seconds(self.receiver_pid) or 0.0)

    def time(self, send: Callable[[], None]) -> Run:
        cpu, start = self.cpu_seconds(), time.perf_counter()
        send()
        return Run(time.perf_counter() - start, self.cpu_seconds() - cpu)

    def timed(self, send: Callable[[], None]) -> Callable[[], Run]:
        """`send`, timed by this clock when called."""
        return lambda: self.time(send)


@dataclass(frozen=True, slots=True)
class Throughput:
    num_bytes: int
    runs: list[Run]

    @property
    def gb_per_s(self) -> float:  # of the median run; GB = 1e9 bytes
        return self.num_bytes / statistics.median(r.seconds for r in self.runs) / 1e9

    @property
    def spread(self) -> str:
        rates = sorted(self.num_bytes / r.seconds / 1e9 for r in self.runs)
        return f"{rates[0]:.2f}-{rates[-1]:.2f}"

    @property
    def cpu_per_gb(self) -> float:
        return statistics.median(r.cpu_seconds for r in self.runs) / (self.num_bytes / 1e9)


def alternating_runs(repeats: int, clock: Clock, sends: list[Callable[[], None]]):
    """`repeats` timed runs of each after one untimed warm-up, in a rotating order
    (`alternate`): a slow spell of the machine lands on every side rather than one."""
    for send in sends:  # untimed
        send()
    return alternate(repeats, 0, *(clock.timed(send) for send in sends))


# -- the report -----------------------------------------------------------------------------


def headline(clock: Clock, ports: dict[str, int], layers, rounds: int, num_prompts: int) -> str:
    num_bytes = num_prompts * sum(len(layer.data) for layer in layers)
    with (
        KVPusher(f"127.0.0.1:{ports['zero-copy']}") as pusher,
        KVPusher(f"127.0.0.1:{ports['generated']}") as generated,
    ):
        raw_runs, grpc_runs, generated_runs = alternating_runs(
            rounds,
            clock,
            [
                lambda: raw_tcp_send(ports["raw"], layers, num_prompts),
                lambda: grpc_push(pusher, layers, num_prompts),
                lambda: grpc_push(generated, layers, num_prompts),
            ],
        )
    raw = Throughput(num_bytes, raw_runs)
    ours = Throughput(num_bytes, grpc_runs)
    protobuf = Throughput(num_bytes, generated_runs)
    ratio = ours.gb_per_s / raw.gb_per_s
    per_round = sorted(r.seconds / g.seconds for r, g in zip(raw_runs, grpc_runs, strict=True))
    streams = f"{DEFAULT_NUM_STREAMS} stream{'s' * (DEFAULT_NUM_STREAMS > 1)}"
    defaults = f"{streams}, {DEFAULT_MAX_MESSAGE_BYTES // MiB} MiB messages"
    return "\n".join(
        [
            f"{num_bytes / GiB:.2f} GiB per run ({num_prompts} prompts x {NUM_LAYERS} layers x "
            f"{len(layers[0].data) / MiB:g} MiB), median of {rounds} runs each, in rotation:",
            "",
            "| path | GB/s (median) | range | ratio to raw TCP | CPU-s per GB (both processes) |",
            "| --- | --- | --- | --- | --- |",
            f"| raw TCP socket | {raw.gb_per_s:.2f} | {raw.spread} | 1.00 | {raw.cpu_per_gb:.2f} |",
            f"| gRPC PushKV, {defaults} | {ours.gb_per_s:.2f} | {ours.spread} | **{ratio:.2f}** "
            f"| {ours.cpu_per_gb:.2f} |",
            f"| same, receiver parsing KVChunk with protobuf (generated registration) "
            f"| {protobuf.gb_per_s:.2f} | {protobuf.spread} "
            f"| {protobuf.gb_per_s / raw.gb_per_s:.2f} | {protobuf.cpu_per_gb:.2f} |",
            "",
            f"Target >= {TARGET_RATIO:.0%} of raw TCP: "
            f"{'met' if ratio >= TARGET_RATIO else 'NOT met'}. Per-round ratios: "
            + ", ".join(f"{r:.2f}" for r in per_round),
        ]
    )


def sweep(clock: Clock, port: int, layers, repeats: int, num_prompts: int) -> str:
    num_bytes = num_prompts * sum(len(layer.data) for layer in layers)
    streams = " | ".join(f"{n} stream{'s' * (n > 1)}" for n in SWEEP_STREAMS)
    lines = [
        f"Sweep: {num_bytes / MiB:g} MiB per run, median of {repeats}; "
        "GB/s (CPU-s per GB of both processes):",
        "",
        f"| message size | {streams} |",
        "| --- |" + " --- |" * len(SWEEP_STREAMS),
    ]
    for message_bytes in SWEEP_MESSAGE_BYTES:
        cells = []
        for num_streams in SWEEP_STREAMS:
            with KVPusher(
                f"127.0.0.1:{port}", num_streams=num_streams, max_message_bytes=message_bytes
            ) as pusher:
                [runs] = alternating_runs(
                    repeats, clock, [lambda p=pusher: grpc_push(p, layers, num_prompts)]
                )
            result = Throughput(num_bytes, runs)
            cells.append(f"{result.gb_per_s:.2f} ({result.cpu_per_gb:.2f})")
        lines.append(f"| {message_bytes / MiB:g} MiB | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small smoke version")
    parser.add_argument("--rounds", type=int, default=7, help="timed runs per headline row")
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    parser.add_argument(
        "--no-keep-freed-memory",
        dest="keep_memory",
        action="store_false",
        help="leave glibc's allocator at its defaults in both processes",
    )
    args = parser.parse_args(argv)
    prompts, sweep_prompts, rounds = (4, 2, 2) if args.quick else (64, 8, args.rounds)
    if args.keep_memory:
        keep_freed_memory()

    context = multiprocessing.get_context("spawn")  # no fork after gRPC has started
    parent_end, child_end = context.Pipe()
    receiver = context.Process(target=receiver_main, args=(child_end, args.keep_memory))
    receiver.start()
    try:
        ports = dict(zip(("raw", "zero-copy", "generated"), parent_end.recv(), strict=True))
        layers = make_layers(args.prompt_tokens)
        print(
            describe(
                f"{platform.machine()}, grpcio {grpc.__version__}",
                f"crc32 from {crc32.__module__}",
                f"keep_freed_memory={args.keep_memory}\n",
            )
        )
        clock = Clock(receiver.pid)
        with CpuWindow({"sender": os.getpid(), "receiver": receiver.pid}) as window:
            print(headline(clock, ports, layers, rounds, prompts), end="\n\n")
            repeats = 1 if args.quick else 3
            print(sweep(clock, ports["zero-copy"], layers, repeats, sweep_prompts), end="\n\n")
        print(window.others_line(NOISY_SHARE))
    finally:
        parent_end.close()
        receiver.join(timeout=10)
        if receiver.is_alive():
            receiver.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
