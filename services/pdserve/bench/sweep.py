"""The sweep itself: every target measured alone per request kind, then at every rate.

Targets (clusters started side by side, or one router given) are measured one at a time.
Each turn (a rate, or one of its repeated runs) starts at the next target in rotation (a b,
b a, ...), so a slow spell of the machine lands on every target rather than on one; the
i-th runs of all targets send the same requests next to each other.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pdserve.bench.loadgen import RequestResult, run_plan
from pdserve.bench.machine import OWN, CpuSample
from pdserve.bench.metrics import MS, summarize
from pdserve.bench.report import ConfigRun, RateRun, Sweep, solo_text
from pdserve.bench.workload import PlannedRequest, plan, sample_request
from pdserve.client import AsyncClient

SETTLE_S = 1.0  # pause between runs: cancelled requests of the last one are freed by then
# Requests of each kind sent alone: the first ones warm the workers up (two, so a worker
# pair sharing requests both get one), the others are timed and their median kept.
SOLO_WARMUPS, SOLO_TIMED = 2, 3


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    address: str
    # a local cluster's processes by role (router, prefill, decode, colocated), for the
    # CPU time each role takes
    pids: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    # what `AsyncClient` takes beside the address (--router's TLS and API key)
    client_kwargs: Mapping[str, object] = field(default_factory=dict)


@dataclass(slots=True)
class _Measured:
    """One target's runs of one rate so far: their requests, and the CPU-seconds of each
    of its roles, of this benchmark and of the rest of the machine (`CpuSample`)."""

    results: list[RequestResult] = field(default_factory=list)
    cpu_s: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def cores(self) -> dict[str, float]:
        """The CPU-seconds as cores used on average over the runs."""
        return {name: s / self.wall_s for name, s in self.cpu_s.items()} if self.wall_s else {}


def rotation(turn: int, count: int) -> list[int]:
    """The order `count` targets are measured in at turn `turn`: from `turn mod count` on,
    round once (for two: 0 1, 1 0, 0 1, ...)."""
    return [(turn + j) % count for j in range(count)]


async def measure(
    sweep: Sweep, targets: list[Target], console: Console
) -> tuple[str, list[ConfigRun]]:
    """The model's name, and every target measured alone per kind, then at every rate
    `sweep.repeats` times. Calibrates `sweep.slo` on the first target's solo times."""
    first = targets[0]
    async with AsyncClient(first.address, timeout=30, **first.client_kwargs) as client:
        model = (await client.model_info()).model
    configs = [ConfigRun(t.name, t.address) for t in targets]
    for target, c in zip(targets, configs, strict=True):
        c.solo = await solo(target, sweep)
        console.print(f"{c.name} alone: {solo_text(c.solo)}")
    sweep.slo = sweep.slo.calibrated(configs[0].solo)  # relative to the first listed
    sent = "; each request carries its TTFT SLO" if sweep.slo.sent else ""
    console.print(f"SLOs: {sweep.slo.ttft_text()}, TPOT <= {sweep.slo.tpot_ms:g} ms{sent}")
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), console=console) as progress:
        turn = 0
        for rate in sweep.rates:
            measured = [_Measured() for _ in targets]
            for repeat in range(sweep.repeats):
                planned = plan(
                    sweep.workload, rate, sweep.duration_s, sweep.num_warmup, sweep.seed, repeat
                )
                for i in rotation(turn, len(targets)):
                    label = f"{configs[i].name} @ {rate:g} req/s{_run_text(repeat, sweep)}"
                    advance = partial(
                        progress.advance, progress.add_task(label, total=len(planned))
                    )
                    await _run(targets[i], planned, sweep, measured[i], advance)
                turn += 1
            for c, m in zip(configs, measured, strict=True):
                summary = summarize(rate, m.results, sweep.slo)
                c.runs.append(RateRun(rate, summary, m.results, m.cores))
    return model, configs


async def _run(
    target: Target,
    planned: list[PlannedRequest],
    sweep: Sweep,
    into: _Measured,
    advance: Callable[[], None],
) -> None:
    """Send `planned` to `target` (`advance` called per request done); its requests and
    CPU time are added `into`."""
    pids = {**target.pids, OWN: (os.getpid(),)}
    before = CpuSample.take(pids)
    into.results += await run_plan(
        target.address,
        planned,
        sweep.drain_s,
        on_done=lambda r: advance(),
        ttft_slo_ms=sweep.slo.ttft_ms_sent,
        **target.client_kwargs,
    )
    after = CpuSample.take(pids)
    for name, seconds in after.seconds_since(before).items():
        into.cpu_s[name] = into.cpu_s.get(name, 0.0) + seconds
    into.wall_s += after.at - before.at
    await asyncio.sleep(SETTLE_S)


def _run_text(repeat: int, sweep: Sweep) -> str:
    return f", run {repeat + 1} of {sweep.repeats}" if sweep.repeats > 1 else ""


async def solo(target: Target, sweep: Sweep) -> dict[str, dict[str, float]]:
    """Requests of each kind sent alone, timed: what an idle cluster does (calibration)."""
    result = {}
    for kind in sweep.workload.kinds:
        timed = []
        for repeat in range(SOLO_WARMUPS + SOLO_TIMED):  # fresh prompt ids: no cache hits
            rng = random.Random(f"{sweep.seed}/solo/{kind.name}/{repeat}")
            planned = [sample_request(kind, rng, rng)]
            [one] = await run_plan(target.address, planned, sweep.drain_s, **target.client_kwargs)
            if not one.ok:
                raise RuntimeError(f"a {kind.name} request alone failed: {one.error}")
            timed += [one] if repeat >= SOLO_WARMUPS else []
        result[kind.name] = {
            "ttft_ms": statistics.median(r.ttft for r in timed) * MS,
            "tpot_ms": statistics.median(r.tpot or 0.0 for r in timed) * MS,
        }
    return result
