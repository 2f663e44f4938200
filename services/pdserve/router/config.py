"""The router process's configuration: one dataclass, the one home of its defaults.

`pdserve router` makes a flag of every field (`core/flags.py`), each also read
from its `PDSERVE_*` variable. Durations are seconds (floats), as everywhere in pdserve.
"""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field

from pdserve.core.listen import check_bind, check_port
from pdserve.router.handoff import DEFAULT_LEASE_TTL_S
from pdserve.router.policy import DEFAULT_PREFILL_POLICY, PREFILL_POLICIES, ColocationRule
from pdserve.router.relay import DEFAULT_STREAM_PROGRESS_TIMEOUT_S
from pdserve.telemetry.logs import LogConfig
from pdserve.telemetry.metrics import MetricsConfig
from pdserve.telemetry.request import served_model_name


class DiscoveryKind(enum.StrEnum):
    """Where the router learns its workers from."""

    REDIS = "redis"  # the registry workers publish their heartbeats to
    STATIC = "static"  # fixed address lists (--prefill, --decode, --both)
    KUBERNETES = "kubernetes"  # the EndpointSlices of the workers' Services


def _addresses(help_text: str):
    return field(default_factory=list, metadata={"help": help_text, "metavar": "ADDR,..."})


@dataclass(slots=True)
class RouterConfig:
    """Everything one router process needs, validated once."""

    model: str = field(
        metadata={"help": "model directory (tokenizer and config; weights optional)"}
    )
    redis_url: str = field(
        metadata={"help": "Redis: request state and the worker registry", "env": ("REDIS_URL",)}
    )
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=0, metadata={"help": "port to listen on (0: a free one, printed)"})
    insecure: bool = field(
        default=False,
        metadata={"help": "serve plaintext gRPC on an address beyond loopback (no TLS)"},
    )
    http_port: int | None = field(
        default=None,
        metadata={"help": "also serve the OpenAI-compatible HTTP API on this port (0: a free one)"},
    )
    served_model_name: str | None = field(
        default=None,
        metadata={
            "help": "the model's name in the OpenAI and KServe APIs, metrics and spans",
            "default_help": "the model directory's name",
        },
    )
    discovery: DiscoveryKind = field(
        default=DiscoveryKind.REDIS, metadata={"help": "where the router finds its workers"}
    )
    prefill: list[str] = _addresses("static discovery: prefill worker addresses")
    decode: list[str] = _addresses("static discovery: decode worker addresses")
    both: list[str] = _addresses("static discovery: colocated worker addresses")
    k8s_namespace: str = field(
        default="default", metadata={"help": "kubernetes discovery: the workers' namespace"}
    )
    k8s_prefill_service: str = field(
        default="pdserve-prefill", metadata={"help": "kubernetes discovery: the prefill Service"}
    )
    k8s_decode_service: str = field(
        default="pdserve-decode", metadata={"help": "kubernetes discovery: the decode Service"}
    )
    prefill_policy: str = field(
        default=DEFAULT_PREFILL_POLICY,
        metadata={"help": "how a prefill worker is chosen", "choices": sorted(PREFILL_POLICIES)},
    )
    colocate_below: int = field(
        default=0,
        metadata={
            "help": "prefill prompts shorter than this on the decode worker (0: off)",
            "metavar": "TOKENS",
        },
    )
    max_inflight: int = field(
        default=256, metadata={"help": "requests this router runs at once; more are refused"}
    )
    lease_ttl_s: float = field(
        default=DEFAULT_LEASE_TTL_S,
        metadata={
            "help": "seconds a decode worker holds a request's blocks for its prefill's KV",
            "flag": "lease-ttl",
        },
    )
    max_attempts: int = field(
        default=3, metadata={"help": "tries per request (the first included) across workers"}
    )
    stream_interval: int = field(
        default=1,
        metadata={
            "help": "decode workers send tokens once this many wait (the first and last at "
            "once); more: less router CPU per token, burstier streams",
            "metavar": "TOKENS",
        },
    )
    stream_progress_timeout_s: float = field(
        default=DEFAULT_STREAM_PROGRESS_TIMEOUT_S,
        metadata={
            "help": "seconds a decode worker may send nothing while a request waits for its "
            "tokens; then it counts as dead and its requests retry elsewhere",
            "flag": "stream-progress-timeout",
        },
    )
    grace_s: float = field(
        default=30.0,
        metadata={"help": "seconds running requests get to finish on SIGTERM", "flag": "grace"},
    )
    router_id: str = field(
        default_factory=lambda: "router-" + uuid.uuid4().hex[:8],
        metadata={
            "help": "this router's name in logs and request records",
            "default_help": "router-<random>",
        },
    )
    # how it logs: --log-format, --log-level
    log: LogConfig = field(default_factory=LogConfig)
    # its Prometheus endpoint: --metrics-port (`pdserve up` gives every process one)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self) -> None:
        self.discovery = DiscoveryKind(self.discovery)
        if self.discovery is DiscoveryKind.STATIC and not (
            (self.prefill and self.decode) or self.both
        ):
            raise ValueError("static discovery needs --prefill and --decode (or --both) addresses")
        if self.prefill_policy not in PREFILL_POLICIES:
            choices = ", ".join(sorted(PREFILL_POLICIES))
            raise ValueError(
                f"prefill_policy must be one of {choices}, got {self.prefill_policy!r}"
            )
        check_port("port", self.port)
        if self.http_port is not None:
            check_port("http_port", self.http_port)
        check_bind(self.host, insecure=self.insecure)
        for name in ("max_inflight", "max_attempts", "stream_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.colocate_below < 0:
            raise ValueError(f"colocate_below must be >= 0, got {self.colocate_below}")
        if self.lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {self.lease_ttl_s}")
        if self.stream_progress_timeout_s <= 0:
            raise ValueError(
                f"stream_progress_timeout_s must be > 0, got {self.stream_progress_timeout_s}"
            )
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")

    @property
    def model_name(self) -> str:
        """The name clients ask for: --served-model-name, else the model directory's name."""
        return self.served_model_name or served_model_name(self.model)

    @property
    def colocation(self) -> ColocationRule:
        """When to prefill on the decode worker: prompts under `colocate_below` tokens."""
        return ColocationRule(
            enabled=self.colocate_below > 0, max_prompt_tokens=max(self.colocate_below, 1)
        )
