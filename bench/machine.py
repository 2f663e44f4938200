"""What the component benchmarks read off the machine: CPU model, CPU time, others' load.

From Linux's /proc; where it is missing, callers say "unknown" rather than guess. On a
2-core machine one busy neighbour halves what both sides of a comparison get, so every
benchmark says how much CPU other processes took while it measured.
"""

from __future__ import annotations

import os
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


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
    if not stat.is_file():
        return None
    # pid (comm) state ... utime stime are fields 14 and 15; comm may hold spaces
    after_comm = stat.read_text().rsplit(")", 1)[1].split()
    return (int(after_comm[11]) + int(after_comm[12])) / CLOCK_TICKS


def others_line(others_s: float, wall_s: float, noisy_share: float) -> str:
    """The report line: what other processes took, and whether that makes figures noise."""
    share = others_s / (wall_s * (os.cpu_count() or 1))
    verdict = "; figures are unreliable" if share > noisy_share else ""
    return (
        f"other processes used {others_s:.1f} CPU-s in {wall_s:.0f} s "
        f"({share:.0%} of the machine){verdict}"
    )
