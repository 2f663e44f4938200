"""A `pdserve bench` JSON record, read back as the planner needs it: for every measured
configuration of known shape, each rate's requests (the record's own `RequestResult`s).

The record's shape is `pdserve bench`'s (bench/report.py): configs -> runs -> requests with
`kind`, `warmup`, `prompt_tokens`, `max_tokens`, `token_times` and `error`. A configuration
started by `--compare` is named after its shape (`prefill:1,decode:2`); one measured through
`--router` is named after the address, and its shape must be given (`shapes`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.loadgen import RequestResult
from pdserve.bench.metrics import SLO
from pdserve.cluster.local import ClusterShape


class RecordError(ValueError):
    """A record the planner cannot use; the message names the file's field."""


@dataclass(frozen=True, slots=True)
class RecordedRun:
    """One rate of one configuration: what was offered, and how each request fared."""

    config: str  # the configuration's name in the record
    num_prefill: int  # its workers of each pool
    num_decode: int
    rate: float  # requests per second offered
    duration_s: float  # the measured arrivals' window (all of a repeated rate's runs)
    results: tuple[RequestResult, ...]  # measured requests only (warm-ups left out)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.results)

    @property
    def output_tokens(self) -> int:
        """Output tokens asked for (requests ignore EOS: each asks for exactly these)."""
        return sum(r.max_tokens for r in self.results)


@dataclass(frozen=True, slots=True)
class Record:
    path: str
    workload: str
    slo: SLO  # the SLOs the benchmark was run with
    runs: tuple[RecordedRun, ...]  # disaggregated configurations only, by config then rate
    skipped: tuple[str, ...]  # configurations left out, each with why

    def mean_request(self) -> tuple[float, float]:
        """(prompt tokens, output tokens) of the record's average measured request: the mix
        an offered request rate is converted to tokens with."""
        results = [r for run in self.runs for r in run.results]
        if not results:
            raise RecordError(f"{self.path}: no measured requests")
        n = len(results)
        return sum(r.prompt_tokens for r in results) / n, sum(r.max_tokens for r in results) / n


def load_record(path: str | Path, shapes: Mapping[str, ClusterShape] | None = None) -> Record:
    """Read a bench record; RecordError naming the field when it does not parse."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise RecordError(f"{path}: {exc}") from exc
    return parse_record(data, str(path), shapes or {})


def parse_record(data: object, path: str, shapes: Mapping[str, ClusterShape]) -> Record:
    """A record from its parsed JSON."""
    top = _mapping(data, path)
    slo_field = _mapping(_field(top, "slo", path), f"{path}: slo")
    try:
        scale = slo_field.get("ttft_scale")
        slo = SLO(
            float(slo_field["ttft_ms"]),
            float(slo_field["tpot_ms"]),
            None if scale is None else float(scale),
            {str(k): float(v) for k, v in (slo_field.get("solo_ttft_ms") or {}).items()},
        )
        # a rate run several times (`--repeats`) offered its load over every run's window
        duration_s = float(top["duration_s"]) * int(top.get("repeats", 1))
    except (KeyError, TypeError, ValueError) as exc:
        raise RecordError(f"{path}: slo or duration_s: {exc}") from exc
    runs, skipped = [], []
    configs = _field(top, "configs", path)
    if not isinstance(configs, list):
        raise RecordError(f"{path}: configs: not a list")
    for i, config in enumerate(configs):
        where = f"{path}: configs[{i}]"
        config = _mapping(config, where)
        name = str(_field(config, "name", where))
        shape = shapes.get(name) or _shape_of(name)
        if shape is None or shape.colocated or not shape.prefill:
            skipped.append(f"{name}: not a prefill:P,decode:D shape (give it with --shape)")
            continue
        for j, run in enumerate(_field(config, "runs", where)):
            runs.append(_run(_mapping(run, f"{where}.runs[{j}]"), name, shape, duration_s, where))
    if not runs:
        raise RecordError(f"{path}: no disaggregated configuration: {'; '.join(skipped)}")
    return Record(
        path, str(top.get("workload", {}).get("name", "")), slo, tuple(runs), tuple(skipped)
    )


def _run(run: dict, name: str, shape: ClusterShape, duration_s: float, where: str) -> RecordedRun:
    rate = float(_field(run, "rate", where))
    results = []
    known = {f.name for f in dataclasses.fields(RequestResult)}
    for k, raw in enumerate(_field(run, "requests", where)):
        at = f"{where}.runs[rate={rate:g}].requests[{k}]"
        raw = _mapping(raw, at)
        try:
            result = RequestResult(**{key: v for key, v in raw.items() if key in known})
        except TypeError as exc:
            raise RecordError(f"{at}: {exc}") from exc
        if not result.warmup:
            results.append(result)
    return RecordedRun(name, shape.prefill, shape.decode, rate, duration_s, tuple(results))


def _shape_of(name: str) -> ClusterShape | None:
    try:
        return ClusterShape.parse(name)
    except ValueError:
        return None


def _mapping(value: object, where: str) -> dict:
    if not isinstance(value, dict):
        raise RecordError(f"{where}: not an object")
    return value


def _field(mapping: dict, key: str, where: str):
    if key not in mapping:
        raise RecordError(f"{where}: no field {key!r}")
    return mapping[key]
