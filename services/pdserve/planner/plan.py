"""An offered load divided by measured capacities: the workers each pool needs, and why.

Pure functions: the plan of a load is its tokens per second per pool (prompt tokens for
prefill, output tokens for decode) over what one worker of that pool sustains within its
SLO (`capacity.measure`), rounded up, with an optional headroom on top.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.bench.metrics import SLO
from pdserve.planner.capacity import Capacity, Pool

# A count within this of a whole number is that number: 3.0000000001 workers is 3, so that
# float noise in a load never costs a worker.
_WHOLE = 1e-9


@dataclass(frozen=True, slots=True)
class Load:
    """What the pools are offered, in tokens per second."""

    prompt_tokens_per_s: float
    output_tokens_per_s: float
    rate: float | None = None  # requests per second, when the load was given as one
    source: str = ""  # where it came from: "--rate 4 with the record's mix", a Prometheus URL

    def __post_init__(self) -> None:
        if self.prompt_tokens_per_s < 0 or self.output_tokens_per_s < 0:
            raise ValueError("a load's tokens per second must be >= 0")

    @classmethod
    def at_rate(cls, rate: float, prompt_tokens: float, output_tokens: float) -> Load:
        """`rate` requests per second of the average request (`prompt_tokens`, `output_tokens`)."""
        if rate <= 0:
            raise ValueError(f"rate must be > 0, got {rate:g}")
        return cls(rate * prompt_tokens, rate * output_tokens, rate, f"{rate:g} req/s")

    def tokens_per_s(self, pool: Pool) -> float:
        return self.prompt_tokens_per_s if pool is Pool.PREFILL else self.output_tokens_per_s


def workers_needed(tokens_per_s: float, capacity_per_worker: float, headroom: float = 0.0) -> int:
    """Workers that carry `tokens_per_s` (times 1 + headroom) at `capacity_per_worker` each:
    at least one, so that a pool is never planned away."""
    if capacity_per_worker <= 0:
        raise ValueError("a capacity must be > 0 tokens per second")
    if headroom < 0:
        raise ValueError(f"headroom must be >= 0, got {headroom:g}")
    exact = tokens_per_s * (1 + headroom) / capacity_per_worker
    return max(1, math.ceil(exact - _WHOLE))


@dataclass(frozen=True, slots=True)
class PoolPlan:
    pool: Pool
    workers: int
    tokens_per_s: float  # the load offered to the pool
    capacity: Capacity

    @property
    def utilization(self) -> float:
        """The planned workers' share of what they sustain within the SLO."""
        return self.tokens_per_s / (self.workers * self.capacity.tokens_per_s)

    def reason(self) -> str:
        return (
            f"{self.tokens_per_s:.1f} tok/s offered / {self.capacity.describe()} -> "
            f"{self.workers} worker(s), {self.utilization:.0%} used"
        )


@dataclass(frozen=True, slots=True)
class Plan:
    load: Load
    slo: SLO
    headroom: float
    pools: tuple[PoolPlan, ...]  # prefill, then decode

    def workers(self, pool: Pool) -> int:
        return next(p.workers for p in self.pools if p.pool is pool)

    @property
    def ratio(self) -> str:
        """The P:D shape, `prefill:P,decode:D` (what `pdserve bench --compare` takes)."""
        return f"prefill:{self.workers(Pool.PREFILL)},decode:{self.workers(Pool.DECODE)}"


def make_plan(
    load: Load, capacities: dict[Pool, Capacity], slo: SLO, headroom: float = 0.0
) -> Plan:
    """The workers `load` needs in each pool, from each pool's measured capacity."""
    pools = []
    for pool in Pool:
        capacity = capacities[pool]
        tokens = load.tokens_per_s(pool)
        pools.append(
            PoolPlan(
                pool, workers_needed(tokens, capacity.tokens_per_s, headroom), tokens, capacity
            )
        )
    return Plan(load, slo, headroom, tuple(pools))


def plan_json(plan: Plan) -> dict:
    """The plan as `pdserve plan --json` prints it."""
    return {
        "shape": plan.ratio,
        "load": {
            "source": plan.load.source,
            "rate_rps": plan.load.rate,
            "prompt_tokens_per_s": plan.load.prompt_tokens_per_s,
            "output_tokens_per_s": plan.load.output_tokens_per_s,
        },
        "slo": {
            "ttft_ms": plan.slo.ttft_ms,
            "ttft_scale": plan.slo.ttft_scale,
            "tpot_ms": plan.slo.tpot_ms,
        },
        "headroom": plan.headroom,
        "pools": {
            p.pool.value: {
                "workers": p.workers,
                "tokens_per_s": p.tokens_per_s,
                "utilization": p.utilization,
                "slo": p.pool.slo_name,
                "slo_ms": p.pool.slo_ms(plan.slo),
                "capacity_tokens_per_s_per_worker": p.capacity.tokens_per_s,
                "measured_on": p.capacity.config,
                "measured_at_rps": p.capacity.rate,
                "attainment": p.capacity.attainment,
                "lower_bound": not p.capacity.bounded,
                "reason": p.reason(),
            }
            for p in plan.pools
        },
    }


def plan_table(plan: Plan) -> str:
    """The plan for a person: one row per pool, then why."""
    header = ("POOL", "WORKERS", "OFFERED TOK/S", "PER WORKER WITHIN SLO", "SLO", "USED")
    rows = [
        (
            p.pool.value,
            str(p.workers),
            f"{p.tokens_per_s:.1f}",
            ("" if p.capacity.bounded else ">= ") + f"{p.capacity.tokens_per_s:.1f}",
            p.pool.slo_text(plan.slo),
            f"{p.utilization:.0%}",
        )
        for p in plan.pools
    ]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in (header, *rows)
    ]
    lines += ["", f"Load: {plan.load.source}; headroom {plan.headroom:.0%}. Shape: {plan.ratio}."]
    lines += [f"{p.pool.value}: {p.reason()}" for p in plan.pools]
    return "\n".join(lines)
