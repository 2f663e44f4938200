"""Start a `pdserve` subcommand as a child process and wait for its ready line.

A worker's or router's arguments come from one function each (`worker_args`,
`router_args`), which names its settings as the config's fields.

Every server prints `PDSERVE_READY key=value ...` (its bound address among them)
once it serves; waiting for that line beats polling ports. Used by `pdserve up`,
the benchmarks and the tests.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.core.flags import to_args
from pdserve.router.config import RouterConfig
from pdserve.rpc.server import READY_LINE
from pdserve.telemetry.trace_export import service_name
from pdserve.worker.config import WorkerConfig

READY_TIMEOUT_S = 180.0


@dataclass
class ChildProcess:
    name: str
    proc: subprocess.Popen
    log_path: str
    fields: dict[str, str] = field(default_factory=dict)  # from the ready line
    # how it was started, so that a supervisor can start it again (`respawn`)
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    python_args: Sequence[str] = ()

    @property
    def address(self) -> str:
        return self.fields["address"]

    @property
    def role(self) -> str:
        return self.fields["role"]

    @property
    def metrics_address(self) -> str | None:
        """host:port of its GET /metrics, if it serves one (`--metrics-port`)."""
        return self.fields.get("metrics")

    @property
    def http_address(self) -> str | None:
        """host:port of a router's OpenAI-compatible HTTP API, if it serves one."""
        return self.fields.get("http")

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (graceful drain), then SIGKILL after timeout_s; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def respawn(self, args: list[str]) -> ChildProcess:
        """Start it again in place (same name, log appended to), with `args`; the caller
        waits for its ready line (`wait_ready`). References to this object stay valid, and
        so do its `fields` (its ports do not change) until the new ready line replaces them."""
        self.args = args
        self.proc = _popen(args, self.log_path, self.env, self.python_args, mode="a")
        return self


def worker_args(role: str, model: str, extra: Sequence[str] = (), **settings) -> list[str]:
    """`serve ROLE --model MODEL ...`: the arguments of a worker process.

    `settings` are `WorkerConfig` fields by name, the engine's included (`port=0`,
    `block_size=32`); `extra` is appended as given (`pdserve up --worker-arg`), so it
    wins over a setting of the same flag.
    """
    return ["serve", *to_args(WorkerConfig, role=role, model=model, **settings), *extra]


def router_args(model: str, redis_url: str, extra: Sequence[str] = (), **settings) -> list[str]:
    """`router --model MODEL --redis-url URL ...`: the arguments of a router process;
    `settings` are `RouterConfig` fields by name, `extra` is appended as given."""
    config_args = to_args(RouterConfig, model=model, redis_url=redis_url, **settings)
    return ["router", *config_args, *extra]


def service_env(role: str) -> dict[str, str]:
    """A child's own variables: its role as OTEL_SERVICE_NAME, so that a trace shows each
    process as a service of its own (one name for all would merge them). The caller's
    other OTEL_* variables reach every child as they are (`spawn` passes its environment)."""
    return {"OTEL_SERVICE_NAME": service_name(role)}


def spawn(
    name: str,
    args: list[str],
    log_dir: str,
    env: dict[str, str] | None = None,
    python_args: Sequence[str] = (),
):
    """Start `python PYTHON_ARGS -m pdserve ARGS`; stderr goes to LOG_DIR/NAME.log.

    `python_args` run it under another module (`-m cProfile -o PATH`: a benchmark's
    profiled router).

    Each child gets a session of its own. Linux's autogroup scheduler shares the CPU
    between sessions first, so children in the caller's session would share one slice
    among them against the rest of the machine, however many engines they run. And
    the terminal's Ctrl-C reaches only the caller, which then stops its children in
    order (`ChildProcess.stop`), instead of every process at once.
    """
    log_path = os.path.join(log_dir, f"{name}.log")
    env = dict(env or {})
    proc = _popen(args, log_path, env, python_args, mode="w")
    return ChildProcess(name, proc, log_path, args=args, env=env, python_args=python_args)


def _popen(
    args: list[str], log_path: str, env: dict[str, str], python_args: Sequence[str], mode: str
) -> subprocess.Popen:
    with open(log_path, mode) as log:
        return subprocess.Popen(
            [sys.executable, *python_args, "-m", "pdserve", *args],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
        )


def exit_description(returncode: int) -> str:
    """How a child ended, as a person reads it: `killed by SIGKILL`, `exit status 1`."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


def wait_ready(child: ChildProcess, timeout_s: float = READY_TIMEOUT_S) -> ChildProcess:
    """Block until the child prints its ready line; RuntimeError with its log if it dies."""
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in child.proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True, name=f"{child.name}-stdout").start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            continue
        if line is None:
            break
        if line.startswith(READY_LINE):
            child.fields = dict(part.split("=", 1) for part in line.split()[1:])
            return child
    child.stop(timeout_s=5)
    with open(child.log_path) as f:
        tail = f.read()[-3000:]
    raise RuntimeError(f"{child.name} did not become ready; the end of its log:\n{tail}")
