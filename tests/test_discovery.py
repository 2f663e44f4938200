"""Worker discovery: the Redis registry, static addresses, and Kubernetes EndpointSlices.

The Kubernetes tests run the real `kubernetes` client against a small API server of our
own that speaks the real list and watch protocol (JSON lists, chunked watch streams,
resource versions, 410 Gone).
"""

import asyncio
import functools
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import grpc
import pytest
from kubernetes import client as k8s
from procs import worker_process

from pdserve.api.v1 import decode_pb2, prefill_pb2_grpc
from pdserve.core.workers import WorkerInfo
from pdserve.router.discovery import (
    SERVICE_NAME_LABEL,
    GrpcLoadProbe,
    KubernetesDiscovery,
    RedisDiscovery,
    StaticDiscovery,
)
from pdserve.state.redis_server import PrivateRedis
from pdserve.state.registry import WorkerRegistry

pytestmark = pytest.mark.cluster

WAIT_S = 3.0


async def wait_until(predicate, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout_s}s")
        await asyncio.sleep(0.01)


def addresses(workers: list[WorkerInfo]) -> list[str]:
    return [w.address for w in workers]


async def answering_load_fn(address: str, role: str) -> WorkerInfo:
    return WorkerInfo(worker_id=address, role=role, address=address, free_blocks=8)


# -- Redis ---------------------------------------------------------------------------------


@pytest.fixture
async def registry(redis_url):
    registry = WorkerRegistry(redis_url, key_prefix=f"test-{uuid.uuid4().hex}", ttl_s=0.5)
    yield registry
    await registry.close()


async def test_redis_discovery_sees_a_worker_within_the_refresh_and_drops_it_after_ttl(registry):
    discovery = RedisDiscovery(registry, refresh_interval_s=0.1)
    await discovery.start()
    try:
        assert discovery.workers("decode") == []
        await registry.publish(WorkerInfo("w1", "decode", "10.0.0.1:9000", free_blocks=3))
        published = time.monotonic()
        await wait_until(lambda: addresses(discovery.workers("decode")) == ["10.0.0.1:9000"])
        assert time.monotonic() - published < 0.1 + 0.4  # one refresh interval, plus slack
        assert discovery.workers("decode")[0].free_blocks == 3
        assert discovery.workers("prefill") == []
        await wait_until(lambda: discovery.workers("decode") == [])  # no heartbeat: TTL ends it
    finally:
        await discovery.stop()


async def test_redis_discovery_excludes_a_failed_worker_until_its_next_heartbeat(registry):
    discovery = RedisDiscovery(registry, refresh_interval_s=60)  # we refresh by hand
    info = WorkerInfo("w1", "both", "10.0.0.1:9000")
    await registry.publish(info)
    await discovery.start()
    try:
        assert addresses(discovery.workers("prefill")) == ["10.0.0.1:9000"]
        discovery.mark_unhealthy("10.0.0.1:9000")
        assert discovery.workers("prefill") == discovery.workers("decode") == []
        await discovery.refresh()  # still listed, but nothing newer than the failure
        assert discovery.workers("prefill") == []
        await registry.publish(info)
        await discovery.refresh()
        assert addresses(discovery.workers("prefill")) == ["10.0.0.1:9000"]
    finally:
        await discovery.stop()


async def test_redis_discovery_carries_the_block_size_each_worker_publishes(registry):
    await registry.publish(WorkerInfo("w1", "prefill", "10.0.0.1:9000", block_size=32))
    await registry.publish(WorkerInfo("w2", "decode", "10.0.0.2:9000", block_size=16))
    discovery = RedisDiscovery(registry, refresh_interval_s=60)
    await discovery.start()
    try:
        assert [w.block_size for w in discovery.workers("prefill")] == [32]
        assert [w.block_size for w in discovery.workers("decode")] == [16]
    finally:
        await discovery.stop()


async def test_redis_discovery_keeps_its_snapshot_while_redis_is_unreachable():
    server = PrivateRedis().start()  # our own, so the test can stop it
    registry = WorkerRegistry(server.url, ttl_s=30)
    discovery = RedisDiscovery(registry, refresh_interval_s=60)  # we refresh by hand
    try:
        await registry.publish(WorkerInfo("w1", "decode", "10.0.0.1:9000"))
        await discovery.start()
        server.stop()
        await discovery.refresh()  # logs, does not raise
        assert addresses(discovery.workers("decode")) == ["10.0.0.1:9000"]
    finally:
        await discovery.stop()
        await registry.close()
        server.stop()


# -- static --------------------------------------------------------------------------------


