"""The sweep itself: every target measured alone per request kind, then at every load
(each rate, or each concurrency level).

Targets (clusters started side by side, or one server given) are measured one at a time.
Each turn (a load, or one of its repeated runs) starts at the next target in rotation (a
b, b a, ...), so a slow spell of the machine lands on every target rather than on one; the
i-th runs of all targets send the same requests next to each other.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pdserve.bench.loadgen import RequestResult, run_closed, run_plan
from pdserve.bench.machine import OWN, CpuSample
from pdserve.bench.markdown import solo_text
from pdserve.bench.metrics import MS, summarize
from pdserve.bench.report import ConfigRun, RateRun, Sweep
from pdserve.bench.targets import Target
from pdserve.bench.workload import (
    Concurrency,
    Load,
    PlannedRequest,
    closed_plan,
    plan,
    sample_request,
)

SETTLE_S = 1.0  # pause between runs: cancelled requests of the last one are freed by then
# Requests of each kind sent alone: the first ones warm the workers up (two, so a worker
# pair sharing requests both get one), the others are timed and their median kept.
SOLO_WARMUPS, SOLO_TIMED = 2, 3
# an open loop's plan, or a closed loop's endless requests (taken as requests finish)
Planned = list[PlannedRequest] | Iterator[PlannedRequest]


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
    """The model's name, and every target measured alone per kind, then at every load
    `sweep.repeats` times. Calibrates `sweep.slo` on the first target's solo times."""
    async with targets[0].connect() as connection:
        model = await connection.model()
    configs = [ConfigRun(t.name, t.address, backend=t.backend) for t in targets]
    for target, c in zip(targets, configs, strict=True):
        c.solo = await solo(target, sweep)
        console.print(f"{c.name} alone: {solo_text(c.solo)}")
    sweep.slo = sweep.slo.calibrated(configs[0].solo)  # relative to the first listed
    sent = "; each request carries its TTFT SLO" if sweep.slo.sent else ""
    console.print(f"SLOs: {sweep.slo.ttft_text()}, TPOT <= {sweep.slo.tpot_ms:g} ms{sent}")
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), console=console) as progress:
        turn = 0
        for load in sweep.loads:
            measured = [_Measured() for _ in targets]
            for repeat in range(sweep.repeats):
                for i in rotation(turn, len(targets)):
                    label = f"{configs[i].name} @ {load}{_run_text(repeat, sweep)}"
                    requests = _requests(sweep, load, repeat)  # a closed loop's: consumed
                    task = progress.add_task(label, total=_num_sent(sweep, requests))
                    advance = partial(progress.advance, task)
                    await _run(targets[i], load, requests, sweep, measured[i], advance)
                turn += 1
            for c, m in zip(configs, measured, strict=True):
                summary = summarize(load, m.results, sweep.slo)
                c.runs.append(RateRun(load, summary, m.results, m.cores))
    return model, configs


def _requests(sweep: Sweep, load: Load, repeat: int) -> Planned:
    """A run's requests: the same for every target."""
    if isinstance(load, Concurrency):
        return closed_plan(sweep.workload, load.n, sweep.num_warmup, sweep.seed, repeat)
    return plan(sweep.workload, load.rate, sweep.duration_s, sweep.num_warmup, sweep.seed, repeat)


def _num_sent(sweep: Sweep, requests: Planned) -> int | None:
    """How many requests a run sends (None: as many as its duration takes)."""
    if isinstance(requests, list):
        return len(requests)
    return None if sweep.num_requests is None else sweep.num_warmup + sweep.num_requests


async def _send(
    target: Target, load: Load, requests: Planned, sweep: Sweep, on_done: Callable
) -> list[RequestResult]:
    ttft_slo_ms = sweep.slo.ttft_ms_sent
    if not isinstance(load, Concurrency):
        return await run_plan(target, requests, sweep.drain_s, on_done, ttft_slo_ms=ttft_slo_ms)
    return await run_closed(
        target,
        requests,
        load.n,
        sweep.drain_s,
        duration_s=None if sweep.num_requests is not None else sweep.duration_s,
        num_requests=sweep.num_requests,
        on_done=on_done,
        ttft_slo_ms=ttft_slo_ms,
    )


async def _run(
    target: Target,
    load: Load,
    requests: Planned,
    sweep: Sweep,
    into: _Measured,
    advance: Callable[[], None],
) -> None:
    """Send `requests` to `target` under `load` (`advance` called per request done); its
    results and CPU time are added `into`."""
    pids = {**target.pids, OWN: (os.getpid(),)}
    before = CpuSample.take(pids)
    into.results += await _send(target, load, requests, sweep, lambda r: advance())
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
            [one] = await run_plan(target, planned, sweep.drain_s)
            if not one.ok:
                raise RuntimeError(f"a {kind.name} request alone failed: {_failure(one)}")
            timed += [one] if repeat >= SOLO_WARMUPS else []
        result[kind.name] = {
            "ttft_ms": statistics.median(r.ttft for r in timed) * MS,
            "tpot_ms": statistics.median(r.tpot or 0.0 for r in timed) * MS,
        }
    return result


def _failure(result: RequestResult) -> str:
    """Why a request is not `ok`: its error, or how short it fell."""
    if result.error:
        return result.error
    return (
        f"{result.output_tokens} tokens (counted by {result.counted_by}), asked for "
        f"{result.max_tokens}; finish reason {result.finish_reason or 'none'}"
    )
