"""A hung prefill worker (SIGSTOP: its TCP connections stay open) costs seconds, not requests.

Before, a Prefill call to a frozen worker had no deadline but the client's: every request
sent there waited until the worker resumed or gRPC's keepalive gave up on the connection.
Now a running Prefill is given up once discovery stops listing its worker (its heartbeat
stopped) and the request is retried on the other prefill worker; the failures open the
worker's circuit breaker, and once it resumes it is routed to again only after it passed
a health probe.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import grpc
import pytest

from pdserve.api.v1 import router_pb2, router_pb2_grpc
from pdserve.cluster.load import wait_idle
from pdserve.cluster.local import ClusterShape, LocalCluster
from pdserve.core.sampling_params import SamplingParams
from pdserve.rpc.wire import sampling_params_to_proto

pytestmark = pytest.mark.cluster

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
COOLDOWN_S = 2.0
ROUTER_ARGS = [
    "--prefill-policy",
    "round_robin",  # every other request goes to the worker we freeze
    "--breaker-failures",
    "2",
    "--breaker-cooldown",
    str(COOLDOWN_S),
]
NUM_REQUESTS = 8
# the registry's TTL (3 s) until the frozen worker's heartbeat counts as stopped, the
# retry's prefill and decode on two loaded cores
FAILOVER_BOUND_S = 12.0


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("hung")
    shape = ClusterShape(prefill=2, decode=1)
    with LocalCluster(str(demo_model_dir), shape, run_dir, router_args=ROUTER_ARGS) as cluster:
        yield cluster


def prompt(i: int) -> list[int]:
    return [(11 * j + 5 * i) % 990 + 3 for j in range(24)]


async def generate(stub, i: int) -> tuple[str, list[int]]:
    request = router_pb2.GenerateRequest(
        token_ids=router_pb2.TokenIds(ids=prompt(i)),
        sampling=sampling_params_to_proto(PARAMS),
        stream=True,
    )
    request_id, tokens = "", []
    async for message in stub.Generate(request, timeout=60):
        request_id = message.request_id or request_id
        tokens.extend(message.token_ids)
    return request_id, tokens


async def listed(stub) -> set[str]:
    reply = await stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=5)
    return {worker.address for worker in reply.workers if worker.healthy}


def router_log(cluster: LocalCluster) -> str:
    return Path(cluster.router.log_path).read_text(errors="replace")


async def test_a_hung_prefill_worker_is_left_and_taken_back_after_its_probe(cluster):
    prefills = [child for child in cluster.workers if child.role == "prefill"]
    victim, other = prefills
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        expected = [await generate(stub, i) for i in range(NUM_REQUESTS)]  # undisturbed
        os.kill(victim.proc.pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        try:
            results = await asyncio.gather(*(generate(stub, i) for i in range(NUM_REQUESTS)))
            took = time.monotonic() - frozen_at
            during = await listed(stub)
        finally:
            os.kill(victim.proc.pid, signal.SIGCONT)
        thawed_at = time.monotonic()
        print(f"hung prefill worker: {NUM_REQUESTS} requests finished {took:.2f} s after SIGSTOP")
        assert [tokens for _, tokens in results] == [tokens for _, tokens in expected]
        assert took < FAILOVER_BOUND_S, f"requests waited {took:.1f}s on a hung worker"
        assert victim.address not in during and other.address in during
        log = router_log(cluster)
        assert f"worker {victim.address}: circuit open" in log
        assert f"worker {victim.address} passed its health probe" not in log

        # resumed: heartbeating again at once, but routed to only once its probe passed
        while victim.address not in await listed(stub):
            assert time.monotonic() - thawed_at < 15, "the thawed worker never came back"
            await asyncio.sleep(0.1)
        assert f"worker {victim.address} passed its health probe" in router_log(cluster)
        used = set()
        for i in range(4):
            request_id, _ = await generate(stub, 100 + i)
            info = await stub.GetRequest(router_pb2.GetRequestRequest(request_id=request_id))
            used.add(info.prefill_worker)
        assert victim.address in used
    for worker in cluster.workers:  # nothing stranded by the calls given up
        load = wait_idle(worker.address, worker.role)
        assert (load.free_blocks, load.running) == (load.total_blocks, 0), worker.name
