"""Workers keep torch's CPU tensors (the weights, the KV cache) in transparent huge pages,
unless THP_MEM_ALLOC_ENABLE=0 says otherwise."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from procs import worker_process

from pdserve.engine.huge_pages import KERNEL_THP_MODE, THP_ENV, kernel_grants_huge_pages

KV_CACHE_BYTES = 64 << 20
kernel_grants = pytest.mark.skipif(
    not kernel_grants_huge_pages(), reason="this kernel grants no transparent huge pages"
)


def kernel_mode() -> str:
    """The bracketed word of the kernel's THP mode: always, madvise or never."""
    try:
        return re.search(r"\[(\w+)\]", KERNEL_THP_MODE.read_text()).group(1)
    except OSError:
        return "never"


def huge_page_bytes(pid: int) -> int:
    rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    return int(re.search(r"^AnonHugePages:\s+(\d+) kB", rollup, re.M).group(1)) * 1024


def in_fresh_python(code: str, env: dict[str, str]) -> str:
    """What `code` prints in a new interpreter whose environment is `env` and no more."""
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


ASK = (
    "import os; from pdserve.engine.huge_pages import use_huge_pages; "
    f"print(use_huge_pages(), os.environ[{THP_ENV!r}])"
)


def test_use_huge_pages_asks_torch_for_them_unless_the_environment_said_no():
    paths = {"PYTHONPATH": ":".join(sys.path)}
    granted = kernel_grants_huge_pages()
    assert in_fresh_python(ASK, paths) == f"{granted} 1"
    assert in_fresh_python(ASK, {**paths, THP_ENV: "0"}) == "False 0"


@kernel_grants
def test_a_worker_s_kv_cache_lives_in_huge_pages(demo_model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv(THP_ENV, raising=False)  # the worker's own default decides
    kv = ("--kv-cache-bytes", str(KV_CACHE_BYTES))
    with worker_process("decode", demo_model_dir, *kv, log_dir=tmp_path) as worker:
        assert huge_page_bytes(worker.proc.pid) >= KV_CACHE_BYTES // 2
        assert "huge pages for weights and KV: on" in Path(worker.log_path).read_text()


@pytest.mark.skipif(kernel_mode() != "madvise", reason="only `madvise` leaves it to torch")
def test_thp_mem_alloc_enable_0_keeps_a_worker_on_small_pages(demo_model_dir, tmp_path):
    kv = ("--kv-cache-bytes", str(KV_CACHE_BYTES))
    env = {THP_ENV: "0"}
    with worker_process("decode", demo_model_dir, *kv, log_dir=tmp_path, env=env) as worker:
        assert huge_page_bytes(worker.proc.pid) == 0
        assert "huge pages for weights and KV: off" in Path(worker.log_path).read_text()
