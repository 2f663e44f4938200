"""Per-rate statistics of a run, SLO attainment and goodput. Pure functions, no I/O.

TTFT is the client's time to the first token; TPOT a request's mean time per output token
after the first, (e2e - ttft) / (tokens - 1); ITL every single gap between two tokens, so
its p99 shows the stalls that a per-request mean smooths over. Latencies are reported in
milliseconds. Warm-up requests are left out of everything here, and a short request (it
finished with fewer tokens than asked for) is counted apart: never in the latencies.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from pdserve.bench.loadgen import RequestResult
from pdserve.bench.workload import Concurrency, Load

# DistServe's goodput: the highest rate at which at least this share of requests meets both
# the TTFT and the TPOT SLO.
SLO_ATTAINMENT_GOAL = 0.9
MS = 1000.0


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), interpolated between closest ranks as numpy does; nan if
    there are no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True, slots=True)
class Stats:
    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float
    std: float = math.nan  # the population's (numpy's default, as vLLM's benchmark reports)

    @classmethod
    def of(cls, values: Iterable[float], scale: float = MS) -> Stats:
        """Stats of `values` times `scale` (seconds to milliseconds by default)."""
        scaled = [v * scale for v in values]
        if not scaled:
            return cls(0, *[math.nan] * 6)
        mean = sum(scaled) / len(scaled)
        std = math.sqrt(sum((v - mean) ** 2 for v in scaled) / len(scaled))
        return cls(len(scaled), mean, *(percentile(scaled, q) for q in (50, 90, 99, 100)), std)


@dataclass(frozen=True, slots=True)
class SLO:
    """TTFT and TPOT bounds, in ms. The TTFT bound is absolute (`ttft_ms`), or relative to
    each request kind's TTFT alone (DistServe's style): `ttft_scale` times the kind's median
    TTFT in the solo calibration (`solo_ttft_ms`), and never below `ttft_ms`."""

    ttft_ms: float  # the bound; with `ttft_scale`, its floor
    tpot_ms: float
    ttft_scale: float | None = None
    solo_ttft_ms: Mapping[str, float] = field(default_factory=dict)  # kind -> median alone
    # each request carries its TTFT bound (GenerateRequest.ttft_slo_ms), as a client that
    # states its targets does (--send-ttft-slo); False: the servers do not know them
    sent: bool = False

    def __post_init__(self) -> None:
        if self.ttft_ms <= 0 or self.tpot_ms <= 0:
            raise ValueError("SLOs must be > 0 ms")
        if self.ttft_scale is not None and self.ttft_scale <= 0:
            raise ValueError(f"the TTFT SLO's scale must be > 0, got {self.ttft_scale:g}")

    @property
    def is_relative(self) -> bool:
        return self.ttft_scale is not None

    def ttft_ms_for(self, kind: str) -> float:
        """The TTFT bound of a request of `kind` (the floor for a kind not calibrated)."""
        if self.ttft_scale is None or kind not in self.solo_ttft_ms:
            return self.ttft_ms
        return max(self.ttft_scale * self.solo_ttft_ms[kind], self.ttft_ms)

    def ttft_ms_sent(self, kind: str) -> int:
        """What a request of `kind` carries as its `ttft_slo_ms`: its bound, 0 if not sent."""
        return max(1, round(self.ttft_ms_for(kind))) if self.sent else 0

    def calibrated(self, solo: Mapping[str, Mapping[str, float]]) -> SLO:
        """This SLO with each kind's median TTFT alone from a solo calibration
        (`{kind: {"ttft_ms": ...}}`); an absolute one is returned as it is."""
        if self.ttft_scale is None:
            return self
        medians = {kind: values["ttft_ms"] for kind, values in solo.items()}
        return dataclasses.replace(self, solo_ttft_ms=medians)

    def scaled(self, ttft_factor: float, tpot_factor: float) -> SLO:
        """Both bounds multiplied (a relative TTFT bound: its scale and its floor)."""
        scale = None if self.ttft_scale is None else self.ttft_scale * ttft_factor
        return dataclasses.replace(
            self,
            ttft_ms=self.ttft_ms * ttft_factor,
            tpot_ms=self.tpot_ms * tpot_factor,
            ttft_scale=scale,
        )

    def overridden(self, ttft_ms: float | None, tpot_ms: float | None) -> SLO:
        """This SLO with the bounds given instead: an absolute TTFT bound replaces a
        relative one; None keeps what was."""
        slo = (
            self if ttft_ms is None else dataclasses.replace(self, ttft_ms=ttft_ms, ttft_scale=None)
        )
        return slo if tpot_ms is None else dataclasses.replace(slo, tpot_ms=tpot_ms)

    def ttft_text(self) -> str:
        """The TTFT bound in words: `TTFT <= 3x alone (>= 200 ms)` or `TTFT <= 8000 ms`."""
        if self.ttft_scale is None:
            return f"TTFT <= {self.ttft_ms:g} ms"
        return f"TTFT <= {self.ttft_scale:g}x alone (>= {self.ttft_ms:g} ms)"

    def met_by(self, result: RequestResult) -> bool:
        """Finished, and within both SLOs (a one-token request has no TPOT to miss)."""
        if not result.ok:
            return False
        tpot = result.tpot
        within_ttft = result.ttft * MS <= self.ttft_ms_for(result.kind)
        return within_ttft and (tpot is None or tpot * MS <= self.tpot_ms)


@dataclass(frozen=True, slots=True)
class RateSummary:
    rate: float | None  # requests per second offered; None: a closed loop's
    num_requests: int  # measured: warm-ups excluded
    num_completed: int  # with exactly the tokens asked for
    num_failed: int  # errors and requests cut off at the end of the run
    num_warmup: int
    num_output_tokens: int  # of the completed requests
    # first measured send to the last measured request's last token; a rate run several
    # times (`--repeats`): the sum of each run's window
    window_s: float
    ttft: Stats
    tpot: Stats
    itl: Stats
    e2e: Stats
    request_throughput: float  # completed requests per second of the window
    output_throughput: float  # output tokens per second of the window
    slo_attainment: float  # share of measured requests meeting both SLOs; failed ones miss
    # per request kind (when the workload has several): TTFT and TPOT stats
    by_kind: dict[str, dict[str, Stats]] = field(default_factory=dict)
    concurrency: int | None = None  # a closed loop's requests in flight; None: open loop
    # finished without an error but with fewer tokens than asked for (the server stopped
    # early): neither completed nor failed
    num_short: int = 0
    num_input_tokens: int = 0  # the completed requests' prompts
    request_goodput: float = 0.0  # requests within both SLOs per second of the window

    @property
    def total_token_throughput(self) -> float:
        """Prompt and output tokens of the completed requests per second of the window."""
        tokens = self.num_input_tokens + self.num_output_tokens
        return tokens / self.window_s if self.window_s else 0.0


def summarize(load: Load, results: Sequence[RequestResult], slo: SLO) -> RateSummary:
    measured = [r for r in results if not r.warmup]
    done = [r for r in measured if r.ok]
    num_short = sum(r.is_short for r in measured)
    tokens = sum(r.output_tokens for r in done)
    window = sum(_window(measured, done, repeat) for repeat in {r.repeat for r in measured})
    kinds = sorted({r.kind for r in measured})
    num_good = sum(slo.met_by(r) for r in measured)
    closed = isinstance(load, Concurrency)
    return RateSummary(
        rate=None if closed else load.rate,
        concurrency=load.n if closed else None,
        num_requests=len(measured),
        num_completed=len(done),
        num_failed=len(measured) - len(done) - num_short,
        num_short=num_short,
        num_warmup=len(results) - len(measured),
        num_output_tokens=tokens,
        num_input_tokens=sum(r.prompt_tokens for r in done),
        request_goodput=num_good / window if window else 0.0,
        window_s=window,
        ttft=Stats.of(r.ttft for r in done),
        tpot=_tpot(done),
        itl=Stats.of(gap for r in done for gap in r.itls),
        e2e=Stats.of(r.e2e for r in done),
        request_throughput=len(done) / window if window else 0.0,
        output_throughput=tokens / window if window else 0.0,
        slo_attainment=num_good / len(measured) if measured else 0.0,
        by_kind={}
        if len(kinds) < 2
        else {
            kind: {
                "ttft": Stats.of(r.ttft for r in done if r.kind == kind),
                "tpot": _tpot(r for r in done if r.kind == kind),
            }
            for kind in kinds
        },
    )


def _window(measured: Sequence[RequestResult], done: Sequence[RequestResult], repeat: int) -> float:
    """Seconds from the repeat's first measured send to its last token (0: none done)."""
    finished = [r.sent_at + r.e2e for r in done if r.repeat == repeat]
    if not finished:
        return 0.0
    return max(finished) - min(r.sent_at for r in measured if r.repeat == repeat)


def slo_attainment(results: Sequence[RequestResult], slo: SLO) -> float:
    """The share of measured requests that finished within both SLOs (0 with none)."""
    measured = [r for r in results if not r.warmup]
    return sum(slo.met_by(r) for r in measured) / len(measured) if measured else 0.0


def _tpot(results: Iterable[RequestResult]) -> Stats:
    return Stats.of(r.tpot for r in results if r.tpot is not None)


def goodput(attainment_by_rate: dict[float, float], goal: float = SLO_ATTAINMENT_GOAL) -> float:
    """The highest swept rate up to which every swept rate meets the attainment goal.

    0 when even the lowest rate misses it. Requiring every lower rate too keeps one lucky
    high rate after a miss (noise) from counting.
    """
    best = 0.0
    for rate in sorted(attainment_by_rate):
        if attainment_by_rate[rate] < goal:
            break
        best = rate
    return best
