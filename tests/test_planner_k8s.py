"""`pdserve planner` against a Kubernetes API: the real `kubernetes` client over real HTTP
to a small API server of our own that serves the apps/v1 `scale` subresource of two
Deployments (GET, and PATCH with a merge patch), as tests/test_discovery.py does for
EndpointSlices. Also the whole `pdserve planner` process, pointed at it by a kubeconfig.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from kubernetes import client as k8s

from pdserve.planner.capacity import Capacity, Pool
from pdserve.planner.kubernetes import DeploymentScaler, ScaleError
from pdserve.planner.loop import Planner
from pdserve.planner.plan import Load
from pdserve.planner.scaling import Bounds, ScalingPolicy

pytestmark = pytest.mark.cluster

NAMESPACE = "pdserve"
DEPLOYMENTS = {Pool.PREFILL: "pdserve-prefill", Pool.DECODE: "pdserve-decode"}
SCALE_PATH = re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/deployments/([^/]+)/scale$")
PATCH_TYPES = ("application/merge-patch+json", "application/strategic-merge-patch+json")
# what one worker of each pool sustains within its SLO (as a record would say)
CAPACITY = {
    Pool.PREFILL: Capacity(Pool.PREFILL, 1000.0, "prefill:1,decode:1", 4, 1.0, True),
    Pool.DECODE: Capacity(Pool.DECODE, 100.0, "prefill:1,decode:1", 4, 1.0, True),
}
POLICY = ScalingPolicy(Bounds(1, 4), hysteresis=0.2, cooldown_s=60)


class FakeScales:
    """Deployments' replica counts, and every change the API server was asked for."""

    def __init__(self, replicas: dict[str, int]):
        self.replicas = dict(replicas)
        self.patches: list[tuple[str, str, dict]] = []  # (name, content type, body)
        self.forbidden: set[str] = set()  # names whose scale RBAC refuses
        self.num_refused = 0
        self.changed = threading.Event()


class ScaleApi(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        name = self._deployment()
        if name is not None:
            self._reply(200, self._scale(name))

    def do_PATCH(self):
        name = self._deployment()
        if name is None:
            return
        store: FakeScales = self.server.store
        content_type = self.headers.get("Content-Type", "")
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if content_type not in PATCH_TYPES:
            self._reply(415, _status(415, f"unsupported patch type {content_type}"))
            return
        replicas = body.get("spec", {}).get("replicas")
        if not isinstance(replicas, int) or replicas < 0:
            self._reply(422, _status(422, "spec.replicas: must be an integer >= 0"))
            return
        store.patches.append((name, content_type, body))
        store.replicas[name] = replicas
        store.changed.set()
        self._reply(200, self._scale(name))

    def _deployment(self) -> str | None:
        """The Deployment the path names, or None once an error reply is sent."""
        store: FakeScales = self.server.store
        match = SCALE_PATH.match(self.path.split("?", 1)[0])
        if match is None or match.group(1) != NAMESPACE:
            self._reply(404, _status(404, f"no route {self.path}"))
            return None
        name = match.group(2)
        if name in store.forbidden:
            store.num_refused += 1
            self._reply(403, _status(403, f'cannot get resource "deployments/scale" {name}'))
            return None
        if name not in store.replicas:
            self._reply(404, _status(404, f'deployments.apps "{name}" not found'))
            return None
        return name

    def _scale(self, name: str) -> dict:
        replicas = self.server.store.replicas[name]
        return {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"replicas": replicas},
            "status": {"replicas": replicas, "selector": f"app={name}"},
        }

    def _reply(self, code: int, doc: dict) -> None:
        data = json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _status(code: int, message: str) -> dict:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "code": code,
    }


@pytest.fixture
def api():
    """(store, ApiClient, url) of a local API server serving the two Deployments' scale."""
    store = FakeScales({"pdserve-prefill": 1, "pdserve-decode": 1})
    server = ThreadingHTTPServer(("127.0.0.1", 0), ScaleApi)
    server.daemon_threads = True
    server.store = store
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_port}"
    api_client = k8s.ApiClient(k8s.Configuration(host=url))
    try:
        yield store, api_client, url
    finally:
        server.shutdown()
        server.server_close()
        api_client.close()


def planner_for(api_client, output_tokens_per_s: float, prompt_tokens_per_s: float = 500.0):
    load = Load(prompt_tokens_per_s, output_tokens_per_s)
    scaler = DeploymentScaler(api_client, NAMESPACE, DEPLOYMENTS)
    return Planner(CAPACITY, {pool: POLICY for pool in Pool}, scaler, lambda: load)


def test_the_planner_scales_the_pool_that_needs_it_through_the_scale_subresource(api):
    store, api_client, _ = api
    planner = planner_for(api_client, output_tokens_per_s=250)  # 3 decode workers' worth
    decisions = planner.tick(now=0)
    assert [(d.pool, d.current, d.target) for d in decisions] == [
        (Pool.PREFILL, 1, 1),
        (Pool.DECODE, 1, 3),
    ]
    assert store.patches == [
        ("pdserve-decode", "application/merge-patch+json", {"spec": {"replicas": 3}})
    ]
    assert store.replicas == {"pdserve-prefill": 1, "pdserve-decode": 3}


