"""The router process: public gRPC API over the worker pools, state in Redis."""

from __future__ import annotations

import asyncio
import logging

from pdserve.api.v1 import router_pb2
from pdserve.core.checkpoint import model_fingerprint
from pdserve.core.errors import ModelLoadError
from pdserve.core.model_config import ModelConfig
from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateways import kserve
from pdserve.gateways import openai as openai_gateway
from pdserve.router.cancel_bus import CancelBus
from pdserve.router.config import DiscoveryKind, RouterConfig
from pdserve.router.discovery import KubernetesDiscovery, RedisDiscovery, StaticDiscovery
from pdserve.router.frontend import Frontend
from pdserve.router.handoff import ChannelPool
from pdserve.router.policy import MostFreeDecode, make_prefill_policy
from pdserve.router.runner import RequestRunner, RunnerConfig
from pdserve.router.service import RouterServicer
from pdserve.rpc import server as rpc_server
from pdserve.rpc.registration import Service
from pdserve.rpc.server import KEEPALIVE_OPTIONS, ServerOptions, message_size_options
from pdserve.state.registry import WorkerRegistry
from pdserve.state.requests import RequestStore
from pdserve.telemetry import metrics, tracing
from pdserve.telemetry.metrics import ROUTER_ROLE, ProcessLabels, ProcessMetrics

__all__ = ["RouterConfig", "main", "serve"]
log = logging.getLogger(__name__)
ROUTER_SERVICE = router_pb2.DESCRIPTOR.services_by_name["Router"]
MAX_MESSAGE_BYTES = 16 << 20


def make_discovery(config: RouterConfig):
    if config.discovery is DiscoveryKind.STATIC:
        return StaticDiscovery(prefill=config.prefill, decode=config.decode, both=config.both)
    if config.discovery is DiscoveryKind.KUBERNETES:
        return KubernetesDiscovery(
            config.k8s_namespace, config.k8s_prefill_service, config.k8s_decode_service
        )
    return RedisDiscovery(WorkerRegistry(config.redis_url))


class RouterApp:
    """The router's parts, built from its config; `rpc.server.serve` runs them."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.store = RequestStore(config.redis_url)
        self.discovery = make_discovery(config)
        self.channels = ChannelPool(options=KEEPALIVE_OPTIONS)
        self.runner = RequestRunner(
            self.discovery,
            make_prefill_policy(config.prefill_policy),
            MostFreeDecode(),
            self.channels,
            RunnerConfig(
                lease_ttl_s=config.lease_ttl_s,
                max_attempts=config.max_attempts,
                stream_interval=config.stream_interval,
                colocation=config.colocation,
                stream_progress_timeout_s=config.stream_progress_timeout_s,
            ),
        )
        self.frontend = _frontend(config, self.runner, self.store)
        self.servicer = RouterServicer(
            self.frontend,
            discovery=self.discovery,
            fingerprint=_fingerprint(config.model),
        )
        self.kserve = kserve.KServeServicer(self.frontend, discovery=self.discovery)
        self.metrics: ProcessMetrics | None = None  # once started, with --metrics-port
        self.http: openai_gateway.HttpServer | None = None  # once started, with --http-port

    @property
    def services(self) -> list[Service]:
        return [Service(self.servicer, ROUTER_SERVICE), Service(self.kserve, kserve.SERVICE)]

    async def start(self, port: int) -> dict[str, object]:
        await self.store.start()
        await self.discovery.start()
        await self.frontend.cancel_bus.start(self.frontend.cancel_local)
        config = self.config
        labels = ProcessLabels(config.model_name, ROUTER_ROLE, config.router_id)
        self.metrics = metrics.serve(labels, config.host, config.metrics)
        fields: dict[str, object] = {"id": config.router_id}
        if self.metrics is not None:
            self.metrics.watch_relays(self.runner.handoff.relays)
            fields["metrics"] = self.metrics.address
        if config.http_port is not None:
            registry = None if self.metrics is None else self.metrics.registry
            self.http = await openai_gateway.HttpServer.start(
                self.frontend,
                config.host,
                config.http_port,
                model_dir=config.model,
                metrics=registry,
                grace_s=config.grace_s,
            )
            fields["http"] = self.http.address
        return fields

    async def drain(self) -> None:
        """No new HTTP connections (running requests go on); workers are not told."""
        if self.http is not None:
            self.http.stop_accepting()

    async def close(self) -> None:
        if self.http is not None:
            await self.http.close()
        if self.metrics is not None:
            self.metrics.close()
        await self.frontend.cancel_bus.close()
        await self.discovery.stop()
        await self.runner.close()
        await self.channels.close()
        await self.store.close()


def _frontend(config: RouterConfig, runner, store) -> Frontend:
    model_config = ModelConfig.from_dir(config.model)
    return Frontend(
        model_name=config.model_name,
        tokenizer=Tokenizer.from_dir(config.model),
        model_config=model_config,
        max_model_len=model_config.max_position_embeddings,
        runner=runner,
        store=store,
        cancel_bus=CancelBus(config.redis_url),
        router_id=config.router_id,
        max_inflight=config.max_inflight,
    )


def _fingerprint(model_dir: str) -> str:
    try:
        return model_fingerprint(model_dir)
    except (ModelLoadError, OSError):  # a router may hold only the tokenizer and config
        return ""


async def serve(config: RouterConfig, stop: asyncio.Event | None = None) -> None:
    """Serve until `stop` is set or SIGTERM/SIGINT arrives, then drain and exit."""
    options = ServerOptions(
        role="router",
        host=config.host,
        port=config.port,
        grace_s=config.grace_s,
        grpc_options=message_size_options(MAX_MESSAGE_BYTES),
    )
    tracer_provider = tracing.configure(ROUTER_ROLE)  # from the OTEL_* variables; None: off
    try:
        await rpc_server.serve(RouterApp(config), options, stop)
    finally:
        tracing.shutdown(tracer_provider)  # export the spans still queued


def main(config: RouterConfig) -> int:
    return rpc_server.run(
        serve(config), role="router", process_id=config.router_id, log_config=config.log
    )
