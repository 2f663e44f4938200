"""What benchmarks read off the machine: CPU model, CPU time, others' load, core pinning.

From Linux's /proc; where it is missing, callers say "unknown" rather than guess. On a
2-core machine one busy neighbour halves what both sides of a comparison get, so every
benchmark says how much CPU other processes took while it measured. `pdserve bench` and
the component benchmarks in bench/ both read the machine through this module.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# The name `pdserve bench` gives its own process, and `CpuSample.seconds_since` everything
# else on the machine
OWN, REST = "bench itself", "rest of machine"
CPU_QUOTA_PERIOD_US = 100_000
MIN_CPU_QUOTA_US = 1000  # the kernel refuses a smaller quota


def cpu_model(default: str = "unknown CPU") -> str:
    """The first "model name" of /proc/cpuinfo."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return default
    names = [
        ln.split(":", 1)[1].strip()
        for ln in cpuinfo.read_text().splitlines()
        if ln.startswith("model name")
    ]
    return names[0] if names else default


def describe(*software: str) -> str:
    """One line for a report: cores, CPU model, Python, then `software` (versions, settings)."""
    cpu = cpu_model(platform.processor() or "unknown CPU")
    return "; ".join(
        [f"{os.cpu_count()} cores, {cpu}", f"Python {sys.version.split()[0]}", *software]
    )


def facts(threads: int) -> dict[str, object]:
    """What `pdserve bench` records of the machine it ran on (its JSON's "machine")."""
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "platform": platform.platform(),
        "threads": threads,
        "started_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "load_avg_before": os.getloadavg(),
    }


def load_average() -> str:
    """/proc/loadavg as it reads: 1, 5 and 15-minute averages, runnable/all, last pid."""
    path = Path("/proc/loadavg")
    return path.read_text().strip() if path.is_file() else "unknown"


def machine_busy_seconds() -> float | None:
    """CPU-seconds the whole machine was busy since boot; None without /proc/stat."""
    stat = Path("/proc/stat")
    if not stat.is_file():
        return None
    # cpu  user nice system idle iowait irq softirq steal ...  (in clock ticks)
    fields = [int(x) for x in stat.read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / CLOCK_TICKS


def process_cpu_seconds(pid: int) -> float | None:
    """utime + stime of every thread of the process; None without its /proc entry."""
    stat = Path(f"/proc/{pid}/stat")
    try:
        text = stat.read_text()
    except FileNotFoundError:
        return None
    # pid (comm) state ... utime stime are fields 14 and 15; comm may hold spaces
    after_comm = text.rsplit(")", 1)[1].split()
    return (int(after_comm[11]) + int(after_comm[12])) / CLOCK_TICKS


def cpu_seconds(pids: Sequence[int]) -> float:
    """CPU-seconds these processes used so far; ProcessLookupError if one has no /proc entry."""
    total = 0.0
    for pid in pids:
        seconds = process_cpu_seconds(pid)
        if seconds is None:
            raise ProcessLookupError(f"no /proc entry for process {pid}: did it exit?")
        total += seconds
    return total


@dataclass(frozen=True, slots=True)
class CpuSample:
    """CPU-seconds used so far by named groups of processes and by the whole machine (None
    without /proc/stat), at one instant: two samples give a window's split of the machine
    (`CpuSample.seconds_since`)."""

    groups: dict[str, float]
    machine_s: float | None
    at: float

    @classmethod
    def take(
        cls, pids: Mapping[str, Sequence[int]], read: Callable[[Sequence[int]], float] = cpu_seconds
    ) -> CpuSample:
        """Now, for `pids` by group name, each group read with `read` (by default
        ProcessLookupError if one of its processes has no /proc entry)."""
        groups = {name: read(group) for name, group in pids.items()}
        return cls(groups, machine_busy_seconds(), time.perf_counter())

    def seconds_since(self, before: CpuSample) -> dict[str, float]:
        """CPU-seconds each group and the rest of the machine (REST: every other process,
        and the kernel's work for none of them) used between the two samples; REST is
        left out without /proc/stat."""
        used = {name: s - before.groups[name] for name, s in self.groups.items()}
        if self.machine_s is not None and before.machine_s is not None:
            used[REST] = max(0.0, self.machine_s - before.machine_s - sum(used.values()))
        return used


def _cpu_seconds_or_zero(pids: Sequence[int]) -> float:
    """What `cpu_seconds` says, a process without a /proc entry counting 0."""
    return sum(process_cpu_seconds(pid) or 0.0 for pid in pids)


def others_line(others_s: float | None, wall_s: float, noisy_share: float) -> str:
    """The report line: what other processes took, and whether that makes figures noise."""
    if others_s is None:
        return "CPU use of other processes: unknown (no /proc/stat)"
    share = others_s / (wall_s * (os.cpu_count() or 1))
    verdict = "; figures are unreliable" if share > noisy_share else ""
    return (
        f"other processes used {others_s:.1f} CPU-s in {wall_s:.0f} s "
        f"({share:.0%} of the machine){verdict}"
    )


class CpuWindow:
    """CPU-seconds of named processes, and of everything else, between enter and exit.

    After the window, `cpu_s` maps each name to its processes' CPU-seconds and "others"
    to what the rest of the machine took (None without /proc/stat); `wall_s` is its length.
    """

    def __init__(self, pids: dict[str, int]):
        self.pids = {name: (pid,) for name, pid in pids.items()}
        self.cpu_s: dict[str, float] = {}
        self.others_s: float | None = None
        self.wall_s = 0.0

    def __enter__(self) -> CpuWindow:
        self._begin = CpuSample.take(self.pids, _cpu_seconds_or_zero)
        return self

    def __exit__(self, *exc_info) -> None:
        end = CpuSample.take(self.pids, _cpu_seconds_or_zero)
        self.cpu_s = end.seconds_since(self._begin)
        self.others_s = self.cpu_s.pop(REST, None)
        self.wall_s = end.at - self._begin.at

    def others_line(self, noisy_share: float) -> str:
        return others_line(self.others_s, self.wall_s, noisy_share)


def pin(pid: int, core: int) -> None:
    """Pin every thread of the process to `core` (threads it starts later inherit the
    mask); nothing on a one-core machine."""
    if (os.cpu_count() or 1) < 2:
        return
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except ProcessLookupError:  # the thread ended meanwhile
            pass


@contextmanager
def cpu_quota(pid: int, share: float) -> Iterator[None]:
    """Cap the process at `share` of one core (a cgroup CPU quota), so that it is the
    bottleneck: its figures are then those of a saturated process.

    Needs a writable cgroup CPU controller (v1 `cpu` or v2); raises if there is none.
    """
    quota_us = max(MIN_CPU_QUOTA_US, round(share * CPU_QUOTA_PERIOD_US))
    v1 = Path("/sys/fs/cgroup/cpu")
    group = (v1 if v1.is_dir() else Path("/sys/fs/cgroup")) / f"pdserve-bench-{pid}"
    group.mkdir()
    try:
        if v1.is_dir():
            (group / "cpu.cfs_period_us").write_text(str(CPU_QUOTA_PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(quota_us))
        else:
            (group / "cpu.max").write_text(f"{quota_us} {CPU_QUOTA_PERIOD_US}")
        (group / "cgroup.procs").write_text(str(pid))  # every thread of the process
        yield
    finally:
        parent = group.parent / "cgroup.procs"
        for member in (group / "cgroup.procs").read_text().split():
            try:
                parent.write_text(member)
            except OSError:  # it exited meanwhile
                pass
        group.rmdir()
