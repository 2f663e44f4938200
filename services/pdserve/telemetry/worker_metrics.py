"""A worker's engine, KV leases and orphans as Prometheus metrics, read when scraped: part
of a worker's metrics (`metrics.ProcessMetrics.watch_worker`), in a module of their own so
`metrics.py` stays one screenful per owner."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


class WatchedWorker(Protocol):
    """What a worker's collector reads (`pdserve.worker.worker.Worker`): telemetry sits
    below the worker and the router, so it names what it reads, not their classes."""

    engine: Any  # an LLMEngine: .scheduler and .block_manager counts
    leases: Any  # AdmittedLeases: len() and .num_expired


class WatchedOrphans(Protocol):
    """What a decode worker's collector reads of its orphans (`worker.orphans.Orphans`)."""

    num_reattached: int
    num_expired: int

    def __len__(self) -> int: ...


class WorkerCollector:
    """A worker's engine, leases and orphans, read when scraped: the hot path pays nothing.

    Runs on the endpoint's thread while the engine runs on its own: it reads counts only
    (ints and lengths, each read whole under the GIL), never iterates what they change.
    """

    def __init__(
        self,
        worker: WatchedWorker,
        orphans: WatchedOrphans | None,
        label_names: Sequence[str],
        label_values: Sequence[str],
    ):
        self._worker, self._orphans = worker, orphans
        self._label_names, self._label_values = list(label_names), list(label_values)

    def collect(self) -> Iterator[Metric]:
        worker, orphans = self._worker, self._orphans
        scheduler, blocks = worker.engine.scheduler, worker.engine.block_manager
        gauges = (
            ("num_requests_running", "Requests in the engine's batch", scheduler.num_running),
            ("num_requests_waiting", "Requests queued for the engine", scheduler.num_waiting),
            ("kv_cache_usage_perc", "Share of KV blocks held by requests (0-1)", blocks.usage),
            ("kv_leases_active", "KV leases admitted and not yet ended", len(worker.leases)),
        )
        counters = (
            ("prefix_cache_queries", "Prompt tokens looked up", blocks.prefix_cache_queries),
            ("prefix_cache_hits", "Of those, tokens found cached", blocks.prefix_cache_hits),
            ("num_preemptions", "Requests preempted for KV blocks", scheduler.num_preemptions),
            ("kv_leases_expired", "Leases ended before their KV", worker.leases.num_expired),
        )
        if orphans is not None:  # a worker that decodes
            gauges += (("orphans_kept", "Requests of a broken relay call kept", len(orphans)),)
            counters += (
                ("orphans_reattached", "Orphans a router re-attached", orphans.num_reattached),
                ("orphans_expired", "Orphans aborted, none re-attached", orphans.num_expired),
            )
        for family, rows in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for name, documentation, value in rows:
                metric = family(f"pdserve:{name}", documentation, labels=self._label_names)
                metric.add_metric(self._label_values, value)
                yield metric
