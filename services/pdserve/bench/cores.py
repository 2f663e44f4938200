"""Where a serving benchmark's CPU went, rate by rate: each role of a local cluster (its
router, prefill, decode or colocated workers), the benchmark itself (load generator and
client), the rest of the machine, and what stayed idle.

That split is the physical bound a rate's latencies sit under: a worker runs its engine on
`--threads` torch threads, so a role near that many cores per worker is saturated (its
queue, not its placement, sets its requests' latency from there on), and a machine with no
idle core left has no rate above it for any shape. The figures are averages over each
run's whole window, its drain and lulls included: a role well below its threads may still
have been saturated while its queue built up (on a 2-core VM, a prefill worker at 0.68
cores over a 4 req/s run had its engine thread running 0.91 of the time mid-run).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from pdserve.bench.machine import OWN, REST
from pdserve.bench.workload import Load, Poisson

NOT_ROLES = (OWN, REST)


class MeasuredRate(Protocol):
    """What the split reads of one rate's (or concurrency's) run (`report.RateRun`)."""

    @property
    def load(self) -> Load: ...

    @property
    def cores(self) -> Mapping[str, float]: ...


def cluster_cores(cores: Mapping[str, float]) -> float | None:
    """The cluster's processes' cores together; None when none of them were measured (a
    router given by address)."""
    roles = [used for name, used in cores.items() if name not in NOT_ROLES]
    return sum(roles) if roles else None


def split_table(
    runs: Sequence[MeasuredRate], cpus: int | None
) -> tuple[list[str], list[list[str]]]:
    """The header and a row per rate: cores used by each role, by the benchmark, by the
    rest of the machine, and left idle of `cpus` (unknown without /proc/stat or `cpus`);
    no rows when no rate was measured on this machine's /proc."""
    measured = [run for run in runs if run.cores]
    roles = list(dict.fromkeys(n for run in measured for n in run.cores if n not in NOT_ROLES))
    unit = runs[0].load.unit if runs else Poisson.unit
    header = [unit, *roles, OWN, REST, f"idle (of {cpus or '?'})"]
    rows = []
    for run in measured:
        used = [run.cores.get(name) for name in (*roles, OWN, REST)]
        known = [u for u in used if u is not None]
        idle = cpus - sum(known) if cpus and REST in run.cores else None
        rows.append([f"{run.load.level:g}", *(_cores(u) for u in used), _cores(idle)])
    return header, rows


def _cores(value: float | None) -> str:
    return "-" if value is None else f"{max(value, 0.0):.2f}"
