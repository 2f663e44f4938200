"""The router's request state on a real Redis: records, batched checkpoints, resume, outages."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis.asyncio as aioredis

from pdserve.core.errors import CheckpointsLostError, StateUnavailableError, UnknownRequestError
from pdserve.core.phase import RequestPhase
from pdserve.state import redis_server
from pdserve.state.redis_server import PrivateRedis
from pdserve.state.requests import RequestRecord, RequestStore

# What the engine emits, one delta per step: token ids and the text they completed.
# "é" takes two tokens (the first completes no character); the last delta has no token,
# only text held back until the end (as a stop-string matcher flushes it).
DELTAS = [
    ([11], "Hello"),
    ([12], ","),
    ([13], ""),
    ([14], " é"),
    ([15, 16], " wor"),
    ([17], "ld"),
    ([], "!"),
]
TOKENS = [t for ids, _ in DELTAS for t in ids]
TEXT = "".join(text for _, text in DELTAS)


def record(request_id: str = "r1", **fields) -> RequestRecord:
    return RequestRecord(
        request_id=request_id,
        status=RequestPhase.QUEUED,
        prompt_tokens=7,
        router_id="router-a",
        **fields,
    )


@pytest.fixture
async def store(redis_url):
    # a prefix of its own per test: no cleanup needed, no test sees another's keys
    async with RequestStore(redis_url, key_prefix=f"test-{uuid.uuid4().hex}") as store:
        yield store


@pytest.fixture
async def client(redis_url):
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
def private_redis():
    server = PrivateRedis().start()
    yield server
    server.stop()


def append_all(store: RequestStore, request_id: str, deltas=DELTAS) -> None:
    for ids, text in deltas:
        store.append_tokens(request_id, ids, text)


async def eventually(check, timeout_s: float = 5.0):
    """Poll an async check until it returns a truthy value."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = await check()
        if result or time.monotonic() > deadline:
            return result
        await asyncio.sleep(0.02)


async def test_create_is_atomic_create_if_absent(store, redis_url):
    assert await store.create(record(params_json='{"max_tokens":8}'))
    assert not await store.create(record(params_json='{"max_tokens":9}'))
    # another router sharing the Redis sees the first record and cannot create it either
    async with RequestStore(redis_url, key_prefix=store.key_prefix) as other:
        assert not await other.create(record())
        got = await other.get("r1")
    assert got.params_json == '{"max_tokens":8}'
    assert got.status is RequestPhase.QUEUED
    assert await store.get("nope") is None


async def test_update_then_get_round_trip(store):
    await store.create(record())
    assert await store.update("r1", status=RequestPhase.PREFILLING, prefill_worker="p0")
    assert await store.update("r1", status="decoding", decode_worker="d1", cached_prompt_tokens=4)
    got = await store.get("r1")
    assert (got.status, got.prefill_worker, got.decode_worker) == ("decoding", "p0", "d1")
    assert got.cached_prompt_tokens == 4 and got.router_id == "router-a"
    assert got.updated_at >= got.created_at > 0


async def test_update_refuses_terminal_status_and_unknown_fields(store):
    await store.create(record())
    with pytest.raises(ValueError, match="finish"):
        await store.update("r1", status=RequestPhase.FINISHED)
    with pytest.raises(ValueError, match="colour"):
        await store.update("r1", colour="red")


async def test_only_the_creating_store_writes(store, redis_url):
    await store.create(record())
    async with RequestStore(redis_url, key_prefix=store.key_prefix) as other:
        assert not await other.update("r1", status=RequestPhase.DECODING)
        assert not await other.finish("r1", RequestPhase.CANCELLED, "abort")
    assert (await store.get("r1")).status is RequestPhase.QUEUED


async def test_appends_reach_redis_in_one_round_trip_for_all_requests(private_redis):
    client = aioredis.Redis.from_url(private_redis.url)

    async def calls(command: str) -> int:
        return (await client.info("commandstats")).get(f"cmdstat_{command}", {}).get("calls", 0)

    async with RequestStore(private_redis.url, checkpoint_interval_s=60) as store:
        for request_id in ("a", "b", "c"):
            await store.create(record(request_id))
        execs, xadds = await calls("exec"), await calls("xadd")
        for ids, text in DELTAS:  # interleaved, the loop running between them
            for request_id in ("a", "b", "c"):
                store.append_tokens(request_id, ids, text)
                await asyncio.sleep(0)
        assert await calls("exec") == execs  # appending alone sends nothing
        assert await store.flush()
        assert await calls("exec") == execs + 1
        assert await calls("xadd") == xadds + 3  # one checkpoint entry per request
        for request_id in ("a", "b", "c"):
            assert await store.read_tokens(request_id, 0) == (TOKENS, TEXT)
    await client.aclose()


