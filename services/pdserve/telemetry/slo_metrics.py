"""Clients' TTFT targets as Prometheus metrics: part of the router's metrics
(`metrics._RouterMetrics.ttft_targets`), in a module of their own as the admission
queue's are.

A request that carries its client's TTFT target (`GenerateRequest.ttft_slo_ms`, the
`x-slo-ttft-ms` header) counts once when it ends: `met` when its first token went out
within the target, `missed` when it went out later, or the request failed before it, or
its client gave up on it after the target had passed. One the client cancelled while its
target could still be met counts neither way, and neither does a request without one.
`met / (met + missed)` is the share of stated targets kept.
"""

from __future__ import annotations

import enum

from prometheus_client import CollectorRegistry, Counter

from pdserve.core.phase import RequestPhase
from pdserve.telemetry.labels import LABELS
from pdserve.telemetry.summary import RequestSummary


class TargetOutcome(enum.StrEnum):
    """`ttft_target_requests_total{outcome}`."""

    MET = "met"
    MISSED = "missed"


def ttft_target_outcome(summary: RequestSummary) -> TargetOutcome | None:
    """How the request did against its client's TTFT target; None: it had none, or its
    client left before the target had passed."""
    if not summary.ttft_target_s:
        return None
    if summary.first_token_at:
        met = summary.time_to_first_token_s <= summary.ttft_target_s
        return TargetOutcome.MET if met else TargetOutcome.MISSED
    if summary.outcome is RequestPhase.CANCELLED and summary.e2e_latency_s <= summary.ttft_target_s:
        return None
    return TargetOutcome.MISSED


class TtftTargetMetrics:
    def __init__(self, registry: CollectorRegistry | None, labels: tuple[str, ...]):
        family = Counter(
            "pdserve:ttft_target_requests",
            "Requests that carried their client's TTFT target, by whether the first token "
            "went out within it (met) or not, or the request failed first (missed)",
            (*LABELS, "outcome"),
            registry=registry,
        )
        # both series exist from the start, so a ratio of rates sees the first request
        self.outcomes = {outcome: family.labels(*labels, outcome) for outcome in TargetOutcome}

    def record(self, summary: RequestSummary) -> None:
        outcome = ttft_target_outcome(summary)
        if outcome is not None:
            self.outcomes[outcome].inc()
