"""The router process: public gRPC API over the worker pools, state in Redis.

It builds the router (`pdserve.router`) and mounts the front doors beside its own API
(`pdserve.gateways`: KServe on the same gRPC port, OpenAI over HTTP), which translate
their protocols to the router's `Frontend`; so it sits above both, and the router never
imports a gateway."""

from __future__ import annotations

import asyncio
import logging

from pdserve.api.v1 import router_pb2
from pdserve.core.checkpoint import model_fingerprint
from pdserve.core.errors import ModelLoadError
from pdserve.core.model_config import ModelConfig
from pdserve.core.sampling_params import RequestLimits
from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateways import kserve
from pdserve.gateways import openai as openai_gateway
from pdserve.router.admission import AdmissionQueue
from pdserve.router.auth.gate import open_gate
from pdserve.router.auth.interceptor import ApiKeyInterceptor
from pdserve.router.cancel_bus import CancelBus
from pdserve.router.config import DiscoveryKind, RouterConfig
from pdserve.router.discovery import (
    GrpcLoadProbe,
    KubernetesDiscovery,
    RedisDiscovery,
    StaticDiscovery,
)
from pdserve.router.discovery.verify import VerifiedRegistry
from pdserve.router.frontend import Frontend
from pdserve.router.handoff import ChannelPool
from pdserve.router.policy import MostFreeDecode, make_prefill_policy
from pdserve.router.runner import RequestRunner, RunnerConfig
from pdserve.router.service import RouterServicer
from pdserve.rpc import server as rpc_server
from pdserve.rpc.registration import Service
from pdserve.rpc.server import KEEPALIVE_OPTIONS, ServerOptions, SidePort
from pdserve.rpc.tls import ChannelTls, server_tls
from pdserve.state.conversations import ResponseStore
from pdserve.state.registry import WorkerRegistry
from pdserve.state.requests import RequestStore
from pdserve.telemetry import metrics, tracing
from pdserve.telemetry.metrics import ROUTER_ROLE, ProcessLabels, ProcessMetrics

__all__ = ["RouterConfig", "main", "serve"]
log = logging.getLogger(__name__)
ROUTER_SERVICE = router_pb2.DESCRIPTOR.services_by_name["Router"]
KSERVE_GENERATIONS = ("ModelInfer", "ModelStreamInfer")  # admitted under a key's limits
MAX_MESSAGE_BYTES = 16 << 20  # what the router sends at most (a whole answer, unstreamed)


def server_options(config: RouterConfig, limits: RequestLimits) -> ServerOptions:
    """Where and how the router serves: messages and streams per connection bounded."""
    return ServerOptions(
        role="router",
        host=config.host,
        port=config.port,
        grace_s=config.grace_s,
        grpc_options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", limits.max_message_bytes()),
            ("grpc.max_concurrent_streams", config.max_concurrent_streams),
        ],
        # TLS to clients, who need no certificate (they hold API keys); health alone,
        # plaintext, on --health-port for probes
        credentials=server_tls(config.tls, require_client_cert=False),
        side_ports=[] if config.health_port is None else [SidePort.health_only(config.health_port)],
    )


def make_discovery(config: RouterConfig, tls: ChannelTls | None = None):
    """The discovery `config` names; with mTLS (`tls`), load is polled over it and a
    registered worker is used only once checked (`discovery.verify`)."""
    tls = tls or ChannelTls()
    probe = GrpcLoadProbe(tls=tls) if tls.enabled else None
    if config.discovery is DiscoveryKind.STATIC:
        return StaticDiscovery(
            prefill=config.prefill, decode=config.decode, both=config.both, load_fn=probe
        )
    if config.discovery is DiscoveryKind.KUBERNETES:
        return KubernetesDiscovery(
            config.k8s_namespace,
            config.k8s_prefill_service,
            config.k8s_decode_service,
            load_fn=probe,
        )
    registry = WorkerRegistry(config.redis_url)
    if tls.enabled:
        return RedisDiscovery(VerifiedRegistry(registry, tls, _fingerprint(config.model)))
    return RedisDiscovery(registry)


