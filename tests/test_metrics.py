"""Prometheus metrics as an operator scrapes them: a real cluster (a router, a prefill and a
decode worker, each serving GET /metrics), a known workload, and exactly how far every
counter and histogram count moved, read over HTTP from each process.

Each metric has one owner: request latencies and token counts on the router, engine
counts on the workers, the KV transfer on both ends of it (`side=`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import time
import urllib.error
import urllib.request
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from procs import pdserve_process
from prometheus_client.parser import text_string_to_metric_families

from pdserve.api.v1 import decode_pb2, decode_pb2_grpc
from pdserve.cli import main as pdserve
from pdserve.client import Client, PdserveError, SamplingParams
from pdserve.cluster.local import ClusterShape, LocalCluster
from pdserve.cluster.processes import ChildProcess, router_args, worker_args
from pdserve.commands.up import metrics_lines
from pdserve.core.block_hash import num_blocks_for
from pdserve.core.flags import add_flags, config_from_args
from pdserve.core.kv_chunk import KVLayerChunk
from pdserve.core.model_config import ModelConfig
from pdserve.core.phase import RequestPhase
from pdserve.kv.transfer import KVPusher, KVPushError
from pdserve.router.config import RouterConfig
from pdserve.rpc.wire import sampling_params_to_proto
from pdserve.telemetry import metrics
from pdserve.telemetry.metrics import TTFT_BUCKETS, ProcessLabels, metrics_url
from pdserve.telemetry.summary import RequestSummary
from pdserve.worker.config import WorkerConfig

pytestmark = pytest.mark.cluster

BLOCK_SIZE = 16
DTYPE, DTYPE_BYTES = "float32", 4
PROMPT_LENGTHS = (40, 57, 16, 100)  # 3, 4, 1 and 7 blocks
MAX_TOKENS = 6
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
SETTLE_S = 10.0  # a push's last count lands just after the client's call ends


class Scrape:
    """One GET /metrics of a process, parsed."""

    def __init__(self, text: str):
        families = text_string_to_metric_families(text)
        self.samples = [sample for family in families for sample in family.samples]

    def value(self, name: str, **labels: str) -> float:
        """The sum of `name`'s samples that carry `labels` (0 when there are none)."""
        return sum(
            s.value for s in self.samples if s.name == name and labels.items() <= s.labels.items()
        )


def get(address: str, accept: str | None = None, path: str = "/metrics"):
    headers = {"Accept": accept} if accept else {}
    request = urllib.request.Request(f"http://{address}{path}", headers=headers)
    return urllib.request.urlopen(request, timeout=10)


def scrape(child: ChildProcess) -> Scrape:
    with get(child.metrics_address) as response:
        return Scrape(response.read().decode())


def kv_bytes(model: ModelConfig, num_prompt_tokens: int) -> int:
    """The KV payload of a prompt: layers x 2 x blocks x block size x KV heads x head dim
    x dtype size."""
    blocks = num_blocks_for(num_prompt_tokens, BLOCK_SIZE)
    per_block = BLOCK_SIZE * model.num_kv_heads * model.head_dim * DTYPE_BYTES
    return model.num_layers * 2 * blocks * per_block


def prompt(seed: int, length: int) -> list[int]:
    """A prompt no other request of the module sends."""
    return [10 + (seed * 7919 + i * 31) % 900 for i in range(length)]


@dataclass
class Workload:
    """What the client saw of each request, and every process's metrics around it."""

    prompts: list[list[int]]
    completions: list[int]  # output tokens per request
    first_message_tokens: list[int]  # tokens in each request's first streamed message
    finish_reasons: list[str]
    cached_tokens: list[int]
    before: dict[str, Scrape]  # by role
    after: dict[str, Scrape]

    def delta(self, role: str, name: str, **labels: str) -> float:
        return self.after[role].value(name, **labels) - self.before[role].value(name, **labels)


