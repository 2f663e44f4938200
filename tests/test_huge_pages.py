"""Workers keep torch's CPU tensors (the weights, the KV cache) in transparent huge pages,
unless THP_MEM_ALLOC_ENABLE=0 says otherwise."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from procs import worker_process

from pdserve.engine import huge_pages
from pdserve.engine.huge_pages import THP_ENV, KernelThpMode, kernel_thp_mode

pytestmark = pytest.mark.cluster

KV_CACHE_BYTES = 64 << 20
MODE = kernel_thp_mode()


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


@pytest.mark.parametrize(
    ("text", "mode"),
    [
        ("always [madvise] never\n", KernelThpMode.MADVISE),
        ("[always] madvise never\n", KernelThpMode.ALWAYS),
        ("always madvise [never]\n", KernelThpMode.NEVER),
        ("always madvise [inherit] never\n", KernelThpMode.NEVER),  # a word it does not know
        ("", KernelThpMode.NEVER),
        (None, KernelThpMode.NEVER),  # a kernel without THP: no file
    ],
)
def test_the_kernel_s_mode_is_its_bracketed_word(tmp_path, monkeypatch, text, mode):
    path = tmp_path / "enabled"
    if text is not None:
        path.write_text(text)
    monkeypatch.setattr(huge_pages, "KERNEL_THP_MODE", path)
    assert kernel_thp_mode() is mode


def test_use_huge_pages_asks_torch_for_them_unless_the_environment_said_no():
    paths = {"PYTHONPATH": ":".join(sys.path)}
    granted = MODE is not KernelThpMode.NEVER
    assert in_fresh_python(ASK, paths) == f"{granted} 1"
    assert in_fresh_python(ASK, {**paths, THP_ENV: "0"}) == "False 0"


@pytest.mark.skipif(MODE is KernelThpMode.NEVER, reason="this kernel grants no huge pages")
def test_a_worker_s_kv_cache_lives_in_huge_pages(demo_model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv(THP_ENV, raising=False)  # the worker's own default decides
    kv = ("--kv-cache-bytes", str(KV_CACHE_BYTES))
    with worker_process("decode", demo_model_dir, *kv, log_dir=tmp_path) as worker:
        assert huge_page_bytes(worker.proc.pid) >= KV_CACHE_BYTES // 2
        assert "huge pages for weights and KV: on" in Path(worker.log_path).read_text()


@pytest.mark.skipif(MODE is not KernelThpMode.MADVISE, reason="only `madvise` leaves it to torch")
def test_thp_mem_alloc_enable_0_keeps_a_worker_on_small_pages(demo_model_dir, tmp_path):
    kv = ("--kv-cache-bytes", str(KV_CACHE_BYTES))
    env = {THP_ENV: "0"}
    with worker_process("decode", demo_model_dir, *kv, log_dir=tmp_path, env=env) as worker:
        assert huge_page_bytes(worker.proc.pid) == 0
        assert "huge pages for weights and KV: off" in Path(worker.log_path).read_text()
