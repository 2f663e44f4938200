"""A worker whose heartbeat stopped is not healthy, even where Redis cannot say so.

Redis' key expiry drops a dead worker while Redis answers. When Redis went away with the
workers (a whole machine, or `pdserve up`'s children all killed), the router kept its
last listing and showed the dead workers as healthy for ever; now a worker whose
heartbeat the router has not seen move for the registry's TTL is unhealthy.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from procs import router_process

from pdserve.api.v1 import router_pb2, router_pb2_grpc
from pdserve.core.workers import WorkerInfo
from pdserve.router.discovery import RedisDiscovery
from pdserve.state.redis_server import PrivateRedis
from pdserve.state.registry import WorkerRegistry, heartbeat

pytestmark = pytest.mark.cluster

TTL_S = 0.5
HEARTBEAT_S = 0.1
ROUTER_TTL_S = 3.0  # the registry's default, which the router process uses


async def wait_until(predicate, timeout_s: float, what: str) -> float:
    """Seconds it took `predicate` (a coroutine function) to hold; fails after `timeout_s`."""
    started = time.monotonic()
    while not await predicate():
        if time.monotonic() - started > timeout_s:
            pytest.fail(f"{what}: not within {timeout_s}s")
        await asyncio.sleep(0.05)
    return time.monotonic() - started


def decode_worker(name: str, port: int) -> WorkerInfo:
    return WorkerInfo(worker_id=name, role="decode", address=f"10.0.0.1:{port}")


def beating(registry: WorkerRegistry, info: WorkerInfo, interval_s: float) -> asyncio.Task:
    stop = asyncio.Event()  # never set: the task is cancelled, as a killed worker stops
    return asyncio.create_task(heartbeat(registry, lambda: info, interval_s, stop=stop))


async def test_a_live_worker_stays_routable_for_many_ttls(redis_url):
    registry = WorkerRegistry(redis_url, key_prefix=f"alive-{time.time_ns()}", ttl_s=TTL_S)
    discovery = RedisDiscovery(registry, refresh_interval_s=HEARTBEAT_S)
    beat = beating(registry, decode_worker("alive", 1), HEARTBEAT_S)
    try:
        await asyncio.sleep(2 * HEARTBEAT_S)
        await discovery.start()
        for _ in range(int(4 * TTL_S / HEARTBEAT_S)):
            assert [w.worker_id for w in discovery.workers("decode")] == ["alive"]
            await asyncio.sleep(HEARTBEAT_S)
    finally:
        beat.cancel()
        await discovery.stop()
        await registry.close()


async def test_workers_gone_with_redis_are_not_routed_to_after_the_ttl():
    server = PrivateRedis().start()  # our own, so that it can die with the workers
    registry = WorkerRegistry(server.url, ttl_s=TTL_S)
    discovery = RedisDiscovery(registry, refresh_interval_s=HEARTBEAT_S)
    beats = [beating(registry, decode_worker(f"w{i}", i), HEARTBEAT_S) for i in range(2)]
    try:
        await asyncio.sleep(2 * HEARTBEAT_S)
        await discovery.start()
        assert len(discovery.workers("decode")) == 2
        for beat in beats:
            beat.cancel()
        server.stop()

        async def none_routable() -> bool:
            return discovery.workers("decode") == []

        took = await wait_until(none_routable, 4 * TTL_S, "dead workers still routed to")
        assert took >= TTL_S / 2  # a short outage keeps the last listing
    finally:
        await discovery.stop()
        await registry.close()
        server.stop()


async def test_list_workers_stops_showing_dead_workers_healthy(demo_model_dir, tmp_path):
    server = PrivateRedis().start()
    registry = WorkerRegistry(server.url, ttl_s=ROUTER_TTL_S)
    beat = beating(registry, decode_worker("doomed", 7), 1.0)
    try:
        with router_process(demo_model_dir, server.url, log_dir=tmp_path) as (router, _):
            async with grpc.aio.insecure_channel(router) as channel:
                stub = router_pb2_grpc.RouterStub(channel)

                async def healthy_listed() -> list[str]:
                    reply = await stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=5)
                    return [w.worker_id for w in reply.workers if w.healthy]

                await wait_until(healthy_listed, 10, "the worker never showed")
                beat.cancel()
                server.stop()  # Redis dies with the worker: nothing expires its key now

                async def none_healthy() -> bool:
                    return not await healthy_listed()

                await wait_until(none_healthy, ROUTER_TTL_S + 3, "a dead worker listed healthy")
    finally:
        beat.cancel()
        await registry.close()
        server.stop()
