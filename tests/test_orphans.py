"""A dead router's requests keep running on their decode worker as orphans
(`--orphan-timeout`), for the router that takes them over to re-attach.

Real processes on loopback: 2 routers, a prefill and a decode worker, Redis. A router
is killed (SIGKILL) mid-stream; the client resumes on the other router, which re-attaches
the request where it runs: the stream is identical to an uninterrupted run, the request
kept its first run's name on the decode worker (a run again goes by `ID@router`) and its
prompt's KV was pushed at most once (the router may also colocate it), so nothing ran
again. An orphan that
nobody re-attaches is aborted once its time is up, and its blocks are free; a request
its client cancels is still aborted at once.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from router_failover import assert_seamless, kill_router, wait_until_routers_serve

from pdserve.api.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from pdserve.client import AsyncClient, Client, PdserveError
from pdserve.cluster.load import is_idle, wait_idle, worker_load
from pdserve.cluster.local import ClusterShape, LocalCluster
from pdserve.cluster.processes import ChildProcess
from pdserve.cluster.supervisor import Backoff
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.outputs import RequestOutput
from pdserve.state.requests import RequestStore
from pdserve.worker.orphans import ReattachRangeError, kept_from
from pdserve.worker.outbox import PendingDeltas

pytestmark = pytest.mark.cluster

ORPHAN_TIMEOUT_S = 8.0  # above a takeover's (3 s of silence, then the re-attach)
PROMPT = "The router that streams this dies, and its request lives on"
# still running when the router taking it over re-attaches: it gets what was kept, then
# the live tokens
GREEDY = SamplingParams(temperature=0.0, max_tokens=800, ignore_eos=True)
# shorter: likely finished by then, so it gets what was kept, to the end
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=77, max_tokens=300, ignore_eos=True)
UNSEEDED = SamplingParams(temperature=1.0, max_tokens=300, ignore_eos=True)
# long enough to be still running when the router dies and for a while after
LONG = SamplingParams(temperature=0.0, max_tokens=3800, ignore_eos=True)
KILL_AFTER_TOKENS = 40
FAILOVER_BUDGET_S = 30.0
NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    quick = Backoff(first_delay_s=0.1)  # a killed router comes back for the next test
    with LocalCluster(
        str(demo_model_dir),
        ClusterShape(prefill=1, decode=1),
        tmp_path_factory.mktemp("orphans"),
        num_routers=2,
        supervise=True,
        backoff=quick,
        metrics=True,
        worker_args=["--orphan-timeout", str(ORPHAN_TIMEOUT_S)],
    ) as cluster:
        yield cluster


def worker(cluster: LocalCluster, role: str) -> ChildProcess:
    [child] = [w for w in cluster.workers if w.role == role]
    return child


def metric(cluster: LocalCluster, role: str, name: str, **labels: str) -> float:
    """The sum of a worker's samples named `name` with `labels`."""
    with urllib.request.urlopen(f"http://{worker(cluster, role).metrics_address}/metrics") as r:
        families = text_string_to_metric_families(r.read().decode())
        return sum(
            s.value
            for f in families
            for s in f.samples
            if s.name == name and labels.items() <= s.labels.items()
        )


def kv_pushes(cluster: LocalCluster) -> float:
    """Prompts whose KV the prefill worker pushed to the decode worker so far."""
    return metric(cluster, "prefill", "pdserve:kv_transfer_seconds_count", side="send")


def reattached(cluster: LocalCluster) -> float:
    return metric(cluster, "decode", "pdserve:orphans_reattached_total")


def decode_request_id(cluster: LocalCluster, request_id: str) -> str:
    """The request's name on its decode worker, as its record says."""

    async def get():
        async with RequestStore(cluster.redis) as store:
            return (await store.get(request_id)).decode_request_id

    return asyncio.run(get())


def reference(cluster: LocalCluster, params: SamplingParams):
    with Client(cluster.router_addresses[1]) as client:
        return client.generate(PROMPT, params)


def killed_mid_stream(cluster: LocalCluster, params: SamplingParams, request_id: str):
    """Stream through a client given both routers, killing the one it is on after
    KILL_AFTER_TOKENS tokens; the chunks the caller saw."""
    chunks, killed = [], False
    with Client(cluster.router_addresses) as client:
        for chunk in client.stream(PROMPT, params, request_id=request_id):
            chunks.append(chunk)
            if not killed and chunk.offset + len(chunk.token_ids) >= KILL_AFTER_TOKENS:
                kill_router(cluster, client.current_address)
                killed = True
        assert client.num_reconnects >= 1
    return chunks


@pytest.mark.parametrize("params", [GREEDY, UNSEEDED], ids=["greedy", "unseeded"])
def test_the_router_taking_over_re_attaches_and_nothing_runs_twice(cluster, params):
    wait_until_routers_serve(cluster, FAILOVER_BUDGET_S)
    request_id = f"orphan-{params.temperature}-{params.seed}"
    pushes, reattaches = kv_pushes(cluster), reattached(cluster)
    chunks = killed_mid_stream(cluster, params, request_id)
    assert decode_request_id(cluster, request_id) == request_id, "it ran again"
    assert kv_pushes(cluster) <= pushes + 1, "its prompt was prefilled again"
    assert reattached(cluster) == reattaches + 1
    if params.seed is None and params.temperature:  # its output as the store holds it
        with Client(cluster.router_addresses) as client:
            expected = client.generate(PROMPT, params, request_id=request_id)
    else:
        expected = reference(cluster, params)
    assert_seamless(chunks, expected)


