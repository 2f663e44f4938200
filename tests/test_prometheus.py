"""The dashboard and the alert rules of charts/pdserve/files, checked by a real Prometheus.

`promtool` checks the rules and fires each alert from the synthetic series of
alerts_test.yaml. Then a Prometheus of the test's own, on loopback, scrapes a local cluster
(router, prefill worker, decode worker) every second while it serves a small workload:
every expression of the dashboard and of the rules evaluates without error through
Prometheus' HTTP API, and the core panels (TTFT, inter-token latency, token throughput,
KV transfer bytes) have data. An expression over a misspelt metric evaluates fine and
returns nothing, so the names the files use are checked against what the cluster serves.

Needs Prometheus 2.x (`make prometheus` installs Debian's package): without it these tests
skip, and under CI=true they fail.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from pdserve.client import Client, SamplingParams
from pdserve.cluster.local import ClusterShape, LocalCluster

pytestmark = pytest.mark.cluster

FILES = Path(__file__).resolve().parents[1] / "charts" / "pdserve" / "files"
DASHBOARD = FILES / "grafana" / "pdserve.json"
ALERTS = FILES / "prometheus" / "alerts.yaml"
ALERTS_TEST = FILES / "prometheus" / "alerts_test.yaml"

ROWS = [
    "Requests and latency SLOs",
    "Router",
    "Prefill pool",
    "Decode pool",
    "KV transfer",
    "KV cache",
]
ALERT_NAMES = {
    "PdserveTimeToFirstTokenHigh",
    "PdserveInterTokenLatencyHigh",
    "PdserveKVCacheNearlyFull",
    "PdserveQueueDepthHigh",
    "PdserveKVTransferFailing",
    "PdserveKVLeasesExpiring",
    "PdserveOrphansExpiring",
}
CORE_PANELS = [
    "Time to first token",
    "Inter-token latency",
    "Token throughput",
    "KV transfer throughput by side",
]
# what a healthy workload leaves empty: these show only failures
QUIET_PANELS = {"Retries per second by reason", "KV transfer failures per second"}
METRIC = re.compile(r"pdserve:[a-z0-9_:]+")
# Grafana's interval variables, as Grafana would fill them for a short time range
INTERVALS = {"$__rate_interval": "1m", "$__range": "1m"}
SCRAPE_INTERVAL_S = 1
PROMETHEUS_READY_S = 30.0
SCRAPE_WAIT_S = 20.0
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
NUM_PROMPT_TOKENS = 40  # over a block, so that a repeat hits the prefix cache


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is not None:
        return path
    message = (
        f"{name} not found: `make prometheus` installs Debian's prometheus package "
        "(apt-get install prometheus), or put Prometheus 2.x's prometheus and promtool on PATH"
    )
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def alert_rules() -> list[dict]:
    return [
        rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]
    ]


def panels() -> list[dict]:
    return [panel for panel in dashboard()["panels"] if panel["type"] != "row"]


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, expression) of every query of the dashboard, as written."""
    return [(panel["title"], target["expr"]) for panel in panels() for target in panel["targets"]]


def model_variable_query() -> tuple[str, str]:
    """The `$model_name` variable's `label_values(METRIC, LABEL)`, as (METRIC, LABEL)."""
    variable = next(v for v in dashboard()["templating"]["list"] if v["name"] == "model_name")
    match = re.fullmatch(r"label_values\((.+), *(\w+)\)", variable["definition"])
    return match.group(1), match.group(2)


def promql_regex(value: str) -> str:
    """`value` as a regex matching only itself, inside a PromQL string literal."""
    return re.sub(r"([.+*?()\[\]{}|^$\\])", r"\\\\\1", value)


def substitute(expr: str, model_name: str) -> str:
    for name, value in INTERVALS.items():
        expr = expr.replace(name, value)
    return expr.replace("$model_name", promql_regex(model_name))


# -- without a cluster ----------------------------------------------------------------------


def test_the_dashboard_has_its_rows_and_variables():
    board = dashboard()
    assert [p["title"] for p in board["panels"] if p["type"] == "row"] == ROWS
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["model_name"]["type"] == "query"
    for panel in panels():
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]


def test_every_metric_of_the_dashboard_is_filtered_by_model_name():
    selector = re.compile(r'pdserve:[a-z0-9_:]+\{[^}]*model_name=~"\$model_name"')
    for title, expr in dashboard_exprs():
        assert len(selector.findall(expr)) == len(METRIC.findall(expr)) > 0, (title, expr)


