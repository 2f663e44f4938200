"""Transparent huge pages for torch's CPU tensors: a CPU engine's weights and KV cache.

A decode step reads every weight and each running request's KV. Through 4 KiB pages
that is a TLB miss every few hundred bytes of a 220 MB model; 2 MiB pages take
those misses away. Measured on a 2-core Intel Xeon VM, the demo model's decode steps
took 3-7% less time with them, in the engine alone and in a cluster (docs/benchmarks.md,
issue 16), at no cost in memory: a worker's resident set is the same either way. The
price is paid once, at start-up: there a worker took 1-2 s longer to be ready, the
kernel zeroing its 1 GiB KV cache in 2 MiB faults at half the speed of 4 KiB ones.

torch backs its CPU allocations of 2 MiB and more with huge pages (`madvise`) when the
`THP_MEM_ALLOC_ENABLE` variable is 1. It reads the variable once, at its first
allocation, so a process asks before it creates any tensor. The kernel has the last word:
`never` in /sys/kernel/mm/transparent_hugepage/enabled turns the advice down.
"""

from __future__ import annotations

import enum
import os
import re
from pathlib import Path

THP_ENV = "THP_MEM_ALLOC_ENABLE"
KERNEL_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


class KernelThpMode(enum.StrEnum):
    """When the kernel backs anonymous memory with huge pages."""

    ALWAYS = "always"  # wherever it can, advised or not
    MADVISE = "madvise"  # where the process advised MADV_HUGEPAGE (torch, when asked)
    NEVER = "never"  # nowhere; also a kernel without THP


def use_huge_pages() -> bool:
    """Ask torch for huge pages, unless the environment already says (`THP_MEM_ALLOC_ENABLE=0`
    keeps them off). Call before the process's first tensor. Returns whether they are
    asked for and the kernel grants them on request."""
    os.environ.setdefault(THP_ENV, "1")
    return os.environ[THP_ENV] == "1" and kernel_thp_mode() is not KernelThpMode.NEVER


def kernel_thp_mode() -> KernelThpMode:
    """The kernel's mode: the bracketed word of KERNEL_THP_MODE (`always [madvise] never`);
    NEVER where the file is missing or names a mode this module does not know."""
    try:
        found = re.search(r"\[(\w+)\]", KERNEL_THP_MODE.read_text())
        return KernelThpMode(found.group(1))
    except (OSError, AttributeError, ValueError):  # no file, no bracketed word, another word
        return KernelThpMode.NEVER
