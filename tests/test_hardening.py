"""What a caller on the network cannot do: hold KV blocks for weeks, read another request's
output by its id, learn the server's paths, map a worker's services, or share a port.

Leases run against a decode worker in this process, served by its own server skeleton;
request ids, ModelInfo and reflection against real router and worker processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
import uuid
from dataclasses import replace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from manual_clock import Clock
from procs import router_process, worker_process

from pdserve.api.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)
from pdserve.cluster.processes import router_args
from pdserve.core.block_hash import num_blocks_for
from pdserve.core.errors import LeaseExpiredError
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.kv.lease import LeaseLimits, LeaseTable, LeaseTerms
from pdserve.rpc import server as rpc_server
from pdserve.rpc.server import ListenError, ServerOptions
from pdserve.rpc.wire import sampling_params_to_proto
from pdserve.worker.config import WorkerConfig
from pdserve.worker.server import WorkerApp, server_options

pytestmark = pytest.mark.cluster

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
NUM_KV_BLOCKS = 300
LONG_PROMPT = [7 + i % 900 for i in range(4090)]  # with GREEDY's 6 tokens: the whole context
MAX_TTL_MS = 2**32 - 1  # lease_ttl_ms is a uint32: 49.7 days
# Clocks and calls on a loaded machine: how far a deadline may sit from the one computed
# here, and how long a freed lease may take to show in GetLoad.
SLACK_MS = 50
SETTLE_S = 5.0
SERVED_MODEL_NAME = "hardening-demo"
COLOCATE_BELOW_TOKENS = 4096  # every request whole on the one "both" worker


def now_ms() -> float:
    return time.time() * 1000


# -- leases: a decode worker in this process ------------------------------------------------


@contextlib.asynccontextmanager
async def decode_worker(model_dir, **settings):
    """A decode worker as `pdserve serve decode` runs it (its app, its server options),
    in this process on port 0; yields its address once it serves."""
    engine = EngineConfig(model=str(model_dir), num_kv_blocks=NUM_KV_BLOCKS)
    config = WorkerConfig(role="decode", engine=engine, **settings)
    app, stop = WorkerApp(config), asyncio.Event()
    server = asyncio.create_task(rpc_server.serve(app, server_options(config), stop))
    try:
        yield await _serving(app, server)
    finally:
        stop.set()
        await server


async def _serving(app: WorkerApp, server: asyncio.Task) -> str:
    while True:  # the port is known once the app built its worker; then health says when
        if server.done():
            server.result()  # start-up failed: raise why
        if app.worker is not None:
            async with grpc.aio.insecure_channel(app.worker.address) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                reply = await health.Check(health_pb2.HealthCheckRequest())
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return app.worker.address
        await asyncio.sleep(0.02)


def admit_request(lease_ttl_ms: int, prompt=LONG_PROMPT) -> decode_pb2.AdmitRequest:
    return decode_pb2.AdmitRequest(
        request_id=uuid.uuid4().hex,
        prompt_token_ids=prompt,
        sampling=sampling_params_to_proto(GREEDY),
        lease_ttl_ms=lease_ttl_ms,
    )


async def wait_all_free(decode: decode_pb2_grpc.DecodeStub, within_s: float):
    """GetLoad until every block is free and no lease open; the last load otherwise."""
    deadline = time.monotonic() + within_s
    while True:
        load = await decode.GetLoad(decode_pb2.GetLoadRequest())
        if (load.free_blocks, load.open_leases) == (load.total_blocks, 0):
            return load
        if time.monotonic() > deadline:
            return load
        await asyncio.sleep(0.05)


async def test_an_admit_asking_for_49_days_gets_the_capped_ttl_and_its_blocks_come_back(
    demo_model_dir,
):
    async with (
        decode_worker(demo_model_dir, lease_ttl_s=0.5, max_lease_ttl_s=1.0) as address,
        grpc.aio.insecure_channel(address) as channel,
    ):
        decode = decode_pb2_grpc.DecodeStub(channel)
        asked_at = now_ms()
        lease = await decode.Admit(admit_request(MAX_TTL_MS))
        answered_at = now_ms()
        assert lease.num_blocks == num_blocks_for(len(LONG_PROMPT), 16) == 256
        assert asked_at + 1000 - 1 <= lease.deadline_unix_ms <= answered_at + 1000
        load = await decode.GetLoad(decode_pb2.GetLoadRequest())
        assert load.free_blocks == NUM_KV_BLOCKS - lease.num_blocks

        asked_at = now_ms()  # 0 asks for the worker's default, --lease-ttl
        default = await decode.Admit(admit_request(0, prompt=[5, 6, 7]))
        assert asked_at + 500 - 1 <= default.deadline_unix_ms <= now_ms() + 500

        # Nobody pushes KV: both leases expire within the cap, and free their blocks.
        load = await wait_all_free(decode, within_s=1.0 + SETTLE_S)
        assert (load.free_blocks, load.open_leases) == (NUM_KV_BLOCKS, 0)
        assert now_ms() >= answered_at + 1000 - SLACK_MS  # not before its deadline


async def test_renewals_stop_at_the_lease_lifetime_and_its_blocks_come_back(demo_model_dir):
    settings = dict(lease_ttl_s=0.6, max_lease_ttl_s=0.6, max_lease_lifetime_s=1.8)
    async with (
        decode_worker(demo_model_dir, **settings) as address,
        grpc.aio.insecure_channel(address) as channel,
    ):
        decode = decode_pb2_grpc.DecodeStub(channel)
        kv = kv_transfer_pb2_grpc.KVTransferStub(channel)
        asked_at = now_ms()
        lease = await decode.Admit(admit_request(MAX_TTL_MS))
        answered_at = now_ms()
        renew = kv_transfer_pb2.RenewLeaseRequest(lease_id=lease.lease_id)
        deadlines = []
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            while now_ms() < answered_at + 1800 + 2000:  # a renewer that never stops
                deadlines.append((await kv.RenewLease(renew)).deadline_unix_ms)
                await asyncio.sleep(0.1)
        refused_at = now_ms()
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "lifetime of 1.8 s (--max-lease-lifetime)" in refused.value.details()
        assert refused_at <= answered_at + 1800
        # Renewals kept it open to its lifetime's end, never past it.
        assert len(deadlines) >= 8
        assert asked_at + 1800 - 1 <= max(deadlines) <= answered_at + 1800 + 1
        load = await wait_all_free(decode, within_s=SETTLE_S)
        assert (load.free_blocks, load.open_leases) == (NUM_KV_BLOCKS, 0)


def test_a_lease_gets_the_ttl_asked_for_up_to_the_cap_and_the_default_for_none():
    limits = LeaseLimits(default_ttl_s=30.0, max_ttl_s=120.0, max_lifetime_s=600.0)
    assert limits.terms(MAX_TTL_MS / 1000) == LeaseTerms(ttl_s=120.0, max_lifetime_s=600.0)
    assert limits.terms(5.0).ttl_s == 5.0
    assert limits.terms(0.0).ttl_s == limits.terms(None).ttl_s == 30.0


def test_renewals_move_the_deadline_up_to_the_lifetime_and_then_are_refused():
    clock = Clock(100.0)
    table = LeaseTable(num_layers=1, clock=clock)
    lease = table.issue("r", num_blocks=1, terms=LeaseTerms(ttl_s=2.0, max_lifetime_s=5.0))
    for _ in range(3):  # at 101, 102, 103.5: deadlines 103, 104, 105 (the lifetime's end)
        clock.now += 1.0 if clock.now < 102 else 1.5
        table.renew(lease.lease_id)
    assert lease.deadline == pytest.approx(105.0)
    clock.now = 104.0
    with pytest.raises(LeaseExpiredError, match="lifetime of 5 s"):
        table.renew(lease.lease_id)
    assert lease.deadline == pytest.approx(105.0)  # the refusal takes nothing away
    clock.now = 105.1
    assert table.expired() == [lease]


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        (dict(max_lease_ttl_s=0.0), "max_lease_ttl_s"),
        (dict(lease_ttl_s=60.0, max_lease_ttl_s=30.0), "lease_ttl_s"),
        (dict(max_lease_ttl_s=120.0, max_lease_lifetime_s=60.0), "max_lease_lifetime_s"),
    ],
)
def test_lease_limits_that_cannot_hold_are_refused_naming_the_field(settings, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        WorkerConfig(role="decode", engine=EngineConfig(model="/nonexistent"), **settings)


# -- request ids, ModelInfo, reflection: router and worker processes -------------------------


@pytest.fixture(scope="module")
def cluster(demo_model_dir, redis_url, tmp_path_factory):
    """One "both" worker (default flags) in the Redis registry and one router over it."""
    logs = tmp_path_factory.mktemp("hardening-logs")
    worker_args = ("--redis-url", redis_url, "--num-kv-blocks", str(NUM_KV_BLOCKS))
    router_flags = (
        "--colocate-below",
        str(COLOCATE_BELOW_TOKENS),
        "--served-model-name",
        SERVED_MODEL_NAME,
    )
    with (
        worker_process("both", demo_model_dir, *worker_args, log_dir=logs) as worker,
        router_process(demo_model_dir, redis_url, *router_flags, log_dir=logs) as (router, _),
    ):
        asyncio.run(_wait_until_routed(router))
        yield {"router": router, "worker": worker.address}


async def _wait_until_routed(router: str, timeout_s: float = 15) -> None:
    async with grpc.aio.insecure_channel(router) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            listed = await stub.ListWorkers(router_pb2.ListWorkersRequest())
            if any(w.healthy for w in listed.workers):
                return
            await asyncio.sleep(0.1)
    raise TimeoutError("the worker never showed up in the registry")


async def generate(router: str, **fields) -> list[router_pb2.GenerateResponse]:
    async with grpc.aio.insecure_channel(router) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        request = router_pb2.GenerateRequest(stream=True, **fields)
        return [message async for message in stub.Generate(request, timeout=30)]


def tokens_of(messages) -> list[int]:
    return [t for m in messages for t in m.token_ids]


SAMPLED = SamplingParams(temperature=0.9, max_tokens=6, ignore_eos=True)  # unseeded


ORIGINAL_PROMPT = "The original prompt"


@pytest.mark.parametrize(
    ("text", "params", "resume"),
    [
        pytest.param("Another prompt entirely", SAMPLED, {}, id="another-prompt"),
        pytest.param(ORIGINAL_PROMPT, replace(SAMPLED, max_tokens=7), {}, id="more-tokens"),
        pytest.param(ORIGINAL_PROMPT, replace(SAMPLED, seed=1), {}, id="a-seed"),
        pytest.param(
            ORIGINAL_PROMPT, replace(SAMPLED, top_k=5), {"resume_from": 0}, id="resume-top-k"
        ),
    ],
)
async def test_a_reused_request_id_with_other_input_is_already_exists_not_its_output(
    cluster, text, params, resume
):
    router, request_id = cluster["router"], uuid.uuid4().hex
    sampling = sampling_params_to_proto(SAMPLED)
    first = await generate(router, request_id=request_id, text=ORIGINAL_PROMPT, sampling=sampling)
    assert len(tokens_of(first)) == SAMPLED.max_tokens
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await generate(
            router,
            request_id=request_id,
            text=text,
            sampling=sampling_params_to_proto(params),
            **resume,
        )
    assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "request_id" in refused.value.details()
    assert request_id in refused.value.details()


async def test_a_reused_request_id_with_the_same_input_replays_and_resumes(cluster, redis_client):
    router, request_id = cluster["router"], uuid.uuid4().hex
    sampling = sampling_params_to_proto(SAMPLED)  # unseeded: the router seeds its copy
    asked = dict(request_id=request_id, text="Resume the sampled stream", sampling=sampling)
    full = await generate(router, **asked)
    again = await generate(router, **asked)
    tail = await generate(router, resume_from=2, **asked)
    assert tokens_of(again) == tokens_of(full) and len(tokens_of(full)) == SAMPLED.max_tokens
    assert tokens_of(tail) == tokens_of(full)[2:]
    # What the record keeps of the request: a digest, not the prompt.
    record = redis_client.get(f"pdserve:req:{request_id}").decode()
    assert "Resume the sampled stream" not in record
    assert '"request_digest":"' in record


async def test_model_info_names_the_served_model_not_a_path(cluster, demo_model_dir):
    async with grpc.aio.insecure_channel(cluster["router"]) as channel:
        info = await router_pb2_grpc.RouterStub(channel).ModelInfo(router_pb2.ModelInfoRequest())
    assert info.model == SERVED_MODEL_NAME
    assert str(demo_model_dir) not in str(info)


async def reflected_services(address: str) -> list[str]:
    """The services a server's reflection lists (AioRpcError if it has none)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        async for reply in stub.ServerReflectionInfo(iter([request]), timeout=10):
            return [service.name for service in reply.list_services_response.service]
    return []