async def test_static_discovery_pools_by_role_and_polls_load():
    discovery = StaticDiscovery(
        prefill=["p:1", "pd:1"], decode=["d:1", "pd:1"], both=["b:1"], load_fn=answering_load_fn
    )
    await discovery.start()
    try:
        assert addresses(discovery.workers("prefill")) == ["b:1", "p:1", "pd:1"]
        assert addresses(discovery.workers("decode")) == ["b:1", "d:1", "pd:1"]
        roles = {w.address: w.role for w in discovery.workers("decode")}
        assert roles == {"b:1": "both", "d:1": "decode", "pd:1": "both"}
        assert all(w.free_blocks == 8 for w in discovery.workers("decode"))
    finally:
        await discovery.stop()


async def test_static_discovery_marks_unreachable_workers_unhealthy_until_they_answer():
    down = {"d:2"}

    async def load_fn(address, role):
        if address == "d:3":
            raise RuntimeError("a broken load_fn")
        return None if address in down else await answering_load_fn(address, role)

    discovery = StaticDiscovery([], ["d:1", "d:2", "d:3"], poll_interval_s=0.05, load_fn=load_fn)
    await discovery.start()
    try:
        assert addresses(discovery.workers("decode")) == ["d:1"]
        down.clear()  # d:2 comes up; the background poll notices
        await wait_until(lambda: addresses(discovery.workers("decode")) == ["d:1", "d:2"])
    finally:
        await discovery.stop()


async def test_static_discovery_times_out_a_hanging_worker():
    async def load_fn(address, role):
        if address == "d:2":
            await asyncio.Event().wait()  # never answers
        return await answering_load_fn(address, role)

    discovery = StaticDiscovery([], ["d:1", "d:2"], load_fn=load_fn, probe_timeout_s=0.1)
    await discovery.start()
    try:
        assert addresses(discovery.workers("decode")) == ["d:1"]
    finally:
        await discovery.stop()


async def test_mark_unhealthy_holds_until_a_poll_started_after_it_succeeds():
    entered, release = asyncio.Event(), asyncio.Event()
    hold = False

    async def load_fn(address, role):
        if hold:
            entered.set()
            await release.wait()
        return await answering_load_fn(address, role)

    discovery = StaticDiscovery(["p:1"], [], poll_interval_s=60, load_fn=load_fn)
    await discovery.start()
    try:
        assert addresses(discovery.workers("prefill")) == ["p:1"]
        hold = True
        in_flight = asyncio.create_task(discovery.refresh())  # a poll that began before...
        await entered.wait()
        discovery.mark_unhealthy("p:1")  # ...the router saw the worker fail
        assert discovery.workers("prefill") == []
        release.set()
        await in_flight
        assert discovery.workers("prefill") == []  # that poll proves nothing
        await discovery.refresh()
        assert addresses(discovery.workers("prefill")) == ["p:1"]
    finally:
        await discovery.stop()


class PrefillLoad(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, block_size: int = 32):
        self.block_size = block_size

    async def GetLoad(self, request, context):
        return decode_pb2.WorkerLoad(
            role="prefill",
            free_blocks=5,
            total_blocks=9,
            running=1,
            waiting=2,
            open_leases=0,
            block_size=self.block_size,
        )


