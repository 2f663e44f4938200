"""Redis killed and started again empty, under running requests, and what a retry finds.

One cluster (1 prefill and 1 decode worker, 2 routers) on a Redis this module starts,
kills (SIGKILL: its data is gone) and starts again on the same port, as a Redis pod
would come back. While it is gone, running requests stream on (their routers buffer
their records and checkpoints) and a new request fails at once with UNAVAILABLE and a
retry delay. Once it is back, the workers register again and the routers write the
records of their running requests again, and every request ends identical to an
undisturbed run.

A request that failed with a status asking its client to try again (UNAVAILABLE: after
a restart a router may see no worker until their next heartbeat) is run again by a call
with its id; any other failure is given back as the error it was. Before, such a call
got an empty stream that looked finished: no tokens, no error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
import uuid

import grpc
import pytest
import redis

from pdserve.client import AsyncClient, Client, PdserveError
from pdserve.cluster.local import ClusterShape, LocalCluster, num_healthy_workers
from pdserve.cluster.supervisor import RedisChild
from pdserve.core.phase import RequestPhase
from pdserve.core.sampling_params import SamplingParams
from pdserve.rpc.wire import sampling_params_from_proto
from pdserve.rpc.wire.client import generate_request_to_proto
from pdserve.state.record import RequestRecord, request_digest
from pdserve.state.redis_server import free_port
from pdserve.state.requests import RequestStore

pytestmark = pytest.mark.cluster

NUM_RUNNING = 6
MAX_TOKENS = 800  # about 8 s on two loaded cores: they outlive the outage by far
OUTAGE_S = 1.0
UNAVAILABLE_WITHIN_S = 1.5  # "fail fast": no wait for a Redis that is not there
RECORDS_BACK_WITHIN_S = 5.0  # a running request's record is rewritten at least every second
PROMPT_IDS = [11, 57, 203, 89, 400, 17, 650, 33, 8, 120]
SHORT = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def params_of(index: int) -> SamplingParams:
    if index % 2 == 0:
        return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return SamplingParams(temperature=0.9, seed=index, max_tokens=MAX_TOKENS, ignore_eos=True)


def prompt_of(index: int) -> str:
    return f"Request {index} streams on while the request store restarts"


@pytest.fixture(scope="module")
def redis_child():
    child = RedisChild(free_port()).start()
    try:
        yield child
    finally:
        child.remove()


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory, redis_child):
    run_dir = tmp_path_factory.mktemp("redis-restart")
    with LocalCluster(
        str(demo_model_dir),
        ClusterShape(prefill=1, decode=1),
        run_dir,
        num_routers=2,
        redis=redis_child.url,
    ) as cluster:
        yield cluster


def poll(condition, timeout_s: float, every_s: float = 0.05):
    """`condition()`'s first true value within `timeout_s`, else None."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if value := condition():
                return value
        except Exception:  # a router or Redis on its way back
            pass
        time.sleep(every_s)
    return None


def wait_for(condition, timeout_s: float, what: str):
    value = poll(condition, timeout_s)
    assert value, f"not within {timeout_s} s: {what}"
    return value


async def stream_all(client: AsyncClient, index: int, wave: str, started: asyncio.Event):
    """One request's whole stream; `started` is set once its first chunk came."""
    chunks = []
    async for chunk in client.stream(prompt_of(index), params_of(index), request_id=wave):
        chunks.append(chunk)
        started.set()
    return chunks


def joined(chunks) -> tuple[list[int], str, str | None]:
    return (
        [t for c in chunks for t in c.token_ids],
        "".join(c.text for c in chunks),
        chunks[-1].finish_reason,
    )


async def run_wave(cluster, wave: str, during=None):
    """NUM_RUNNING streams, half through each router; `during()` runs (in a thread) once
    every stream has its first chunk, and its result comes back with the outputs."""
    addresses = cluster.router_addresses
    clients = [AsyncClient(addresses), AsyncClient(addresses[::-1])]
    try:
        started = [asyncio.Event() for _ in range(NUM_RUNNING)]
        streams = [
            asyncio.ensure_future(stream_all(clients[i % 2], i, f"{wave}-{i}", started[i]))
            for i in range(NUM_RUNNING)
        ]
        await asyncio.gather(*(event.wait() for event in started))
        found = None if during is None else await asyncio.to_thread(during)
        return [joined(chunks) for chunks in await asyncio.gather(*streams)], found
    finally:
        for client in clients:
            await client.close()


