"""The router process's configuration: one dataclass, the one home of its defaults.

`pdserve router` makes a flag of every field (`core/flags.py`), each also read
from its `PDSERVE_*` variable. Durations are seconds (floats), as everywhere in pdserve.
"""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field

from pdserve.core.checkpoint import served_name
from pdserve.core.listen import check_bind, check_port
from pdserve.core.sampling_params import (
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
    PROMPT_BYTES_PER_TOKEN,
    RequestLimits,
)
from pdserve.core.tls_config import TlsConfig
from pdserve.router.admission import AdmissionLimits
from pdserve.router.auth.keys import KeyFileError, read_key_file
from pdserve.router.breaker import BreakerSettings, WorkerFailureConfig
from pdserve.router.colocation import LiveColocation
from pdserve.router.disaggregation import (
    DEFAULT_TPOT_TARGET_S,
    DEFAULT_TTFT_TARGET_S,
    PlacementMode,
    Targets,
)
from pdserve.router.handoff import DEFAULT_LEASE_TTL_S, Deadlines
from pdserve.router.policy import DEFAULT_PREFILL_POLICY, PREFILL_POLICIES, ColocationRule
from pdserve.router.relay import DEFAULT_STREAM_PROGRESS_TIMEOUT_S
from pdserve.telemetry.logs import LogConfig
from pdserve.telemetry.metrics import MetricsConfig

