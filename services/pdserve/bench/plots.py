"""The figures: latency CDFs, latency and SLO attainment against rate, and a run's timeline.

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


def plot_cdfs(result: BenchResult, path: Path) -> Path:
    """TTFT and TPOT CDFs: a colour per configuration, a line style per rate."""
    fig = _figure((11, 4.2))
    ttft_ax, tpot_ax = fig.subplots(1, 2)
    styles = LINESTYLES[-len(result.rates) :] if len(result.rates) <= len(LINESTYLES) else None
    for color, config in zip(COLORS, result.configs, strict=False):
        for i, run in enumerate(config.runs):
            measured = [r for r in run.results if r.ok and not r.warmup]
            style = styles[i] if styles else "-"
            label = f"{config.name} @ {run.rate:g}/s"
            _cdf(ttft_ax, [r.ttft * MS for r in measured], color, style, label)
            _cdf(
                tpot_ax, [r.tpot * MS for r in measured if r.tpot is not None], color, style, label
            )
    for ax, what, slo in (
        (ttft_ax, "TTFT", result.slo.ttft_ms),
        (tpot_ax, "TPOT", result.slo.tpot_ms),
    ):
        ax.axvline(slo, color="k", linewidth=0.8, linestyle="--", label=f"SLO {slo:g} ms")
        ax.set(
            xscale="log",
            xlabel=f"{what} (ms, log)",
            ylabel="share of requests",
            ylim=(0, 1),
            title=f"{what} CDF",
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


def plot_latency_vs_rate(result: BenchResult, path: Path) -> Path:
    """p90 TTFT and p90 TPOT (p99 dotted) against rate with the SLOs; SLO attainment."""
    fig = _figure((13, 4))
    ttft_ax, tpot_ax, slo_ax = fig.subplots(1, 3)
    for color, config in zip(COLORS, result.configs, strict=False):
        rates = [run.rate for run in config.runs]
        summaries = [run.summary for run in config.runs]
        ttft_ax.plot(rates, [s.ttft.p90 for s in summaries], "o-", color=color, label=config.name)
        tpot_ax.plot(
            rates, [s.tpot.p90 for s in summaries], "o-", color=color, label=f"{config.name} p90"
        )
        tpot_ax.plot(
            rates,
            [s.tpot.p99 for s in summaries],
            "o:",
            color=color,
            alpha=0.6,
            label=f"{config.name} p99",
        )
        slo_ax.plot(
            rates,
            [100 * s.slo_attainment for s in summaries],
            "o-",
            color=color,
            label=f"{config.name} (goodput {config.goodput:g}/s)",
        )
    ttft_ax.axhline(result.slo.ttft_ms, color="k", linestyle="--", linewidth=0.8, label="SLO")
    tpot_ax.axhline(result.slo.tpot_ms, color="k", linestyle="--", linewidth=0.8, label="SLO")
    slo_ax.axhline(
        100 * SLO_ATTAINMENT_GOAL,
        color="k",
        linestyle="--",
        linewidth=0.8,
        label=f"{SLO_ATTAINMENT_GOAL:.0%} goal",
    )
    ttft_ax.set(title="p90 TTFT", ylabel="ms (log)", yscale="log")
    tpot_ax.set(title="TPOT", ylabel="ms (log)", yscale="log")
    slo_ax.set(title="requests within both SLOs", ylabel="%", ylim=(0, 105))
    for ax in (ttft_ax, tpot_ax, slo_ax):
        ax.set_xlabel("offered rate (requests/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{result.workload.name} workload: latency against load", fontsize=10)
    return _save(fig, path)


def plot_timeline(result: BenchResult, rate: float, path: Path) -> Path:
    """Every request of the run at `rate` as a bar from its send, split into the router's
    phases: queue, prefill (to the first token), KV transfer and decode. One panel each."""
    runs = [(config.name, config.run_at(rate)) for config in result.configs]
    runs = [(name, run) for name, run in runs if run is not None]
    fig = _figure((11, 1.2 + 2.6 * len(runs)))
    axes = fig.subplots(len(runs), 1, sharex=True, squeeze=False)
    for ax, (name, run) in zip(axes[:, 0], runs, strict=True):
        _timeline(ax, run)
        ax.set(ylabel="request", title=f"{name} @ {rate:g} req/s", xlim=(0, None))
    axes[-1, 0].set_xlabel("seconds since the run started")
    from matplotlib.patches import Patch  # matplotlib is there: _figure checked

    handles = [Patch(color=c, label=phase) for phase, c in PHASE_COLORS.items()]
    axes[0, 0].legend(handles=handles, fontsize=7, loc="upper left", ncols=4)
    return _save(fig, path)


def _timeline(ax, run: RateRun) -> None:
    for r in run.results:
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
