"""Real worker processes for tests: `pdserve serve ...` on port 0, stopped in finally."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import grpc

from pdserve.api.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2_grpc

READY_TIMEOUT_S = 120


@dataclass
class WorkerProcess:
    role: str
    address: str
    total_blocks: int
    proc: subprocess.Popen
    log_path: str

    def channel(self) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(self.address)

    def load(self) -> decode_pb2.WorkerLoad:
        """Blocking GetLoad (prefill and decode both serve it)."""
        with grpc.insecure_channel(self.address) as channel:
            if self.role == "prefill":
                stub = prefill_pb2_grpc.PrefillStub(channel)
            else:
                stub = decode_pb2_grpc.DecodeStub(channel)
            return stub.GetLoad(decode_pb2.GetLoadRequest(), timeout=10)

    def wait_idle(self, timeout_s: float = 10.0) -> decode_pb2.WorkerLoad:
        """Poll until nothing runs, no lease is open and every block is free."""
        deadline = time.monotonic() + timeout_s
        while True:
            load = self.load()
            idle = load.running == 0 and load.waiting == 0 and load.open_leases == 0
            if (idle and load.free_blocks == load.total_blocks) or time.monotonic() > deadline:
                return load
            time.sleep(0.05)


def _read_ready(proc: subprocess.Popen, lines: queue.Queue) -> None:
    for line in proc.stdout:
        lines.put(line)
    lines.put(None)


@contextmanager
def worker_process(role: str, model_dir, *args: str, log_dir=None):
    """`pdserve serve ROLE` on port 0 with one torch thread."""
    cmd = ["serve", role, "--model", str(model_dir), "--port", "0", "--threads", "1", *args]
    with pdserve_process(cmd, log_dir) as (fields, proc, log_path):
        yield WorkerProcess(role, fields["address"], int(fields["blocks"]), proc, log_path)


@contextmanager
def router_process(model_dir, redis_url: str, *args: str, log_dir=None):
    """`pdserve router` on port 0; yields (address, process)."""
    cmd = ["router", "--model", str(model_dir), "--redis-url", redis_url, "--port", "0", *args]
    with pdserve_process(cmd, log_dir) as (fields, proc, _):
        yield fields["address"], proc


@contextmanager
def pdserve_process(args: list[str], log_dir=None):
    """Run `python -m pdserve ARGS` until its ready line; SIGTERM it afterwards."""
    name = "-".join(args[:2])
    log_path = os.path.join(log_dir or "/tmp", f"pdserve-{name}-{time.time_ns()}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pdserve", *args],
                                stdout=subprocess.PIPE, stderr=log, text=True)  # fmt: skip
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_read_ready, args=(proc, lines), daemon=True).start()
    try:
        yield _wait_ready(lines, log_path), proc, log_path
    finally:
        stop(proc)


def _wait_ready(lines: queue.Queue, log_path: str) -> dict[str, str]:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        if line is None:
            break
        if line.startswith("PDSERVE_READY"):
            return dict(part.split("=", 1) for part in line.split()[1:])
    with open(log_path) as f:
        raise RuntimeError(f"worker did not become ready:\n{f.read()[-3000:]}")


def stop(proc: subprocess.Popen, timeout_s: float = 30) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
