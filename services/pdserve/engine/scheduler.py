"""Continuous batching: which requests run this step, and how many tokens each. No tensors.

Each step, running requests are served first, in admission order, then waiting requests
are admitted first-in first-out. A prompt larger than the token budget is split into
chunks. When blocks run out, the newest running request is preempted: its blocks are
freed and it goes back to the front of the waiting queue, to be recomputed later.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request, RequestStatus


@dataclass(slots=True, kw_only=True)
class SchedulerConfig:
    max_model_len: int  # prompt + output tokens a request may hold
    max_num_seqs: int = 64  # running requests at once
    max_num_batched_tokens: int = 2048  # tokens computed per step, all requests together
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        # unchunked, a prompt longer than the budget could never be scheduled
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens})"
                f" must be >= max_model_len ({self.max_model_len})"
            )


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step: compute tokens [start, start + num_new_tokens).

    `start` and `num_tokens` are taken when the step is planned, so the plan still reads
    the same after `update_from_output` has advanced the request.
    """

    request: Request
    num_new_tokens: int
    start: int  # request.num_computed_tokens when scheduled
    num_tokens: int  # request.num_tokens when scheduled

    @classmethod
    def plan(cls, request: Request, num_new_tokens: int) -> ScheduledRequest:
        return cls(request, num_new_tokens, request.num_computed_tokens, request.num_tokens)

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def is_decode(self) -> bool:
        """One token, the last known one: the rest of the context is already cached.

        A one-token prompt, or a last prefill chunk of one token, is a decode step too:
        the model does exactly the same work.
        """
        return self.num_new_tokens == 1 and self.start == self.num_tokens - 1

    @property
    def is_prefill(self) -> bool:
        return not self.is_decode

    @property
    def produces_token(self) -> bool:
        """The step computes the last known token, so a new one is sampled from its logits."""
        return self.end == self.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    # running requests first, in their order, then the newly admitted ones
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # requests that finished or were aborted since the last step: workers drop their state
    finished_request_ids: list[str] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # oldest admitted first; preemption takes the last
        self._requests: dict[str, Request] = {}  # unfinished requests, waiting or running
        self._finished_request_ids: list[str] = []
        self.num_preemptions = 0  # since the start, for metrics

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def max_blocks_per_request(self) -> int:
        """A request alone may take the whole pool."""
        return self.block_manager.num_blocks

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a request growing to `num_tokens` tokens fits the pool when alone.

        The engine rejects requests that cannot; the scheduler would otherwise preempt and
        re-admit such a request forever.
        """
        return self.block_manager.num_blocks_for(num_tokens) <= self.max_blocks_per_request

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises ValueError on what the engine should have rejected."""
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if not 0 < request.num_prompt_tokens <= self.config.max_model_len:
            raise ValueError(
                f"request {request.request_id}: prompt of {request.num_prompt_tokens} tokens, "
                f"must be 1 to max_model_len ({self.config.max_model_len})"
            )
        max_num_tokens = min(
            request.num_prompt_tokens + request.params.max_tokens, self.config.max_model_len
        )
        if not self.can_ever_fit(max_num_tokens):
            raise ValueError(
                f"request {request.request_id}: {max_num_tokens} tokens can never fit in "
                f"{self.max_blocks_per_request} blocks of {self.block_manager.block_size}"
            )
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self._requests[request.request_id] = request

    def add_prefilled_request(self, request: Request) -> None:
        """Join the running batch with a prompt whose KV another engine computed.

        The caller has allocated the request's blocks, imported the prompt's KV into
        them, set num_computed_tokens to the prompt length and appended the first token.
        If it is preempted later it is recomputed like any other request.
        """
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.num_cached_tokens = 0  # computed elsewhere, not served from this cache
        self.block_manager.cache_full_blocks(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._requests[request.request_id] = request

    def abort_request(self, request_id: str) -> Request | None:
        """Drop a waiting or running request and free its blocks; None if unknown."""
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish a request the engine decided is done (a stop string); None if unknown."""
        if not status.is_finished:
            raise ValueError(f"{status.name} is not a finished status")
        request = self._requests.get(request_id)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, status)
        return request

    def schedule(self) -> SchedulerOutput:
        """Plan one step within the token budget, `max_num_seqs` and the free blocks.

        The requests' counts are not advanced here; `update_from_output` does that once
        the step has run.
        """
        output = SchedulerOutput(finished_request_ids=self._finished_request_ids)
        self._finished_request_ids = []
        token_budget = self._schedule_running(output, self.config.max_num_batched_tokens)
        # a preemption means blocks are short: let the running requests drain first
        if not output.preempted_request_ids:
            self._schedule_waiting(output, token_budget)
        output.num_batched_tokens = sum(s.num_new_tokens for s in output.scheduled)
        return output

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance the scheduled requests after the step ran.

        Args:
            sampled: the token sampled for each request whose step `produces_token`.

        Returns:
            The requests that got a new token this step, finished ones included.
        """
        updated: list[Request] = []
        for scheduled in output.scheduled:
            request = scheduled.request
            if request.status != RequestStatus.RUNNING:  # aborted while the step ran
                continue
            request.num_computed_tokens = scheduled.end
            self.block_manager.cache_full_blocks(request)
            if not scheduled.produces_token:
                continue
            request.append_output_token(sampled[request.request_id])
            updated.append(request)
            stop_status = self._stop_status(request)
            if stop_status is not None:
                self.running.remove(request)
                self._finish(request, stop_status)
        return updated

    def _schedule_running(self, output: SchedulerOutput, token_budget: int) -> int:
        """Schedule running requests in order, preempting the newest when blocks run out."""
        index = 0
        while index < len(self.running) and token_budget > 0:
            request = self.running[index]
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, token_budget)
            while self.block_manager.allocate_slots(request, num_new_tokens) is None:
                # the newest request is never one already scheduled: those come before it
                victim = self.running.pop()
                self._preempt(victim)
                output.preempted_request_ids.append(victim.request_id)
                if victim is request:
                    return token_budget
            output.scheduled.append(ScheduledRequest.plan(request, num_new_tokens))
            token_budget -= num_new_tokens
            index += 1
        return token_budget

    def _schedule_waiting(self, output: SchedulerOutput, token_budget: int) -> None:
        """Admit waiting requests first-in first-out; stop at the first that does not fit."""
        while self.waiting and token_budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            computed_blocks, num_computed_tokens = self.block_manager.get_computed_blocks(request)
            num_new_tokens = request.num_tokens - num_computed_tokens
            if num_new_tokens > token_budget:
                if not self.config.enable_chunked_prefill:
                    return
                num_new_tokens = token_budget
            request.num_computed_tokens = num_computed_tokens  # allocate_slots counts from it
            if self.block_manager.allocate_slots(request, num_new_tokens, computed_blocks) is None:
                request.num_computed_tokens = 0
                return
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            if request.num_cached_tokens is None:  # first scheduling only, not after preemption
                request.num_cached_tokens = num_computed_tokens
                request.scheduled_time = time.monotonic()
            self.running.append(request)
            output.scheduled.append(ScheduledRequest.plan(request, num_new_tokens))
            token_budget -= num_new_tokens

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _stop_status(self, request: Request) -> RequestStatus | None:
        """Why the request stops after its newest token, or None to go on."""
        params = request.params
        token_id = request.token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Free a request already taken out of the waiting or running queue."""
        request.status = status
        self.block_manager.free(request)
        del self._requests[request.request_id]
        self._finished_request_ids.append(request.request_id)
