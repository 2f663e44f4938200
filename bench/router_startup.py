"""The router process's start-up time and resident memory.

Spawns `python -m pdserve router` against a private Redis and the tiny demo model, times
it from spawn to its ready line, and reads its resident memory (VmRSS) half a second
later, `--runs` times. Whichever `pdserve` is first on sys.path runs, so PYTHONPATH picks
the tree (for a before/after pair on one machine):

    .venv/bin/python bench/router_startup.py [--runs N] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from pdserve.engine.demo_model import write_demo_model
from pdserve.state.redis_server import PrivateRedis

READY_LINE = "PDSERVE_READY"  # what every pdserve server prints once it serves
SETTLE_S = 0.5  # after the ready line, before reading its memory


def resident_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def one_run(model_dir: str, redis_url: str) -> tuple[float, float]:
    """(seconds from spawn to the ready line, resident MiB) of one router process."""
    start = time.perf_counter()
    args = ["router", "--model", model_dir, "--redis-url", redis_url, "--port", "0"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        for line in proc.stdout:
            if line.startswith(READY_LINE):
                break
        else:
            raise RuntimeError(f"the router exited ({proc.wait()}) before its ready line")
        ready_s = time.perf_counter() - start
        time.sleep(SETTLE_S)
        return ready_s, resident_mib(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--model-dir", help="default: the tiny demo model, written to a temp dir")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model_dir or str(write_demo_model(scratch, size="tiny"))
        redis = PrivateRedis().start()
        try:
            runs = [one_run(model_dir, redis.url) for _ in range(args.runs)]
        finally:
            redis.stop()
    ready, rss = zip(*runs, strict=True)
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, pdserve.router_server; print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    print(
        json.dumps(
            {
                "ready_s_median": round(statistics.median(ready), 3),
                "ready_s": [round(r, 3) for r in ready],
                "rss_mib_median": round(statistics.median(rss), 1),
                "router_server_imports_torch": loaded == "True",
            }
        )
    )


if __name__ == "__main__":
    main()
