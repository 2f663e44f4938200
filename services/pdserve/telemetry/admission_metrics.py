"""The router's admission queue as Prometheus metrics: part of the router's metrics
(`metrics._RouterMetrics.admission`), in a module of their own so `metrics.py` stays one
screenful per owner. `metrics.admission()` is this process's, or None when it records
nothing."""

from __future__ import annotations

import enum
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.telemetry.labels import LABELS

# Most waits are 0 (a slot was free); the rest run up to --queue-timeout (10 s default).
WAIT_BUCKETS = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)


class AdmissionRefusal(enum.StrEnum):
    """Why the admission queue refused a request: `router_requests_refused{reason}`."""

    QUEUE_FULL = "queue_full"  # --max-inflight running and --max-queued-requests waiting
    QUEUE_TIMEOUT = "queue_timeout"  # waited --queue-timeout without a slot coming free


class WatchedQueue(Protocol):
    """What the gauges read (`pdserve.router.admission.AdmissionQueue`)."""

    num_running: int
    num_waiting: int


class AdmissionMetrics:
    """The queue's depth and running count (read when scraped), its waits and refusals."""

    def __init__(self, registry: CollectorRegistry | None, labels: tuple[str, str, str]):
        self.wait = Histogram(
            "pdserve:router_queue_wait_seconds",
            "Seconds a request waited in the router's admission queue for a running slot "
            "(0: one was free)",
            LABELS,
            buckets=WAIT_BUCKETS,
            registry=registry,
        ).labels(*labels)
        refused = Counter(
            "pdserve:router_requests_refused",
            "Requests the router's admission queue refused (RESOURCE_EXHAUSTED), by reason",
            (*LABELS, "reason"),
            registry=registry,
        )
        # every reason's series exists from the start, so rate() sees the first refusal
        self.refused = {reason: refused.labels(*labels, reason) for reason in AdmissionRefusal}
        self.num_running, self.num_waiting = (
            Gauge(f"pdserve:router_num_requests_{name}", text, LABELS, registry=registry).labels(
                *labels
            )
            for name, text in (
                ("running", "Requests holding one of the router's running slots"),
                ("waiting", "Requests in the router's admission queue"),
            )
        )

    def watch(self, queue: WatchedQueue) -> None:
        """Serve the queue's counts from now on, read at each scrape."""
        self.num_running.set_function(lambda: queue.num_running)
        self.num_waiting.set_function(lambda: queue.num_waiting)

    def waited(self, seconds: float) -> None:
        self.wait.observe(seconds)

    def refuse(self, reason: AdmissionRefusal) -> None:
        self.refused[reason].inc()
