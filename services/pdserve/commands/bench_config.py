"""What `pdserve bench` measures, from its flags: the workload, the loads (rates, or
concurrency levels), the SLOs, and the server given (`--router`, `--target`), each flag
checked once, before anything starts."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.metrics import SLO
from pdserve.bench.report import Sweep
from pdserve.bench.sharegpt import sharegpt_workload
from pdserve.bench.targets import OpenAITarget, PdserveTarget, Target, parse_target
from pdserve.bench.workload import WORKLOADS, Load, Workload, custom_workload
from pdserve.cluster.local import ClusterShape
from pdserve.commands import router_address
from pdserve.commands.connection import RouterConnection
from pdserve.core.checkpoint import default_model

SHAREGPT = "sharegpt"  # the dataset's workload, built once the model's tokenizer is known
DEFAULT_TTFT_SLO_MS = 2000.0  # absolute, without --ttft-slo-scale
DEFAULT_TTFT_SLO_FLOOR_MS = 200.0  # with --ttft-slo-scale: no kind's bound is below it
DEFAULT_RATES = "1"  # without --rates or --concurrency
DEFAULT_DURATION_S = 20.0  # without --duration (or, closed loop, --num-requests)


@dataclass(slots=True)
class BenchConfig(Sweep):
    """What one `pdserve bench` measures, validated once from the flags."""

    shapes: list[ClusterShape]  # empty: measure the server given
    timeline_level: float | None  # --timeline-rate: the rate (or concurrency) of the timeline
    tokenizer: str | None = None  # what tokenized ShareGPT's prompts; None: random ids

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BenchConfig:
        if (args.prompt_len is None) != (args.output_len is None):
            raise ValueError("--prompt-len and --output-len come together")
        workload, tokenizer = _workload(args)
        rates, concurrencies = _levels(args)
        duration = DEFAULT_DURATION_S if args.duration is None else args.duration
        if duration <= 0 or args.drain <= 0 or args.warmup < 0:
            raise ValueError("--duration and --drain must be > 0; --warmup >= 0")
        if args.threads < 1 or args.repeats < 1:
            raise ValueError("--threads and --repeats must be >= 1")
        config = cls(
            workload=workload,
            rates=rates,
            duration_s=duration,
            drain_s=args.drain,
            num_warmup=args.warmup,
            seed=args.seed,
            slo=_slo(args),
            repeats=args.repeats,
            concurrencies=concurrencies,
            num_requests=args.num_requests,
            shapes=[ClusterShape.parse(s) for s in args.compare or []],
            timeline_level=args.timeline_rate,
            tokenizer=tokenizer,
        )
        _ = config.timeline  # an unknown level fails now, before anything starts
        return config

    @property
    def timeline(self) -> Load:
        """The load whose run the timeline shows: --timeline-rate's, else mid-sweep."""
        loads = self.loads
        if self.timeline_level is None:
            return loads[len(loads) // 2]
        found = next((load for load in loads if load.level == self.timeline_level), None)
        if found is None:
            raise ValueError(f"--timeline-rate {self.timeline_level:g} is not a level swept")
        return found


def _levels(args: argparse.Namespace) -> tuple[list[float], list[int]]:
    """(--rates, --concurrency): one of them given (--rates 1 when neither is)."""
    if args.concurrency is None:
        if args.num_requests is not None:
            raise ValueError("--num-requests goes with --concurrency (a rate runs --duration)")
        return _numbers("--rates", args.rates or DEFAULT_RATES, float), []
    if args.rates is not None:
        raise ValueError("--rates or --concurrency: one load or the other")
    if args.num_requests is not None and (args.duration is not None or args.num_requests < 1):
        raise ValueError("--num-requests (>= 1) measures instead of --duration: not both")
    return [], _numbers("--concurrency", args.concurrency, int)


def _numbers(flag: str, text: str, kind: type) -> list:
    """A comma-separated list of positive numbers, sorted, each once."""
    try:
        numbers = sorted({kind(word) for word in text.split(",")})
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from exc
    if numbers[0] <= 0:
        raise ValueError(f"{flag}: every value must be > 0")
    return numbers


def _workload(args: argparse.Namespace) -> tuple[Workload, str | None]:
    """The workload, and what tokenized its prompts (None: random ids)."""
    sharegpt = args.workload == SHAREGPT and not args.prompt_len
    if not sharegpt and (args.sharegpt_path or args.max_model_len is not None):
        raise ValueError("--sharegpt-path and --max-model-len go with --workload sharegpt")
    if args.prompt_len:
        return custom_workload(args.prompt_len, args.output_len), None
    if sharegpt:  # tokenized with the model's tokenizer, at its context
        model = args.model or str(default_model())
        path = Path(args.sharegpt_path) if args.sharegpt_path else None
        return sharegpt_workload(model, args.max_model_len, path), model
    return WORKLOADS[args.workload], None


def given_target(args: argparse.Namespace, connection: RouterConnection) -> Target | None:
    """The server --target or --router names (None with --compare), reached through
    `connection`; ValueError for flags that do not go with it."""
    extra_body = None if args.extra_body is None else _json_object("--extra-body", args.extra_body)
    target: Target | None = None  # --compare: clusters started here
    if args.target is not None:
        target = parse_target(args.target, extra_body=extra_body or {}, api_key=connection.api_key)
    elif not args.compare:
        address = router_address(args.router)
        target = PdserveTarget(address, address)
    if not isinstance(target, OpenAITarget):
        if extra_body is not None:
            raise ValueError("--extra-body goes with --target openai:URL")
        if target is None:
            return None
        return dataclasses.replace(target, client_kwargs=connection.client_kwargs)
    if connection.credentials is not None:
        raise ValueError("--tls-* go with pdserve targets: give openai an https:// URL")
    if args.send_ttft_slo and not target.takes_ttft_slo:
        raise ValueError("--send-ttft-slo needs a pdserve target: OpenAI's API has no field")
    return target


def _json_object(flag: str, text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{flag}: a JSON object, got {text!r}")
    return value


def _slo(args: argparse.Namespace) -> SLO:
    """The SLOs asked for; a relative TTFT bound is calibrated once the kinds ran alone."""
    if args.ttft_slo_scale is None:
        ttft_ms = DEFAULT_TTFT_SLO_MS if args.ttft_slo_ms is None else args.ttft_slo_ms
        return SLO(ttft_ms, args.tpot_slo_ms, sent=args.send_ttft_slo)
    floor = DEFAULT_TTFT_SLO_FLOOR_MS if args.ttft_slo_ms is None else args.ttft_slo_ms
    return SLO(floor, args.tpot_slo_ms, ttft_scale=args.ttft_slo_scale, sent=args.send_ttft_slo)