def restart_redis_under_running_requests(cluster, redis_child: RedisChild) -> dict:
    """Kill Redis, try a new request while it is gone, start it again, and read back
    what rebuilt itself. Every stream of the wave is running meanwhile."""
    os.kill(redis_child.proc.pid, signal.SIGKILL)
    redis_child.proc.wait()
    killed_at = time.monotonic()
    with Client(cluster.router_addresses[0], max_reconnects=0) as client:
        asked_at = time.monotonic()
        with pytest.raises(PdserveError) as refused:
            client.generate("a new request while Redis is gone", SamplingParams(max_tokens=4))
        refused_after = time.monotonic() - asked_at
    time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - killed_at)))
    redis_child.start()  # the same port, nothing in it
    back_at = time.monotonic()
    direct = redis.Redis.from_url(redis_child.url)
    wanted = [f"pdserve:req:redis-{i}" for i in range(NUM_RUNNING)]
    wait_for(lambda: all(direct.exists(key) for key in wanted), RECORDS_BACK_WITHIN_S, "records")
    records = [RequestRecord.from_json(direct.get(key)) for key in wanted]
    direct.close()
    records_back_after = time.monotonic() - back_at
    # Until the workers' next heartbeat a router may list none: a request it takes then
    # fails UNAVAILABLE, and the client's retry (same id) runs it again.
    first = cluster.router_addresses[0]
    saw_none = poll(lambda: num_healthy_workers(first) < 2, 1.5, every_s=0.01)
    with Client(cluster.router_addresses) as client:
        right_after = client.generate(PROMPT_IDS, SHORT, request_id="right-after-restart")
    for address in cluster.router_addresses:
        wait_for(lambda a=address: num_healthy_workers(a) == 2, 10.0, f"{address} routes again")
    return {
        "right_after": right_after,
        "saw_no_worker": bool(saw_none),
        "refused": refused.value,
        "refused_after": refused_after,
        "records": records,
        "records_back_after": records_back_after,
    }


def test_running_requests_stream_on_identically_through_a_redis_restart(cluster, redis_child):
    reference, _ = asyncio.run(run_wave(cluster, "reference"))
    outputs, found = asyncio.run(
        run_wave(
            cluster, "redis", lambda: restart_redis_under_running_requests(cluster, redis_child)
        )
    )
    # new requests while Redis is gone: UNAVAILABLE at once, with a retry delay
    refused: PdserveError = found["refused"]
    assert refused.code == grpc.StatusCode.UNAVAILABLE, refused
    assert refused.retry_after is not None and refused.retry_after > 0
    assert found["refused_after"] < UNAVAILABLE_WITHIN_S
    # the records of the running requests are back, naming their routers, still running
    for record in found["records"]:
        assert not record.is_terminal, record
        assert record.router_id
    print(
        f"\nredis restart: new request refused in {found['refused_after']:.3f} s; "
        f"records back {found['records_back_after']:.2f} s after Redis; a router listed "
        f"{'no' if found['saw_no_worker'] else 'all'} workers right after it"
    )
    # a request sent as Redis came back (its router may have had no worker): whole
    with Client(cluster.router_addresses[1]) as client:
        expected = client.generate(PROMPT_IDS, SHORT, request_id="after-reference")
    right_after = found["right_after"]
    assert (right_after.token_ids, right_after.text) == (expected.token_ids, expected.text)
    # and every stream ended whole, identical to the undisturbed wave
    for index, (got, expected) in enumerate(zip(outputs, reference, strict=True)):
        assert got[2] == "length" and len(got[0]) == MAX_TOKENS, (index, len(got[0]), got[2])
        assert got == expected, index
    # the finished requests' records say so, with every token counted
    with Client(cluster.router_addresses[1]) as client:
        for index in range(NUM_RUNNING):
            info = wait_for(
                lambda i=index: (r := client.get_request(f"redis-{i}")).status == "finished" and r,
                5.0,
                f"redis-{index} finished",
            )
            assert info.usage.completion_tokens == MAX_TOKENS


async def write_failed(url: str, request_id: str, params: SamplingParams, code: str, error: str):
    """The record and end entry a router leaves for a request that failed with `code`
    before its first token, as `RequestSession` writes them (the digest of what the
    client asks, so that a call with the same prompt and params may follow it)."""
    proto = generate_request_to_proto(
        PROMPT_IDS, params, request_id=request_id, resume_from=None, stream=True
    )
    digest = request_digest(PROMPT_IDS, sampling_params_from_proto(proto.sampling))
    async with RequestStore(url) as store:
        record = RequestRecord(
            request_id,
            RequestPhase.QUEUED,
            len(PROMPT_IDS),
            router_id="gone",
            request_digest=digest,
        )
        assert await store.create(record)
        assert await store.finish(request_id, RequestPhase.FAILED, "", error=error, error_code=code)


async def write_failed_asking_to_retry(url: str, request_id: str, params: SamplingParams):
    """What a router leaves for a request that failed with UNAVAILABLE before its first
    token was checkpointed (`write_failed`)."""
    error = "UnavailableError: no healthy decode worker"
    await write_failed(url, request_id, params, "UNAVAILABLE", error)


