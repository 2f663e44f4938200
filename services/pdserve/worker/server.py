"""A worker process: grpc.aio server, health, reflection, graceful shutdown on SIGTERM."""

from __future__ import annotations

import asyncio
import logging

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.api.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    kv_transfer_pb2,
    prefill_pb2,
    prefill_pb2_grpc,
)
from pdserve.core.checkpoint import model_fingerprint
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kv.transfer import add_kv_transfer_servicer, channel_options, keep_freed_memory
from pdserve.rpc.server import KEEPALIVE_OPTIONS, announce_ready, configure_logging, stop_on_signals
from pdserve.state.registry import WorkerRegistry, heartbeat
from pdserve.worker.decode import DecodeServicer, KVTransferServicer
from pdserve.worker.prefill import PrefillServicer
from pdserve.worker.worker import Worker, WorkerConfig

log = logging.getLogger(__name__)
_SERVICES = {
    "prefill": [prefill_pb2.DESCRIPTOR.services_by_name["Prefill"]],
    "decode": [
        decode_pb2.DESCRIPTOR.services_by_name["Decode"],
        kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"],
    ],
}
_SERVICES["both"] = _SERVICES["prefill"] + _SERVICES["decode"]


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [*channel_options(max_message_bytes), *KEEPALIVE_OPTIONS]


def _load_engine(config: WorkerConfig) -> tuple[LLMEngine, str]:
    if config.threads:
        torch.set_num_threads(config.threads)
    device = config.device
    if device == "auto":  # chosen at start-up: the GPU when there is one
        device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = LLMEngine.from_pretrained(
        config.model,
        device=device,
        dtype=config.dtype,
        block_size=config.block_size,
        num_kv_blocks=config.num_kv_blocks,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
    )
    return engine, model_fingerprint(config.model)


async def serve(config: WorkerConfig, stop: asyncio.Event | None = None) -> None:
    """Serve until `stop` is set or SIGTERM/SIGINT arrives, then drain and exit."""
    stop = stop or asyncio.Event()
    keep_freed_memory()  # KV messages are MBs each: reuse their buffers, don't refault them
    server = grpc.aio.server(options=server_options(config.max_message_bytes))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [s.full_name for s in _SERVICES[config.role]]
    await _set_health(health_servicer, names, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection(
        [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )

    worker = Worker(config)
    decode = prefill = None
    if config.role in ("decode", "both"):
        decode = DecodeServicer(worker)
        decode_pb2_grpc.add_DecodeServicer_to_server(decode, server)
        add_kv_transfer_servicer(KVTransferServicer(worker, decode), server)
    if config.role in ("prefill", "both"):
        prefill = PrefillServicer(worker)
        prefill_pb2_grpc.add_PrefillServicer_to_server(prefill, server)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    await server.start()  # health answers NOT_SERVING while the model loads
    stop_on_signals(stop)
    engine, fingerprint = await asyncio.to_thread(_load_engine, config)
    worker.attach(engine, fingerprint)
    if decode is not None:
        decode.start()
    await _set_health(health_servicer, names, health_pb2.HealthCheckResponse.SERVING)
    heartbeats = _start_heartbeats(worker, port)
    announce_ready(
        role=config.role, address=f"{config.host}:{port}", blocks=engine.block_manager.num_blocks
    )
    await stop.wait()

    log.info("draining: no new requests; finishing the running ones")
    worker.draining = True
    if decode is not None:
        decode.wake_relays()  # each Relay call ends once its requests have
    if heartbeats is not None:  # leave the registry first: routers stop sending us work
        heartbeats[1].set()
        await heartbeats[0]
    await _set_health(health_servicer, names, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.stop(grace=config.grace_s)
    if prefill is not None:
        await prefill.close()
    if decode is not None:
        await decode.close()
    await worker.loop.stop()


def _start_heartbeats(worker: Worker, port: int):
    """Publish this worker to the Redis registry every second (when a URL is configured)."""
    if not worker.config.redis_url:
        return None
    registry = WorkerRegistry(worker.config.redis_url)
    stop = asyncio.Event()
    task = asyncio.create_task(heartbeat(registry, lambda: worker.info(port), 1.0, stop=stop))
    return task, stop


async def _set_health(servicer, names, status) -> None:
    for name in ["", *names]:
        await servicer.set(name, status)


def main(config: WorkerConfig) -> int:
    configure_logging(f"{config.role}[{config.worker_id}]")
    asyncio.run(serve(config))
    return 0