async def reflection_status(address: str) -> grpc.StatusCode:
    """How a server ends a reflection call that sends nothing: a server without reflection
    refuses the method at once (a request written meanwhile could race that refusal and
    fail on the client's side instead)."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter(()), timeout=10
        )
        return await call.code()


async def test_reflection_is_off_on_workers_unless_asked_and_on_on_the_router(
    cluster, demo_model_dir
):
    assert "pdserve.v1.Router" in await reflected_services(cluster["router"])
    assert await reflection_status(cluster["worker"]) == grpc.StatusCode.UNIMPLEMENTED
    async with decode_worker(demo_model_dir, reflection=True) as address:
        assert "pdserve.v1.Decode" in await reflected_services(address)


# -- a port another server holds -------------------------------------------------------------


@contextlib.asynccontextmanager
async def another_grpc_server():
    """A gRPC server with gRPC's default options (SO_REUSEPORT on), as any other process
    might run; yields its port."""
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield port
    finally:
        await server.stop(grace=None)


class IdleApp:
    services = ()

    async def start(self, port: int) -> dict[str, object]:
        return {}

    async def drain(self) -> None:
        pass

    async def close(self) -> None:
        pass


async def test_a_port_another_server_holds_is_a_listen_error_naming_it():
    async with another_grpc_server() as port:
        stop = asyncio.Event()
        stop.set()  # were the port shared, serve would return at once
        options = ServerOptions(role="router", host="127.0.0.1", port=port, grace_s=0.0)
        with pytest.raises(ListenError, match=f"127.0.0.1:{port}"):
            await rpc_server.serve(IdleApp(), options, stop)


async def test_a_router_on_a_taken_port_exits_with_one_line_naming_it(demo_model_dir, redis_url):
    async with another_grpc_server() as port:
        args = router_args(str(demo_model_dir), redis_url, port=port)
        router = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "pdserve",
            *args,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            _, stderr = await asyncio.wait_for(router.communicate(), timeout=60)
        finally:
            if router.returncode is None:
                router.kill()
                await router.wait()
    lines = stderr.decode().strip().splitlines()
    assert router.returncode == 1
    assert "Traceback" not in stderr.decode()
    assert f"127.0.0.1:{port}" in lines[-1] and "in use" in lines[-1]
