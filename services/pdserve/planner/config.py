"""`pdserve planner`'s configuration: one dataclass, every field a flag and a `PDSERVE_*`
variable (`core/flags.py`), what the chart's planner Deployment sets."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.bench.metrics import SLO
from pdserve.cluster.local import ClusterShape
from pdserve.planner.capacity import Pool
from pdserve.planner.scaling import DEFAULT_COOLDOWN_S, DEFAULT_HYSTERESIS, Bounds, ScalingPolicy
from pdserve.telemetry.logs import LogConfig


def parse_shapes(entries: list[str]) -> dict[str, ClusterShape]:
    """`NAME=P:D` entries (a record's configuration measured through --router, named after
    its address, and its prefill and decode worker counts) as {NAME: shape}."""
    shapes = {}
    for entry in entries:
        name, sep, counts = entry.rpartition("=")
        prefill, colon, decode = counts.partition(":")
        if not (sep and name and colon and prefill.isdigit() and decode.isdigit()):
            raise ValueError(f"shape {entry!r}: use NAME=PREFILL:DECODE, e.g. 10.0.0.5:50051=1:2")
        shapes[name] = ClusterShape(int(prefill), int(decode))
    return shapes


def _help(text: str, **more) -> dict:
    return {"help": text, **more}


@dataclass(slots=True)
class PlannerConfig:
    """Everything one planner process needs, validated once."""

    record: str = field(
        metadata=_help("a pdserve bench JSON record: what each pool sustains within its SLO")
    )
    prefill_deployment: str = field(
        default="pdserve-prefill", metadata=_help("the prefill pool's Deployment")
    )
    decode_deployment: str = field(
        default="pdserve-decode", metadata=_help("the decode pool's Deployment")
    )
    namespace: str = field(default="default", metadata=_help("the Deployments' namespace"))
    prometheus_url: str | None = field(
        default=None, metadata=_help("the offered load from this Prometheus (the routers' rates)")
    )
    rate: float | None = field(
        default=None, metadata=_help("instead: a fixed load, requests/s of the record's mix")
    )
    load_window_s: float = field(
        default=300.0, metadata=_help("seconds of load the rates average", flag="load-window")
    )
    shape: list[str] = field(
        default_factory=list,
        metadata=_help("shapes of the record's --router configurations", metavar="NAME=P:D,..."),
    )
    ttft_slo_ms: float | None = field(
        default=None, metadata=_help("the TTFT SLO", default_help="the record's")
    )
    tpot_slo_ms: float | None = field(
        default=None, metadata=_help("the TPOT SLO", default_help="the record's")
    )
    headroom: float = field(default=0.0, metadata=_help("plan for the load times 1 + this"))
    hysteresis: float = field(
        default=DEFAULT_HYSTERESIS,
        metadata=_help("scale down only if the load times 1 + this fits in fewer workers"),
    )
    cooldown_s: float = field(
        default=DEFAULT_COOLDOWN_S,
        metadata=_help("seconds after a pool's change before it scales down", flag="cooldown"),
    )
    interval_s: float = field(
        default=30.0, metadata=_help("seconds between looks at the load", flag="interval")
    )
    min_prefill: int = field(default=1, metadata=_help("fewest prefill workers"))
    max_prefill: int = field(default=4, metadata=_help("most prefill workers"))
    min_decode: int = field(default=1, metadata=_help("fewest decode workers"))
    max_decode: int = field(default=4, metadata=_help("most decode workers"))
    dry_run: bool = field(default=False, metadata=_help("log each decision, change nothing"))
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        if (self.prometheus_url is None) == (self.rate is None):
            raise ValueError("give the load as exactly one of prometheus_url and rate")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate must be > 0, got {self.rate:g}")
        if self.interval_s <= 0 or self.load_window_s <= 0:
            raise ValueError("interval_s and load_window_s must be > 0")
        self.policies()  # bounds, hysteresis, cool-down and headroom checked there
        parse_shapes(self.shape)

    def policies(self) -> dict[Pool, ScalingPolicy]:
        bounds = {}
        for pool, (low, high) in (
            (Pool.PREFILL, (self.min_prefill, self.max_prefill)),
            (Pool.DECODE, (self.min_decode, self.max_decode)),
        ):
            try:
                bounds[pool] = Bounds(low, high)
            except ValueError as exc:
                raise ValueError(f"min_{pool}/max_{pool}: {exc}") from exc
        return {
            pool: ScalingPolicy(b, self.hysteresis, self.cooldown_s, self.headroom)
            for pool, b in bounds.items()
        }

    def deployments(self) -> dict[Pool, str]:
        return {Pool.PREFILL: self.prefill_deployment, Pool.DECODE: self.decode_deployment}

    def slo(self, recorded: SLO) -> SLO:
        """The SLOs given, each defaulting to the one the record was judged by."""
        return recorded.overridden(self.ttft_slo_ms, self.tpot_slo_ms)
