"""Prometheus metrics of a pdserve process: every metric defined once, here, with vLLM's
names (prefixed `pdserve:`) and buckets, in a registry per process that `endpoint.py`
serves at `GET /metrics` (always in the text format, so the names stay as written).

Each metric has one owner, so that a sum over processes counts nothing twice:
- the router: every request's latencies and tokens (`record_request`, called once per
  request by its `RequestTelemetry`; `tokens_delivered` for the inter-token latency),
  retries, routing decisions and its relay streams;
- a worker: its engine's gauges and counters and its KV leases, read when scraped
  (`ProcessMetrics.watch_worker`: the hot path pays nothing for them), and the KV it
  sent or received (`side="send"|"receive"`).

Every metric carries `model_name`, `role` and `worker` (the worker's id; for the router,
its router id). A process records only while its endpoint runs (`--metrics-port`); in a
process without one the recording functions return at once.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from pdserve.core.phase import RequestPhase
from pdserve.telemetry.admission_metrics import AdmissionMetrics
from pdserve.telemetry.endpoint import METRICS_PATH, MetricsServer
from pdserve.telemetry.labels import LABELS
from pdserve.telemetry.slo_metrics import TtftTargetMetrics
from pdserve.telemetry.summary import RequestSummary
from pdserve.telemetry.worker_metrics import WatchedOrphans, WatchedWorker, WorkerCollector

ROUTER_ROLE = "router"
# vLLM's buckets (vllm/v1/metrics/loggers.py), so that dashboards made for vLLM read ours
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0)
TTFT_BUCKETS += (2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0)
TOKEN_BUCKETS += (2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0)
REQUEST_BUCKETS += (50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# ours: a small prompt's KV on loopback takes about a millisecond, a long one seconds
KV_TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
KV_TRANSFER_BUCKETS += (2.5, 5.0, 10.0, 30.0)
FAILED_REASON = "error"  # request_success_total's finished_reason for a failed request
FINISHED_REASONS = ("stop", "length", "abort", FAILED_REASON)


class TransferSide(enum.StrEnum):
    """Which end of a KV transfer a worker counts: both ends count, each its own."""

    SEND = "send"  # the prefill worker pushing a prompt's KV
    RECEIVE = "receive"  # the decode worker taking it into a lease's blocks


class RoutingOutcome(enum.StrEnum):
    """How a routing decision turned out, as `routing_decisions_total{outcome}` counts it."""

    CACHE_HIT = "cache_hit"  # the chosen prefill worker had a prefix of the prompt cached
    CACHE_MISS = "cache_miss"  # it computed the whole prompt
    COLOCATED = "colocated"  # prefilled on the decode worker itself: no KV transfer


COLOCATED_POLICY = "colocated"  # routing_decisions_total's policy when colocating


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    """Where a server process serves its metrics; a part of RouterConfig and WorkerConfig."""

    metrics_port: int | None = field(
        default=None,
        metadata={
            "help": "serve Prometheus metrics at GET /metrics on this port (0: a free one, "
            "printed in the ready line; default: no endpoint, nothing recorded)",
            "metavar": "PORT",
        },
    )

    def __post_init__(self) -> None:
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")


@dataclass(frozen=True, slots=True)
class ProcessLabels:
    """The labels every metric of one process carries."""

    model_name: str  # the served model's name (as spans and log lines name it)
    role: str  # router, prefill, decode or both
    worker: str  # the worker's id, or the router's

    @property
    def values(self) -> tuple[str, str, str]:
        return self.model_name, self.role, self.worker


class _RouterMetrics:
    """What the router records: each request's latencies and tokens, retries, routing."""

    def __init__(self, registry: CollectorRegistry | None, labels: ProcessLabels):
        self._labels = labels.values

        def histogram(name: str, documentation: str, buckets) -> Histogram:
            family = Histogram(name, documentation, LABELS, buckets=buckets, registry=registry)
            return family.labels(*self._labels)

        self.ttft = histogram(
            "pdserve:time_to_first_token_seconds",
            "Call received to the first token's message (tokenization included)",
            TTFT_BUCKETS,
        )
        self.inter_token = histogram(
            "pdserve:inter_token_latency_seconds",
            "Time between tokens sent to the client, one observation per token",
            TOKEN_BUCKETS,
        )
        self.time_per_output_token = histogram(
            "pdserve:request_time_per_output_token_seconds",
            "A finished request's (last token - first token) / (output tokens - 1)",
            TOKEN_BUCKETS,
        )
        self._request_histograms(histogram)
        self._counters(registry)
        self.admission = AdmissionMetrics(registry, self._labels)  # the admission queue's
        self.ttft_targets = TtftTargetMetrics(registry, self._labels)  # clients' TTFT targets

    def _request_histograms(self, histogram) -> None:
        self.e2e = histogram(
            "pdserve:e2e_request_latency_seconds",
            "A finished request: call received to its last token",
            REQUEST_BUCKETS,
        )
        self.queue = histogram(
            "pdserve:request_queue_time_seconds",
            "Call received to a decode worker holding the request's KV blocks",
            REQUEST_BUCKETS,
        )
        self.prefill = histogram(
            "pdserve:request_prefill_time_seconds",
            "Decode worker admitted the request to its first token",
            REQUEST_BUCKETS,
        )
        self.decode = histogram(
            "pdserve:request_decode_time_seconds",
            "A finished request: first token to last token",
            REQUEST_BUCKETS,
        )

    def _counters(self, registry: CollectorRegistry | None) -> None:
        labels = self._labels
        self.prompt_tokens = Counter(
            "pdserve:prompt_tokens", "Prompt tokens prefilled", LABELS, registry=registry
        ).labels(*labels)
        self.generation_tokens = Counter(
            "pdserve:generation_tokens", "Tokens sent to clients", LABELS, registry=registry
        ).labels(*labels)
        self.request_success = success = Counter(
            "pdserve:request_success",
            "Requests ended, by finish reason (stop, length, abort; error: failed)",
            (*LABELS, "finished_reason"),
            registry=registry,
        )
        # every reason's series exists from the start, so rate() sees the first request
        self.finished = {reason: success.labels(*labels, reason) for reason in FINISHED_REASONS}
        self.retries = Counter(
            "pdserve:retries",
            "Attempts retried on other workers, by the status code that ended the last one",
            (*LABELS, "reason"),
            registry=registry,
        )
        self.routing_decisions = Counter(
            "pdserve:routing_decisions",
            "Prefill workers chosen, by policy and outcome (cache hit or miss, colocated) "
            "and the reason for remote or colocated (router/disaggregation.py's Reason)",
            (*LABELS, "policy", "outcome", "reason"),
            registry=registry,
        )
        self.relay_streams = Gauge(
            "pdserve:relay_streams",
            "Requests attached to this router's Relay calls to decode workers",
            LABELS,
            registry=registry,
        ).labels(*labels)
        self.remote_hop = Gauge(
            "pdserve:remote_hop_seconds",
            "What the remote prefill path adds to a prompt's TTFT, as the router measures "
            "it on its recent remote requests (and weighs it in each placement decision)",
            LABELS,
            registry=registry,
        ).labels(*labels)
        self.estimate_error = Gauge(
            "pdserve:ttft_estimate_error_seconds",
            "How much longer than the placement decision estimated this router's recent "
            "requests placed that way waited for their first token (and what it adds to "
            "that path's next estimates)",
            (*LABELS, "placement"),
            registry=registry,
        )

    def record(self, summary: RequestSummary) -> None:
        if summary.first_token_at:  # the prompt was computed and its first token sent
            self.prompt_tokens.inc(summary.prompt_tokens)
            self.ttft.observe(summary.time_to_first_token_s)
        self.generation_tokens.inc(summary.completion_tokens)
        reason = summary.finish_reason or FAILED_REASON
        counter = self.finished.get(reason)
        if counter is None:  # a reason newer than this table
            counter = self.request_success.labels(*self._labels, reason)
        counter.inc()
        self.ttft_targets.record(summary)
        if summary.admitted_at:
            self.queue.observe(summary.queue_time_s)
            if summary.first_token_at:
                self.prefill.observe(summary.prefill_time_s)
        if summary.outcome is RequestPhase.FINISHED:  # what a whole request took
            self.e2e.observe(summary.e2e_latency_s)
            self.decode.observe(summary.decode_time_s)
            if summary.completion_tokens >= 2:
                self.time_per_output_token.observe(summary.time_per_output_token_s)

    def tokens_delivered(self, num_tokens: int, gap_s: float) -> None:
        # vLLM observes every token; the tokens of one message share its gap evenly
        per_token_s = gap_s / num_tokens if num_tokens else 0.0
        for _ in range(num_tokens):
            self.inter_token.observe(per_token_s)


