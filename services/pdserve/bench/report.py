"""A whole benchmark's results: the JSON file (every request, raw) and a Markdown summary."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.bench.cores import cluster_cores, split_table
from pdserve.bench.loadgen import RequestResult
from pdserve.bench.metrics import (
    SLO,
    SLO_ATTAINMENT_GOAL,
    RateSummary,
    Stats,
    goodput,
    slo_attainment,
    summarize,
)
from pdserve.bench.workload import Workload

TIME_DECIMALS = 5  # raw times in the JSON, in seconds: 10 µs is finer than any step


@dataclass(slots=True)
class RateRun:
    rate: float
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

    @property
    def goodput(self) -> float:
        return goodput({run.rate: run.summary.slo_attainment for run in self.runs})

    def goodput_under(self, slo: SLO) -> float:
        """Goodput had the SLOs been `slo`: the same requests, judged again."""
        return goodput({run.rate: slo_attainment(run.results, slo) for run in self.runs})

    def run_at(self, rate: float) -> RateRun | None:
        return next((run for run in self.runs if run.rate == rate), None)


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

    def sweep_fields(self) -> dict[str, object]:
        """This sweep's fields by name (shallow: the workload and SLO objects themselves)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(Sweep)}


@dataclass(slots=True)
class BenchResult(Sweep):
    command: str
    model: str
    machine: dict[str, object]
    configs: list[ConfigRun] = field(default_factory=list)


def to_json(result: BenchResult) -> dict:
    return {
        "command": result.command,
        "model": result.model,
        "workload": {"name": result.workload.name, "kinds": result.workload.describe()},
        "rates": result.rates,
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
                "goodput_rps": config.goodput,
                "solo": config.solo,
                "runs": [
                    {
                        "rate": run.rate,
                        "cluster_cores": run.cluster_cores,
                        "cores": run.cores,
                        "summary": _finite(dataclasses.asdict(run.summary)),
                        "requests": [_request_json(r) for r in run.results],
                    }
                    for run in config.runs
                ],
            }
            for config in result.configs
        ],
    }


def _request_json(result: RequestResult) -> dict:
    raw = dataclasses.asdict(result)
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


# -- Markdown --------------------------------------------------------------------------------


def markdown(result: BenchResult, figures: list[str]) -> str:
    slo = result.slo
    lines = [
        f"# pdserve bench: `{result.workload.name}` workload",
        "",
        f"`{result.command}`",
        "",
        f"Model `{result.model}`; Poisson arrivals, seed {result.seed}; per rate "
        f"{result.num_warmup} warm-up requests, then {result.duration_s:g} s of measured "
        f"arrivals{_repeats_text(result.repeats)}; requests unfinished {result.drain_s:g} s "
        f"after the last send count as failed. SLOs: {slo.ttft_text()}{_per_kind_text(slo)} "
        f"and TPOT <= {slo.tpot_ms:g} ms; goodput is the highest swept rate up to which "
        f">= {SLO_ATTAINMENT_GOAL:.0%} of requests meet both. Latencies in ms.",
        "",
        _machine_text(result.machine),
        "",
        _table(
            ["kind", "share", "prompt tokens", "output tokens"],
            [
                [k["name"], f"{k['share']:g}", k["prompt_len"], k["output_len"]]
                for k in result.workload.describe()
            ],
        ),
        "",
    ]
    if len(result.configs) > 1:
        lines += ["## Side by side", "", *compare_tables(result), ""]
    if len(result.configs) > 1 and result.repeats > 1:
        lines += ["## Run by run", "", *repeat_tables(result), ""]
    lines += [
        "## Goodput under other SLOs",
        "",
        "The same requests, judged against tighter and looser SLOs (req/s; "
        + " / ".join(c.name for c in result.configs)
        + "; in bold, the SLOs asked for):",
        "",
        slo_grid(result),
        "",
    ]
    for config in result.configs:
        lines += [f"## {config.name}", "", *config_tables(config, result.machine.get("cpus")), ""]
    lines += [f"![{name}]({name})" for name in figures]
    return "\n".join(lines) + "\n"


def _machine_text(machine: dict) -> str:
    """Other load on the machine, so a reader can tell a quiet run from a disturbed one."""
    before, after = machine.get("load_avg_before"), machine.get("load_avg_after")
    load = ""
    if before and after:
        load = f"; 1-minute load average {before[0]:.1f} before, {after[0]:.1f} after"
    return (
        f"Machine: {machine.get('cpus')} CPUs, {machine.get('threads')} torch thread(s) "
        f"per worker{load}."
    )


def solo_text(solo: dict[str, dict[str, float]]) -> str:
    return "; ".join(
        f"{kind}: TTFT {v['ttft_ms']:.0f} ms, TPOT {v['tpot_ms']:.1f} ms"
        for kind, v in solo.items()
    )


