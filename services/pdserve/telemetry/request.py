"""One request's telemetry in the router: its span, the gaps between its messages, and
the summary its metrics and its log line are made of.

The router's `RequestSession` makes one `RequestTelemetry` per request and calls it at
each step. Its span is the request's root in the router (SERVER, named as the GenAI
conventions say: `text_completion <model>`), a child of the client's `traceparent` when
it sent one; the hand-off's spans are its children. Prompts and outputs are never
recorded, only their token counts.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from typing import Protocol

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from pdserve.api.v1 import common_pb2
from pdserve.core.phase import RequestPhase
from pdserve.telemetry import logs, metrics, tracing
from pdserve.telemetry.slo_metrics import TargetOutcome, ttft_target_outcome
from pdserve.telemetry.summary import RequestSummary

OPERATION = "text_completion"  # gen_ai.operation.name: a prompt in, its completion out
PROVIDER = "pdserve"  # gen_ai.provider.name


def failure_text(error: BaseException) -> str:
    """A failed request's error as its record and its log line keep it: `Type: message`."""
    return f"{type(error).__name__}: {error}"


class Milestones(Protocol):
    """Where a request stands (the session's `Progress`); times are time.monotonic()."""

    prefill_worker: str
    decode_worker: str
    num_attempts: int
    cached_prompt_tokens: int
    received_at: float
    admitted_at: float
    first_token_at: float


PLACEMENT_EVENT = "pdserve.placement"
# What the event keeps of the decision's attributes: the decision. Its inputs (the
# estimates, targets and reports it weighed) are attributes of the `route decode` span,
# which the runner opens around it; a second copy here cost every traced request about
# 15 attributes to record and to export, for nothing a reader could not find one level up.
PLACEMENT_EVENT_ATTRIBUTES = (PLACEMENT_EVENT, "pdserve.placement.reason")


def placement_event(attributes: dict[str, object]) -> None:
    """Where the router prefills the request and why (router/disaggregation.py), as an
    event on the current span (the request's, where the runner decides): the placement and
    its reason, of the decision's `attributes`."""
    span = trace.get_current_span()
    if span.is_recording():
        kept = {k: attributes[k] for k in PLACEMENT_EVENT_ATTRIBUTES if k in attributes}
        span.add_event(PLACEMENT_EVENT, kept)


def request_attributes(
    sampling: common_pb2.SamplingParams, model: str, priority: int = 0, ttft_slo_ms: int = 0
) -> dict[str, object]:
    """The request span's attributes from what the client asked for: GenAI's, and how
    urgent it said the request is (its priority, and its TTFT target if it gave one)."""
    attributes: dict[str, object] = {
        "gen_ai.operation.name": OPERATION,
        "gen_ai.provider.name": PROVIDER,
        "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": sampling.max_tokens,
        "gen_ai.request.temperature": sampling.temperature,
        "gen_ai.request.top_p": sampling.top_p if sampling.HasField("top_p") else 1.0,
        "gen_ai.request.top_k": sampling.top_k,
    }
    if sampling.HasField("seed"):  # the router seeds unseeded sampling: the one it ran with
        attributes["gen_ai.request.seed"] = sampling.seed
    attributes["pdserve.request.priority"] = priority
    if ttft_slo_ms:
        attributes["pdserve.request.ttft_slo_ms"] = ttft_slo_ms
    return attributes


def summary_attributes(summary: RequestSummary) -> dict[str, object]:
    """The request span's attributes once it ended: usage, latencies (vLLM's names), workers."""
    attributes: dict[str, object] = {
        "gen_ai.response.id": summary.request_id,
        "gen_ai.usage.input_tokens": summary.prompt_tokens,
        "gen_ai.usage.output_tokens": summary.completion_tokens,
        "gen_ai.latency.time_to_first_token": summary.time_to_first_token_s,
        "gen_ai.latency.time_in_queue": summary.queue_time_s,
        "gen_ai.latency.e2e": summary.e2e_latency_s,
        "pdserve.latency.time_per_output_token": summary.time_per_output_token_s,
        "pdserve.usage.cached_input_tokens": summary.cached_prompt_tokens,
        "pdserve.attempts": summary.num_attempts,
        "pdserve.outcome": summary.outcome.value,
        "pdserve.prefill.worker": summary.prefill_worker,
        "pdserve.decode.worker": summary.decode_worker,
    }
    if summary.finish_reason:
        attributes["gen_ai.response.finish_reasons"] = [summary.finish_reason]
    if (outcome := ttft_target_outcome(summary)) is not None:
        attributes["pdserve.request.ttft_slo_met"] = outcome is TargetOutcome.MET
    return attributes


