"""The router process: public gRPC API over the worker pools, state in Redis."""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.api.v1 import router_pb2
from pdserve.core.checkpoint import model_fingerprint
from pdserve.core.errors import ModelLoadError
from pdserve.core.model_config import ModelConfig
from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.cancel_bus import CancelBus
from pdserve.router.discovery import KubernetesDiscovery, RedisDiscovery, StaticDiscovery
from pdserve.router.policy import ColocationRule, MostFreeDecode, make_prefill_policy
from pdserve.router.runner import ChannelPool, RequestRunner, RunnerConfig
from pdserve.router.service import RouterServicer
from pdserve.rpc.registration import add_servicer
from pdserve.rpc.server import KEEPALIVE_OPTIONS, announce_ready, configure_logging, stop_on_signals
from pdserve.state.registry import WorkerRegistry
from pdserve.state.requests import RequestStore

log = logging.getLogger(__name__)
SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name
MAX_MESSAGE_BYTES = 16 << 20


@dataclass(slots=True)
class RouterConfig:
    model: str  # the model directory: tokenizer and config (weights optional)
    redis_url: str
    host: str = "127.0.0.1"
    port: int = 0
    discovery: str = "redis"  # redis | static | kubernetes
    prefill: list[str] = field(default_factory=list)  # static discovery
    decode: list[str] = field(default_factory=list)
    both: list[str] = field(default_factory=list)
    k8s_namespace: str = "default"
    k8s_prefill_service: str = "pdserve-prefill"
    k8s_decode_service: str = "pdserve-decode"
    prefill_policy: str = "cache_aware"
    colocate: bool = False  # conditional disaggregation (off by default)
    colocate_max_prompt_tokens: int = 256
    max_inflight: int = 256
    lease_ttl_ms: int = 10_000
    max_attempts: int = 3
    stream_interval: int = 1  # tokens per decode message (see decode.proto StreamRequest)
    grace_s: float = 30.0
    router_id: str = field(default_factory=lambda: "router-" + uuid.uuid4().hex[:8])

    def __post_init__(self) -> None:
        if self.discovery not in ("redis", "static", "kubernetes"):
            raise ValueError(f"discovery must be redis, static or kubernetes: {self.discovery!r}")
        if self.discovery == "static" and not ((self.prefill and self.decode) or self.both):
            raise ValueError("static discovery needs --prefill and --decode (or --both) addresses")
        if self.max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {self.max_inflight}")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")


def make_discovery(config: RouterConfig):
    if config.discovery == "static":
        return StaticDiscovery(prefill=config.prefill, decode=config.decode, both=config.both)
    if config.discovery == "kubernetes":
        return KubernetesDiscovery(
            config.k8s_namespace, config.k8s_prefill_service, config.k8s_decode_service
        )
    return RedisDiscovery(WorkerRegistry(config.redis_url))


async def serve(config: RouterConfig, stop: asyncio.Event | None = None) -> None:
    stop = stop or asyncio.Event()
    tokenizer = Tokenizer.from_dir(config.model)
    model_config = ModelConfig.from_dir(config.model)
    try:
        fingerprint = model_fingerprint(config.model)
    except (ModelLoadError, OSError):  # a router may hold only the tokenizer and config
        fingerprint = ""
    store = RequestStore(config.redis_url)
    await store.start()
    discovery = make_discovery(config)
    await discovery.start()
    channels = ChannelPool(options=KEEPALIVE_OPTIONS)
    runner = RequestRunner(
        discovery,
        make_prefill_policy(config.prefill_policy),
        MostFreeDecode(),
        channels,
        RunnerConfig(
            block_size=16,
            lease_ttl_ms=config.lease_ttl_ms,
            max_attempts=config.max_attempts,
            stream_interval=config.stream_interval,
            colocation=ColocationRule(
                enabled=config.colocate, max_prompt_tokens=config.colocate_max_prompt_tokens
            ),
        ),
    )
    servicer = RouterServicer(
        model_dir=config.model,
        tokenizer=tokenizer,
        model_config=model_config,
        fingerprint=fingerprint,
        max_model_len=model_config.max_position_embeddings,
        runner=runner,
        store=store,
        discovery=discovery,
        cancel_bus=CancelBus(config.redis_url),
        router_id=config.router_id,
        max_inflight=config.max_inflight,
    )
    await servicer.cancel_bus.start(servicer.cancel_local)

    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            *KEEPALIVE_OPTIONS,
        ]
    )
    add_servicer(servicer, router_pb2.DESCRIPTOR.services_by_name["Router"], server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    stop_on_signals(stop)
    announce_ready(role="router", address=f"{config.host}:{port}", id=config.router_id)
    await stop.wait()

    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.stop(grace=config.grace_s)
    await servicer.cancel_bus.close()
    await discovery.stop()
    await runner.relays.close()
    await channels.close()
    await store.close()


def main(config: RouterConfig) -> int:
    configure_logging(config.router_id)
    asyncio.run(serve(config))
    return 0
