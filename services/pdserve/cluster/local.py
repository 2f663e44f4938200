"""A whole pdserve cluster on this machine: Redis, workers and routers, as processes.

`pdserve up` runs one for people; benchmarks run several shapes side by side.
Stopping it stops every child (SIGTERM, then SIGKILL) and the private Redis. With
`supervise`, a child that dies is started again on its ports (cluster/supervisor.py).

With `tls_dir` every child speaks mTLS with its role's certificate from that directory
(made there by `cluster/certs.py` when it is empty), the router's public port is TLS, and
the cluster's own calls (the registry wait, `tls` for load probes) go over TLS too. The
private Redis stays plaintext on loopback.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pdserve.api.v1 import router_pb2, router_pb2_grpc
from pdserve.cluster.certs import Issued, ensure_role_certs
from pdserve.cluster.processes import (
    ChildProcess,
    router_args,
    service_env,
    spawn,
    wait_ready,
    worker_args,
)
from pdserve.cluster.supervisor import Backoff, RedisChild, Supervisor
from pdserve.core.tls_config import Role, TlsConfig
from pdserve.state.redis_server import REDIS_URL_ENV, free_port, redis_url

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
    # with --api-key-file among router_args: a key of that file, for the cluster's own calls
    api_key: str | None = None
    on_progress: Callable[[str], None] = lambda message: None
    num_routers: int = 1  # routers on one Redis: the others take over a dead one's clients
    # restart a child that dies, on its ports (one on_progress line each time); the
    # private Redis too (started empty, as a restarted Redis pod is)
    supervise: bool = False
    backoff: Backoff = field(default_factory=Backoff)
    # mTLS between the children, TLS on the router's port: a certificate per role from
    # here (a missing or empty directory gets a new CA and set: `pdserve certs`)
    tls_dir: Path | None = None
    certs: dict[Role, Issued] = field(default_factory=dict)  # by role, once started
    children: list[ChildProcess] = field(default_factory=list)
    routers: list[ChildProcess] = field(default_factory=list)
    redis_server: RedisChild | None = None  # the private Redis, when supervised
    _supervisor: Supervisor | None = None
    _stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    @property
    def router(self) -> ChildProcess | None:
        """The first router (the one `router_port` names)."""
        return self.routers[0] if self.routers else None

    @property
    def router_address(self) -> str:
        return self.router.address

    @property
    def router_addresses(self) -> list[str]:
        return [router.address for router in self.routers]

    @property
    def workers(self) -> list[ChildProcess]:
        return [c for c in self.children if not any(c is router for router in self.routers)]

    @property
    def openai_url(self) -> str | None:
        """The router's OpenAI API base URL (`http://host:port/v1`), if it serves one."""
        address = self.router.http_address if self.router is not None else None
        return None if address is None else f"http://{address}/v1"

    @property
    def tls(self) -> TlsConfig | None:
        """The router's certificate, for the cluster's own calls to its workers (a load
        probe is a router's call: `cluster.load.wait_idle(..., tls=cluster.tls)`); None
        without TLS."""
        return self.certs[Role.ROUTER].config if self.certs else None

    @property
    def credentials(self) -> grpc.ChannelCredentials | None:
        """What a client of the router's public port needs (`Client(address,
        credentials=...)`): trust in the cluster's CA, no certificate of its own; None
        without TLS."""
        if not self.certs:
            return None
        return grpc.ssl_channel_credentials(self.certs[Role.ROUTER].ca.read_bytes())

    def _tls_settings(self, role: Role) -> dict[str, str]:
        """`role`'s --tls-cert/--tls-key/--tls-ca as config fields; none without TLS."""
        if not self.certs:
            return {}
        issued = self.certs[role]
        return {"tls_cert": str(issued.cert), "tls_key": str(issued.key), "tls_ca": str(issued.ca)}

    def start(self) -> LocalCluster:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        if self.tls_dir is not None:
            self.certs, made = ensure_role_certs(self.tls_dir)
            self.on_progress(f"certificates {'made' if made else 'taken'} in {self.tls_dir}")
        if self.with_router and self.redis is None:
            if self.supervise and not os.environ.get(REDIS_URL_ENV):
                self.redis_server = RedisChild(free_port()).start()
                self._stack.callback(self.redis_server.remove)
                self.redis = self.redis_server.url
            else:
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
        if self.with_router:
            for index in range(self.num_routers):
                self._start_router(index)
            for router in self.routers:
                self._wait_registered(router.address, len(workers))
        if self.supervise:
            self._watch(roles)

    def _start_router(self, index: int) -> None:
        first = index == 0
        args = self._router_args(
            self.router_port if first else 0, self._metrics_port, self.http_port if first else None
        )
        name = "router" if first else f"router-{index}"
        router = spawn(name, args, str(self.run_dir), env=service_env("router"))
        self.children.append(router)
        self.routers.append(router)
        wait_ready(router)
        self.on_progress(f"{name} ready at {router.address}")

    def _router_args(self, port: int, metrics_port: int | None, http_port: int | None):
        return router_args(
            self.model,
            self.redis,
            self.router_args,
            port=port,
            metrics_port=metrics_port,
            http_port=http_port,
            served_model_name=self.served_model_name,
            **self._tls_settings(Role.ROUTER),
        )

    def _worker_args(self, role: str, port: int, metrics_port: int | None) -> list[str]:
        return worker_args(
            role,
            self.model,
            self.worker_args,
            port=port,
            threads=self.threads,
            redis_url=self.redis,
            metrics_port=metrics_port,
            **self._tls_settings(Role(role)),
        )

    def _spawn_worker(self, role: str, index: int) -> ChildProcess:
        name = f"{'colocated' if role == 'both' else role}-{index}"
        self.on_progress(f"starting {name} (loading the model)")
        args = self._worker_args(role, 0, self._metrics_port)
        return spawn(name, args, str(self.run_dir), env=service_env(role))

    def _watch(self, roles: list[str]) -> None:
        """Restart any child that dies, on the ports its first ready line named."""
        self._supervisor = Supervisor(self.on_progress, self.backoff)
        if self.redis_server is not None:
            self._supervisor.watch_redis(self.redis_server)
        for child, role in zip(self.workers, roles, strict=True):
            port, metrics_port = _port(child.address), _port(child.metrics_address)
            self._supervisor.watch_process(
                child, lambda role=role, p=port, m=metrics_port: self._worker_args(role, p, m)
            )
        for router in self.routers:
            ports = (_port(router.address), _port(router.metrics_address))
            http = _port(router.http_address)
            self._supervisor.watch_process(
                router, lambda ports=ports, http=http: self._router_args(*ports, http)
            )
        self._supervisor.start()

    @property
    def _metrics_port(self) -> int | None:
        return 0 if self.metrics else None  # 0: a free port; None: no endpoint

    def _wait_registered(self, address: str, count: int) -> None:
        """Until the router at `address` sees every worker healthy in the registry."""
        deadline = time.monotonic() + REGISTRY_WAIT_S
        while time.monotonic() < deadline:
            healthy = num_healthy_workers(
                address, api_key=self.api_key, credentials=self.credentials
            )
            if healthy >= count:
                return
            time.sleep(0.1)
        raise RuntimeError(f"the router did not see all {count} workers in {REGISTRY_WAIT_S} s")

    def wait_recovered(self, timeout_s: float = REGISTRY_WAIT_S) -> None:
        """Until every router lists every worker healthy again: after a fault, with a
        restarted router or Redis still on its way back. RuntimeError past `timeout_s`."""
        deadline, last = time.monotonic() + timeout_s, "no answer yet"
        while time.monotonic() < deadline:
            try:
                seen = [
                    num_healthy_workers(address, api_key=self.api_key, credentials=self.credentials)
                    for address in self.router_addresses
                ]
            except grpc.RpcError as exc:  # a router (or its Redis) not back yet
                last = f"{exc.code().name}: {exc.details()}"
            else:
                if all(healthy >= len(self.workers) for healthy in seen):
                    return
                last = f"the routers see {seen} of {len(self.workers)} workers"
            time.sleep(0.2)
        raise RuntimeError(f"the cluster did not recover in {timeout_s:.0f} s: {last}")

    def stop(self) -> None:
        """Routers first (no new work), then workers in parallel; then Redis. A
        supervised cluster stops restarting first."""
        if self._supervisor is not None:
            self._supervisor.stop()
        for router in self.routers:
            router.stop()
        workers = self.workers
        if workers:
            with ThreadPoolExecutor(max_workers=len(workers)) as pool:
                list(pool.map(ChildProcess.stop, workers))
        self.children.clear()
        self.routers.clear()
        self._stack.close()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def num_healthy_workers(
    router_address: str,
    *,
    api_key: str | None = None,
    credentials: grpc.ChannelCredentials | None = None,
) -> int:
    """How many workers the router at `router_address` lists as healthy (ListWorkers);
    `api_key` for a router with --api-key-file, `credentials` for one with TLS."""
    metadata = [("authorization", f"Bearer {api_key}")] if api_key else []
    with _channel(router_address, credentials) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        request = router_pb2.ListWorkersRequest()
        workers = stub.ListWorkers(request, timeout=5, metadata=metadata).workers
    return sum(worker.healthy for worker in workers)


def _channel(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.Channel:
    if credentials is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, credentials)


def _port(address: str | None) -> int | None:
    """The port of `host:port`; None for no address (no such endpoint)."""
    return None if address is None else int(address.rsplit(":", 1)[1])