class RouterApp:
    """The router's parts, built from its config; `rpc.server.serve` runs them."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.store = RequestStore(config.redis_url)
        self.tls = ChannelTls(config.tls)  # mTLS to the workers, when configured
        self.discovery = make_discovery(config, self.tls)
        self.channels = ChannelPool(options=KEEPALIVE_OPTIONS, tls=self.tls)
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
                deadlines=config.deadlines,
                breaker=config.breaker,
            ),
        )
        self.discovery = self.runner.discovery  # with each worker's circuit breaker
        self.frontend = _frontend(config, self.runner, self.store)
        self.gate = open_gate(config.api_key_file, config.redis_url)  # API keys, if any
        self.frontend.limiter = self.gate.limiter
        self.servicer = RouterServicer(
            self.frontend,
            discovery=self.discovery,
            fingerprint=_fingerprint(config.model),
        )
        self.kserve = kserve.KServeServicer(self.frontend, discovery=self.discovery)
        self.metrics: ProcessMetrics | None = None  # once started, with --metrics-port
        self.http: openai_gateway.HttpServer | None = None  # once started, with --http-port
        self.responses: ResponseStore | None = None  # the Responses API's, with the HTTP door

    @property
    def interceptors(self) -> list[ApiKeyInterceptor]:
        """API keys on every service but health's; none without a key file."""
        if not self.gate.enabled:
            return []
        generations = [f"/{ROUTER_SERVICE.full_name}/Generate"]
        generations += [f"/{kserve.SERVICE.full_name}/{m}" for m in KSERVE_GENERATIONS]
        return [ApiKeyInterceptor(self.gate, metered=generations)]

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
            self.metrics.watch_remote_hop(self.runner.config.colocation.hop)
            self.metrics.watch_estimate_errors(self.runner.config.colocation.errors)
            self.metrics.router.admission.watch(self.frontend.admission)
            fields["metrics"] = self.metrics.address
        if config.http_port is not None:
            registry = None if self.metrics is None else self.metrics.registry
            self.responses = _response_store(config, self.frontend.limits)
            self.http = await openai_gateway.HttpServer.start(
                self.frontend,
                config.host,
                config.http_port,
                model_dir=config.model,
                metrics=registry,
                grace_s=config.grace_s,
                gate=self.gate,
                response_store=self.responses,
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
        if self.responses is not None:
            await self.responses.close()
        if self.metrics is not None:
            self.metrics.close()
        await self.frontend.cancel_bus.close()
        self.frontend.close()
        await self.discovery.stop()
        await self.runner.close()
        await self.channels.close()
        await self.store.close()
        if self.gate.limiter is not None:
            await self.gate.limiter.close()


def _frontend(config: RouterConfig, runner, store) -> Frontend:
    model_config = ModelConfig.load(config.model)
    return Frontend(
        model_name=config.model_name,
        tokenizer=Tokenizer.load(config.model),
        model_config=model_config,
        max_model_len=model_config.max_position_embeddings,
        runner=runner,
        store=store,
        cancel_bus=CancelBus(config.redis_url),
        router_id=config.router_id,
        limits=config.request_limits(model_config.max_position_embeddings),
        admission=AdmissionQueue(config.admission),
    )


def _response_store(config: RouterConfig, limits: RequestLimits) -> ResponseStore:
    """Stored responses, each at most twice the largest body the door takes: the
    conversation (what one body could hold) and the response (its output)."""
    return ResponseStore(
        config.redis_url,
        ttl_s=config.response_ttl_s,
        max_record_bytes=2 * limits.max_json_body_bytes(),
    )


def _fingerprint(model_dir: str) -> str:
    try:
        return model_fingerprint(model_dir)
    except (ModelLoadError, OSError):  # a router may hold only the tokenizer and config
        return ""


async def serve(config: RouterConfig, stop: asyncio.Event | None = None) -> None:
    """Serve until `stop` is set or SIGTERM/SIGINT arrives, then drain and exit."""
    tracer_provider = tracing.configure(ROUTER_ROLE)  # from the OTEL_* variables; None: off
    try:
        app = RouterApp(config)
        options = server_options(config, app.frontend.limits)
        await rpc_server.serve(app, options, stop, interceptors=app.interceptors)
    finally:
        tracing.shutdown(tracer_provider)  # export the spans still queued


def main(config: RouterConfig) -> int:
    return rpc_server.run(
        serve(config), role="router", process_id=config.router_id, log_config=config.log
    )