# Requests waiting for a running slot: four times the default --max-inflight, so a burst
# of 5x what runs waits instead of being refused; each holds its prompt (at most
# --max-prompt-bytes) while it waits.
DEFAULT_MAX_QUEUED = 1024
DEFAULT_QUEUE_TIMEOUT_S = 10.0  # a TTFT past which most clients would rather retry elsewhere
# OpenAI's API and TGI allow 4 stop strings; vLLM any number. 16 serves clients written
# for either, and bounds the matcher's automaton at 16 x 256 characters per request.
DEFAULT_MAX_STOP_STRINGS = 16
DEFAULT_MAX_STOP_LENGTH = 256
# How long a stored response of the Responses API (and its conversation) is kept: a
# conversation idle for a day is given up.
DEFAULT_RESPONSE_TTL_S = 24 * 3600.0
# HTTP/2 streams one client connection may hold open: a client multiplexes every call on
# one connection, so this is above the running limit plus the queue (256 + 1024).
DEFAULT_MAX_CONCURRENT_STREAMS = 2048


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
        metadata={
            "help": "model: a Hugging Face directory (tokenizer and config; weights optional) "
            "or a GGUF file"
        }
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
    # TLS: --tls-cert, --tls-key, --tls-ca (mTLS to the workers, TLS to clients)
    tls: TlsConfig = field(default_factory=TlsConfig)
    health_port: int | None = field(
        default=None,
        metadata={"help": "also serve grpc.health.v1 alone, plaintext, on this port (probes)"},
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
    prefill_placement: PlacementMode = field(
        default=PlacementMode.LIVE,
        metadata={
            "help": "where prompts are prefilled: live (per request, from live load and the "
            "targets: short prompts on their decode worker, long ones on the prefill pool) "
            "or remote (every prompt on the prefill pool)",
        },
    )
    colocate_below: int = field(
        default=0,
        metadata={
            "help": "prefill prompts shorter than this on the decode worker, the others on "
            "the prefill pool, whatever the load (0: off: decide from live load)",
            "metavar": "TOKENS",
        },
    )
    ttft_target_s: float = field(
        default=DEFAULT_TTFT_TARGET_S,
        metadata={
            "help": "seconds to a first token the router aims for: no prompt is prefilled on "
            "a decode worker whose streams its prefill would hold up for longer; of the "
            "two places left, the faster one",
            "flag": "ttft-target",
        },
    )
    tpot_target_s: float = field(
        default=DEFAULT_TPOT_TARGET_S,
        metadata={
            "help": "seconds per output token the router keeps decode workers within: no "
            "prompt is prefilled on a decode worker whose requests' TPOT it would push "
            "past this",
            "flag": "tpot-target",
        },
    )
    max_inflight: int = field(
        default=256,
        metadata={"help": "requests this router runs at once; more wait in its queue"},
    )
    max_queued_requests: int = field(
        default=DEFAULT_MAX_QUEUED,
        metadata={
            "help": "requests that wait for a running slot (lowest priority first, then "
            "in arrival order); past them RESOURCE_EXHAUSTED (0: no queue)"
        },
    )
    queue_timeout_s: float = field(
        default=DEFAULT_QUEUE_TIMEOUT_S,
        metadata={
            "help": "seconds a request waits in the queue at most; then RESOURCE_EXHAUSTED",
            "flag": "queue-timeout",
        },
    )
    max_prompt_bytes: int | None = field(
        default=None,
        metadata={
            "help": "UTF-8 bytes of a prompt's text, checked before tokenizing",
            "default_help": f"{PROMPT_BYTES_PER_TOKEN} x the model's context length",
            "metavar": "BYTES",
        },
    )
    max_stop_strings: int = field(
        default=DEFAULT_MAX_STOP_STRINGS,
        metadata={"help": f"stop strings per request (at most {MAX_STOP_STRINGS})"},
    )
    max_stop_length: int = field(
        default=DEFAULT_MAX_STOP_LENGTH,
        metadata={
            "help": f"characters per stop string (at most {MAX_STOP_LENGTH})",
            "metavar": "CHARS",
        },
    )
    max_concurrent_streams: int = field(
        default=DEFAULT_MAX_CONCURRENT_STREAMS,
        metadata={"help": "calls at once on one client connection (HTTP/2); more wait"},
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
    # how a failing or hung worker is treated (docs/reliability.md): --admit-timeout,
    # --prefill-timeout, --breaker-failures, --breaker-window, --breaker-cooldown,
    # --probe-timeout
    worker_failures: WorkerFailureConfig = field(default_factory=WorkerFailureConfig)
    response_ttl_s: float = field(
        default=DEFAULT_RESPONSE_TTL_S,
        metadata={
            "help": "seconds the OpenAI door keeps a stored response of the Responses API "
            "(and the conversation it ended, for previous_response_id) in Redis",
            "flag": "response-ttl",
        },
    )
    api_key_file: str | None = field(
        default=None,
        metadata={
            "help": "API keys (`pdserve keys`): every call but health needs one; the file "
            "is reloaded when it changes (off: no keys, ids global)",
            "metavar": "PATH",
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
        check_bind(self.host, insecure=self.insecure, tls=self.tls.enabled)
        if self.health_port is not None:
            check_port("health_port", self.health_port)
        self._check_limits()
        for name in ("max_inflight", "max_attempts", "stream_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.colocate_below < 0:
            raise ValueError(f"colocate_below must be >= 0, got {self.colocate_below}")
        if self.ttft_target_s <= 0 or self.tpot_target_s <= 0:
            raise ValueError(
                f"ttft_target_s and tpot_target_s must be > 0, got {self.ttft_target_s} "
                f"and {self.tpot_target_s}"
            )
        if self.response_ttl_s <= 0:
            raise ValueError(f"response_ttl_s must be > 0, got {self.response_ttl_s}")
        if self.lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {self.lease_ttl_s}")
        if self.stream_progress_timeout_s <= 0:
            raise ValueError(
                f"stream_progress_timeout_s must be > 0, got {self.stream_progress_timeout_s}"
            )
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")
        if self.api_key_file is not None:  # a missing or malformed file: refuse to start
            try:
                read_key_file(self.api_key_file)
            except KeyFileError as exc:
                raise ValueError(f"api_key_file: {exc}") from None

    def _check_limits(self) -> None:
        """The request limits: the workers' hard caps bound the stop strings."""
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if self.queue_timeout_s <= 0:
            raise ValueError(f"queue_timeout_s must be > 0, got {self.queue_timeout_s}")
        if self.max_prompt_bytes is not None and self.max_prompt_bytes < 1:
            raise ValueError(f"max_prompt_bytes must be >= 1, got {self.max_prompt_bytes}")
        if not 0 <= self.max_stop_strings <= MAX_STOP_STRINGS:
            raise ValueError(
                f"max_stop_strings must be in [0, {MAX_STOP_STRINGS}], got {self.max_stop_strings}"
            )
        if not 1 <= self.max_stop_length <= MAX_STOP_LENGTH:
            raise ValueError(
                f"max_stop_length must be in [1, {MAX_STOP_LENGTH}], got {self.max_stop_length}"
            )
        if self.max_concurrent_streams < 1:
            raise ValueError(
                f"max_concurrent_streams must be >= 1, got {self.max_concurrent_streams}"
            )

    def request_limits(self, max_model_len: int) -> RequestLimits:
        """What one request may hold, for a model with this context window."""
        return RequestLimits(
            max_prompt_bytes=self.max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * max_model_len,
            max_model_len=max_model_len,
            max_stop_strings=self.max_stop_strings,
            max_stop_length=self.max_stop_length,
        )

    @property
    def deadlines(self) -> Deadlines:
        """The router's own deadlines on Admit and Prefill."""
        failures = self.worker_failures
        return Deadlines(admit_s=failures.admit_timeout_s, prefill_s=failures.prefill_timeout_s)

    @property
    def breaker(self) -> BreakerSettings:
        """When a worker's circuit breaker opens and how it closes."""
        return self.worker_failures.breaker

    @property
    def admission(self) -> AdmissionLimits:
        """The admission queue in front of the running-request limit."""
        return AdmissionLimits(
            max_running=self.max_inflight,
            max_queued=self.max_queued_requests,
            queue_timeout_s=self.queue_timeout_s,
        )

    @property
    def model_name(self) -> str:
        """The name clients ask for: --served-model-name, else the model directory's name."""
        return self.served_model_name or served_name(self.model)

    @property
    def colocation(self) -> LiveColocation:
        """Where each prompt is prefilled: decided from live load against the targets, or
        by the fixed `colocate_below` threshold when it is set."""
        rule = ColocationRule(
            enabled=self.colocate_below > 0, max_prompt_tokens=max(self.colocate_below, 1)
        )
        targets = Targets(self.ttft_target_s, self.tpot_target_s)
        return LiveColocation(targets, rule, PlacementMode(self.prefill_placement))
