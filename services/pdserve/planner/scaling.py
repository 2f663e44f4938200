"""From a plan to a replica count: bounds, hysteresis and a cool-down. Pure: the caller
passes the time.

- Up at once: when the load needs more workers than run, the pool gets them now (a new
  worker takes minutes to load its model; waiting costs the SLO).
- Down reluctantly: only when even the load plus `hysteresis` (a share of it) fits in
  fewer workers, so that a load hovering at a boundary does not flap; and only once
  `cooldown_s` has passed since the pool last changed, so that a change shows its effect
  (and a burst its end) before the next.
- Always within `bounds`: a pool outside them (scaled by hand) is brought back at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.planner.capacity import Pool
from pdserve.planner.plan import workers_needed

DEFAULT_HYSTERESIS = 0.2
DEFAULT_COOLDOWN_S = 300.0


@dataclass(frozen=True, slots=True)
class Bounds:
    """The fewest and the most workers a pool may run (a pool never scales to zero)."""

    min: int
    max: int

    def __post_init__(self) -> None:
        if not 1 <= self.min <= self.max:
            raise ValueError(f"bounds need 1 <= min <= max, got min {self.min}, max {self.max}")

    def clamp(self, n: int) -> int:
        return min(max(n, self.min), self.max)


@dataclass(frozen=True, slots=True)
class ScalingPolicy:
    bounds: Bounds
    hysteresis: float = DEFAULT_HYSTERESIS
    cooldown_s: float = DEFAULT_COOLDOWN_S
    headroom: float = 0.0  # planned on top of the load, in either direction

    def __post_init__(self) -> None:
        if self.hysteresis < 0 or self.cooldown_s < 0 or self.headroom < 0:
            raise ValueError("hysteresis, cool-down and headroom must be >= 0")


@dataclass(frozen=True, slots=True)
class Decision:
    pool: Pool
    current: int
    target: int
    reason: str

    @property
    def changed(self) -> bool:
        return self.target != self.current


def decide(
    pool: Pool,
    policy: ScalingPolicy,
    current: int,
    tokens_per_s: float,
    capacity_per_worker: float,
    now: float,
    last_change_at: float | None,
) -> Decision:
    """The replicas `pool` should run now (`now` and `last_change_at` on one clock, seconds;
    None: the pool has not changed since the planner started)."""
    bounds = policy.bounds
    if bounds.clamp(current) != current:
        target = bounds.clamp(current)
        return Decision(pool, current, target, f"{current} is outside [{bounds.min}, {bounds.max}]")
    needed = workers_needed(tokens_per_s, capacity_per_worker, policy.headroom)
    load = f"{tokens_per_s:.1f} tok/s needs {needed} at {capacity_per_worker:.1f} per worker"
    if bounds.clamp(needed) > current:
        capped = "" if needed <= bounds.max else f" (capped at max {bounds.max})"
        return Decision(pool, current, bounds.clamp(needed), f"up: {load}{capped}")
    margin = tokens_per_s * (1 + policy.hysteresis)
    down = bounds.clamp(workers_needed(margin, capacity_per_worker, policy.headroom))
    if down >= current:
        why = "steady" if needed >= current else f"held by the {policy.hysteresis:.0%} hysteresis"
        return Decision(pool, current, current, f"{why}: {load}")
    waited = None if last_change_at is None else now - last_change_at
    if waited is not None and waited < policy.cooldown_s:
        left = policy.cooldown_s - waited
        return Decision(pool, current, current, f"cool-down, {left:.0f} s left: {load}")
    return Decision(pool, current, down, f"down: {load}, {down} with the hysteresis")