async def test_checkpoint_lands_after_the_interval(redis_url):
    prefix = uuid.uuid4().hex
    async with RequestStore(
        redis_url, key_prefix=prefix, checkpoint_interval_s=0.05, checkpoint_tokens=1000
    ) as store:
        await store.create(record())
        store.append_tokens("r1", [5], "x")

        async def landed():
            return await store.read_tokens("r1", 0) == ([5], "x")

        assert await eventually(landed, timeout_s=2.0)


async def test_checkpoint_lands_once_checkpoint_tokens_are_buffered(redis_url):
    prefix = uuid.uuid4().hex
    async with RequestStore(
        redis_url, key_prefix=prefix, checkpoint_interval_s=60, checkpoint_tokens=4
    ) as store:
        await store.create(record())
        for token in range(4):
            store.append_tokens("r1", [token], str(token))

        async def landed():
            return (await store.read_tokens("r1", 0))[0] == [0, 1, 2, 3]

        assert await eventually(landed, timeout_s=2.0)
        assert (await store.get("r1")).completion_tokens == 4


async def test_read_tokens_from_any_offset(store):
    await store.create(record())
    append_all(store, "r1", DELTAS[:3])
    await store.flush()
    append_all(store, "r1", DELTAS[3:])
    await store.finish("r1", RequestPhase.FINISHED, "stop")
    for offset in range(len(TOKENS) + 1):
        ids, _ = await store.read_tokens("r1", offset)
        assert ids == TOKENS[offset:]
    assert await store.read_tokens("r1", 0) == (TOKENS, TEXT)
    assert await store.read_tokens("r1", 3) == (TOKENS[3:], " é world!")
    assert await store.read_tokens("r1", len(TOKENS)) == ([], "!")  # the text-only last delta


async def test_resume_after_any_delta_gives_exactly_the_rest_of_the_text(store):
    await store.create(record())
    for ids, text in DELTAS:  # a checkpoint after every delta: entries of one delta each
        store.append_tokens("r1", ids, text)
        await store.flush()
    await store.finish("r1", RequestPhase.FINISHED, "stop")
    # a client that got deltas [0, n) and disconnected resumes from the tokens it holds
    for n in range(len(DELTAS)):
        seen = DELTAS[:n]
        offset = sum(len(ids) for ids, _ in seen)
        _, rest = await store.read_tokens("r1", offset)
        assert "".join(text for _, text in seen) + rest == TEXT


async def test_offset_past_the_end_of_a_finished_request(store):
    await store.create(record())
    append_all(store, "r1")
    await store.finish("r1", RequestPhase.FINISHED, "stop")
    with pytest.raises(ValueError, match="resume_from beyond the stream"):
        await store.read_tokens("r1", len(TOKENS) + 1)
    with pytest.raises(ValueError, match="resume_from beyond the stream"):
        async for _ in store.follow("r1", len(TOKENS) + 1):
            pass
    with pytest.raises(UnknownRequestError):
        await store.read_tokens("nope", 0)
    with pytest.raises(UnknownRequestError):
        async for _ in store.follow("nope", 0):
            pass


async def test_offset_past_the_end_of_a_failed_request_gives_the_failure(store):
    """Its router may have sent tokens before their checkpoints landed: the reader gets
    the failure (and may run the request again), not an offset error."""
    await store.create(record())
    append_all(store, "r1", DELTAS[:2])
    await store.finish("r1", RequestPhase.FAILED, "", error="x", error_code="UNAVAILABLE")
    past = sum(len(ids) for ids, _ in DELTAS[:2]) + 1
    assert await store.read_tokens("r1", past) == ([], "")
    ((ids, text, final),) = await collect(store, "r1", past)
    assert (ids, text, final.status, final.error_code) == (
        [],
        "",
        RequestPhase.FAILED,
        "UNAVAILABLE",
    )


async def collect(store: RequestStore, request_id: str, offset: int) -> list:
    return [item async for item in store.follow(request_id, offset)]


