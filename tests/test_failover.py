"""A client given two routers rides over the death of the one its stream is on.

The router is killed (SIGKILL) mid-stream; the client reconnects to the other with its
request id and the number of tokens it has, that router takes the request over (the
dead one stopped writing its record) and runs it on, and the caller sees one stream:
every token once, in order, identical to an uninterrupted run. A stream that a router
ends without its final message is resumed the same way, never taken as finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest
from router_failover import assert_seamless, kill_router, wait_until_routers_serve

from pdserve.api.v1 import router_pb2_grpc
from pdserve.client import AsyncClient, Client, PdserveError
from pdserve.cluster.local import ClusterShape, LocalCluster
from pdserve.cluster.supervisor import Backoff
from pdserve.core.sampling_params import SamplingParams
from pdserve.state.redis_server import free_port

pytestmark = pytest.mark.cluster

PROMPT = "The router that streams this dies halfway"
GREEDY = SamplingParams(temperature=0.0, max_tokens=800, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=800, ignore_eos=True)
KILL_AFTER_TOKENS = 1  # the first chunk: the prefill worker's token
# reconnect, notice the dead router (3 s without a record write), run it again
FAILOVER_BUDGET_S = 30.0


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("failover")
    shape = ClusterShape(prefill=1, decode=1)
    quick = Backoff(first_delay_s=0.1)  # a killed router comes back for the next test
    with LocalCluster(
        str(demo_model_dir), shape, run_dir, num_routers=2, supervise=True, backoff=quick
    ) as cluster:
        yield cluster


def reference(cluster: LocalCluster, params: SamplingParams):
    with Client(cluster.router_addresses[1]) as client:
        return client.generate(PROMPT, params)


def test_a_stream_survives_its_router_being_killed(cluster):
    wait_until_routers_serve(cluster, FAILOVER_BUDGET_S)
    expected = reference(cluster, GREEDY)
    chunks = []
    started = time.monotonic()
    with Client(cluster.router_addresses) as client:
        killed = None
        for chunk in client.stream(PROMPT, GREEDY):
            chunks.append(chunk)
            if killed is None and chunk.offset + len(chunk.token_ids) >= KILL_AFTER_TOKENS:
                killed = client.current_address
                kill_router(cluster, killed)
        assert client.num_reconnects >= 1
    assert killed is not None
    assert time.monotonic() - started < FAILOVER_BUDGET_S
    assert_seamless(chunks, expected)


def test_an_async_seeded_stream_survives_its_router_being_killed(cluster):
    wait_until_routers_serve(cluster, FAILOVER_BUDGET_S)
    expected = reference(cluster, SEEDED)

    async def run():
        chunks, killed = [], None
        async with AsyncClient(",".join(reversed(cluster.router_addresses))) as client:
            async for chunk in client.stream(PROMPT, SEEDED, request_id="failover-seeded"):
                chunks.append(chunk)
                if killed is None and chunk.offset + len(chunk.token_ids) >= KILL_AFTER_TOKENS:
                    killed = client.current_address
                    kill_router(cluster, killed)
            assert client.num_reconnects >= 1
        return chunks, killed

    chunks, killed = asyncio.run(run())
    assert killed is not None
    assert_seamless(chunks, expected)


def test_an_unseeded_sampled_stream_is_taken_over_with_its_seed(cluster):
    """The router seeds an unseeded request; the one taking it over uses that seed, so
    the stream goes on as it began (the checkpoints say how it began)."""
    wait_until_routers_serve(cluster, FAILOVER_BUDGET_S)
    unseeded = SamplingParams(temperature=1.0, max_tokens=800, ignore_eos=True)
    chunks = []
    with Client(cluster.router_addresses) as client:
        for chunk in client.stream(PROMPT, unseeded, request_id="failover-unseeded"):
            chunks.append(chunk)
            if len(chunks) == 1:
                kill_router(cluster, client.current_address)
        assert client.num_reconnects >= 1
        # the whole output, as the request store holds it (the routers agree on it)
        stored = client.generate(PROMPT, unseeded, request_id="failover-unseeded")
    assert_seamless(chunks, stored)


def test_a_client_gives_up_after_its_reconnects_naming_each_router():
    closed = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    with (
        Client(closed, max_reconnects=2, timeout=10) as client,
        pytest.raises(PdserveError) as raised,
    ):
        client.model_info()
    error = raised.value
    assert error.code.name == "UNAVAILABLE"
    assert "gave up after 3 tries" in str(error)
    assert all(address in str(error) for address in closed)


def test_addresses_come_as_a_list_or_a_comma_separated_string():
    with Client(" 127.0.0.1:1, 127.0.0.1:2 ") as client:
        assert client.addresses == ["127.0.0.1:1", "127.0.0.1:2"]
    with pytest.raises(ValueError, match="no router address"):
        Client(",")


class UnfinishedRouter(router_pb2_grpc.RouterServicer):
    """A router whose streams end, with status OK, before their final message (what
    replaying a failed request's record gave before): the client must not take that for
    a finished request."""

    def __init__(self) -> None:
        self.num_calls = 0

    async def Generate(self, request, context):
        self.num_calls += 1
        for message in ():  # no message at all; the call ends with status OK
            yield message


@contextlib.asynccontextmanager
async def unfinished_router():
    server = grpc.aio.server()
    servicer = UnfinishedRouter()
    router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        await server.stop(None)


def test_a_stream_that_ends_without_its_final_message_goes_on_at_the_next_router(cluster):
    wait_until_routers_serve(cluster, FAILOVER_BUDGET_S)
    short = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = reference(cluster, short)

    async def run():
        async with unfinished_router() as (address, servicer):
            async with AsyncClient([address, cluster.router_addresses[1]]) as client:
                completion = await client.generate(PROMPT, short)
                assert client.num_reconnects == 1
            async with AsyncClient([address], max_reconnects=1) as client:
                with pytest.raises(PdserveError) as raised:
                    await client.generate(PROMPT, short)
            assert servicer.num_calls == 3
        return completion, raised.value

    completion, error = asyncio.run(run())
    assert (completion.token_ids, completion.text) == (expected.token_ids, expected.text)
    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert "without its final message" in error.message
