"""The prefill worker's decode peers are bounded: no thread per decode address ever seen.

Each decode peer holds a KV pusher with a thread of its own. Decode pods come and go, so
a prefill worker used to gain a thread for every address it pushed to, never reclaimed.
The workers run in this process (real gRPC servers on loopback, real engines), so the
test can count the process's threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time

import grpc
import pytest

from pdserve.api.v1 import prefill_pb2, prefill_pb2_grpc
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kv.transfer import PUSHER_THREAD
from pdserve.router.handoff import Attempt, ChannelPool, HandOff
from pdserve.rpc.registration import add_servicer
from pdserve.rpc.wire import sampling_params_to_proto
from pdserve.worker.config import WorkerConfig
from pdserve.worker.services import WorkerServices
from pdserve.worker.worker import Worker

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
NUM_CLOSED_PORTS = 100
SETTLE_S = 10.0
POOL_SLACK = 4  # threads the process's bounded pools may start meanwhile


@contextlib.asynccontextmanager
async def in_process_worker(role: str, model_dir, *, num_ports: int = 1, **settings):
    """A worker of `role` on `num_ports` loopback ports of one server; yields
    (its services, its addresses)."""
    services = WorkerServices(role)
    server = grpc.aio.server()
    for service in services.services:
        add_servicer(service.servicer, service.descriptor, server, parsers=service.parsers)
    ports = [server.add_insecure_port("127.0.0.1:0") for _ in range(num_ports)]
    await server.start()
    engine = await asyncio.to_thread(LLMEngine.from_pretrained, model_dir, num_kv_blocks=64)
    config = WorkerConfig(role=role, engine=engine.config, **settings)
    worker = Worker(config, engine, "fingerprint", ports[0])
    worker.start()
    services.open(worker)
    try:
        yield services, [f"127.0.0.1:{port}" for port in ports]
    finally:
        await server.stop(grace=None)
        await services.close()
        await worker.close()


def closed_ports(count: int) -> list[int]:
    """Ports nothing listens on: bound once, then let go."""
    sockets = [socket.create_server(("127.0.0.1", 0)) for _ in range(count)]
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def pusher_threads() -> int:
    return sum(thread.name == PUSHER_THREAD for thread in threading.enumerate())


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


async def settled(predicate) -> bool:
    """Whether `predicate` holds within SETTLE_S (peers close in the background)."""
    deadline = time.monotonic() + SETTLE_S
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def prefill_into(stub, address: str) -> grpc.StatusCode:
    request = prefill_pb2.PrefillRequest(
        request_id=f"to-{address}",
        prompt_token_ids=[5, 6, 7],
        sampling=sampling_params_to_proto(GREEDY),
        target=prefill_pb2.KVTarget(address=address, lease_id="no-such-lease"),
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Prefill(request, timeout=30)
    return err.value.code()


async def test_prefills_into_unreachable_decode_workers_leave_no_thread_behind(demo_model_dir):
    async with in_process_worker("prefill", demo_model_dir) as (services, [address]):
        channel = grpc.aio.insecure_channel(address)
        stub = prefill_pb2_grpc.PrefillStub(channel)
        [warm_up, *ports] = closed_ports(NUM_CLOSED_PORTS + 1)
        # the first one starts what stays: gRPC's threads, asyncio's executor threads
        await prefill_into(stub, f"127.0.0.1:{warm_up}")
        await settled(lambda: len(services.prefill.peers) == 0)
        baseline, baseline_os = threading.active_count(), os_threads()
        codes = {await prefill_into(stub, f"127.0.0.1:{port}") for port in ports}
        await channel.close()
        assert codes == {grpc.StatusCode.UNAVAILABLE}
        assert await settled(lambda: pusher_threads() == 0), f"{pusher_threads()} pushers left"
        assert len(services.prefill.peers) == 0
        # what else may add a thread is bounded: asyncio's executor, gRPC's own pool
        assert threading.active_count() <= baseline + POOL_SLACK
        assert os_threads() <= baseline_os + POOL_SLACK


async def test_more_decode_workers_than_the_bound_still_get_every_transfer(demo_model_dir):
    prompts = [[(11 * i + 3 * j) % 900 + 3 for j in range(20 + 7 * i)] for i in range(4)]
    expected = LLMEngine.from_pretrained(demo_model_dir).generate(prompts, GREEDY)
    async with (
        in_process_worker("decode", demo_model_dir, num_ports=4) as (_, decode_addresses),
        in_process_worker("prefill", demo_model_dir, max_decode_peers=2) as (services, [prefill]),
    ):
        channels = ChannelPool()
        try:
            async with HandOff(channels) as handoff:

                async def run(prompt: list[int], decode_address: str) -> list[int]:
                    attempt = Attempt(
                        f"bounded-{decode_address}", prompt, sampling_params_to_proto(GREEDY)
                    )
                    attempt = attempt.for_block_size(16)
                    deltas = handoff.generate(prefill, decode_address, attempt)
                    return [t async for delta in deltas for t in delta.token_ids]

                # four decode addresses at once through a pool of two: two peers are
                # evicted while their pushes may still run, and must finish them first
                results = await asyncio.gather(
                    *(run(p, a) for p, a in zip(prompts, decode_addresses, strict=True))
                )
        finally:
            await channels.close()
        assert results == [want.token_ids for want in expected]
        assert len(services.prefill.peers) == 2
        assert await settled(lambda: pusher_threads() == 2), (
            f"{pusher_threads()} pusher threads for a pool of 2"
        )