@pytest.fixture(scope="module")
def cluster(demo_model_dir, redis_url, tmp_path_factory):
    with LocalCluster(
        model=str(demo_model_dir),
        shape=ClusterShape(prefill=1, decode=1),
        run_dir=tmp_path_factory.mktemp("metrics"),
        worker_args=["--block-size", str(BLOCK_SIZE), "--dtype", DTYPE],
        redis=redis_url,
        metrics=True,
    ) as started:
        yield started


def processes(cluster: LocalCluster) -> dict[str, ChildProcess]:
    return {child.role: child for child in cluster.children}


@dataclass
class Streamed:
    """One request as its client saw it."""

    token_ids: list[int]
    first_message_tokens: int
    finish_reason: str
    cached_tokens: int


def stream(client: Client, token_ids: list[int], params: SamplingParams) -> Streamed:
    chunks = list(client.stream(token_ids, params))
    output = [token_id for chunk in chunks for token_id in chunk.token_ids]
    last = chunks[-1]
    return Streamed(
        output, len(chunks[0].token_ids), last.finish_reason, last.usage.cached_prompt_tokens
    )


def stop_params(output: list[int]) -> SamplingParams:
    """Greedy again, stopped by the first token of `output` not seen before it."""
    stop_at = next((k for k in range(1, len(output)) if output[k] not in output[:k]), 0)
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[output[stop_at]])


@pytest.fixture(scope="module")
def workload(cluster) -> Workload:
    """Four prompts to their length, then the first again (a prefix-cache hit) ended by
    a stop token."""
    by_role = processes(cluster)
    before = {role: scrape(child) for role, child in by_role.items()}
    length = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [prompt(seed, n) for seed, n in enumerate(PROMPT_LENGTHS)]
    with Client(cluster.router_address, timeout=60) as client:
        seen = [stream(client, token_ids, length) for token_ids in prompts]
        seen.append(stream(client, prompts[0], stop_params(seen[0].token_ids)))
    prompts.append(prompts[0])
    return Workload(
        prompts=prompts,
        completions=[len(s.token_ids) for s in seen],
        first_message_tokens=[s.first_message_tokens for s in seen],
        finish_reasons=[s.finish_reason for s in seen],
        cached_tokens=[s.cached_tokens for s in seen],
        before=before,
        after=settled(by_role, before, num_requests=len(prompts)),
    )


def settled(by_role: dict[str, ChildProcess], before: dict[str, Scrape], num_requests: int):
    """Every process's metrics once the router counted the requests and both workers the
    pushes (a push's last count may land just after the client's call ended)."""
    counted = {
        "router": ("pdserve:request_success_total", {}),
        "prefill": ("pdserve:kv_transfer_seconds_count", {"side": "send"}),
        "decode": ("pdserve:kv_transfer_seconds_count", {"side": "receive"}),
    }
    deadline = time.monotonic() + SETTLE_S
    while True:
        after = {role: scrape(child) for role, child in by_role.items()}
        done = all(
            after[role].value(name, **labels) - before[role].value(name, **labels) >= num_requests
            for role, (name, labels) in counted.items()
        )
        if done or time.monotonic() > deadline:
            return after
        time.sleep(0.05)


# -- the router: request latencies and tokens ------------------------------------------


def test_router_counts_the_prompt_and_generated_tokens(workload):
    assert workload.delta("router", "pdserve:prompt_tokens_total") == sum(
        len(p) for p in workload.prompts
    )
    assert workload.delta("router", "pdserve:generation_tokens_total") == sum(workload.completions)


def test_router_counts_requests_by_finish_reason(workload):
    assert Counter(workload.finish_reasons) == {"length": len(PROMPT_LENGTHS), "stop": 1}
    for reason in ("length", "stop", "abort", "error"):
        moved = workload.delta("router", "pdserve:request_success_total", finished_reason=reason)
        assert moved == workload.finish_reasons.count(reason), reason


def test_router_observes_every_request_in_its_latency_histograms(workload):
    num_requests = len(workload.prompts)
    for name in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
    ):
        assert workload.delta("router", f"pdserve:{name}_count") == num_requests, name
        assert workload.delta("router", f"pdserve:{name}_sum") > 0, name
        infinite = workload.delta("router", f"pdserve:{name}_bucket", le="+Inf")
        assert infinite == num_requests, name
    tpot = workload.delta("router", "pdserve:request_time_per_output_token_seconds_count")
    assert tpot == sum(1 for n in workload.completions if n >= 2)