def config_tables(config: ConfigRun, cpus: int | None = None) -> list[str]:
    rows = [
        [
            f"{run.rate:g}",
            f"{s.num_requests} (+{s.num_warmup})",
            str(s.num_completed),
            str(s.num_failed),
            _pcts(s.ttft),
            _pcts(s.tpot),
            f"{_ms(s.itl.p99)}/{_ms(s.itl.max)}",
            f"{s.request_throughput:.2f}",
            f"{s.output_throughput:.1f}",
            f"{s.slo_attainment:.0%}",
            "-" if run.cluster_cores is None else f"{run.cluster_cores:.2f}",
        ]
        for run in config.runs
        for s in [run.summary]
    ]
    lines = [
        f"Router {config.address}. Alone: {solo_text(config.solo) or 'not measured'}.",
        "",
        _table(
            [
                "req/s",
                "sent (+warm-up)",
                "done",
                "failed",
                "TTFT p50/p90/p99",
                "TPOT p50/p90/p99",
                "ITL p99/max",
                "done/s",
                "tok/s",
                "SLO met",
                "cores used",
            ],
            rows,
        ),
    ]
    kind_rows = [
        [f"{run.rate:g}", kind, _pcts(stats["ttft"]), _pcts(stats["tpot"])]
        for run in config.runs
        for kind, stats in run.summary.by_kind.items()
    ]
    if kind_rows:
        lines += ["", _table(["req/s", "kind", "TTFT p50/p90/p99", "TPOT p50/p90/p99"], kind_rows)]
    if (split := split_table(config.runs, cpus))[1]:
        lines += ["", "Where the CPU went (cores, on average over the runs):", "", _table(*split)]
    return lines + ["", f"Goodput: **{config.goodput:g} req/s**."]


def compare_tables(result: BenchResult) -> list[str]:
    """Each configuration against the first one listed (the baseline), rate by rate."""
    base, others = result.configs[0], result.configs[1:]
    header = [
        "req/s",
        "metric",
        base.name,
        *(c.name for c in others),
        *(f"{c.name} / {base.name}" for c in others),
    ]
    metrics = [
        ("TTFT p90", lambda s: s.ttft.p90),
        ("TPOT p90", lambda s: s.tpot.p90),
        ("TPOT p99", lambda s: s.tpot.p99),
        ("ITL p99", lambda s: s.itl.p99),
        ("ITL max", lambda s: s.itl.max),
        ("SLO met", lambda s: s.slo_attainment),
    ]
    rows = []
    for rate in result.rates:
        runs = [c.run_at(rate) for c in result.configs]
        if any(run is None for run in runs):
            continue
        for name, value in metrics:
            values = [value(run.summary) for run in runs]
            shown = [f"{v:.0%}" if name == "SLO met" else _ms(v) for v in values]
            rows.append([f"{rate:g}", name, *shown, *(_ratio(v, values[0]) for v in values[1:])])
    goodputs = [c.goodput for c in result.configs]
    rows.append(
        [
            "",
            "goodput (req/s)",
            *(f"{g:g}" for g in goodputs),
            *(_ratio(g, goodputs[0]) for g in goodputs[1:]),
        ]
    )
    return [_table(header, rows)]


def repeat_tables(result: BenchResult) -> list[str]:
    """Each repeated run's TTFT and TPOT p90 on its own, against the baseline's run of the
    same arrivals: the spread the pooled ratios above sit in."""
    base, others = result.configs[0], result.configs[1:]
    header = ["req/s", "run", "metric", base.name, *(c.name for c in others)]
    header += [f"{c.name} / {base.name}" for c in others]
    metrics = (("TTFT p90", lambda rs: rs.ttft.p90), ("TPOT p90", lambda rs: rs.tpot.p90))
    rows = []
    for rate in result.rates:
        runs = [c.run_at(rate) for c in result.configs]
        if any(run is None for run in runs):
            continue
        for repeat in range(result.repeats):
            parts = [summarize(rate, run.of_repeat(repeat), result.slo) for run in runs]
            for name, value in metrics:
                values = [value(part) for part in parts]
                ratios = [_ratio(v, values[0]) for v in values[1:]]
                rows.append([f"{rate:g}", str(repeat + 1), name, *map(_ms, values), *ratios])
    return [_table(header, rows)]


def _repeats_text(repeats: int) -> str:
    if repeats == 1:
        return ""
    return f", run {repeats} times with arrivals and prompts of their own and pooled"


SLO_SCALES = (0.5, 1.0, 2.0)  # the grid: each SLO halved, as given, doubled


def slo_grid_cells(slo: SLO) -> list[list[tuple[SLO, bool]]]:
    """The grid's SLOs, a row per TTFT bound and a column per TPOT bound, each with
    whether it is the pair asked for."""
    return [
        [(slo.scaled(kt, kp), kt == 1.0 and kp == 1.0) for kp in SLO_SCALES] for kt in SLO_SCALES
    ]


def slo_grid(result: BenchResult) -> str:
    """Goodput of every configuration for TTFT and TPOT SLOs around the ones given, the
    pair asked for in bold."""
    cells = slo_grid_cells(result.slo)
    rows = []
    for row in cells:
        shown = []
        for slo, requested in row:
            text = " / ".join(f"{c.goodput_under(slo):g}" for c in result.configs)
            shown.append(f"**{text}**" if requested else text)
        rows.append([row[0][0].ttft_text(), *shown])
    return _table(["", *(f"TPOT <= {slo.tpot_ms:g} ms" for slo, _ in cells[0])], rows)


def _per_kind_text(slo: SLO) -> str:
    parts = [f"{k} {slo.ttft_ms_for(k):.0f} ms" for k in slo.solo_ttft_ms]
    parts += ["sent with each request"] if slo.sent else []
    return f" ({', '.join(parts)})" if parts else ""


def _pcts(stats: Stats) -> str:
    return "/".join(_ms(v) for v in (stats.p50, stats.p90, stats.p99))


def _ms(value: float) -> str:
    if math.isnan(value):
        return "-"
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def _ratio(value: float, base: float) -> str:
    if math.isnan(value) or math.isnan(base) or base == 0:
        return "-"
    return f"{value / base:.2f}x"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