def test_a_request_that_failed_asking_to_retry_runs_again_for_a_call_with_its_id(
    cluster, redis_child
):
    params = SHORT
    asyncio.run(write_failed_asking_to_retry(redis_child.url, "failed-unavailable", params))
    with Client(cluster.router_addresses) as client:
        expected = client.generate(PROMPT_IDS, params, request_id="not-failed")
        again = client.generate(PROMPT_IDS, params, request_id="failed-unavailable")
        assert (again.token_ids, again.text, again.finish_reason) == (
            expected.token_ids,
            expected.text,
            "length",
        )
        info = client.get_request("failed-unavailable")
        assert (info.status, info.usage.completion_tokens) == ("finished", 24)
        # and a call after that gets the finished output again, not a third run
        replayed = client.generate(PROMPT_IDS, params, request_id="failed-unavailable")
        assert replayed.token_ids == expected.token_ids


def test_a_client_ahead_of_a_failed_requests_checkpoints_gets_it_run_again_from_where_it_is(
    cluster, redis_child
):
    """The router sends a token before its checkpoint lands. If the request then fails
    asking to try again (its stream ends at 0 tokens), a client holding that first token
    resumes from 1: the request runs again and the client gets the rest, not an
    OUT_OF_RANGE for an offset beyond a stream that is about to go on."""
    params = SHORT
    asyncio.run(write_failed_asking_to_retry(redis_child.url, "failed-client-ahead", params))
    with Client(cluster.router_addresses) as client:
        expected = client.generate(PROMPT_IDS, params, request_id="not-failed-ahead")
        rest = client.generate(PROMPT_IDS, params, request_id="failed-client-ahead", resume_from=1)
        assert (rest.token_ids, rest.finish_reason) == (expected.token_ids[1:], "length")
        info = client.get_request("failed-client-ahead")
        assert (info.status, info.usage.completion_tokens) == ("finished", 24)


@pytest.mark.parametrize(
    ("code", "expected"),
    [("INTERNAL", grpc.StatusCode.INTERNAL), ("", grpc.StatusCode.UNKNOWN)],
    ids=["failed-internal", "failed-without-a-code"],
)
def test_a_request_that_failed_for_good_gives_its_error_again_never_an_empty_stream(
    cluster, redis_child, code, expected
):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    request_id = f"failed-{code or 'nocode'}"
    error = "AioRpcError: the engine step failed"
    asyncio.run(write_failed(redis_child.url, request_id, params, code, error))
    with Client(cluster.router_addresses) as client, pytest.raises(PdserveError) as failed:
        client.generate(PROMPT_IDS, params, request_id=request_id)
    assert failed.value.code == expected
    assert "the engine step failed" in failed.value.message


# -- the store's side: who may run a request again -----------------------------------------


async def test_a_request_that_failed_asking_to_retry_is_adopted_once_and_its_stream_goes_on(
    redis_url,
):
    prefix = f"adopt-{uuid.uuid4().hex}"
    async with (
        RequestStore(redis_url, key_prefix=prefix) as first,
        RequestStore(redis_url, key_prefix=prefix) as second,
    ):
        assert await first.create(RequestRecord("r", RequestPhase.QUEUED, 3, router_id="first"))
        first.append_tokens("r", [1, 2], "ab")
        error = "UnavailableError: no healthy decode worker"
        await first.finish("r", RequestPhase.FAILED, "", error=error, error_code="UNAVAILABLE")
        failed = await second.get("r")
        assert failed.may_run_again
        again = dataclasses.replace(
            failed, router_id="second", status=RequestPhase.QUEUED, error="", error_code=""
        )
        assert await second.adopt(again, failed.updated_at) == 2  # the tokens it holds
        # another router that read the same failed record comes second: it follows
        third = dataclasses.replace(again, router_id="third")
        assert await first.adopt(third, failed.updated_at) is None
        second.append_tokens("r", [3], "c")
        assert await second.finish("r", RequestPhase.FINISHED, "length")
        assert await first.read_tokens("r", 0) == ([1, 2, 3], "abc")  # the end entry went
        record = await first.get("r")
        assert (record.status, record.router_id, record.completion_tokens) == (
            RequestPhase.FINISHED,
            "second",
            3,
        )


@pytest.mark.parametrize(
    ("status", "error_code"),
    [(RequestPhase.FINISHED, ""), (RequestPhase.FAILED, "INTERNAL"), (RequestPhase.FAILED, "")],
)
async def test_a_request_that_ended_for_good_is_never_adopted(redis_url, status, error_code):
    async with RequestStore(redis_url, key_prefix=f"adopt-{uuid.uuid4().hex}") as store:
        assert await store.create(RequestRecord("r", RequestPhase.QUEUED, 3, router_id="first"))
        reason = "length" if status is RequestPhase.FINISHED else ""
        await store.finish("r", status, reason, error_code=error_code)
        ended = await store.get("r")
        assert not ended.may_run_again
        again = dataclasses.replace(ended, router_id="second", status=RequestPhase.QUEUED)
        assert await store.adopt(again, ended.updated_at) is None
        assert (await store.get("r")).router_id == "first"