def test_inter_token_latency_is_observed_once_per_token_after_the_first_message(workload):
    later_tokens = sum(
        n - first
        for n, first in zip(workload.completions, workload.first_message_tokens, strict=True)
    )
    assert workload.delta("router", "pdserve:inter_token_latency_seconds_count") == later_tokens


def test_router_counts_routing_decisions_by_cache_outcome(workload):
    hits = sum(1 for cached in workload.cached_tokens if cached)
    assert hits == 1  # the repeated prompt, on the prefill worker that computed it
    decisions = "pdserve:routing_decisions_total"
    policy = {"policy": "cache_aware"}
    assert workload.delta("router", decisions, **policy, outcome="cache_hit") == hits
    misses = len(workload.prompts) - hits
    assert workload.delta("router", decisions, **policy, outcome="cache_miss") == misses
    assert workload.delta("router", "pdserve:retries_total") == 0


def test_router_counts_clients_ttft_targets_met_and_missed(cluster, workload):
    """One request whose client allows a minute for its first token, one 1 ms: no prompt
    gets through the router and a worker that fast."""
    router = processes(cluster)["router"]
    before = scrape(router)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    with Client(cluster.router_address, timeout=60) as client:
        for seed, ttft_slo_ms in ((50, 60_000), (51, 1)):
            list(client.stream(prompt(seed, 8), params, ttft_slo_ms=ttft_slo_ms))
    name = "pdserve:ttft_target_requests_total"
    deadline = time.monotonic() + SETTLE_S
    while True:  # the router counts a request just after its last message went out
        after = scrape(router)
        counted = {
            o: after.value(name, outcome=o) - before.value(name, outcome=o)
            for o in ("met", "missed")
        }
        if counted == {"met": 1, "missed": 1} or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert counted == {"met": 1, "missed": 1}


def test_router_holds_no_relay_stream_once_requests_ended(workload):
    assert workload.after["router"].value("pdserve:relay_streams") == 0


# -- the workers: the KV transfer on both ends, the engine's counts ---------------------


def test_both_ends_count_the_kv_size_of_every_prompt(workload, demo_model_dir):
    model = ModelConfig.from_dir(demo_model_dir)
    expected = sum(kv_bytes(model, len(p)) for p in workload.prompts)
    for role, side in (("prefill", "send"), ("decode", "receive")):
        assert workload.delta(role, "pdserve:kv_transfer_bytes_total", side=side) == expected
        pushes = workload.delta(role, "pdserve:kv_transfer_seconds_count", side=side)
        assert pushes == len(workload.prompts)
        assert workload.delta(role, "pdserve:kv_transfer_failures_total") == 0


