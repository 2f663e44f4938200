"""The figures: latency CDFs, latency and SLO attainment against load (the rate, or the
concurrency), and a run's timeline.

Figures are built without pyplot (no global figure state, no GUI backend): a bare
`Figure` saves PNGs through matplotlib's Agg canvas. Each function writes one PNG and
returns its path; sizes and resolution keep every file well under 200 KB.

matplotlib is the optional extra `pdserve[bench]`, and takes ~0.4 s to import: it is
imported when a figure is drawn, so that this module (and every `pdserve` command)
loads without it, and `require_matplotlib` lets `pdserve bench` refuse to start without.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.bench.metrics import MS, SLO_ATTAINMENT_GOAL
from pdserve.bench.report import BenchResult, RateRun
from pdserve.bench.workload import Load

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MISSING_MATPLOTLIB = (
    "the plots need matplotlib, which is not installed: pip install 'pdserve[bench]' "
    "(or pip install matplotlib)"
)

DPI = 100
COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")
LINESTYLES = (":", "--", "-.", "-")  # by rate, the highest solid
PHASE_COLORS = {
    "queue": "0.75",
    "prefill": "tab:orange",
    "transfer": "tab:red",
    "decode": "tab:blue",
}


def require_matplotlib() -> None:
    """Raise RuntimeError, saying what to install, if matplotlib cannot be imported."""
    if importlib.util.find_spec("matplotlib") is None:
        raise RuntimeError(MISSING_MATPLOTLIB)


def _figure(figsize: tuple[float, float]) -> Figure:
    require_matplotlib()
    from matplotlib.figure import Figure

    return Figure(figsize=figsize)


def _kinds(result: BenchResult) -> list[str]:
    """The workload's request kinds, in its order: each gets its own lines and panels."""
    return [kind.name for kind in result.workload.kinds]


def plot_cdfs(result: BenchResult, path: Path) -> Path:
    """TTFT and TPOT CDFs, a row of two per request kind: a colour per configuration, a
    line style per rate, the kind's SLOs dashed."""
    kinds = _kinds(result)
    fig = _figure((11, 0.6 + 3.6 * len(kinds)))
    axes = fig.subplots(len(kinds), 2, squeeze=False)
    num_loads = len(result.loads)
    styles = LINESTYLES[-num_loads:] if num_loads <= len(LINESTYLES) else None
    for (ttft_ax, tpot_ax), kind in zip(axes, kinds, strict=True):
        for color, config in zip(COLORS, result.configs, strict=False):
            for i, run in enumerate(config.runs):
                measured = [r for r in run.results if r.ok and not r.warmup and r.kind == kind]
                style = styles[i] if styles else "-"
                label = f"{config.name} @ {run.load}"
                _cdf(ttft_ax, [r.ttft * MS for r in measured], color, style, label)
                tpots = [r.tpot * MS for r in measured if r.tpot is not None]
                _cdf(tpot_ax, tpots, color, style, label)
        for ax, what, slo in (
            (ttft_ax, "TTFT", result.slo.ttft_ms_for(kind)),
            (tpot_ax, "TPOT", result.slo.tpot_ms),
        ):
            ax.axvline(slo, color="k", linewidth=0.8, linestyle="--", label=f"SLO {slo:.0f} ms")
            ax.set(
                xscale="log",
                xlabel=f"{what} (ms, log)",
                ylabel="share of requests",
                ylim=(0, 1),
                title=f"{kind}: {what} CDF",
            )
            ax.grid(alpha=0.3)
        tpot_ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{result.workload.name} workload", fontsize=10)
    return _save(fig, path)


def _cdf(ax, values: list[float], color: str, style: str, label: str) -> None:
    if not values:
        return
    ordered = sorted(values)
    shares = [(i + 1) / len(ordered) for i in range(len(ordered))]
    ax.step(ordered, shares, where="post", color=color, linestyle=style, label=label)


def _kind_stats(run: RateRun, kind: str, metric: str):
    """A run's TTFT or TPOT stats of one kind (the whole run's with a single kind)."""
    by_kind = run.summary.by_kind
    return by_kind[kind][metric] if kind in by_kind else getattr(run.summary, metric)


