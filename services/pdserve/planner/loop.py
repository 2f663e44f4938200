"""`pdserve planner`'s loop: every interval, look at the load, decide each pool's replicas
(`scaling.decide`) and apply what changed through the scale subresource.

A look that fails (Prometheus unreachable, the API server refusing) changes nothing and is
logged; the next interval tries again, so a passing outage leaves the pools as they were.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.planner.capacity import Capacity, Pool
from pdserve.planner.kubernetes import ScaleError
from pdserve.planner.live import LiveLoadError
from pdserve.planner.plan import Load
from pdserve.planner.scaling import Decision, ScalingPolicy, decide

log = logging.getLogger(__name__)


class Scaler(Protocol):
    """The pools' replica counts: `kubernetes.DeploymentScaler`."""

    def replicas(self, pool: Pool) -> int: ...

    def scale(self, pool: Pool, replicas: int) -> None: ...


@dataclass(slots=True)
class Planner:
    capacities: dict[Pool, Capacity]
    policies: dict[Pool, ScalingPolicy]
    scaler: Scaler
    load: Callable[[], Load]  # the offered load now
    dry_run: bool = False
    # when each pool last changed, on the `now` clock of `tick` (absent: not since start)
    last_change_at: dict[Pool, float] = field(default_factory=dict)

    def tick(self, now: float) -> list[Decision]:
        """One look: each pool's decision, applied unless dry-run. Raises LiveLoadError or
        ScaleError when the load or a Deployment's scale cannot be had."""
        load = self.load()
        decisions = []
        for pool in Pool:
            current = self.scaler.replicas(pool)
            decision = decide(
                pool,
                self.policies[pool],
                current,
                load.tokens_per_s(pool),
                self.capacities[pool].tokens_per_s,
                now,
                self.last_change_at.get(pool),
            )
            if decision.changed and not self.dry_run:
                self.scaler.scale(pool, decision.target)
                self.last_change_at[pool] = now
            decisions.append(decision)
            log.info(
                "%s: %d -> %d (%s)%s",
                pool,
                current,
                decision.target,
                decision.reason,
                " [dry run]" if self.dry_run and decision.changed else "",
            )
        return decisions

    def run(
        self,
        interval_s: float,
        stop: threading.Event,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Look every `interval_s` until `stop` is set."""
        while not stop.is_set():
            try:
                self.tick(clock())
            except (LiveLoadError, ScaleError) as exc:
                log.warning("no change this time: %s", exc)
            stop.wait(interval_s)
