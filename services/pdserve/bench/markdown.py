"""A benchmark's Markdown summary: the setup, the configurations side by side, goodput
under a grid of SLOs, and each configuration's table per load (bench/report.py holds the
results and their JSON)."""

from __future__ import annotations

import math

from pdserve.bench.cores import split_table
from pdserve.bench.metrics import SLO, SLO_ATTAINMENT_GOAL, Stats, summarize
from pdserve.bench.report import BenchResult, ConfigRun, RateRun, slo_grid_cells
from pdserve.bench.targets import OPENAI, PDSERVE
from pdserve.bench.workload import Poisson

_API_NAMES = {PDSERVE: "Router", OPENAI: "OpenAI-compatible server"}  # by backend


def markdown(result: BenchResult, figures: list[str]) -> str:
    slo = result.slo
    lines = [
        f"# pdserve bench: `{result.workload.name}` workload",
        "",
        f"`{result.command}`",
        "",
        f"Model `{result.model}`; {_load_text(result)}. SLOs: {slo.ttft_text()}"
        f"{_per_kind_text(slo)} and TPOT <= {slo.tpot_ms:g} ms; goodput is the highest swept "
        f"{_level_name(result)} up to which >= {SLO_ATTAINMENT_GOAL:.0%} of requests meet "
        "both. A request that finished with fewer tokens than asked for is short: counted "
        "apart, in no latency. Latencies in ms.",
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
        f"The same requests, judged against tighter and looser SLOs ({result.unit}; "
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


def _load_text(result: BenchResult) -> str:
    """How the requests were sent, and when one counts as failed."""
    warmup = f"{result.num_warmup} warm-up requests, then"
    if not result.concurrencies:
        return (
            f"Poisson arrivals, seed {result.seed}; per rate {warmup} {result.duration_s:g} s "
            f"of measured arrivals{_repeats_text(result.repeats)}; requests unfinished "
            f"{result.drain_s:g} s after the last send count as failed"
        )
    measured = (
        f"{result.duration_s:g} s of measured requests"
        if result.num_requests is None
        else f"{result.num_requests} measured requests"
    )
    return (
        f"a closed loop, seed {result.seed}: a fixed number of requests in flight, each "
        f"finished one replaced by the next; per level {warmup} {measured}"
        f"{_repeats_text(result.repeats)}; a request unfinished {result.drain_s:g} s after "
        "it was sent counts as failed"
    )


def _level_name(result: BenchResult) -> str:
    return "concurrency" if result.concurrencies else "rate"


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


# The columns of a configuration's table, after the load's
RUN_COLUMNS = (
    "sent (+warm-up)",
    "done",
    "failed",
    "short",
    "TTFT p50/p90/p99",
    "TPOT p50/p90/p99",
    "ITL p99/max",
    "done/s",
    "tok/s",
    "SLO met",
    "cores used",
)


def _run_row(run: RateRun) -> list[str]:
    s = run.summary
    return [
        f"{run.load.level:g}",
        f"{s.num_requests} (+{s.num_warmup})",
        str(s.num_completed),
        str(s.num_failed),
        str(s.num_short),
        _pcts(s.ttft),
        _pcts(s.tpot),
        f"{_ms(s.itl.p99)}/{_ms(s.itl.max)}",
        f"{s.request_throughput:.2f}",
        f"{s.output_throughput:.1f}",
        f"{s.slo_attainment:.0%}",
        "-" if run.cluster_cores is None else f"{run.cluster_cores:.2f}",
    ]


def config_tables(config: ConfigRun, cpus: int | None = None) -> list[str]:
    unit = config.runs[0].load.unit if config.runs else Poisson.unit
    lines = [
        f"{_API_NAMES.get(config.backend, config.backend)} {config.address}. "
        f"Alone: {solo_text(config.solo) or 'not measured'}.",
        "",
        _table([unit, *RUN_COLUMNS], [_run_row(run) for run in config.runs]),
    ]
    kind_rows = [
        [f"{run.load.level:g}", kind, _pcts(stats["ttft"]), _pcts(stats["tpot"])]
        for run in config.runs
        for kind, stats in run.summary.by_kind.items()
    ]
    if kind_rows:
        lines += ["", _table([unit, "kind", "TTFT p50/p90/p99", "TPOT p50/p90/p99"], kind_rows)]
    if (split := split_table(config.runs, cpus))[1]:
        lines += ["", "Where the CPU went (cores, on average over the runs):", "", _table(*split)]
    return lines + ["", f"Goodput: **{config.goodput:g} {unit}**."]


def compare_tables(result: BenchResult) -> list[str]:
    """Each configuration against the first one listed (the baseline), load by load."""
    base, others = result.configs[0], result.configs[1:]
    header = [
        result.unit,
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
    for load in result.loads:
        runs = [c.run_at(load) for c in result.configs]
        if any(run is None for run in runs):
            continue
        for name, value in metrics:
            values = [value(run.summary) for run in runs]
            shown = [f"{v:.0%}" if name == "SLO met" else _ms(v) for v in values]
            ratios = [_ratio(v, values[0]) for v in values[1:]]
            rows.append([f"{load.level:g}", name, *shown, *ratios])
    goodputs = [c.goodput for c in result.configs]
    rows.append(
        [
            "",
            f"goodput ({result.unit})",
            *(f"{g:g}" for g in goodputs),
            *(_ratio(g, goodputs[0]) for g in goodputs[1:]),
        ]
    )
    return [_table(header, rows)]


def repeat_tables(result: BenchResult) -> list[str]:
    """Each repeated run's TTFT and TPOT p90 on its own, against the baseline's run of the
    same arrivals: the spread the pooled ratios above sit in."""
    base, others = result.configs[0], result.configs[1:]
    header = [result.unit, "run", "metric", base.name, *(c.name for c in others)]
    header += [f"{c.name} / {base.name}" for c in others]
    metrics = (("TTFT p90", lambda rs: rs.ttft.p90), ("TPOT p90", lambda rs: rs.tpot.p90))
    rows = []
    for load in result.loads:
        runs = [c.run_at(load) for c in result.configs]
        if any(run is None for run in runs):
            continue
        for repeat in range(result.repeats):
            parts = [summarize(load, run.of_repeat(repeat), result.slo) for run in runs]
            for name, value in metrics:
                values = [value(part) for part in parts]
                ratios = [_ratio(v, values[0]) for v in values[1:]]
                level = f"{load.level:g}"
                rows.append([level, str(repeat + 1), name, *map(_ms, values), *ratios])
    return [_table(header, rows)]


def _repeats_text(repeats: int) -> str:
    if repeats == 1:
        return ""
    return f", run {repeats} times with arrivals and prompts of their own and pooled"


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