async def test_follow_sees_tokens_appended_later_and_ends_at_finish(store):
    await store.create(record())
    append_all(store, "r1", DELTAS[:2])
    await store.flush()
    follower = asyncio.create_task(collect(store, "r1", 0))
    for ids, text in DELTAS[2:]:
        await asyncio.sleep(0.02)
        store.append_tokens("r1", ids, text)
        await store.flush()
    await store.finish("r1", RequestPhase.FINISHED, "stop")
    items = await asyncio.wait_for(follower, 5.0)
    assert len(items) > 1  # it streamed, not just read the end
    assert [t for ids, _, _ in items for t in ids] == TOKENS
    assert "".join(text for _, text, _ in items) == TEXT
    assert all(final is None for _, _, final in items[:-1])
    final = items[-1][2]
    assert final.status is RequestPhase.FINISHED and final.finish_reason == "stop"
    assert final.completion_tokens == len(TOKENS) and final.finished_at > 0


async def test_follow_from_an_offset_ahead_of_the_checkpoints_waits_for_it(store):
    await store.create(record())
    append_all(store, "r1", DELTAS[:2])
    await store.flush()
    follower = asyncio.create_task(collect(store, "r1", 4))  # the client saw 4 tokens
    await asyncio.sleep(0.05)
    append_all(store, "r1", DELTAS[2:])
    await store.finish("r1", RequestPhase.FAILED, "", error="UNAVAILABLE: decode worker lost")
    items = await asyncio.wait_for(follower, 5.0)
    assert [t for ids, _, _ in items for t in ids] == TOKENS[4:]
    assert "".join(text for _, text, _ in items) == " world!"
    assert items[-1][2].error == "UNAVAILABLE: decode worker lost"


async def test_a_range_written_twice_is_read_once(store, client):
    await store.create(record())
    append_all(store, "r1", DELTAS[:3])
    await store.flush()
    # what a retry after an ambiguous failure (EXEC applied, reply lost) leaves behind
    stream = f"{store.key_prefix}:tokens:r1"
    ((_, fields),) = await client.xrange(stream)
    await client.xadd(stream, fields)
    append_all(store, "r1", DELTAS[3:])
    await store.finish("r1", RequestPhase.FINISHED, "stop")
    assert await client.xlen(stream) == 4
    assert await store.read_tokens("r1", 0) == (TOKENS, TEXT)
    assert await store.read_tokens("r1", 2) == (TOKENS[2:], "".join(t for _, t in DELTAS[2:]))


async def test_keys_carry_the_ttl_and_writes_refresh_it(redis_url, client):
    prefix = uuid.uuid4().hex
    async with RequestStore(redis_url, key_prefix=prefix, ttl_s=30) as store:
        await store.create(record())
        append_all(store, "r1", DELTAS[:2])
        await store.flush()
        record_key, stream_key = f"{prefix}:req:r1", f"{prefix}:tokens:r1"
        assert 25_000 < await client.pttl(record_key) <= 30_000
        assert 25_000 < await client.pttl(stream_key) <= 30_000
        await client.pexpire(record_key, 1000)
        await client.pexpire(stream_key, 1000)
        await store.finish("r1", RequestPhase.CANCELLED, "abort")
        assert 25_000 < await client.pttl(record_key) <= 30_000
        assert 25_000 < await client.pttl(stream_key) <= 30_000


async def test_an_outage_fails_new_requests_fast_and_running_ones_catch_up(monkeypatch):
    server = PrivateRedis().start()
    port = server.port
    try:
        async with RequestStore(server.url, checkpoint_interval_s=0.02) as store:
            await store.create(record())
            append_all(store, "r1", DELTAS[:3])
            assert await store.flush()
            server.stop()  # Redis goes away, and comes back empty

            started = time.monotonic()
            with pytest.raises(StateUnavailableError):
                await store.create(record("r2"))
            with pytest.raises(StateUnavailableError):
                await store.get("r1")
            append_all(store, "r1", DELTAS[3:])  # the running stream goes on
            assert await store.update("r1", status=RequestPhase.DECODING)
            assert await store.finish("r1", RequestPhase.FINISHED, "stop")
            assert time.monotonic() - started < 1.0

            monkeypatch.setattr(redis_server, "free_port", lambda host: port)
            server = PrivateRedis().start()

            async def caught_up():
                got = await store.get("r1")
                return got if got is not None and got.is_terminal else None

            got = await eventually(caught_up)
            assert got is not None, "the buffered state never landed"
            assert (got.status, got.prompt_tokens, got.completion_tokens) == ("finished", 7, 7)
            # the tokens from before the outage died with that Redis; the rest landed
            assert await store.read_tokens("r1", 3) == (TOKENS[3:], " é world!")
            with pytest.raises(CheckpointsLostError):
                await store.read_tokens("r1", 0)
            assert [item[0] for item in await collect(store, "r1", 5)] == [TOKENS[5:]]
    finally:
        server.stop()
