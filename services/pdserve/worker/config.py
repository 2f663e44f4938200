"""A worker process's configuration: one dataclass holding the engine's, the one home of
its defaults.

`pdserve serve` makes a flag of every field, the engine's included (`--block-size`), each
also read from its `PDSERVE_*` variable (`core/flags.py`). Durations are
seconds (floats), as everywhere in pdserve.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from pdserve.core.listen import check_bind, check_port
from pdserve.core.tls_config import TlsConfig
from pdserve.core.workers import ROLES
from pdserve.engine.config import EngineConfig
from pdserve.kv.transfer import DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_NUM_STREAMS
from pdserve.telemetry.logs import LogConfig
from pdserve.telemetry.metrics import MetricsConfig


@dataclass(slots=True)
class WorkerConfig:
    """Everything one worker process needs, validated once; `engine` is its engine's."""

    role: str = field(
        metadata={
            "help": "what this worker serves: prefill, decode or both (on one engine)",
            "positional": True,
            "choices": ROLES,
        }
    )
    engine: EngineConfig  # the model, device, dtype, KV blocks and batching
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=0, metadata={"help": "port to listen on (0: a free one, printed)"})
    insecure: bool = field(
        default=False,
        metadata={"help": "serve plaintext gRPC on an address beyond loopback (no TLS)"},
    )
    reflection: bool = field(
        default=False,
        metadata={"help": "serve gRPC reflection (lists the internal services to any caller)"},
    )
    # mTLS: --tls-cert, --tls-key, --tls-ca (callers need a certificate of the CA)
    tls: TlsConfig = field(default_factory=TlsConfig)
    health_port: int | None = field(
        default=None,
        metadata={"help": "also serve grpc.health.v1 alone, plaintext, on this port (probes)"},
    )
    kv_port: int | None = field(
        default=None,
        metadata={
            "help": "decode/both: serve KVTransfer on this port of its own",
            "default_help": "the gRPC port",
        },
    )
    threads: int | None = field(
        default=None, metadata={"help": "torch intra-op threads (default: torch's choice)"}
    )
    lease_ttl_s: float = field(
        default=30.0,
        metadata={"help": "seconds a KV lease waits for its prefill", "flag": "lease-ttl"},
    )
    max_lease_ttl_s: float = field(
        default=120.0,
        metadata={
            "help": "the longest TTL an Admit or a renewal gets, whatever it asks (seconds)",
            "flag": "max-lease-ttl",
        },
    )
    max_lease_lifetime_s: float = field(
        default=600.0,
        metadata={
            "help": "seconds after its Admit that renewals may keep a KV lease open at most",
            "flag": "max-lease-lifetime",
        },
    )
    trust_prefill_kv: bool | None = field(
        default=None,
        metadata={
            "help": "share KV imported from prefill workers with later requests through the "
            "prefix cache (trust it as our own); off: only its own request reads it",
            "default_help": "on when TLS is on",
        },
    )
    # 1 measured best on 2 cores (docs/benchmarks/kv-transfer.md)
    kv_streams: int = field(
        default=DEFAULT_NUM_STREAMS, metadata={"help": "parallel KV push streams per request"}
    )
    max_message_bytes: int = field(
        default=DEFAULT_MAX_MESSAGE_BYTES, metadata={"help": "KV payload bytes per message"}
    )
    # every router multiplexes its calls to a worker on one connection: at most its
    # running requests' Prefill calls (--max-inflight, 256) and their Admits at once
    max_concurrent_streams: int = field(
        default=1024,
        metadata={"help": "calls at once on one connection to this worker (HTTP/2); more wait"},
    )
    max_decode_peers: int = field(
        default=64,
        metadata={
            "help": "decode workers a prefill worker keeps connections to (least recently "
            "used closed first)"
        },
    )
    grace_s: float = field(
        default=30.0,
        metadata={"help": "seconds running requests get to finish on SIGTERM", "flag": "grace"},
    )
    orphan_timeout_s: float = field(
        default=30.0,
        metadata={
            "help": "decode/both: seconds a request still attached when its Relay call ended "
            "(its router died) keeps running for the router taking it over to re-attach "
            "(0: abort it at once)",
            "flag": "orphan-timeout",
        },
    )
    redis_url: str | None = field(
        default=None,
        metadata={"help": "publish heartbeats to this worker registry", "env": ("REDIS_URL",)},
    )
    advertise_host: str | None = field(
        default=None, metadata={"help": "host others reach this worker at (default: --host)"}
    )
    worker_id: str = field(
        default_factory=lambda: uuid.uuid4().hex[:12],
        metadata={"help": "this worker's name in the registry and logs", "default_help": "random"},
    )
    # how it logs: --log-format, --log-level
    log: LogConfig = field(default_factory=LogConfig)
    # its Prometheus endpoint: --metrics-port (`pdserve up` gives every process one)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        check_port("port", self.port)
        check_bind(self.host, insecure=self.insecure, tls=self.tls.enabled)
        self._check_side_ports()
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {self.lease_ttl_s}")
        if self.max_lease_ttl_s <= 0:
            raise ValueError(f"max_lease_ttl_s must be > 0, got {self.max_lease_ttl_s}")
        if self.lease_ttl_s > self.max_lease_ttl_s:
            raise ValueError(
                f"lease_ttl_s ({self.lease_ttl_s}) must be <= max_lease_ttl_s "
                f"({self.max_lease_ttl_s})"
            )
        if self.max_lease_lifetime_s < self.max_lease_ttl_s:
            raise ValueError(
                f"max_lease_lifetime_s ({self.max_lease_lifetime_s}) must be >= "
                f"max_lease_ttl_s ({self.max_lease_ttl_s})"
            )
        positive = ("kv_streams", "max_message_bytes", "max_decode_peers", "max_concurrent_streams")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")
        if self.orphan_timeout_s < 0:
            raise ValueError(f"orphan_timeout_s must be >= 0, got {self.orphan_timeout_s}")

    @property
    def shares_imported_kv(self) -> bool:
        """Whether imported KV joins the prefix cache: --trust-prefill-kv if given, else
        whether TLS is on (then only authenticated prefill workers can push KV here)."""
        if self.trust_prefill_kv is not None:
            return self.trust_prefill_kv
        return self.tls.enabled

    def _check_side_ports(self) -> None:
        for name in ("health_port", "kv_port"):
            if getattr(self, name) is not None:
                check_port(name, getattr(self, name))
        if self.kv_port is not None and self.role == "prefill":
            raise ValueError("kv_port: a prefill worker serves no KV (decode and both do)")

    @property
    def model(self) -> str:
        """The model directory (the engine's)."""
        return self.engine.model