def test_an_async_client_rides_over_a_killed_router_on_the_orphan(cluster):
    wait_until_routers_serve(cluster, FAILOVER_BUDGET_S)
    expected = reference(cluster, SEEDED)
    pushes = kv_pushes(cluster)

    async def run():
        chunks, killed = [], False
        async with AsyncClient(list(reversed(cluster.router_addresses))) as client:
            async for chunk in client.stream(PROMPT, SEEDED, request_id="orphan-async"):
                chunks.append(chunk)
                if not killed and chunk.offset + len(chunk.token_ids) >= KILL_AFTER_TOKENS:
                    kill_router(cluster, client.current_address)
                    killed = True
        return chunks

    chunks = asyncio.run(run())
    assert decode_request_id(cluster, "orphan-async") == "orphan-async"
    assert kv_pushes(cluster) <= pushes + 1
    assert_seamless(chunks, expected)


def test_an_orphan_nobody_re_attaches_is_aborted_after_the_timeout(cluster):
    wait_until_routers_serve(cluster, FAILOVER_BUDGET_S)
    decode = worker(cluster, "decode")
    address = cluster.router_addresses[0]
    expired = metric(cluster, "decode", "pdserve:orphans_expired_total")
    killed = False
    with Client(address, max_reconnects=0) as client:
        with pytest.raises(PdserveError):
            for chunk in client.stream(PROMPT, LONG):
                # once: messages already on their way still arrive after the kill
                if not killed and chunk.offset + len(chunk.token_ids) >= KILL_AFTER_TOKENS:
                    kill_router(cluster, address)
                    killed = True
        killed_at = time.monotonic()
    time.sleep(1.0)
    load = worker_load(decode.address, "decode")
    assert load.running == 1 and load.free_blocks < load.total_blocks, "aborted at once"
    assert metric(cluster, "decode", "pdserve:orphans_kept") == 1
    load = wait_idle(decode.address, "decode", ORPHAN_TIMEOUT_S + 10)
    freed_after = time.monotonic() - killed_at
    assert is_idle(load), f"still held {freed_after:.1f}s after its router died: {load}"
    assert freed_after < ORPHAN_TIMEOUT_S + 10
    # a request that finished meanwhile freed its blocks at once; it is kept (its
    # messages) until the timeout all the same, then counted as expired
    deadline = killed_at + ORPHAN_TIMEOUT_S + 10
    while metric(cluster, "decode", "pdserve:orphans_kept"):
        assert time.monotonic() < deadline, "the orphan outlived its timeout"
        time.sleep(0.2)
    assert metric(cluster, "decode", "pdserve:orphans_expired_total") == expired + 1


def test_a_cancelled_request_is_aborted_at_once(cluster):
    wait_until_routers_serve(cluster, FAILOVER_BUDGET_S)
    decode = worker(cluster, "decode")
    with Client(cluster.router_addresses[1]) as client:
        for chunk in client.stream(PROMPT, LONG):
            if chunk.offset + len(chunk.token_ids) >= KILL_AFTER_TOKENS:
                break  # closes the stream: the router detaches the request
    load = wait_idle(decode.address, "decode", ORPHAN_TIMEOUT_S / 2)
    assert is_idle(load), load


async def relay_errors(address: str, attaches: list[decode_pb2.RelayAttach]) -> dict:
    """Send attaches on a raw Relay call; each stream id's error code."""
    errors: dict[int, int] = {}
    async with grpc.aio.insecure_channel(address) as channel:
        call = decode_pb2_grpc.DecodeStub(channel).Relay()
        for attach in attaches:
            await call.write(decode_pb2.RelayCommand(attach=attach))
        while len(errors) < len(attaches):
            for item in (await call.read()).items:
                errors[item.stream_id] = item.error_code
        await call.done_writing()
    return errors


def test_a_re_attach_to_no_orphan_is_refused_with_not_found(cluster):
    reattach = decode_pb2.RelayReattach(request_id="no-such-request", from_token=3)
    empty = decode_pb2.RelayAttach(stream_id=2)  # no lease, generation or orphan named
    attaches = [decode_pb2.RelayAttach(stream_id=1, reattach=reattach), empty]
    errors = asyncio.run(relay_errors(worker(cluster, "decode").address, attaches))
    assert errors == {1: NOT_FOUND, 2: grpc.StatusCode.INVALID_ARGUMENT.value[0]}


def step(token_id: int, text: str, finished: bool = False) -> RequestOutput:
    reason = "length" if finished else None
    return RequestOutput("r", [], [token_id], text, finished=finished, finish_reason=reason)


def test_the_kept_messages_replay_from_any_token_cut_exactly_with_their_text():
    """What a re-attach from token N gets: tokens N.. with exactly their text, whether N
    falls inside a message, on its edge, at the end, or only in what waited unsent."""
    pending = PendingDeltas(stream_interval=3, num_output_tokens=1, keep=True)  # 0: prefill's
    steps = [step(10, "a"), step(11, "bc"), step(12, "d"), step(13, "ef"), step(14, "g", True)]
    for output in steps[:3]:
        pending.add(output)
    pending.take()  # one message of tokens 1-3, sent
    for output in steps[3:]:
        pending.add(output)  # tokens 4-5, not sent yet (the call broke first)
    for position, tokens, text in [
        (1, [10, 11, 12, 13, 14], "abcdefg"),
        (2, [11, 12, 13, 14], "bcdefg"),
        (4, [13, 14], "efg"),
        (6, [], ""),  # the client has them all: the final message alone
    ]:
        messages = kept_from(pending, position)
        assert [t for m in messages for t in m.token_ids] == tokens, position
        assert "".join(m.text for m in messages) == text, position
        assert messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    for outside in (0, 7):  # the prefill worker's token, and past the end
        with pytest.raises(ReattachRangeError):
            kept_from(pending, outside)
