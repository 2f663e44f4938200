"""Log lines of every pdserve server process: readable text for a terminal, or one JSON
object a line for a log collector (Loki, Elasticsearch, Cloud Logging).

`LogConfig` is the part of `RouterConfig` and `WorkerConfig` that says how
(`--log-format`, `--log-level`, or `PDSERVE_LOG_FORMAT` and `PDSERVE_LOG_LEVEL`);
`configure` installs it once at a process's start (`rpc.server.run`). `pdserve up`'s
children inherit the variables, so `PDSERVE_LOG_FORMAT=json pdserve up` sets them all.

In JSON, a line holds `time`, `level`, `logger`, `role`, `process` and `message`, then
every field a call passed as `extra=` (`log.info("...", extra={"lease_id": ...})`), the
current span's `trace_id` and `span_id` when it is written inside one, and an exception's
traceback as the string field `exception`. Text lines show the message alone: what a
person needs is written into it.

`request_finished` writes the one line of each finished request (the router's
`RequestTelemetry` calls it once per request), at warning level when the request failed.
"""

from __future__ import annotations

import enum
import json
import logging
import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TextIO

from opentelemetry import trace

from pdserve.core.phase import RequestPhase
from pdserve.telemetry.summary import RequestSummary

# The logger of the per-request lines: an operator can route or silence them by name.
REQUEST_LOGGER = "pdserve.requests"
TEXT_FORMAT = "%(asctime)s {who} %(levelname)s %(name)s: %(message)s"
# A record's own attributes; any other attribute came from a call's `extra=`.
_RECORD_ATTRIBUTES = frozenset(vars(logging.LogRecord("", logging.INFO, "", 0, "", None, None)))
_RECORD_ATTRIBUTES |= {"message", "asctime"}  # what formatting adds
_request_log = logging.getLogger(REQUEST_LOGGER)


class LogFormat(enum.StrEnum):
    """How a log line is written."""

    TEXT = "text"  # one readable line, for a terminal
    JSON = "json"  # one JSON object a line, for a log collector


class LogLevel(enum.StrEnum):
    """The least severe lines written."""

    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"

    @property
    def number(self) -> int:
        """The `logging` module's level (logging.INFO, ...)."""
        return logging.getLevelName(self.name)


@dataclass(frozen=True, slots=True)
class LogConfig:
    """How a server process logs; a part of `RouterConfig` and of `WorkerConfig`."""

    log_format: LogFormat = field(
        default=LogFormat.TEXT,
        metadata={"help": "log lines: text for a terminal, json (one object a line) to collect"},
    )
    log_level: LogLevel = field(
        default=LogLevel.INFO, metadata={"help": "the least severe log lines written"}
    )

    def __post_init__(self) -> None:
        # from code, a plain string will do; an unknown one is a ValueError naming it
        object.__setattr__(self, "log_format", LogFormat(self.log_format))
        object.__setattr__(self, "log_level", LogLevel(self.log_level))


def configure(
    config: LogConfig, *, role: str, process_id: str, stream: TextIO | None = None
) -> None:
    """Send every log line of this process to `stream` (stderr) as `config` says, each
    naming this process: its `role` (router, prefill, decode, both) and its id."""
    handler = logging.StreamHandler(stream or sys.stderr)
    if config.log_format is LogFormat.JSON:
        handler.setFormatter(JsonFormatter(role=role, process_id=process_id))
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT.format(who=f"{role}[{process_id}]")))
    logging.basicConfig(level=config.log_level.number, handlers=[handler], force=True)
    logging.captureWarnings(True)  # a library's warnings.warn too: one line, in the format


class JsonFormatter(logging.Formatter):
    """A record as one JSON object on one line (no newline inside: tracebacks included)."""

    def __init__(self, *, role: str, process_id: str):
        super().__init__()
        self.role = role
        self.process_id = process_id

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "role": self.role,
            "process": self.process_id,
            "message": record.getMessage(),
        }
        fields = _trace_fields()  # a call's own trace_id (a request's line) wins
        fields.update((k, v) for k, v in vars(record).items() if k not in _RECORD_ATTRIBUTES)
        line.update((k, v) for k, v in fields.items() if k not in line)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        # default=str: a field a call passed that JSON has no type for (a path, an enum)
        return json.dumps(line, default=str, ensure_ascii=False)


def _trace_fields() -> dict[str, object]:
    """The current span's `trace_id` and `span_id` (a line written inside a traced request
    links to its trace); none outside one, or when tracing is off."""
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return {}
    return {
        "trace_id": trace.format_trace_id(context.trace_id),
        "span_id": trace.format_span_id(context.span_id),
    }


def request_finished(summary: RequestSummary) -> None:
    """Log the one line of a finished request: info, or warning when it failed."""
    level = logging.WARNING if summary.outcome is RequestPhase.FAILED else logging.INFO
    if _request_log.isEnabledFor(level):
        _request_log.log(level, describe(summary), extra=request_fields(summary))


def request_fields(summary: RequestSummary) -> dict[str, object]:
    """The structured fields of a request's line: ids, workers, tokens, timings, outcome."""
    return {
        "request_id": summary.request_id,
        "trace_id": summary.trace_id,
        "model": summary.model,
        "outcome": summary.outcome.value,
        "finish_reason": summary.finish_reason,
        "error": summary.error,
        "prefill_worker": summary.prefill_worker,
        "decode_worker": summary.decode_worker,
        "num_attempts": summary.num_attempts,
        "prompt_tokens": summary.prompt_tokens,
        "cached_prompt_tokens": summary.cached_prompt_tokens,
        "completion_tokens": summary.completion_tokens,
        "time_to_first_token_s": round(summary.time_to_first_token_s, 6),
        "queue_time_s": round(summary.queue_time_s, 6),
        "prefill_time_s": round(summary.prefill_time_s, 6),
        "decode_time_s": round(summary.decode_time_s, 6),
        "time_per_output_token_s": round(summary.time_per_output_token_s, 6),
        "e2e_latency_s": round(summary.e2e_latency_s, 6),
    }


def describe(summary: RequestSummary) -> str:
    """The request's line for a person: `request R finished (stop): 12 prompt tokens
    (4 cached), 32 generated; ttft 41.2 ms, tpot 8.0 ms, e2e 300.1 ms; prefill P,
    decode D; 1 attempt; trace T`."""
    how = summary.finish_reason or summary.error
    head = f"request {summary.request_id} {summary.outcome.value}" + (f" ({how})" if how else "")
    parts = [
        f"{summary.prompt_tokens} prompt tokens ({summary.cached_prompt_tokens} cached), "
        f"{summary.completion_tokens} generated",
        f"ttft {_ms(summary.time_to_first_token_s)}, tpot "
        f"{_ms(summary.time_per_output_token_s)}, e2e {_ms(summary.e2e_latency_s)}",
        f"prefill {summary.prefill_worker or '-'}, decode {summary.decode_worker or '-'}",
        f"{summary.num_attempts} attempt" + ("" if summary.num_attempts == 1 else "s"),
    ]
    if summary.trace_id:
        parts.append(f"trace {summary.trace_id}")
    return f"{head}: {'; '.join(parts)}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"