async def test_grpc_probe_asks_the_role_s_service():
    server = grpc.aio.server()
    prefill_pb2_grpc.add_PrefillServicer_to_server(PrefillLoad(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    probe = GrpcLoadProbe(timeout_s=1.0)
    try:
        info = await probe(f"127.0.0.1:{port}", "prefill")
        load = (info.role, info.free_blocks, info.total_blocks, info.running, info.waiting)
        assert load == ("prefill", 5, 9, 1, 2)
        assert info.block_size == 32
        # a decode worker is asked through Decode, which this server does not serve
        assert await probe(f"127.0.0.1:{port}", "decode") is None
        assert await GrpcLoadProbe(timeout_s=0.5)("127.0.0.1:1", "prefill") is None
    finally:
        await probe.close()
        await server.stop(None)


async def test_grpc_probe_keeps_the_default_block_size_when_a_worker_reports_none():
    server = grpc.aio.server()
    prefill_pb2_grpc.add_PrefillServicer_to_server(PrefillLoad(block_size=0), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    probe = GrpcLoadProbe(timeout_s=1.0)
    try:
        info = await probe(f"127.0.0.1:{port}", "prefill")
        assert info.block_size == WorkerInfo("w", "prefill", "a:1").block_size
    finally:
        await probe.close()
        await server.stop(None)


async def test_static_discovery_takes_the_block_size_a_real_worker_reports(
    demo_model_dir, tmp_path
):
    args = ("--block-size", "32", "--num-kv-blocks", "64")
    with worker_process("decode", demo_model_dir, *args, log_dir=tmp_path) as worker:
        discovery = StaticDiscovery([], [worker.address])
        await discovery.start()
        try:
            [info] = discovery.workers("decode")
        finally:
            await discovery.stop()
    assert (info.address, info.block_size, info.total_blocks) == (worker.address, 32, 64)


# -- Kubernetes ----------------------------------------------------------------------------

NAMESPACE = "pd"
GRPC_PORT = 50051
SLICES_PATH = f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices"


class FakeEndpointSlices:
    """The API server's EndpointSlice store: objects, resource versions, an event log."""

    def __init__(self):
        self.changed = threading.Condition()
        self.resource_version = 1
        self.slices: dict[str, dict] = {}
        self.events: list[tuple[int, dict]] = []  # (resource version, watch event)
        self.oldest_watchable = 0  # watches from an older version get 410 Gone
        self.num_lists: dict[str, int] = {}
        self.closed = False

    def put(
        self, name: str, service: str, endpoints: list[tuple[str, bool]], *, record: bool = True
    ) -> None:
        """Create or replace a slice: (ip, ready) per endpoint, the port named "grpc"."""
        with self.changed:
            self.resource_version += 1
            event_type = "MODIFIED" if name in self.slices else "ADDED"
            self.slices[name] = {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": name,
                    "namespace": NAMESPACE,
                    "resourceVersion": str(self.resource_version),
                    "labels": {SERVICE_NAME_LABEL: service},
                },
                "addressType": "IPv4",
                "endpoints": [
                    {"addresses": [ip], "conditions": {"ready": ready}} for ip, ready in endpoints
                ],
                "ports": [
                    {"name": "metrics", "port": 9090, "protocol": "TCP"},
                    {"name": "grpc", "port": GRPC_PORT, "protocol": "TCP"},
                ],
            }
            if record:
                self._record(event_type, self.slices[name])

    def delete(self, name: str) -> None:
        with self.changed:
            self.resource_version += 1
            deleted = self.slices.pop(name)
            deleted["metadata"]["resourceVersion"] = str(self.resource_version)
            self._record("DELETED", deleted)

    def compact(self) -> None:
        """Forget the event log, as etcd compaction does: open watches end with 410 Gone."""
        with self.changed:
            self.events.clear()
            self.oldest_watchable = self.resource_version
            self.changed.notify_all()

    def close(self) -> None:
        with self.changed:
            self.closed = True
            self.changed.notify_all()

    def _record(self, event_type: str, obj: dict) -> None:
        self.events.append(
            (self.resource_version, {"type": event_type, "object": json.loads(json.dumps(obj))})
        )
        self.changed.notify_all()

    def list(self, service: str) -> dict:
        with self.changed:
            self.num_lists[service] = self.num_lists.get(service, 0) + 1
            return {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSliceList",
                "metadata": {"resourceVersion": str(self.resource_version)},
                "items": [s for s in self.slices.values() if _service(s) == service],
            }

    def watch(self, service: str, since: int, deadline: float):
        """Yield watch events for the service after version `since`, until the deadline."""
        gone = {
            "type": "ERROR",
            "object": {
                "kind": "Status",
                "apiVersion": "v1",
                "status": "Failure",
                "reason": "Expired",
                "code": 410,
                "message": "too old",
            },
        }
        while True:
            with self.changed:
                self.changed.wait_for(
                    functools.partial(self._has_news, since),
                    timeout=max(0.0, deadline - time.monotonic()),
                )
                if self.closed or time.monotonic() >= deadline:
                    return
                expired = since < self.oldest_watchable
                new = [(rv, e) for rv, e in self.events if rv > since]
            if expired:
                yield gone
                return
            since = new[-1][0]
            yield from (e for _, e in new if _service(e["object"]) == service)

    def _has_news(self, since: int) -> bool:  # with the lock held
        return (
            self.closed or since < self.oldest_watchable or any(rv > since for rv, _ in self.events)
        )


def _service(endpoint_slice: dict) -> str:
    return endpoint_slice["metadata"]["labels"][SERVICE_NAME_LABEL]


class ApiHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # chunked watch streams need it

    def log_message(self, *args):  # keep test output quiet
        pass

    def do_GET(self):
        url = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        selector = query.get("labelSelector", "")
        if url.path != SLICES_PATH or not selector.startswith(f"{SERVICE_NAME_LABEL}="):
            self.send_error(404)
            return
        service = selector.split("=", 1)[1]
        store: FakeEndpointSlices = self.server.store
        if query.get("watch") in ("true", "1"):
            timeout_s = float(query.get("timeoutSeconds", 300))
            since = int(query["resourceVersion"])
            self._stream(store.watch(service, since, time.monotonic() + timeout_s))
        else:
            body = json.dumps(store.list(service)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    def _stream(self, events):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for event in events:
                line = json.dumps(event).encode() + b"\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
            self.wfile.write(b"0\r\n\r\n")
        except OSError:  # the client hung up (Watch.stop shuts its socket down)
            self.close_connection = True


@pytest.fixture
def fake_api():
    """(store, ApiClient) for a local API server speaking the EndpointSlice protocol."""
    store = FakeEndpointSlices()
    server = ThreadingHTTPServer(("127.0.0.1", 0), ApiHandler)
    server.daemon_threads = True
    server.store = store
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    configuration = k8s.Configuration(host=f"http://127.0.0.1:{server.server_port}")
    api_client = k8s.ApiClient(configuration)
    try:
        yield store, api_client
    finally:
        store.close()
        server.shutdown()
        server.server_close()
        api_client.close()


def grpc_address(ip: str) -> str:
    return f"{ip}:{GRPC_PORT}"


async def test_kubernetes_discovery_follows_ready_endpoints(fake_api):
    store, api_client = fake_api
    store.put("prefill-a", "pd-prefill", [("10.0.0.1", True), ("10.0.0.2", False)])
    store.put("decode-a", "pd-decode", [("10.0.1.1", True)])
    store.put("other-a", "other", [("10.0.9.9", True)])
    discovery = KubernetesDiscovery(
        NAMESPACE,
        "pd-prefill",
        "pd-decode",
        api_client=api_client,
        poll_interval_s=60,
        load_fn=answering_load_fn,
    )
    await discovery.start()  # listed and polled before it returns
    try:
        assert addresses(discovery.workers("prefill")) == [grpc_address("10.0.0.1")]
        assert addresses(discovery.workers("decode")) == [grpc_address("10.0.1.1")]

        # MODIFIED: the not-ready endpoint turns ready (picked up without waiting a poll)
        store.put("prefill-a", "pd-prefill", [("10.0.0.1", True), ("10.0.0.2", True)])
        await wait_until(
            lambda: (
                addresses(discovery.workers("prefill"))
                == [grpc_address("10.0.0.1"), grpc_address("10.0.0.2")]
            )
        )
        # ADDED: a second slice of the same service
        store.put("decode-b", "pd-decode", [("10.0.1.2", True)])
        await wait_until(lambda: len(discovery.workers("decode")) == 2)
        # DELETED
        store.delete("decode-a")
        await wait_until(
            lambda: addresses(discovery.workers("decode")) == [grpc_address("10.0.1.2")]
        )
        # MODIFIED to not ready: excluded
        store.put("prefill-a", "pd-prefill", [("10.0.0.1", False), ("10.0.0.2", True)])
        await wait_until(
            lambda: addresses(discovery.workers("prefill")) == [grpc_address("10.0.0.2")]
        )
        assert store.num_lists == {"pd-prefill": 1, "pd-decode": 1}  # watched, not re-listed
    finally:
        stopping = time.monotonic()
        await discovery.stop()
    assert time.monotonic() - stopping < 2.0  # open watches are interrupted, not waited out


async def test_kubernetes_discovery_lists_again_after_410_gone(fake_api):
    store, api_client = fake_api
    store.put("decode-a", "pd-decode", [("10.0.1.1", True)])
    discovery = KubernetesDiscovery(
        NAMESPACE,
        "pd-prefill",
        "pd-decode",
        api_client=api_client,
        poll_interval_s=60,
        load_fn=answering_load_fn,
    )
    await discovery.start()
    try:
        assert addresses(discovery.workers("decode")) == [grpc_address("10.0.1.1")]
        # a change whose event was compacted away: only a fresh list can reveal it
        store.put("decode-a", "pd-decode", [("10.0.1.7", True)], record=False)
        store.compact()
        await wait_until(
            lambda: addresses(discovery.workers("decode")) == [grpc_address("10.0.1.7")]
        )
        assert store.num_lists["pd-decode"] == 2
    finally:
        await discovery.stop()


async def test_kubernetes_discovery_one_service_for_both_roles_and_unreachable_pods(fake_api):
    store, api_client = fake_api
    store.put("pd-a", "pd", [("10.0.2.1", True), ("10.0.2.2", True)])

    async def load_fn(address, role):
        if address == grpc_address("10.0.2.2"):
            return None
        return await answering_load_fn(address, role)

    discovery = KubernetesDiscovery(
        NAMESPACE, "pd", "pd", api_client=api_client, poll_interval_s=60, load_fn=load_fn
    )
    await discovery.start()
    try:
        assert addresses(discovery.workers("prefill")) == [grpc_address("10.0.2.1")]
        assert addresses(discovery.workers("decode")) == [grpc_address("10.0.2.1")]
        assert discovery.workers("decode")[0].role == "both"
    finally:
        await discovery.stop()
