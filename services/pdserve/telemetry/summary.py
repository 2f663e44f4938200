"""One finished request, as the router saw it: what metrics and the log line are made of."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.core.phase import RequestPhase


def _span(start: float, end: float) -> float:
    """Seconds from `start` to `end`; 0.0 when either did not happen."""
    return max(0.0, end - start) if start and end else 0.0


@dataclass(frozen=True, slots=True)
class RequestSummary:
    """Times are time.monotonic() seconds in the router; 0.0: it did not happen."""

    request_id: str
    trace_id: str  # 32 hex digits; "" when the request was not traced
    model: str  # the served model's name
    outcome: RequestPhase  # FINISHED, CANCELLED or FAILED
    finish_reason: str  # "stop" | "length" | "abort" | "" (failed)
    error: str  # for FAILED: "ErrorType: message"
    prefill_worker: str
    decode_worker: str
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    num_attempts: int
    received_at: float  # the router took the call
    admitted_at: float  # a decode worker reserved its blocks
    first_token_at: float
    finished_at: float
    ttft_target_s: float = 0.0  # the client's TTFT target (`ttft_slo_ms`); 0.0: none

    @property
    def time_to_first_token_s(self) -> float:
        return _span(self.received_at, self.first_token_at)

    @property
    def queue_time_s(self) -> float:
        """Call received -> admitted on a decode worker (vLLM: queued -> scheduled)."""
        return _span(self.received_at, self.admitted_at)

    @property
    def prefill_time_s(self) -> float:
        """Admitted -> first token (vLLM: scheduled -> first token)."""
        return _span(self.admitted_at, self.first_token_at)

    @property
    def decode_time_s(self) -> float:
        """First token -> last token."""
        return _span(self.first_token_at, self.finished_at)

    @property
    def e2e_latency_s(self) -> float:
        return _span(self.received_at, self.finished_at)

    @property
    def time_per_output_token_s(self) -> float:
        """(last token - first token) / (tokens - 1); 0.0 with fewer than two tokens."""
        if self.completion_tokens < 2:
            return 0.0
        return self.decode_time_s / (self.completion_tokens - 1)
