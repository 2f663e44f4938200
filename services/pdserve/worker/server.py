"""A worker process: its services on the shared server skeleton (`rpc.server.serve`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import torch

from pdserve.core.checkpoint import model_fingerprint, served_name
from pdserve.engine.huge_pages import use_huge_pages
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kv.transfer import channel_options, keep_freed_memory
from pdserve.rpc import server as rpc_server
from pdserve.rpc.registration import Service
from pdserve.rpc.roles import RoleCheck
from pdserve.rpc.server import ServerOptions, SidePort
from pdserve.rpc.tls import server_tls
from pdserve.state.registry import WorkerRegistry, heartbeat
from pdserve.telemetry import metrics, tracing
from pdserve.telemetry.metrics import ProcessLabels, ProcessMetrics
from pdserve.worker.config import WorkerConfig
from pdserve.worker.services import KV_TRANSFER, WorkerServices
from pdserve.worker.worker import Worker

__all__ = ["WorkerConfig", "main", "serve"]
log = logging.getLogger(__name__)
HEARTBEAT_INTERVAL_S = 1.0


def _load_engine(config: WorkerConfig) -> tuple[LLMEngine, str]:
    if config.threads:
        torch.set_num_threads(config.threads)
    engine = config.engine
    log.info("engine on %s: %s weights and KV cache", engine.device, engine.dtype)
    return LLMEngine(engine), model_fingerprint(config.model)


class WorkerApp:
    """A worker's services, built from its config; `rpc.server.serve` runs them.

    The server (and its health service) starts before the model loads: `start` loads it,
    builds the Worker and opens the services.
    """

    def __init__(self, config: WorkerConfig):
        self.config = config
        self.gates = WorkerServices(config.role)
        self.side_ports = side_ports(config)  # for `server_options`: --kv-port, --health-port
        self.worker: Worker | None = None  # once the model is loaded
        self._heartbeats: tuple[asyncio.Task, asyncio.Event] | None = None
        self.metrics: ProcessMetrics | None = None  # once started, with --metrics-port

    @property
    def services(self) -> list[Service]:
        return self.gates.services

    async def start(self, port: int) -> dict[str, object]:
        config = self.config
        engine, fingerprint = await asyncio.to_thread(_load_engine, config)
        labels = ProcessLabels(served_name(config.model), config.role, config.worker_id)
        self.metrics = metrics.serve(labels, config.host, config.metrics)
        metrics_port = self.metrics.port if self.metrics is not None else None
        kv_port = next((side.bound_port for side in self.side_ports if side.name == "kv"), None)
        self.worker = Worker(
            config, engine, fingerprint, port, metrics_port=metrics_port, kv_port=kv_port
        )
        self.worker.start()
        self.gates.open(self.worker)
        self._heartbeats = _start_heartbeats(self.worker)
        if self.metrics is None:
            return {"blocks": engine.block_manager.num_blocks}
        orphans = self.gates.decode.orphans if self.gates.decode is not None else None
        self.metrics.watch_worker(self.worker, orphans)
        return {"blocks": engine.block_manager.num_blocks, "metrics": self.metrics.address}

    async def drain(self) -> None:
        self.worker.draining = True
        self.gates.drain()
        if self._heartbeats is not None:  # leave the registry first: routers stop sending us work
            task, stop = self._heartbeats
            stop.set()
            await task

    async def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        await self.gates.close()
        await self.worker.close()


def _start_heartbeats(worker: Worker) -> tuple[asyncio.Task, asyncio.Event] | None:
    """Publish this worker to the Redis registry every second (when a URL is configured)."""
    if not worker.config.redis_url:
        return None
    registry = WorkerRegistry(worker.config.redis_url)
    stop = asyncio.Event()
    task = asyncio.create_task(heartbeat(registry, worker.info, HEARTBEAT_INTERVAL_S, stop=stop))
    return task, stop


def side_ports(config: WorkerConfig) -> list[SidePort]:
    """The ports beside the gRPC one: KVTransfer alone on --kv-port (its own port, for a
    NetworkPolicy to tell the KV plane apart) and plaintext health on --health-port."""
    ports = []
    if config.kv_port is not None:
        ports.append(SidePort("kv", config.kv_port, frozenset({KV_TRANSFER.full_name})))
    if config.health_port is not None:
        ports.append(SidePort.health_only(config.health_port))
    return ports


def server_options(config: WorkerConfig, side_ports: Sequence[SidePort] = ()) -> ServerOptions:
    """How a worker serves: KV-sized messages; reflection only with --reflection (its
    services are internal: no caller needs them listed); mTLS with a client certificate
    required, when configured; on `side_ports` too (its app's)."""
    return ServerOptions(
        role=config.role,
        host=config.host,
        port=config.port,
        grace_s=config.grace_s,
        grpc_options=[
            *channel_options(config.max_message_bytes),
            ("grpc.max_concurrent_streams", config.max_concurrent_streams),
        ],
        reflection=config.reflection,
        credentials=server_tls(config.tls, require_client_cert=True),
        side_ports=side_ports,
    )


async def serve(config: WorkerConfig, stop: asyncio.Event | None = None) -> None:
    """Serve until `stop` is set or SIGTERM/SIGINT arrives, then drain and exit."""
    keep_freed_memory()  # KV messages are MBs each: reuse their buffers, don't refault them
    # before the model's first tensor: torch decides once, at its first allocation
    log.info("huge pages for weights and KV: %s", "on" if use_huge_pages() else "off")
    app = WorkerApp(config)
    options = server_options(config, app.side_ports)
    # with mTLS, each call's certificate role is checked against rpc/roles.py's table
    interceptors = [RoleCheck()] if config.tls.enabled else []
    tracer_provider = tracing.configure(config.role)  # from the OTEL_* variables; None: off
    try:
        await rpc_server.serve(app, options, stop, interceptors=interceptors)
    finally:
        tracing.shutdown(tracer_provider)  # export the spans still queued


def main(config: WorkerConfig) -> int:
    return rpc_server.run(
        serve(config), role=config.role, process_id=config.worker_id, log_config=config.log
    )