class RequestTelemetry:
    """One request's span, message gaps and, once, its summary (see the module docstring)."""

    __slots__ = (
        "request_id",
        "model",
        "prompt_tokens",
        "ttft_target_s",
        "span",
        "_last_message_at",
        "_ended",
    )

    def __init__(
        self,
        request_id: str,
        sampling: common_pb2.SamplingParams,
        *,
        model: str,
        prompt_tokens: int,
        priority: int = 0,
        ttft_slo_ms: int = 0,
    ):
        self.request_id, self.model, self.prompt_tokens = request_id, model, prompt_tokens
        self.ttft_target_s = ttft_slo_ms / 1000  # the client's TTFT target; 0.0: none
        # The current context is the caller's trace when its call carried one (rpc_errors).
        # The attributes go in at the start (built only when tracing is on): the sampler
        # sees them, and the span copies them once.
        attributes = None
        if tracing.enabled():
            attributes = request_attributes(sampling, model, priority, ttft_slo_ms)
        self.span = tracing.start_span(
            f"{OPERATION} {model}", request_id, kind=SpanKind.SERVER, attributes=attributes
        )
        self._last_message_at = 0.0  # time.monotonic() of the previous message; 0.0: none
        self._ended = False

    @property
    def trace_id(self) -> str:
        """32 hex digits; "" when the request is not traced (off, or not sampled)."""
        context = self.span.get_span_context()
        return format(context.trace_id, "032x") if context.trace_flags.sampled else ""

    def context(self) -> contextvars.Context | None:
        """For the task that runs the attempts: their spans and calls are the request's."""
        return tracing.context_with(self.span)

    def on_retry(self, attempt_number: int, error: BaseException) -> None:
        """Attempt `attempt_number` failed with `error`; another one follows."""
        if self.span.is_recording():
            event = {
                "pdserve.attempt": attempt_number,
                tracing.ERROR_TYPE: tracing.error_type(error),
            }
            self.span.add_event("retry", event)

    def on_failover(self, worker: str, error: BaseException) -> None:
        """`worker` refused or could not be reached; the attempt moves on to the next one."""
        if self.span.is_recording():
            event = {"pdserve.worker": worker, tracing.ERROR_TYPE: tracing.error_type(error)}
            self.span.add_event("failover", event)

    def on_message(self, num_tokens: int) -> None:
        """A message of `num_tokens` tokens goes to the client (inter-token latency)."""
        now = time.monotonic()
        if self._last_message_at:
            metrics.tokens_delivered(num_tokens, now - self._last_message_at)
        self._last_message_at = now

    def finish(
        self,
        milestones: Milestones,
        outcome: RequestPhase,
        finish_reason: str,
        *,
        completion_tokens: int,
        failure: BaseException | None = None,
    ) -> None:
        """The request ended: its summary goes to the metrics and the log line, its span
        ends. Only the first call counts."""
        if self._ended:
            return
        self._ended = True
        summary = RequestSummary(
            request_id=self.request_id,
            trace_id=self.trace_id,
            model=self.model,
            outcome=outcome,
            finish_reason=finish_reason,
            error="" if failure is None else failure_text(failure),
            prefill_worker=milestones.prefill_worker,
            decode_worker=milestones.decode_worker,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=completion_tokens,
            cached_prompt_tokens=milestones.cached_prompt_tokens,
            num_attempts=milestones.num_attempts,
            received_at=milestones.received_at,
            admitted_at=milestones.admitted_at,
            first_token_at=milestones.first_token_at,
            finished_at=time.monotonic(),
            ttft_target_s=self.ttft_target_s,
        )
        metrics.record_request(summary)
        logs.request_finished(summary)
        self._end_span(summary, failure)

    def failed_to_start(self, milestones: Milestones, error: BaseException) -> None:
        """The request ended before it started (its record could not be written)."""
        if isinstance(error, asyncio.CancelledError):  # the client left
            self.finish(milestones, RequestPhase.CANCELLED, "abort", completion_tokens=0)
        else:
            self.finish(milestones, RequestPhase.FAILED, "", completion_tokens=0, failure=error)

    def abandon(self) -> None:
        """Another call runs this request (its id was taken): end the span, count nothing."""
        if not self._ended:
            self._ended = True
            self.span.end()

    def _end_span(self, summary: RequestSummary, failure: BaseException | None) -> None:
        span = self.span
        if span.is_recording():
            span.set_attributes(summary_attributes(summary))
            if failure is not None:
                tracing.set_error(span, failure)
        span.end()
