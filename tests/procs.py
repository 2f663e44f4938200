"""Real worker processes for tests: `pdserve serve ...` on port 0, stopped in finally."""

from __future__ import annotations

import os
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass

import grpc

from pdserve.api.v1 import decode_pb2
from pdserve.cluster.load import wait_idle, worker_load
from pdserve.cluster.processes import ChildProcess, router_args, spawn, wait_ready, worker_args


def descendants_of(pid: int) -> list[int]:
    """Every descendant of pid, from /proc (no psutil needed)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [pid]
    while frontier:
        current = frontier.pop()
        kids = [p for p, parent in parents.items() if parent == current]
        found += kids
        frontier += kids
    return found


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie has exited; its parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


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
        return worker_load(self.address, self.role)

    def wait_idle(self, timeout_s: float = 10.0) -> decode_pb2.WorkerLoad:
        """Poll until nothing runs, no lease is open and every block is free (its last
        load at the deadline otherwise, for the test to assert on)."""
        return wait_idle(self.address, self.role, timeout_s)


@contextmanager
def worker_process(role: str, model_dir, *args: str, log_dir=None, env=None):
    """`pdserve serve ROLE` on port 0 with one torch thread; `args` are further flags,
    `env` variables beside the test's own."""
    cmd = worker_args(role, str(model_dir), args, port=0, threads=1)
    with pdserve_process(cmd, log_dir, env) as child:
        fields = child.fields
        yield WorkerProcess(
            role, fields["address"], int(fields["blocks"]), child.proc, child.log_path
        )


@contextmanager
def router_process(model_dir, redis_url: str, *args: str, log_dir=None):
    """`pdserve router` on port 0; yields (address, process)."""
    cmd = router_args(str(model_dir), redis_url, args, port=0)
    with pdserve_process(cmd, log_dir) as child:
        yield child.address, child.proc


@contextmanager
def pdserve_process(args: list[str], log_dir=None, env=None):
    """Run `python -m pdserve ARGS` until its ready line; SIGTERM it afterwards."""
    name = f"{'-'.join(args[:2])}-{time.time_ns()}"
    child = spawn(name, args, str(log_dir or "/tmp"), env)
    try:
        yield wait_ready(child)
    finally:
        child.stop()


def stop(proc: subprocess.Popen, timeout_s: float = 30) -> int:
    return ChildProcess("", proc, "").stop(timeout_s)