def plot_latency_vs_rate(result: BenchResult, path: Path) -> Path:
    """p90 TTFT and p99 TPOT of each request kind (a line style each) against rate, with
    each kind's TTFT SLO and the TPOT SLO; SLO attainment of the whole run."""
    fig = _figure((13, 4))
    ttft_ax, tpot_ax, slo_ax = fig.subplots(1, 3)
    kinds = _kinds(result)
    kind_styles = dict(zip(kinds, ("o-", "s--", "^-.", "d:"), strict=False))
    for color, config in zip(COLORS, result.configs, strict=False):
        rates = [run.load.level for run in config.runs]
        for kind in kinds:
            style, label = kind_styles.get(kind, "o-"), f"{config.name} {kind}"
            ttfts = [_kind_stats(run, kind, "ttft").p90 for run in config.runs]
            tpots = [_kind_stats(run, kind, "tpot").p99 for run in config.runs]
            ttft_ax.plot(rates, ttfts, style, color=color, label=label)
            tpot_ax.plot(rates, tpots, style, color=color, label=label)
        slo_ax.plot(
            rates,
            [100 * run.summary.slo_attainment for run in config.runs],
            "o-",
            color=color,
            label=f"{config.name} (goodput {config.goodput:g}/s)",
        )
    for kind in kinds:
        bound = result.slo.ttft_ms_for(kind)
        ttft_ax.axhline(bound, color="k", linestyle="--", linewidth=0.8, label=f"SLO {kind}")
    tpot_ax.axhline(result.slo.tpot_ms, color="k", linestyle="--", linewidth=0.8, label="SLO")
    slo_ax.axhline(
        100 * SLO_ATTAINMENT_GOAL,
        color="k",
        linestyle="--",
        linewidth=0.8,
        label=f"{SLO_ATTAINMENT_GOAL:.0%} goal",
    )
    ttft_ax.set(title="p90 TTFT per kind", ylabel="ms (log)", yscale="log")
    tpot_ax.set(title="p99 TPOT per kind", ylabel="ms (log)", yscale="log")
    slo_ax.set(title="requests within both SLOs", ylabel="%", ylim=(0, 105))
    for ax in (ttft_ax, tpot_ax, slo_ax):
        ax.set_xlabel(_load_axis(result))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{result.workload.name} workload: latency against load", fontsize=10)
    return _save(fig, path)


def _load_axis(result: BenchResult) -> str:
    if result.concurrencies:
        return "requests in flight (closed loop)"
    return "offered rate (requests/s)"


def plot_timeline(result: BenchResult, load: Load, path: Path) -> Path:
    """Every request of the run at `load` as a bar from its send, split into the router's
    phases: queue, prefill (to the first token), KV transfer and decode (a server that
    does not report them, an OpenAI-compatible one, has none). One panel each; of a load
    run several times (`--repeats`), the first run."""
    runs = [(config.name, config.run_at(load)) for config in result.configs]
    runs = [(name, run) for name, run in runs if run is not None]
    fig = _figure((11, 1.2 + 2.6 * len(runs)))
    axes = fig.subplots(len(runs), 1, sharex=True, squeeze=False)
    for ax, (name, run) in zip(axes[:, 0], runs, strict=True):
        _timeline(ax, run)
        ax.set(ylabel="request", title=f"{name} @ {load}", xlim=(0, None))
    axes[-1, 0].set_xlabel("seconds since the run started")
    from matplotlib.patches import Patch  # matplotlib is there: _figure checked

    handles = [Patch(color=c, label=phase) for phase, c in PHASE_COLORS.items()]
    axes[0, 0].legend(handles=handles, fontsize=7, loc="upper left", ncols=4)
    return _save(fig, path)


def _timeline(ax, run: RateRun) -> None:
    for r in run.of_repeat(0):
        if not r.ok or r.timings is None:
            continue
        t = r.timings
        # The router's phases, placed from the client's send (loopback: offsets are tiny).
        edges = [
            0.0,
            t["queue_ms"],
            t["ttft_ms"],
            t["ttft_ms"] + t["transfer_ms"],
            t["ttft_ms"] + t["decode_ms"],
        ]
        starts = [r.sent_at + e / MS for e in edges[:-1]]
        widths = [max(b - a, 0.0) / MS for a, b in zip(edges, edges[1:], strict=False)]
        ax.broken_barh(
            list(zip(starts, widths, strict=True)),
            (r.index - 0.4, 0.8),
            facecolors=list(PHASE_COLORS.values()),
            alpha=0.45 if r.warmup else 1.0,
        )
    ax.grid(axis="x", alpha=0.3)


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    return path