class _TransferMetrics:
    """The KV a worker sent or received: both ends count, each with its `side`."""

    def __init__(self, registry: CollectorRegistry | None, labels: ProcessLabels):
        self._labels = labels.values
        sides = (*LABELS, "side")
        num_bytes = Counter(
            "pdserve:kv_transfer_bytes",
            "KV payload bytes of completed pushes (layers x 2 x blocks x block size x KV "
            "heads x head dim x dtype size)",
            sides,
            registry=registry,
        )
        seconds = Histogram(
            "pdserve:kv_transfer_seconds",
            "A completed push: its first KV chunk to the last one taken in",
            sides,
            buckets=KV_TRANSFER_BUCKETS,
            registry=registry,
        )
        self.failures = Counter(
            "pdserve:kv_transfer_failures",
            "Pushes that broke off, by the status code they ended with",
            (*sides, "reason"),
            registry=registry,
        )
        # both sides exist from the start, so rate() sees a worker's first push
        self.bytes = {side: num_bytes.labels(*self._labels, side) for side in TransferSide}
        self.seconds = {side: seconds.labels(*self._labels, side) for side in TransferSide}

    def transferred(self, side: TransferSide, num_bytes: int, seconds: float) -> None:
        self.bytes[side].inc(num_bytes)
        self.seconds[side].observe(seconds)

    def failed(self, side: TransferSide, reason: str) -> None:
        self.failures.labels(*self._labels, side, reason).inc()


