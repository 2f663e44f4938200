"""What one worker of each pool sustains within its SLO, measured from a bench record.

DistServe's split: a request's time to first token is the prefill pool's doing, its time
per output token the decode pool's. So each pool is judged on its own SLO alone: at each
rate of a configuration, the share of measured requests whose TTFT (prefill) or TPOT
(decode) met it, a failed request missing both. A pool's capacity is the load per worker,
in tokens per second (prompt tokens for prefill, output tokens for decode), at the highest
swept rate up to which every rate met the attainment goal: bench's goodput rule, per pool.

Pure functions: no I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.bench.loadgen import RequestResult
from pdserve.bench.metrics import MS, SLO, SLO_ATTAINMENT_GOAL, goodput
from pdserve.planner.record import RecordedRun


class Pool(enum.StrEnum):
    """A worker pool the planner sizes, and the SLO that judges it."""

    PREFILL = "prefill"  # prompt tokens per second; TTFT
    DECODE = "decode"  # output tokens per second; TPOT

    @property
    def slo_name(self) -> str:
        return "TTFT" if self is Pool.PREFILL else "TPOT"

    def slo_ms(self, slo: SLO) -> float:
        """The bound, or a relative TTFT bound's floor."""
        return slo.ttft_ms if self is Pool.PREFILL else slo.tpot_ms

    def slo_text(self, slo: SLO) -> str:
        if self is Pool.PREFILL:
            return slo.ttft_text()
        return f"TPOT <= {slo.tpot_ms:g} ms"

    def met(self, result: RequestResult, slo: SLO) -> bool:
        """Whether `result` met this pool's SLO (a failed request meets neither; one with a
        single token has no TPOT to miss)."""
        if not result.ok:
            return False
        if self is Pool.PREFILL:
            return result.ttft * MS <= slo.ttft_ms_for(result.kind)
        return result.tpot is None or result.tpot * MS <= slo.tpot_ms


@dataclass(frozen=True, slots=True)
class PoolLoad:
    """One pool at one rate of one configuration."""

    config: str
    rate: float
    num_workers: int
    tokens_per_s_per_worker: float  # offered: the measured requests' tokens over the window
    attainment: float  # share of measured requests that met the pool's SLO


def pool_load(run: RecordedRun, pool: Pool, slo: SLO) -> PoolLoad:
    """What `pool` carried at `run`, and how much of it met its SLO."""
    workers = run.num_prefill if pool is Pool.PREFILL else run.num_decode
    tokens = run.prompt_tokens if pool is Pool.PREFILL else run.output_tokens
    met = sum(pool.met(r, slo) for r in run.results)
    attainment = met / len(run.results) if run.results else 0.0
    return PoolLoad(run.config, run.rate, workers, tokens / run.duration_s / workers, attainment)


@dataclass(frozen=True, slots=True)
class Capacity:
    """The most one worker of `pool` was measured to carry within its SLO."""

    pool: Pool
    tokens_per_s: float  # per worker
    config: str  # where it was measured
    rate: float
    attainment: float
    # the next swept rate of that configuration missed the goal: the pool's limit (to the
    # sweep's resolution). False: no rate pushed it past its SLO, so this is a lower bound.
    bounded: bool

    def describe(self) -> str:
        bound = "" if self.bounded else " (a lower bound: no swept rate pushed it past its SLO)"
        return (
            f"{self.tokens_per_s:.1f} tok/s per worker, measured on {self.config} at "
            f"{self.rate:g} req/s ({self.attainment:.0%} met {self.pool.slo_name}){bound}"
        )


def config_capacity(
    loads: Iterable[PoolLoad], pool: Pool, goal: float = SLO_ATTAINMENT_GOAL
) -> Capacity | None:
    """`pool`'s capacity from one configuration's rates; None when its lowest rate already
    missed the goal (the record then says nothing of what the pool sustains)."""
    by_rate = {load.rate: load for load in loads}
    best_rate = goodput({rate: load.attainment for rate, load in by_rate.items()}, goal)
    if best_rate not in by_rate:  # goodput is 0: even the lowest rate missed
        return None
    best = by_rate[best_rate]
    bounded = any(rate > best_rate for rate in by_rate)
    return Capacity(
        pool, best.tokens_per_s_per_worker, best.config, best.rate, best.attainment, bounded
    )


def measure(
    runs: Iterable[RecordedRun], pool: Pool, slo: SLO, goal: float = SLO_ATTAINMENT_GOAL
) -> Capacity | None:
    """`pool`'s capacity over every configuration of a record: the highest per-worker load
    any of them carried within the SLO (a configuration short of the other pool's workers
    understates this one's, so the best measurement is the truest); None if none did."""
    by_config: dict[str, list[PoolLoad]] = {}
    for run in runs:
        by_config.setdefault(run.config, []).append(pool_load(run, pool, slo))
    found = [config_capacity(loads, pool, goal) for loads in by_config.values()]
    measured = [c for c in found if c is not None]
    return max(measured, key=lambda c: c.tokens_per_s, default=None)


class NoCapacityError(ValueError):
    """A record that measured no rate at which a pool met its SLO."""


def measure_pools(
    runs: Iterable[RecordedRun], slo: SLO, goal: float = SLO_ATTAINMENT_GOAL
) -> dict[Pool, Capacity]:
    """Every pool's capacity (`measure`); NoCapacityError naming the pool that has none."""
    runs = list(runs)
    found = {}
    for pool in Pool:
        capacity = measure(runs, pool, slo, goal)
        if capacity is None:
            lowest = min(run.rate for run in runs)
            raise NoCapacityError(
                f"the {pool} pool met its SLO ({pool.slo_text(slo)}) for "
                f"under {goal:.0%} of requests even at the lowest rate ({lowest:g} req/s) of "
                f"every configuration: the record cannot say what one worker sustains; "
                "bench lower rates or a looser SLO"
            )
        found[pool] = capacity
    return found
