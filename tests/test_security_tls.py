"""mTLS between real pdserve processes: who can reach which port, with which certificate.

One cluster for the module, on loopback: a prefill worker, a decode worker (KVTransfer on
its own --kv-port, plaintext health on --health-port) and a router, each with its own
certificate of a CA made here, whose Subject OU says its role (tests/tls_certs.py).
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tls_certs import ClusterCA, Issued

from pdserve.api.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)
from pdserve.client import Client
from pdserve.cluster.load import wait_idle
from pdserve.cluster.processes import ChildProcess, router_args, spawn, wait_ready, worker_args
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.workers import WorkerInfo
from pdserve.rpc.wire import sampling_params_to_proto
from pdserve.state.registry import WorkerRegistry

pytestmark = pytest.mark.cluster

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
CALL_TIMEOUT_S = 10.0
REGISTERED_WAIT_S = 30.0
SERVING = health_pb2.HealthCheckResponse.SERVING


@dataclass
class Cluster:
    ca: ClusterCA
    certs: dict[str, Issued]  # by name: router, prefill, decode, nobody
    prefill: str
    decode: str
    decode_kv: str
    decode_health: str
    router: str
    router_health: str
    router_log: str
    redis_url: str


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, demo_model_dir, redis_url):
    ca = ClusterCA(tmp_path_factory.mktemp("ca"))
    certs = {name: ca.issue(name, name) for name in ("router", "prefill", "decode")}
    certs["nobody"] = ca.issue("nobody", None)
    logs, model = str(tmp_path_factory.mktemp("logs")), str(demo_model_dir)
    common = ["--redis-url", redis_url, "--grace", "1"]
    decode_ports = ["--kv-port", "0", "--health-port", "0"]
    commands = {
        "prefill": worker_args("prefill", model, [*certs["prefill"].args(), *common], threads=1),
        "decode": worker_args(
            "decode", model, [*certs["decode"].args(), *common, *decode_ports], threads=1
        ),
        "router": router_args(
            model, redis_url, [*certs["router"].args(), "--health-port", "0", "--grace", "1"]
        ),
    }
    children = {name: spawn(f"tls-{name}", args, logs) for name, args in commands.items()}
    try:
        with ThreadPoolExecutor(len(children)) as pool:  # the three start side by side
            list(pool.map(wait_ready, children.values()))
        prefill, decode, router = (children[name] for name in ("prefill", "decode", "router"))
        found = Cluster(
            ca,
            certs,
            prefill.address,
            decode.address,
            decode.fields["kv"],
            decode.fields["health"],
            router.address,
            router.fields["health"],
            router.log_path,
            redis_url,
        )
        wait_registered(found, [prefill.address, decode.address])
        yield found
    finally:
        with ThreadPoolExecutor(len(children)) as pool:
            list(pool.map(ChildProcess.stop, children.values()))


def secure(address: str, issued: Issued | None, ca: ClusterCA) -> grpc.Channel:
    """A channel presenting `issued` (None: no client certificate) and trusting the CA."""
    client_pair = {}
    if issued is not None:
        client_pair = dict(
            private_key=issued.key.read_bytes(), certificate_chain=issued.cert.read_bytes()
        )
    credentials = grpc.ssl_channel_credentials(ca.ca_path.read_bytes(), **client_pair)
    return grpc.secure_channel(address, credentials)


def wait_registered(cluster: Cluster, addresses: list[str]) -> None:
    """Until the router routes to every worker in `addresses` (checked over mTLS)."""
    deadline = time.monotonic() + REGISTERED_WAIT_S
    with secure(cluster.router, None, cluster.ca) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        while time.monotonic() < deadline:
            listed = stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=5).workers
            if set(addresses) <= {w.address for w in listed if w.healthy}:
                return
            time.sleep(0.1)
    raise AssertionError(f"the router did not route to {addresses} in {REGISTERED_WAIT_S} s")


def health_check(channel: grpc.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(), timeout=CALL_TIMEOUT_S).status


def admit_request() -> decode_pb2.AdmitRequest:
    return decode_pb2.AdmitRequest(
        request_id=uuid.uuid4().hex,
        prompt_token_ids=[5, 6, 7, 8],
        sampling=sampling_params_to_proto(GREEDY),
    )


def refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error.value


def open_leases(cluster: Cluster) -> int:
    return wait_idle(cluster.decode, "decode", tls=cluster.certs["router"].config).open_leases


# -- without a certificate -------------------------------------------------------------------


def test_without_a_client_certificate_every_internal_port_refuses(cluster):
    for address in (cluster.prefill, cluster.decode, cluster.decode_kv):
        for channel in (grpc.insecure_channel(address), secure(address, None, cluster.ca)):
            with channel:
                error = refused(lambda ch=channel: health_check(ch))
                assert error.code() == grpc.StatusCode.UNAVAILABLE, address
    with grpc.insecure_channel(cluster.decode) as channel:
        error = refused(
            lambda: decode_pb2_grpc.DecodeStub(channel).Admit(admit_request(), timeout=5)
        )
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert open_leases(cluster) == 0


def test_a_certificate_of_another_ca_is_refused(cluster, tmp_path):
    stranger = ClusterCA(tmp_path / "stranger").issue("router", "router")
    with secure(cluster.decode, stranger, cluster.ca) as channel:
        error = refused(lambda: health_check(channel))
    assert error.code() == grpc.StatusCode.UNAVAILABLE


def test_the_routers_api_takes_tls_without_a_client_certificate_and_refuses_plaintext(cluster):
    with secure(cluster.router, None, cluster.ca) as channel:
        assert health_check(channel) == SERVING
    with grpc.insecure_channel(cluster.router) as channel:
        assert refused(lambda: health_check(channel)).code() == grpc.StatusCode.UNAVAILABLE


# -- certificate roles -----------------------------------------------------------------------


def test_a_prefill_certificate_cannot_admit(cluster):
    with secure(cluster.decode, cluster.certs["prefill"], cluster.ca) as channel:
        stub = decode_pb2_grpc.DecodeStub(channel)
        error = refused(lambda: stub.Admit(admit_request(), timeout=CALL_TIMEOUT_S))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error.details() == (
        "/pdserve.v1.Decode/Admit is for router certificates; "
        "the caller's role (Subject OU) is prefill"
    )
    assert open_leases(cluster) == 0


def test_a_certificate_without_a_role_cannot_admit(cluster):
    with secure(cluster.decode, cluster.certs["nobody"], cluster.ca) as channel:
        stub = decode_pb2_grpc.DecodeStub(channel)
        error = refused(lambda: stub.Admit(admit_request(), timeout=CALL_TIMEOUT_S))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "the caller's role (Subject OU) is none" in error.details()


def test_a_router_certificate_cannot_push_kv(cluster):
    with secure(cluster.decode, cluster.certs["router"], cluster.ca) as channel:
        lease = decode_pb2_grpc.DecodeStub(channel).Admit(admit_request(), timeout=CALL_TIMEOUT_S)
    chunk = kv_transfer_pb2.KVChunk(lease_id=lease.lease_id, layer=0, data=b"\0" * 64)
    with secure(cluster.decode_kv, cluster.certs["router"], cluster.ca) as channel:
        kv = kv_transfer_pb2_grpc.KVTransferStub(channel)
        error = refused(lambda: kv.PushKV(iter([chunk]), timeout=CALL_TIMEOUT_S))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "is for both or prefill certificates" in error.details()
        request = kv_transfer_pb2.CommitKVRequest(lease_id=lease.lease_id)
        error = refused(lambda: kv.CommitKV(request, timeout=CALL_TIMEOUT_S))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    with secure(cluster.decode, cluster.certs["router"], cluster.ca) as channel:
        release = decode_pb2.ReleaseRequest(lease_id=lease.lease_id)
        assert decode_pb2_grpc.DecodeStub(channel).Release(release, timeout=CALL_TIMEOUT_S).released
    assert open_leases(cluster) == 0


def test_kv_transfer_answers_on_the_kv_port_only(cluster):
    request = kv_transfer_pb2.HandshakeRequest(sender="test")
    with secure(cluster.decode, cluster.certs["prefill"], cluster.ca) as channel:
        kv = kv_transfer_pb2_grpc.KVTransferStub(channel)
        error = refused(lambda: kv.Handshake(request, timeout=CALL_TIMEOUT_S))
    assert error.code() == grpc.StatusCode.UNIMPLEMENTED


def test_an_admit_names_the_kv_port_as_where_the_kv_goes(cluster):
    with secure(cluster.decode, cluster.certs["router"], cluster.ca) as channel:
        stub = decode_pb2_grpc.DecodeStub(channel)
        lease = stub.Admit(admit_request(), timeout=CALL_TIMEOUT_S)
        stub.Release(decode_pb2.ReleaseRequest(lease_id=lease.lease_id), timeout=CALL_TIMEOUT_S)
        load = stub.GetLoad(decode_pb2.GetLoadRequest(), timeout=CALL_TIMEOUT_S)
    assert lease.kv_address == load.kv_address == cluster.decode_kv


def test_only_the_router_may_call_prefill(cluster):
    request = prefill_request(cluster.decode_kv)
    with secure(cluster.prefill, cluster.certs["decode"], cluster.ca) as channel:
        stub = prefill_pb2_grpc.PrefillStub(channel)
        error = refused(lambda: stub.Prefill(request, timeout=CALL_TIMEOUT_S))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error.details().startswith("/pdserve.v1.Prefill/Prefill is for router certificates")


def prefill_request(target: str) -> prefill_pb2.PrefillRequest:
    return prefill_pb2.PrefillRequest(
        request_id=uuid.uuid4().hex,
        prompt_token_ids=[5, 6, 7, 8],
        sampling=sampling_params_to_proto(GREEDY),
        target=prefill_pb2.KVTarget(address=target, lease_id="made-up"),
    )


def test_a_prefill_to_a_target_that_is_not_a_decode_worker_is_refused(cluster):
    with secure(cluster.prefill, cluster.certs["router"], cluster.ca) as channel:
        stub = prefill_pb2_grpc.PrefillStub(channel)
        error = refused(lambda: stub.Prefill(prefill_request(cluster.prefill), timeout=30))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error.details() == (
            f"target.address {cluster.prefill!r}: its certificate's role (Subject OU) is "
            "prefill, not both or decode"
        )
        # a server that speaks no TLS (the decode worker's plaintext health port)
        error = refused(lambda: stub.Prefill(prefill_request(cluster.decode_health), timeout=30))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error.details().startswith(f"target.address {cluster.decode_health!r}: no mTLS")
    load = wait_idle(cluster.prefill, "prefill", tls=cluster.certs["router"].config)
    assert (load.running, load.waiting) == (0, 0)


# -- the health port -------------------------------------------------------------------------


def test_the_health_port_answers_health_alone_in_plaintext(cluster):
    for address in (cluster.decode_health, cluster.router_health):
        with grpc.insecure_channel(address) as channel:
            assert health_check(channel) == SERVING
            stub = health_pb2_grpc.HealthStub(channel)
            named = health_pb2.HealthCheckRequest(service="pdserve.v1.Decode")
            if address == cluster.decode_health:
                assert stub.Check(named, timeout=CALL_TIMEOUT_S).status == SERVING
    with grpc.insecure_channel(cluster.decode_health) as channel:
        calls = [
            lambda: decode_pb2_grpc.DecodeStub(channel).Admit(admit_request(), timeout=5),
            lambda: decode_pb2_grpc.DecodeStub(channel).GetLoad(decode_pb2.GetLoadRequest()),
            lambda: kv_transfer_pb2_grpc.KVTransferStub(channel).Handshake(
                kv_transfer_pb2.HandshakeRequest(), timeout=5
            ),
            lambda: next(
                reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
                )
            ),
        ]
        for call in calls:
            assert refused(call).code() == grpc.StatusCode.UNIMPLEMENTED
    with grpc.insecure_channel(cluster.router_health) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        error = refused(lambda: stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=5))
    assert error.code() == grpc.StatusCode.UNIMPLEMENTED


# -- end to end, and the registry ------------------------------------------------------------


def test_a_request_runs_router_to_prefill_to_decode_over_mtls(cluster):
    credentials = grpc.ssl_channel_credentials(cluster.ca.ca_path.read_bytes())
    with Client(cluster.router, credentials=credentials, timeout=60) as client:
        completion = client.generate("the quick brown fox", GREEDY)
        info = client.get_request(completion.request_id)
    assert len(completion.token_ids) == GREEDY.max_tokens
    assert completion.finish_reason == "length"
    assert (info.prefill_worker, info.decode_worker) == (cluster.prefill, cluster.decode)
    assert open_leases(cluster) == 0


def wait_for_log(path: str, text: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(path) as f:
            if text in f.read():
                return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not in {path} after {timeout_s} s")


async def test_a_registry_entry_the_router_cannot_verify_gets_no_request(cluster):
    registry = WorkerRegistry(cluster.redis_url, ttl_s=60.0)
    fakes = [
        # a made-up address with room for everything (what stole prompts before)
        WorkerInfo("fake-made-up", "decode", "127.0.0.1:9", free_blocks=10**9, total_blocks=10**9),
        # a real server whose certificate says prefill, registered as decode
        WorkerInfo("fake-role", "decode", cluster.prefill, free_blocks=10**9, total_blocks=10**9),
    ]
    try:
        for fake in fakes:
            await registry.publish(fake)
        for fake in fakes:
            wait_for_log(cluster.router_log, f"not routing to registered worker {fake.worker_id}")
        credentials = grpc.ssl_channel_credentials(cluster.ca.ca_path.read_bytes())
        async with grpc.aio.secure_channel(cluster.router, credentials) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            listed = await stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=5)
        decode_addresses = {w.address for w in listed.workers if w.role == "decode"}
        assert decode_addresses == {cluster.decode}
    finally:
        for fake in fakes:
            await registry.remove(fake.worker_id)
        await registry.close()