class WatchedRelays(Protocol):
    """What `relay_streams` reads (`pdserve.router.relay.DecodeRelays`)."""

    @property
    def num_streams(self) -> int: ...


class WatchedHop(Protocol):
    """What `remote_hop_seconds` reads (`pdserve.router.colocation.RemoteHop`)."""

    @property
    def ms(self) -> float: ...


class WatchedErrors(Protocol):
    """What `ttft_estimate_error_seconds` reads (`router.colocation.EstimateErrors`)."""

    @property
    def ms(self) -> Mapping[str, float]: ...


class ProcessMetrics:
    """This process's metrics, in a registry of its own, and the endpoint serving them.
    A router's registry holds the router's metrics, a worker's the workers'; the other
    kind is built too, unregistered, so that no recording call needs to ask which."""

    def __init__(self, labels: ProcessLabels, host: str, port: int):
        disable_created_metrics()  # `_created` series would double what Prometheus stores
        self.labels = labels
        self.registry = CollectorRegistry()
        is_router = labels.role == ROUTER_ROLE
        self.router = _RouterMetrics(self.registry if is_router else None, labels)
        self.transfers = _TransferMetrics(None if is_router else self.registry, labels)
        self._server = MetricsServer(self.registry, host, port)
        self.port: int = self._server.server_address[1]
        self.address = f"{host}:{self.port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="metrics-endpoint", daemon=True
        )
        self._thread.start()

    def watch_worker(self, worker: WatchedWorker, orphans: WatchedOrphans | None = None) -> None:
        """Serve the worker's engine gauges and counters, its leases and, on a worker that
        decodes, its orphans (`--orphan-timeout`) from now on."""
        self.registry.register(WorkerCollector(worker, orphans, LABELS, self.labels.values))

    def watch_relays(self, relays: WatchedRelays) -> None:
        """Serve the number of requests on the router's relay calls as `relay_streams`."""
        self.router.relay_streams.set_function(lambda: relays.num_streams)

    def watch_remote_hop(self, hop: WatchedHop) -> None:
        """Serve the router's measured remote hop as `remote_hop_seconds`."""
        self.router.remote_hop.set_function(lambda: hop.ms / 1000)

    def watch_estimate_errors(self, errors: WatchedErrors) -> None:
        """Serve each placement's TTFT estimate error as `ttft_estimate_error_seconds`."""
        for placement in errors.ms:
            gauge = self.router.estimate_error.labels(*self.labels.values, placement)
            gauge.set_function(lambda placement=placement: errors.ms[placement] / 1000)

    def close(self) -> None:
        """Stop serving; the process records nothing more."""
        global _current
        if _current is self:
            _current = None
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def metrics_url(address: str) -> str:
    """Where a process at `address` (host:port of its endpoint) serves its metrics."""
    return f"http://{address}{METRICS_PATH}"


# -- this process's metrics, for the recording calls ------------------------------------

_current: ProcessMetrics | None = None  # the process's endpoint, once it serves


def serve(labels: ProcessLabels, host: str, config: MetricsConfig) -> ProcessMetrics | None:
    """Start recording and serve `GET /metrics` on `config.metrics_port` (0: a free port,
    then see `.address`); None, recording nothing, when the config gives no port."""
    global _current
    if config.metrics_port is None:
        return None
    _current = ProcessMetrics(labels, host, config.metrics_port)
    return _current


def record_request(summary: RequestSummary) -> None:
    """The router: one request ended (called once per request, by its RequestTelemetry)."""
    if _current is not None:
        _current.router.record(summary)


def tokens_delivered(num_tokens: int, gap_s: float) -> None:
    """The router sent a client `num_tokens` tokens `gap_s` seconds after its previous
    message to it (each message but a request's first)."""
    if _current is not None:
        _current.router.tokens_delivered(num_tokens, gap_s)


def retry(reason: str) -> None:
    """The router retries a request on other workers; `reason`: the status code's name."""
    if _current is not None:
        _current.router.retries.labels(*_current.labels.values, reason).inc()


def routing_decision(policy: str, outcome: RoutingOutcome, reason: str) -> None:
    """The router sent a prompt to a prefill worker its `policy` chose (or colocated it),
    for `reason` (why remote or colocated: router/disaggregation.py's Reason)."""
    if _current is not None:
        labels = (*_current.labels.values, policy, outcome, reason)
        _current.router.routing_decisions.labels(*labels).inc()


def admission() -> AdmissionMetrics | None:
    """The router's admission queue metrics while it records; None: record nothing."""
    return None if _current is None else _current.router.admission


def kv_transferred(side: TransferSide, num_bytes: int, seconds: float) -> None:
    """A worker completed its end of a KV push: `num_bytes` of payload in `seconds`."""
    if _current is not None:
        _current.transfers.transferred(side, num_bytes, seconds)


def kv_transfer_failed(side: TransferSide, reason: str) -> None:
    """A worker's end of a KV push broke off; `reason`: the status code's name."""
    if _current is not None:
        _current.transfers.failed(side, reason)
