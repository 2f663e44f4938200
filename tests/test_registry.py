"""The worker registry against a real Redis: heartbeats with a TTL, listing, removal."""

import asyncio
import dataclasses
import logging
import time
import uuid

import pytest

from pdserve.core.workers import MAX_CACHED_BLOCK_HASHES, WorkerInfo
from pdserve.state.registry import WorkerRegistry, heartbeat

WAIT_S = 3.0


@pytest.fixture
async def registry(redis_url):
    registry = WorkerRegistry(redis_url, key_prefix=f"test-{uuid.uuid4().hex}", ttl_s=0.5)
    yield registry
    await registry.close()


def worker(worker_id: str, role: str = "decode", **fields) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, address=f"10.0.0.1:{worker_id}", **fields)


async def wait_for(predicate, timeout_s: float = WAIT_S):
    """Poll an async predicate until it returns something truthy; fail after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = await predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout_s}s")
        await asyncio.sleep(0.02)


def test_serves_its_role_and_both_serves_either():
    assert worker("1", "prefill").serves("prefill")
    assert not worker("1", "prefill").serves("decode")
    assert worker("1", "both").serves("prefill") and worker("1", "both").serves("decode")
    with pytest.raises(ValueError, match="role"):
        worker("1", "encode")


def test_json_round_trip_ignores_unknown_fields():
    info = worker("1", cached_block_hashes=["ab" * 16], free_blocks=7)
    assert WorkerInfo.from_json(info.to_json()) == info
    assert WorkerInfo.from_json(info.to_json()[:-1] + b',"from_the_future":1}') == info


async def test_publish_then_list_round_trips(registry):
    info = worker(
        "1",
        model_fingerprint="fp",
        free_blocks=10,
        total_blocks=64,
        running=2,
        waiting=1,
        open_leases=1,
        cached_block_hashes=["00" * 16, "ff" * 16],
    )
    before = time.time()
    await registry.publish(info)
    [listed] = await registry.list()
    assert listed.updated_at >= before  # stamped on publish
    assert listed == dataclasses.replace(info, updated_at=listed.updated_at)


async def test_list_filters_by_role(registry):
    for worker_id, role in (("p", "prefill"), ("d", "decode"), ("b", "both")):
        await registry.publish(worker(worker_id, role))
    assert [w.worker_id for w in await registry.list()] == ["b", "d", "p"]
    assert [w.worker_id for w in await registry.list("prefill")] == ["b", "p"]
    assert [w.worker_id for w in await registry.list("decode")] == ["b", "d"]


async def test_publish_keeps_only_the_newest_block_hashes(registry):
    hashes = [f"{i:032x}" for i in range(MAX_CACHED_BLOCK_HASHES + 10)]
    await registry.publish(worker("1", cached_block_hashes=hashes))
    [listed] = await registry.list()
    assert listed.cached_block_hashes == hashes[10:]


async def test_a_worker_that_stops_heartbeating_expires_within_the_ttl(registry, redis_client):
    await registry.publish(worker("1"))
    published = time.monotonic()
    assert await registry.list()

    async def gone():
        return await registry.list() == []

    await wait_for(gone)
    assert time.monotonic() - published < 1.0
    # and listing cleaned the index of it
    assert redis_client.scard(f"{registry.key_prefix}:workers") == 0


async def test_remove_drops_the_worker_at_once(registry):
    await registry.publish(worker("1"))
    await registry.publish(worker("2"))
    await registry.remove("1")
    assert [w.worker_id for w in await registry.list()] == ["2"]


async def test_heartbeat_publishes_repeatedly_and_removes_on_stop(registry):
    stop = asyncio.Event()
    calls = 0

    def info_fn():
        nonlocal calls
        calls += 1
        return worker("1", running=calls)

    task = asyncio.create_task(heartbeat(registry, info_fn, interval_s=0.05, stop=stop))

    async def published_thrice():
        listed = await registry.list()
        return listed and listed[0].running >= 3

    await wait_for(published_thrice)
    # heartbeats outlive the TTL: the worker stays listed past it
    await asyncio.sleep(registry.ttl_s + 0.1)
    assert [w.worker_id for w in await registry.list()] == ["1"]
    stop.set()
    await asyncio.wait_for(task, WAIT_S)
    assert await registry.list() == []


async def test_heartbeat_interval_must_be_shorter_than_the_ttl(registry):
    with pytest.raises(ValueError, match="interval_s"):
        await heartbeat(registry, lambda: worker("1"), interval_s=0.5, stop=asyncio.Event())


async def test_heartbeat_survives_an_unreachable_redis(caplog):
    # port 1 on loopback: nothing listens there, so every call is refused
    registry = WorkerRegistry("redis://127.0.0.1:1/0", ttl_s=0.5)
    stop = asyncio.Event()
    calls = 0

    def info_fn():
        nonlocal calls
        calls += 1
        return worker("1")

    try:
        with caplog.at_level(logging.WARNING, logger="pdserve.state.registry"):
            task = asyncio.create_task(heartbeat(registry, info_fn, interval_s=0.05, stop=stop))
            deadline = time.monotonic() + WAIT_S
            while calls < 3 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert calls >= 3 and not task.done()  # still ticking
            stop.set()
            await asyncio.wait_for(task, WAIT_S)  # returns, does not raise
    finally:
        await registry.close()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("heartbeat of worker 1 failed" in m for m in messages) == 1  # once per outage
    assert any("could not remove worker 1" in m for m in messages)
