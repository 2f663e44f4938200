"""A whole benchmark's results, as the sweep fills them in, and their JSON file (every
request, raw); bench/markdown.py writes their summary.

Each run in the JSON also carries, under `"vllm"`, the fields `vllm bench serve
--save-result` writes, under their names and in their units (`vllm_fields`), so that
tooling written for vLLM's result files reads ours.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.bench.cores import cluster_cores
from pdserve.bench.loadgen import RequestResult
from pdserve.bench.metrics import (
    SLO,
    SLO_ATTAINMENT_GOAL,
    RateSummary,
    Stats,
    goodput,
    slo_attainment,
)
from pdserve.bench.targets import PDSERVE
from pdserve.bench.workload import Concurrency, Load, Poisson, Workload

TIME_DECIMALS = 5  # raw times in the JSON, in seconds: 10 µs is finer than any step
VLLM_DATE_FORMAT = "%Y%m%d-%H%M%S"  # vLLM's result files' `date`
VLLM_METRICS = {"ttft": "ttft", "tpot": "tpot", "itl": "itl", "e2e": "e2el"}  # ours: vLLM's


@dataclass(slots=True)
class RateRun:
    """One load (a rate, or a concurrency level) of one configuration, its runs pooled."""

    load: Load
    summary: RateSummary
    results: list[RequestResult]
    # CPU cores used on average over the run (CPU time / wall time) by each role of a local
    # cluster, by the benchmark itself and by the rest of the machine (`bench/cores.py`)
    cores: dict[str, float] = field(default_factory=dict)

    @property
    def cluster_cores(self) -> float | None:
        return cluster_cores(self.cores)

    def of_repeat(self, repeat: int) -> list[RequestResult]:
        """The requests of one of the rate's repeated runs."""
        return [r for r in self.results if r.repeat == repeat]


@dataclass(slots=True)
class ConfigRun:
    """One configuration measured: a cluster shape started here, or a given router."""

    name: str
    address: str
    # one request of each kind sent alone before the sweep: {kind: {"ttft_ms", "tpot_ms"}}
    solo: dict[str, dict[str, float]] = field(default_factory=dict)
    runs: list[RateRun] = field(default_factory=list)
    backend: str = PDSERVE  # the API it was driven through (`Target.backend`)

    @property
    def goodput(self) -> float:
        """The highest load level (rate, or concurrency) up to which every level met the
        attainment goal (`metrics.goodput`)."""
        return goodput({run.load.level: run.summary.slo_attainment for run in self.runs})

    def goodput_under(self, slo: SLO) -> float:
        """Goodput had the SLOs been `slo`: the same requests, judged again."""
        return goodput({run.load.level: slo_attainment(run.results, slo) for run in self.runs})

    def run_at(self, load: Load) -> RateRun | None:
        return next((run for run in self.runs if run.load == load), None)