def test_every_alert_has_a_for_a_severity_and_says_what_to_do():
    rules = alert_rules()
    assert {rule["alert"] for rule in rules} == ALERT_NAMES
    for rule in rules:
        assert rule["for"], rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert set(rule["annotations"]) == {"summary", "description", "action"}, rule["alert"]


def test_the_alert_tests_fire_every_alert():
    tests = yaml.safe_load(ALERTS_TEST.read_text())["tests"]
    fired = {
        case["alertname"]
        for test in tests
        for case in test["alert_rule_test"]
        if case["exp_alerts"]
    }
    assert fired == ALERT_NAMES


def test_promtool_checks_the_rules():
    result = subprocess.run(
        [_binary("promtool"), "check", "rules", str(ALERTS)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(ALERT_NAMES)} rules found" in result.stdout


def test_promtool_fires_each_alert_from_synthetic_series():
    result = subprocess.run(
        [_binary("promtool"), "test", "rules", str(ALERTS_TEST)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


# -- a real Prometheus scraping a real cluster ----------------------------------------------


class Prometheus:
    """A Prometheus server on loopback with its own config and data directory."""

    def __init__(self, binary: str, targets: list[str], work_dir: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {
                "scrape_interval": f"{SCRAPE_INTERVAL_S}s",
                "scrape_timeout": f"{SCRAPE_INTERVAL_S}s",
                "evaluation_interval": f"{SCRAPE_INTERVAL_S}s",
            },
            "rule_files": [str(ALERTS)],
            "scrape_configs": [{"job_name": "pdserve", "static_configs": [{"targets": targets}]}],
        }
        config_path = work_dir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        self.log_path = work_dir / "prometheus.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config_path}",
                    f"--storage.tsdb.path={work_dir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + PROMETHEUS_READY_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"prometheus did not become ready:\n{self.log_path.read_text()}")

    def get(self, path: str, **params: str) -> dict:
        """GET /api/v1/PATH; the body, whatever the status (errors come as JSON too)."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params, doseq=True)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return json.load(response)
        except urllib.error.HTTPError as error:
            return json.load(error)

    def query(self, expr: str) -> dict:
        return self.get("query", query=expr)

    def value(self, expr: str) -> float | None:
        """The single value of an instant query; None when it has no series."""
        result = self.query(expr)["data"]["result"]
        return float(result[0]["value"][1]) if result else None

    def wait_for(self, expr: str, expected: float) -> None:
        """Until the instant query `expr` has the one value `expected`."""
        deadline = time.monotonic() + SCRAPE_WAIT_S
        while time.monotonic() < deadline:
            if self.value(expr) == expected:
                return
            time.sleep(SCRAPE_INTERVAL_S / 4)
        raise AssertionError(f"{expr} is {self.value(expr)}, not {expected}")

    def wait_scraped(self, num_targets: int, num_requests: int) -> None:
        """Until every target has been scraped, healthy, since now, and the router's
        count of finished requests is `num_requests`."""
        now = time.time()
        self.wait_for('count(up{job="pdserve"} == 1)', num_targets)
        self.wait_for(f'count(timestamp(up{{job="pdserve"}}) > {now})', num_targets)
        self.wait_for("sum(pdserve:request_success_total)", num_requests)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def prometheus_binary() -> str:
    return _binary("prometheus")


@pytest.fixture(scope="module")
def cluster(prometheus_binary, demo_model_dir, redis_url, tmp_path_factory):
    """prefill:1, decode:1 and a router, each serving its metrics; only where Prometheus
    is (it skips first, without starting anything)."""
    with LocalCluster(
        model=str(demo_model_dir),
        shape=ClusterShape(prefill=1, decode=1),
        run_dir=tmp_path_factory.mktemp("prometheus-cluster"),
        redis=redis_url,
        metrics=True,
    ) as started:
        yield started


def metrics_targets(cluster: LocalCluster) -> list[str]:
    """host:port of every process's metrics endpoint."""
    return [child.metrics_address for child in cluster.children]


@pytest.fixture(scope="module")
def prometheus(prometheus_binary, cluster, tmp_path_factory) -> Iterator[Prometheus]:
    work_dir = tmp_path_factory.mktemp("prometheus")
    server = Prometheus(prometheus_binary, metrics_targets(cluster), work_dir)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def _prompt(seed: int) -> list[int]:
    return [10 + (seed * 7919 + i * 31) % 900 for i in range(NUM_PROMPT_TOKENS)]


def _stream(client: Client, seed: int) -> None:
    # each with a TTFT target it keeps (a minute), for the panel of targets kept
    chunks = list(client.stream(_prompt(seed), PARAMS, ttft_slo_ms=60_000))
    assert chunks, seed


@pytest.fixture(scope="module")
def served(cluster, prometheus) -> Prometheus:
    """Prometheus, after the cluster served a workload that every scrape has seen.

    A labelled series appears with its first sample, so a rate over it sees only what
    came after: one request first, scraped, then the workload (a prompt repeated, for
    the prefix cache), scraped too.
    """
    targets = len(cluster.children)
    with Client(cluster.router_address, timeout=60) as client:
        _stream(client, seed=0)
        prometheus.wait_scraped(targets, num_requests=1)
        seeds = (1, 2, 2, 3)
        for seed in seeds:
            _stream(client, seed)
    prometheus.wait_scraped(targets, num_requests=1 + len(seeds))
    return prometheus


@pytest.fixture(scope="module")
def model_name(served) -> str:
    metric, label = model_variable_query()
    names = served.get(f"label/{label}/values", **{"match[]": metric})["data"]
    assert len(names) == 1, names
    return names[0]


def test_every_dashboard_expression_evaluates(served, model_name):
    failed = []
    for title, expr in dashboard_exprs():
        body = served.query(substitute(expr, model_name))
        if body["status"] != "success":
            failed.append((title, expr, body.get("error")))
    assert not failed


def test_every_alert_expression_evaluates(served):
    failed = []
    for rule in alert_rules():
        body = served.query(rule["expr"])
        if body["status"] != "success":
            failed.append((rule["alert"], body.get("error")))
    assert not failed


def test_prometheus_evaluates_every_rule_without_error(served):
    groups = served.get("rules", type="alert")["data"]["groups"]
    rules = {rule["name"]: rule for group in groups for rule in group["rules"]}
    assert set(rules) == ALERT_NAMES
    for name, rule in rules.items():
        assert rule["health"] == "ok", (name, rule.get("lastError"))


def test_the_core_panels_have_data(served, model_name):
    by_title = {panel["title"]: panel for panel in panels()}
    for title in CORE_PANELS:
        for target in by_title[title]["targets"]:
            body = served.query(substitute(target["expr"], model_name))
            values = [float(series["value"][1]) for series in body["data"]["result"]]
            assert values, (title, target["expr"])
            assert all(math.isfinite(v) and v > 0 for v in values), (title, target["expr"])


def test_every_other_panel_has_a_value_after_the_workload(served, model_name):
    """A query can evaluate fine and show nothing (a label misspelt in `by`): after a
    workload, every query of a panel that does not show only failures has a value."""
    empty = []
    for title, expr in dashboard_exprs():
        if title in QUIET_PANELS:
            continue
        result = served.query(substitute(expr, model_name))["data"]["result"]
        if not any(math.isfinite(float(series["value"][1])) for series in result):
            empty.append((title, expr))
    assert not empty


def test_kv_transfer_bytes_are_shown_for_both_sides(served, model_name):
    panel = next(p for p in panels() if p["title"] == "KV transfer throughput by side")
    body = served.query(substitute(panel["targets"][0]["expr"], model_name))
    assert {series["metric"]["side"] for series in body["data"]["result"]} == {"send", "receive"}


def test_the_files_name_only_metrics_the_cluster_serves(cluster, served):
    served_names = set()
    for target in metrics_targets(cluster):
        with urllib.request.urlopen(f"http://{target}/metrics", timeout=5) as response:
            served_names |= _metric_names(response.read().decode())
    used = {name for _, expr in dashboard_exprs() for name in METRIC.findall(expr)}
    used |= {name for rule in alert_rules() for name in METRIC.findall(rule["expr"])}
    assert used - served_names == set()


def _metric_names(text: str) -> set[str]:
    """The sample names a text exposition can hold, from its `# TYPE` lines (present
    even for a labelled metric that has no series yet)."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE pdserve:"):
            _, _, name, kind = line.split()
            suffixes = ("_bucket", "_sum", "_count") if kind == "histogram" else ("",)
            names |= {name + suffix for suffix in suffixes}
    return names
