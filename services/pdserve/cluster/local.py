"""A whole pdserve cluster on this machine: Redis, workers and a router, as processes.

`pdserve up` runs one for people; benchmarks run several shapes side by side.
Stopping it stops every child (SIGTERM, then SIGKILL) and the private Redis.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pdserve.api.v1 import router_pb2, router_pb2_grpc
from pdserve.cluster.processes import (
    ChildProcess,
    router_args,
    service_env,
    spawn,
    wait_ready,
    worker_args,
)
from pdserve.state.redis_server import redis_url

REGISTRY_WAIT_S = 30.0


@dataclass(frozen=True, slots=True)
class ClusterShape:
    """How many workers of each role: `prefill:1,decode:1` or `colocated:2`."""

    prefill: int = 1
    decode: int = 1
    colocated: int = 0

    def __post_init__(self) -> None:
        if min(self.prefill, self.decode, self.colocated) < 0:
            raise ValueError("worker counts must be >= 0")
        disaggregated = self.prefill > 0 and self.decode > 0
        if not disaggregated and self.colocated == 0:
            raise ValueError("a cluster needs prefill and decode workers, or colocated ones")
        if (self.prefill > 0) != (self.decode > 0):
            raise ValueError("prefill and decode workers come together (or use colocated)")

    @classmethod
    def parse(cls, text: str) -> ClusterShape:
        counts = {}
        for part in text.split(","):
            role, _, count = part.partition(":")
            if role not in ("prefill", "decode", "colocated") or not count.isdigit():
                raise ValueError(f"bad cluster shape {text!r}: use e.g. prefill:1,decode:1")
            counts[role] = int(count)
        return cls(counts.get("prefill", 0), counts.get("decode", 0), counts.get("colocated", 0))

    def __str__(self) -> str:
        parts = [f"prefill:{self.prefill}", f"decode:{self.decode}"] if self.prefill else []
        return ",".join(parts + ([f"colocated:{self.colocated}"] if self.colocated else []))

    @property
    def num_workers(self) -> int:
        return self.prefill + self.decode + self.colocated


@dataclass
class LocalCluster:
    model: str
    shape: ClusterShape
    run_dir: Path
    threads: int = 1  # torch threads per worker: shapes compared get the same cores
    router_port: int = 0
    worker_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    redis: str | None = None  # REDIS_URL; None: a private server for this cluster
    # False: the workers alone, for benchmarks that call them directly or start routers
    # of their own; no Redis is started for them (they publish heartbeats to `redis` if set)
    with_router: bool = True
    # every process serves GET /metrics on a free port (its ready line says which)
    metrics: bool = False
    # the router's OpenAI-compatible HTTP API on this port (0: a free one); None: off
    http_port: int | None = None
    served_model_name: str | None = None  # the model's name in that API; None: its directory's
    on_progress: Callable[[str], None] = lambda message: None
    children: list[ChildProcess] = field(default_factory=list)
    router: ChildProcess | None = None
    _stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    @property
    def router_address(self) -> str:
        return self.router.address

    @property
    def openai_url(self) -> str | None:
        """The router's OpenAI API base URL (`http://host:port/v1`), if it serves one."""
        address = self.router.http_address if self.router is not None else None
        return None if address is None else f"http://{address}/v1"

    def start(self) -> LocalCluster:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        if self.with_router and self.redis is None:
            self.redis = self._stack.enter_context(redis_url())
        if self.redis is not None:
            self.on_progress(f"redis at {self.redis}")
        roles = (
            ["prefill"] * self.shape.prefill
            + ["decode"] * self.shape.decode
            + ["both"] * self.shape.colocated
        )
        workers = [self._spawn_worker(role, i) for i, role in enumerate(roles)]
        self.children.extend(workers)
        with ThreadPoolExecutor(max_workers=len(workers)) as pool:
            for child in pool.map(wait_ready, workers):
                self.on_progress(f"{child.name} ready at {child.address}")
        if not self.with_router:
            return
        args = router_args(
            self.model,
            self.redis,
            self.router_args,
            port=self.router_port,
            metrics_port=self._metrics_port,
            http_port=self.http_port,
            served_model_name=self.served_model_name,
        )
        self.router = spawn("router", args, str(self.run_dir), env=service_env("router"))
        self.children.append(self.router)
        wait_ready(self.router)
        self.on_progress(f"router ready at {self.router.address}")
        self._wait_registered(len(workers))

    def _spawn_worker(self, role: str, index: int) -> ChildProcess:
        args = worker_args(
            role,
            self.model,
            self.worker_args,
            port=0,
            threads=self.threads,
            redis_url=self.redis,
            metrics_port=self._metrics_port,
        )
        name = f"{'colocated' if role == 'both' else role}-{index}"
        self.on_progress(f"starting {name} (loading the model)")
        return spawn(name, args, str(self.run_dir), env=service_env(role))

    @property
    def _metrics_port(self) -> int | None:
        return 0 if self.metrics else None  # 0: a free port; None: no endpoint

    def _wait_registered(self, count: int) -> None:
        """Until the router sees every worker healthy in the registry."""
        deadline = time.monotonic() + REGISTRY_WAIT_S
        with grpc.insecure_channel(self.router.address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            while time.monotonic() < deadline:
                workers = stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=5).workers
                if sum(w.healthy for w in workers) >= count:
                    return
                time.sleep(0.1)
        raise RuntimeError(f"the router did not see all {count} workers in {REGISTRY_WAIT_S} s")

    def stop(self) -> None:
        """Router first (no new work), then workers in parallel; then Redis."""
        if self.router is not None:
            self.router.stop()
        workers = [c for c in self.children if c is not self.router]
        if workers:
            with ThreadPoolExecutor(max_workers=len(workers)) as pool:
                list(pool.map(ChildProcess.stop, workers))
        self.children.clear()
        self._stack.close()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