@dataclass(slots=True)
class Sweep:
    """What a benchmark sends and how it judges it: the same for every configuration."""

    workload: Workload
    rates: list[float]
    duration_s: float
    drain_s: float
    num_warmup: int
    seed: int
    slo: SLO
    # each rate is run this many times per configuration, each time with its own arrivals
    # and prompts; the statistics pool every run's requests
    repeats: int = field(default=1, kw_only=True)
    # instead of `rates`: closed loops of this many requests in flight each
    concurrencies: list[int] = field(default_factory=list, kw_only=True)
    # a closed loop's measured requests, instead of `duration_s`; None: for duration_s
    num_requests: int | None = field(default=None, kw_only=True)

    @property
    def loads(self) -> list[Load]:
        """What the sweep runs at, in order: each concurrency level, else each rate."""
        if self.concurrencies:
            return [Concurrency(n) for n in self.concurrencies]
        return [Poisson(rate) for rate in self.rates]

    @property
    def unit(self) -> str:
        """The loads' unit, in tables and on axes (`req/s`, `in flight`)."""
        return self.loads[0].unit if self.loads else Poisson.unit

    def sweep_fields(self) -> dict[str, object]:
        """This sweep's fields by name (shallow: the workload and SLO objects themselves)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(Sweep)}


@dataclass(slots=True)
class BenchResult(Sweep):
    command: str
    model: str  # the served model's name (what the first target said)
    machine: dict[str, object]
    configs: list[ConfigRun] = field(default_factory=list)
    tokenizer: str | None = None  # what tokenized the prompts (ShareGPT's); None: random ids
    date: str = ""  # when the benchmark ended (VLLM_DATE_FORMAT)


def to_json(result: BenchResult) -> dict:
    return {
        "command": result.command,
        "model": result.model,
        "workload": {"name": result.workload.name, "kinds": result.workload.describe()},
        "date": result.date,
        "rates": result.rates,
        "concurrencies": result.concurrencies,
        "num_requests": result.num_requests,
        "duration_s": result.duration_s,
        "drain_s": result.drain_s,
        "num_warmup": result.num_warmup,
        "seed": result.seed,
        "repeats": result.repeats,
        "slo": {
            **dataclasses.asdict(result.slo),
            "ttft_ms_by_kind": {k: result.slo.ttft_ms_for(k) for k in result.slo.solo_ttft_ms},
            "attainment_goal": SLO_ATTAINMENT_GOAL,
        },
        "slo_grid": [
            {
                "ttft": slo.ttft_text(),
                "tpot_ms": slo.tpot_ms,
                "requested": requested,
                "goodput_rps": {c.name: c.goodput_under(slo) for c in result.configs},
            }
            for row in slo_grid_cells(result.slo)
            for slo, requested in row
        ],
        "machine": result.machine,
        "configs": [
            {
                "name": config.name,
                "address": config.address,
                "backend": config.backend,
                "goodput_rps": config.goodput,
                "solo": config.solo,
                "runs": [_run_json(result, config, run) for run in config.runs],
            }
            for config in result.configs
        ],
    }


def _run_json(result: BenchResult, config: ConfigRun, run: RateRun) -> dict:
    # A closed loop's run has no "rate": a reader of rates (the planner) fails on it by name
    # instead of taking a concurrency level for requests per second.
    closed = isinstance(run.load, Concurrency)
    load = {"concurrency": run.load.n} if closed else {"rate": run.load.rate}
    return {
        **load,
        "cluster_cores": run.cluster_cores,
        "cores": run.cores,
        "summary": _finite(dataclasses.asdict(run.summary)),
        "vllm": _finite(vllm_fields(result, config, run)),
        "requests": [_request_json(r) for r in run.results],
    }


def vllm_fields(result: BenchResult, config: ConfigRun, run: RateRun) -> dict[str, object]:
    """The run as `vllm bench serve --save-result` writes one: its names, its units (ms,
    seconds, per second), its counts (completed: with exactly the tokens asked for)."""
    s = run.summary
    closed = isinstance(run.load, Concurrency)
    fields: dict[str, object] = {
        "date": result.date,
        "backend": config.backend,
        "model_id": result.model,
        "tokenizer_id": result.tokenizer or result.model,
        "num_prompts": s.num_requests,
        "request_rate": "inf" if closed else run.load.rate,  # vLLM's for "all at once"
        "burstiness": 1.0,  # Poisson (vLLM's gamma arrivals with shape 1)
        "max_concurrency": run.load.n if closed else None,
        "duration": s.window_s,
        "completed": s.num_completed,
        "failed": s.num_failed + s.num_short,
        "total_input_tokens": s.num_input_tokens,
        "total_output_tokens": s.num_output_tokens,
        "request_throughput": s.request_throughput,
        "request_goodput": s.request_goodput,
        "output_throughput": s.output_throughput,
        "total_token_throughput": s.total_token_throughput,
    }
    for ours, theirs in VLLM_METRICS.items():
        stats: Stats = getattr(s, ours)
        fields |= {
            f"mean_{theirs}_ms": stats.mean,
            f"median_{theirs}_ms": stats.p50,
            f"std_{theirs}_ms": stats.std,
            f"p99_{theirs}_ms": stats.p99,
        }
    return fields


def _request_json(result: RequestResult) -> dict:
    raw = dataclasses.asdict(result)
    raw["short"] = result.is_short
    raw["sent_at"] = round(result.sent_at, TIME_DECIMALS)
    raw["token_times"] = [round(t, TIME_DECIMALS) for t in result.token_times]
    return raw


def _finite(value):
    """nan (statistics of nothing) as null, so the file is strict JSON."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def write_json(result: BenchResult, path: Path) -> None:
    path.write_text(json.dumps(to_json(result), indent=1, allow_nan=False) + "\n")


SLO_SCALES = (0.5, 1.0, 2.0)  # the grid: each SLO halved, as given, doubled


def slo_grid_cells(slo: SLO) -> list[list[tuple[SLO, bool]]]:
    """The grid's SLOs, a row per TTFT bound and a column per TPOT bound, each with
    whether it is the pair asked for."""
    return [
        [(slo.scaled(kt, kp), kt == 1.0 and kp == 1.0) for kp in SLO_SCALES] for kt in SLO_SCALES
    ]