def test_prefill_worker_counts_prefix_cache_queries_and_hits_in_tokens(workload):
    queries = workload.delta("prefill", "pdserve:prefix_cache_queries_total")
    assert queries == sum(len(p) for p in workload.prompts)
    # the repeat hits every full block but the one holding its last token
    cacheable = (PROMPT_LENGTHS[0] - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert workload.cached_tokens[-1] == cacheable
    assert workload.delta("prefill", "pdserve:prefix_cache_hits_total") == cacheable


def test_workers_report_their_engine_and_leases_idle_after_the_workload(workload):
    for role in ("prefill", "decode"):
        after = workload.after[role]
        assert after.value("pdserve:num_requests_running") == 0, role
        assert after.value("pdserve:num_requests_waiting") == 0, role
        assert after.value("pdserve:kv_leases_active") == 0, role
        assert 0 <= after.value("pdserve:kv_cache_usage_perc") <= 1, role
        assert workload.delta(role, "pdserve:num_preemptions_total") == 0, role
        assert workload.delta(role, "pdserve:kv_leases_expired_total") == 0, role


def test_the_decode_worker_alone_reports_orphans_and_none_is_left_after_the_workload(workload):
    decode, prefill = workload.after["decode"], workload.after["prefill"]
    assert decode.value("pdserve:orphans_kept") == 0
    assert workload.delta("decode", "pdserve:orphans_reattached_total") == 0
    assert workload.delta("decode", "pdserve:orphans_expired_total") == 0
    assert not [s for s in prefill.samples if s.name.startswith("pdserve:orphans")]


# -- the endpoint ---------------------------------------------------------------------


def test_each_metric_has_one_owner(cluster, workload):
    router, prefill = workload.after["router"], workload.after["prefill"]
    assert not [s for s in router.samples if s.name.startswith("pdserve:kv_transfer")]
    assert not [s for s in router.samples if s.name.startswith("pdserve:num_requests")]
    assert not [s for s in prefill.samples if s.name.startswith("pdserve:prompt_tokens")]
    assert not [s for s in prefill.samples if s.name.startswith("pdserve:time_to_first")]


def test_every_metric_carries_the_model_the_role_and_the_process_id(cluster, workload):
    with Client(cluster.router_address, timeout=10) as client:
        ids = {w.address: w.worker_id for w in client.list_workers()}
    model_name = Path(cluster.model).name
    for role, child in processes(cluster).items():
        expected = {
            "model_name": model_name,
            "role": role,
            "worker": child.fields["id"] if role == "router" else ids[child.address],
        }
        samples = [s for s in workload.after[role].samples if s.name.startswith("pdserve:")]
        assert samples, role
        for sample in samples:
            assert expected.items() <= sample.labels.items(), sample


def test_histograms_have_vllms_buckets(workload):
    buckets = {
        float(s.labels["le"])
        for s in workload.after["router"].samples
        if s.name == "pdserve:time_to_first_token_seconds_bucket"
    }
    assert buckets == {*TTFT_BUCKETS, math.inf}


def test_endpoint_answers_the_text_format_even_to_an_openmetrics_scrape(cluster):
    with get(processes(cluster)["router"].metrics_address, accept=OPENMETRICS) as response:
        content_type = response.headers["Content-Type"]
        text = response.read().decode()
    assert content_type.startswith("text/plain; version=0.0.4")
    assert "pdserve:time_to_first_token_seconds_bucket{" in text
    assert "pdserve_" not in text
    assert "# EOF" not in text  # OpenMetrics' last line


def test_endpoint_serves_metrics_only_at_its_path(cluster):
    with pytest.raises(urllib.error.HTTPError) as error:
        get(processes(cluster)["decode"].metrics_address, path="/")
    assert error.value.code == 404


# -- where people find the endpoints ----------------------------------------------------


def test_up_prints_one_metrics_line_per_process(cluster):
    lines = metrics_lines(cluster)
    assert sorted(line.split()[1] for line in lines) == ["decode", "prefill", "router"]
    for line, child in zip(lines, cluster.children, strict=True):
        assert line == f"metrics {child.role} http://{child.metrics_address}/metrics"
        assert child.metrics_address.startswith("127.0.0.1:")


def status(*args: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert pdserve(["status", *args]) == 0
    return out.getvalue()


@pytest.mark.parametrize("source", ["registry", "router"])
def test_status_shows_each_workers_metrics_endpoint(cluster, source):
    args = ["--redis-url", cluster.redis] if source == "registry" else []
    args += ["--router", cluster.router_address] if source == "router" else []
    workers = {w["address"]: w for w in json.loads(status(*args, "--json"))}
    table = status(*args).splitlines()
    assert table[0].split()[-1] == "METRICS"  # appended: the columns before stay as they were
    for role in ("prefill", "decode"):
        child = processes(cluster)[role]
        assert workers[child.address]["metrics_address"] == child.metrics_address
        [row] = [line for line in table if child.address in line]
        assert row.split()[-1] == metrics_url(child.metrics_address)


# -- what one request adds, in this process ---------------------------------------------


@pytest.fixture
def router_metrics():
    labels = ProcessLabels(model_name="demo", role="router", worker="router-test")
    process = metrics.serve(labels, "127.0.0.1", metrics.MetricsConfig(metrics_port=0))
    try:
        yield process
    finally:
        process.close()


def summary(outcome: RequestPhase, finish_reason: str, **times: float) -> RequestSummary:
    fields = dict(received_at=100.0, admitted_at=0.0, first_token_at=0.0, finished_at=103.0)
    return RequestSummary(
        request_id="r",
        trace_id="",
        model="demo",
        outcome=outcome,
        finish_reason=finish_reason,
        error="",
        prefill_worker="",
        decode_worker="",
        prompt_tokens=7,
        completion_tokens=0,
        cached_prompt_tokens=0,
        num_attempts=1,
        **{**fields, **times},
    )


def sample(process, name: str, **labels: str) -> float | None:
    labels = {"model_name": "demo", "role": "router", "worker": "router-test", **labels}
    return process.registry.get_sample_value(name, labels)


def test_a_failed_request_counts_as_error_without_whole_request_latencies(router_metrics):
    metrics.record_request(summary(RequestPhase.FAILED, "", admitted_at=100.5))

    assert sample(router_metrics, "pdserve:request_success_total", finished_reason="error") == 1
    assert sample(router_metrics, "pdserve:request_queue_time_seconds_count") == 1
    assert sample(router_metrics, "pdserve:e2e_request_latency_seconds_count") == 0
    # its prompt never ran: no first token, no prompt tokens counted
    assert sample(router_metrics, "pdserve:time_to_first_token_seconds_count") == 0
    assert sample(router_metrics, "pdserve:prompt_tokens_total") == 0


TTFT_TARGETS = {
    # the request: (what its summary says, the outcome it counts as; None: neither)
    "first token in time": ((RequestPhase.FINISHED, "length"), {"first_token_at": 100.2}, "met"),
    "first token late": ((RequestPhase.FINISHED, "length"), {"first_token_at": 100.9}, "missed"),
    "failed before it": ((RequestPhase.FAILED, ""), {}, "missed"),
    "failed after it": ((RequestPhase.FAILED, ""), {"first_token_at": 100.1}, "met"),
    "cancelled before it passed": ((RequestPhase.CANCELLED, "abort"), {"finished_at": 100.3}, None),
    "cancelled after it passed": ((RequestPhase.CANCELLED, "abort"), {}, "missed"),
    "late, then cancelled": (
        (RequestPhase.CANCELLED, "abort"),
        {"first_token_at": 101.0},
        "missed",
    ),
}


@pytest.mark.parametrize("case", sorted(TTFT_TARGETS))
def test_a_request_with_a_ttft_target_counts_whether_it_was_met(router_metrics, case):
    (phase, reason), times, expected = TTFT_TARGETS[case]
    metrics.record_request(summary(phase, reason, ttft_target_s=0.5, **times))

    counted = {
        outcome: sample(router_metrics, "pdserve:ttft_target_requests_total", outcome=outcome)
        for outcome in ("met", "missed")
    }
    assert counted == {outcome: float(outcome == expected) for outcome in counted}


def test_a_request_without_a_ttft_target_counts_neither_way(router_metrics):
    metrics.record_request(summary(RequestPhase.FINISHED, "length", first_token_at=109.0))

    for outcome in ("met", "missed"):
        assert sample(router_metrics, "pdserve:ttft_target_requests_total", outcome=outcome) == 0


def test_the_tokens_of_one_message_share_its_gap(router_metrics):
    metrics.tokens_delivered(4, 0.2)

    assert sample(router_metrics, "pdserve:inter_token_latency_seconds_count") == 4
    assert sample(router_metrics, "pdserve:inter_token_latency_seconds_sum") == pytest.approx(0.2)
    assert sample(router_metrics, "pdserve:inter_token_latency_seconds_bucket", le="0.05") == 4
    assert sample(router_metrics, "pdserve:inter_token_latency_seconds_bucket", le="0.025") == 0


@pytest.mark.parametrize(
    "config_cls, required",
    [
        (RouterConfig, ["--model", "m", "--redis-url", "redis://localhost"]),
        (WorkerConfig, ["decode", "--model", "m", "--device", "cpu"]),
    ],
    ids=["router", "worker"],
)
def test_metrics_port_comes_from_its_flag_or_variable_and_is_off_without(config_cls, required):
    parser = argparse.ArgumentParser()
    add_flags(parser, config_cls)

    def port(argv: list[str], environ: dict[str, str]) -> int | None:
        config = config_from_args(config_cls, parser.parse_args(required + argv), environ)
        return config.metrics.metrics_port

    assert port([], {}) is None  # a process started alone serves no endpoint
    assert port([], {"PDSERVE_METRICS_PORT": "9100"}) == 9100
    assert port(["--metrics-port", "0"], {"PDSERVE_METRICS_PORT": "9100"}) == 0


# -- leases that expire, pushes that fail (after the workload: their own deltas) --------


def wait_for(child: ChildProcess, done, timeout_s: float = SETTLE_S) -> Scrape:
    deadline = time.monotonic() + timeout_s
    while not done(now := scrape(child)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return now


def test_an_expired_lease_and_a_push_into_it_are_counted_on_the_decode_worker(cluster, workload):
    # (`workload` first, so that its deltas hold its requests alone)
    decode = processes(cluster)["decode"]
    before = scrape(decode)
    with grpc.insecure_channel(decode.address) as channel:
        lease = decode_pb2_grpc.DecodeStub(channel).Admit(
            decode_pb2.AdmitRequest(
                prompt_token_ids=prompt(99, 20),
                sampling=sampling_params_to_proto(SamplingParams(max_tokens=4)),
                lease_ttl_ms=100,
            ),
            timeout=10,
        )
    expired = "pdserve:kv_leases_expired_total"
    after = wait_for(decode, lambda now: now.value(expired) > before.value(expired))
    assert after.value(expired) - before.value(expired) == 1
    assert after.value("pdserve:kv_leases_active") == 0

    data = bytes(16)
    chunk = KVLayerChunk(0, DTYPE, (2, 1, 1, 1, 2), data, zlib.crc32(data))
    with KVPusher(decode.address) as pusher, pytest.raises(KVPushError) as error:
        pusher.push(lease.lease_id, [(0, chunk)], timeout=10)
    assert error.value.code == grpc.StatusCode.NOT_FOUND
    failures = "pdserve:kv_transfer_failures_total"
    labels = {"side": "receive", "reason": "NOT_FOUND"}
    after = wait_for(
        decode, lambda now: now.value(failures, **labels) > before.value(failures, **labels)
    )
    assert after.value(failures, **labels) - before.value(failures, **labels) == 1


def test_retries_are_counted_by_the_status_code_that_ended_the_attempt(
    cluster, workload, demo_model_dir, tmp_path
):
    """A router whose only prefill worker has a KV dtype the decode worker refuses at the
    handshake (FAILED_PRECONDITION): every attempt fails, all but the last are retried."""
    decode = processes(cluster)["decode"]
    model = str(demo_model_dir)
    prefill_args = worker_args("prefill", model, port=0, threads=1, dtype="bfloat16")
    with pdserve_process(prefill_args, tmp_path) as prefill:
        router_cmd = router_args(
            model,
            cluster.redis,
            port=0,
            discovery="static",
            prefill=[prefill.address],
            decode=[decode.address],
            max_attempts=3,
            metrics_port=0,
        )
        with pdserve_process(router_cmd, tmp_path) as router:
            before = scrape(router)
            with Client(router.address, timeout=60) as client:
                wait_for_workers(client, 2)
                with pytest.raises(PdserveError):
                    client.generate(prompt(77, 20), SamplingParams(max_tokens=2))
            failed = {"finished_reason": "error"}
            success = "pdserve:request_success_total"
            after = wait_for(router, lambda now: now.value(success, **failed) > 0)
    retries = "pdserve:retries_total"
    assert after.value(retries, reason="FAILED_PRECONDITION") - before.value(retries) == 2
    assert after.value(success, **failed) - before.value(success, **failed) == 1


def wait_for_workers(client: Client, count: int) -> None:
    deadline = time.monotonic() + SETTLE_S
    while sum(w.healthy for w in client.list_workers()) < count:
        assert time.monotonic() < deadline, "the router never saw its workers"
        time.sleep(0.05)
