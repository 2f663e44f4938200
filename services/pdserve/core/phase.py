"""A request's phase across the cluster: one vocabulary for the router and Redis.

Distinct from the engine's `RequestStatus`, which says where a request stands inside one
engine (waiting, running, preempted); this says where it stands in the cluster.
"""

from __future__ import annotations

import enum


class RequestPhase(enum.StrEnum):
    """Where a request stands in the cluster; the value is what Redis stores."""

    QUEUED = "queued"
    PREFILLING = "prefilling"
    TRANSFERRING = "transferring"
    DECODING = "decoding"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({RequestPhase.FINISHED, RequestPhase.FAILED, RequestPhase.CANCELLED})
