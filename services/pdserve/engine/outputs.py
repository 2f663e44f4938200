"""What the engine hands back: per-step deltas and whole results, with text."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.core.sampling_params import TokenLogprobs
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer


@dataclass(slots=True)
class RequestOutput:
    """From `step()`: what is new this step. From `generate()`: everything."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    scheduled_time: float = 0.0  # time.monotonic() the request was first scheduled

    def extend(self, delta: RequestOutput) -> None:
        self.token_ids.extend(delta.token_ids)
        self.text += delta.text
        self.finished, self.finish_reason = delta.finished, delta.finish_reason
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs


@dataclass(slots=True)
class _TextState:
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher | None


class OutputProcessor:
    """Turns new tokens into text deltas and finds stop strings, per request."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._states: dict[str, _TextState] = {}

    def add(self, request: Request, already_sent: Sequence[int] = ()) -> None:
        """Track a request; `already_sent` tokens were streamed by another engine."""
        stops = request.params.stop
        self._states[request.request_id] = _TextState(
            IncrementalDetokenizer(self.tokenizer, [*request.prompt_token_ids, *already_sent]),
            StopStringMatcher(stops) if stops else None,
        )

    def process(
        self, request: Request, new_token: int | None, logprobs: TokenLogprobs | None
    ) -> tuple[RequestOutput, bool]:
        """The delta for one request; the bool says a stop string ended it."""
        state = self._states.get(request.request_id)
        text, stopped = "", False
        if state is not None:
            text, stopped = self._text(request, state, new_token)
        finished = stopped or request.is_finished
        if finished:
            self._states.pop(request.request_id, None)
        reason = RequestStatus.FINISHED_STOPPED.finish_reason if stopped else None
        output = RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=[] if new_token is None else [new_token],
            text=text,
            finished=finished,
            finish_reason=reason or request.status.finish_reason,
            logprobs=None if logprobs is None else [logprobs],
            num_cached_tokens=request.num_cached_tokens or 0,
            scheduled_time=request.scheduled_time,
        )
        return output, stopped

    @staticmethod
    def _text(request: Request, state: _TextState, new_token: int | None) -> tuple[str, bool]:
        # A token that stopped the request (EOS, a stop token id) is in token_ids but,
        # as in vLLM, not in the text.
        stopped_by_token = request.status == RequestStatus.FINISHED_STOPPED and (
            new_token in request.eos_token_ids or new_token in request.params.stop_token_ids
        )
        text = ""
        if new_token is not None and not stopped_by_token:
            text = state.detokenizer.push(new_token)
        if request.is_finished:  # the output ends: release a held-back partial character
            text += state.detokenizer.flush()
        if state.stops is None:
            return text, False
        text, stopped = state.stops.feed(text)
        if request.is_finished and not stopped:
            text += state.stops.flush()
        return text, stopped

    def drop(self, request_id: str) -> None:
        self._states.pop(request_id, None)