def test_a_drop_in_load_scales_down_only_past_the_hysteresis_and_the_cool_down(api):
    store, api_client, _ = api
    planner = planner_for(api_client, output_tokens_per_s=250)
    planner.tick(now=0)  # decode 1 -> 3
    planner.load = lambda: Load(500, 190)  # needs 2, but 190 x 1.2 = 228 needs 3: hold
    assert planner.tick(now=100)[1].target == 3
    planner.load = lambda: Load(500, 150)  # 150 x 1.2 = 180 fits in 2
    assert planner.tick(now=59)[1].target == 3  # inside the cool-down
    assert planner.tick(now=60)[1].target == 2
    assert [p[2]["spec"]["replicas"] for p in store.patches] == [3, 2]


def test_the_planner_keeps_each_pool_within_its_bounds(api):
    store, api_client, _ = api
    planner = planner_for(api_client, output_tokens_per_s=10_000, prompt_tokens_per_s=0)
    planner.tick(now=0)
    assert store.replicas == {"pdserve-prefill": 1, "pdserve-decode": 4}  # max 4
    store.replicas["pdserve-prefill"] = 7  # scaled by hand, beyond the max
    planner.tick(now=1)
    assert store.replicas["pdserve-prefill"] == 4


def test_a_dry_run_decides_but_changes_nothing(api):
    store, api_client, _ = api
    planner = planner_for(api_client, output_tokens_per_s=250)
    planner.dry_run = True
    assert planner.tick(now=0)[1].target == 3
    assert store.patches == [] and store.replicas["pdserve-decode"] == 1


def test_a_refused_or_missing_deployment_is_an_error_naming_it(api):
    store, api_client, _ = api
    planner = planner_for(api_client, output_tokens_per_s=250)
    store.forbidden.add("pdserve-prefill")
    with pytest.raises(ScaleError, match="deployments/pdserve-prefill in namespace pdserve: 403"):
        planner.tick(now=0)
    store.forbidden.clear()
    del store.replicas["pdserve-decode"]
    with pytest.raises(ScaleError, match="deployments/pdserve-decode .*: 404"):
        planner.tick(now=0)


def test_a_failed_look_changes_nothing_and_the_loop_carries_on(api):
    store, api_client, _ = api
    planner = planner_for(api_client, output_tokens_per_s=250)
    store.forbidden.add("pdserve-decode")
    stop = threading.Event()
    thread = threading.Thread(target=planner.run, args=(0.01, stop), daemon=True)
    thread.start()
    deadline = time.monotonic() + 5
    while store.num_refused < 3:  # three looks, each refused
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert thread.is_alive() and store.patches == []
    store.forbidden.clear()
    assert store.changed.wait(5)
    stop.set()
    thread.join(5)
    assert store.replicas["pdserve-decode"] == 3


def _record(path) -> None:
    """A bench record of one prefill:1,decode:1 run at 1 req/s over 10 s: 10 requests of 100
    prompt and 10 output tokens, all within the SLOs (100 prompt, 10 output tok/s a worker)."""
    times = [0.05 + 0.01 * i for i in range(10)]
    requests = [
        {
            "index": i,
            "kind": "k",
            "warmup": False,
            "prompt_tokens": 100,
            "max_tokens": 10,
            "sent_at": i,
            "token_times": times,
            "timings": None,
            "error": "",
        }
        for i in range(10)
    ]
    record = {
        "slo": {"ttft_ms": 300, "tpot_ms": 50},
        "duration_s": 10,
        "workload": {"name": "custom"},
        "configs": [{"name": "prefill:1,decode:1", "runs": [{"rate": 1, "requests": requests}]}],
    }
    path.write_text(json.dumps(record))


@pytest.mark.timeout(60)
def test_pdserve_planner_scales_the_deployments_its_kubeconfig_points_at(api, tmp_path):
    store, _, url = api
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "test", "cluster": {"server": url}}],
                "users": [{"name": "planner", "user": {"token": "t"}}],
                "contexts": [{"name": "test", "context": {"cluster": "test", "user": "planner"}}],
                "current-context": "test",
            }
        )
    )
    _record(tmp_path / "record.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env |= {
        "KUBECONFIG": str(kubeconfig),
        "PDSERVE_NAMESPACE": NAMESPACE,
        "PDSERVE_RATE": "3",  # 300 prompt, 30 output tok/s: 3 of each pool
        "PDSERVE_INTERVAL": "0.2",
    }
    planner = subprocess.Popen(
        [sys.executable, "-m", "pdserve", "planner", "--record", str(tmp_path / "record.json")],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 40
        while store.replicas != {"pdserve-prefill": 3, "pdserve-decode": 3}:
            assert planner.poll() is None, planner.stderr.read()
            assert time.monotonic() < deadline, store.replicas
            time.sleep(0.05)
    finally:
        planner.send_signal(signal.SIGTERM)
        _, stderr = planner.communicate(timeout=10)
    assert planner.returncode == 0, stderr
    assert "decode: 1 -> 3" in stderr
