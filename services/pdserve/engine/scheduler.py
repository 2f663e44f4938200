"""Continuous batching: which requests run this step, and how many tokens each. No tensors.

Each step, the requests that are decoding are served first (one token each, in admission
order); what is left of the token budget goes to the requests with prompt tokens still to
compute, waiting ones and those partway through a chunked prefill alike, in the order of
the scheduling policy (`engine/scheduling.py`: arrival order, priority, or the least
remaining work with aging). A prompt larger than what is left of the budget is split into
chunks, so `max_num_batched_tokens` bounds every step, and a long prompt running in chunks
pauses for the shorter ones the policy puts first. When blocks run out, the newest running
request not yet planned in the step is preempted: its blocks are freed and it goes back to
the front of the waiting queue, to be recomputed later.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduling import (
    DEADLINE_PENALTY_TOKENS,
    DEFAULT_AGING,
    Ordering,
    Pace,
    SchedulingPolicy,
    remaining_prefill_tokens,
)


@dataclass(slots=True, kw_only=True)
class SchedulerConfig:
    max_model_len: int  # prompt + output tokens a request may hold
    max_num_seqs: int = 64  # running requests at once
    max_num_batched_tokens: int = 2048  # tokens computed per step, all requests together
    enable_chunked_prefill: bool = True
    # The order of prefill work. Arrival order here, the plain continuous batching this
    # module's own tests pin; engines take theirs from EngineConfig (LEAST_WORK there).
    policy: SchedulingPolicy = SchedulingPolicy.FCFS
    aging: float = DEFAULT_AGING  # LEAST_WORK: remaining work taken off per token computed
    # LEAST_WORK: late prompts go behind on-time ones (engine/scheduling.py); 0: off
    deadline_scale: float = 0.0
    deadline_penalty: int = DEADLINE_PENALTY_TOKENS  # what a late prompt's key grows by

    def __post_init__(self) -> None:
        self.policy = SchedulingPolicy(self.policy)
        if self.aging <= 0:
            raise ValueError(f"aging must be > 0, got {self.aging}")
        if self.deadline_scale < 0:
            raise ValueError(f"deadline_scale must be >= 0, got {self.deadline_scale}")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        # unchunked, a prompt longer than the budget could never be scheduled
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens})"
                f" must be >= max_model_len ({self.max_model_len})"
            )

    def ordering(self, work_now: int, now: float = 0.0, pace: Pace | None = None) -> Ordering:
        """What the policy's keys read, the engine having computed `work_now` tokens, at
        `now` and going at `pace`; a prompt's deadline is for a step's budget at least."""
        return Ordering(
            self.aging,
            self.deadline_scale,
            self.max_num_batched_tokens,
            self.deadline_penalty,
            work_now,
            now,
            pace.seconds_per_token if pace is not None else 0.0,
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
    # decoding requests first, in admission order, then prefill work in policy order
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
        self.num_scheduled_tokens = 0  # every token planned since the start (aging's clock)
        self._num_arrivals = 0
        self.pace = Pace()  # the engine records each step's time (clients' TTFT targets)
        self.clock = time.monotonic  # what `now` is for those targets

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_queued_prefill_tokens(self) -> int:
        """Prompt tokens still to compute, waiting and partway-prefilled requests together:
        the prefill work ahead of a new request (what load reports carry to routers)."""
        prefilling = (r for r in self.running if remaining_prefill_tokens(r) > 1)
        return sum(remaining_prefill_tokens(r) for r in (*self.waiting, *prefilling))

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
        request.arrival_index, self._num_arrivals = self._num_arrivals, self._num_arrivals + 1
        request.work_at_arrival = self.num_scheduled_tokens
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
        request.arrival_index, self._num_arrivals = self._num_arrivals, self._num_arrivals + 1
        request.work_at_arrival = self.num_scheduled_tokens
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
        planned: set[str] = set()  # ids scheduled in this step: never preempted by it
        token_budget = self._schedule_decodes(output, planned, self.config.max_num_batched_tokens)
        if token_budget > 0:
            self._schedule_prefills(output, planned, token_budget)
        output.num_batched_tokens = sum(s.num_new_tokens for s in output.scheduled)
        self.num_scheduled_tokens += output.num_batched_tokens
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

    def _schedule_decodes(self, output: SchedulerOutput, planned: set[str], budget: int) -> int:
        """One token for each decoding request in admission order; returns the budget left."""
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            index += 1
            if remaining_prefill_tokens(request) != 1:
                continue  # prefill work: the policy orders it (`_schedule_prefills`)
            if not self._allocate_or_preempt(request, 1, output, planned):
                return budget
            self._plan(output, planned, request, 1)
            budget -= 1  # (victims come after the request in the list: `index` stays right)
        return budget

    def _schedule_prefills(self, output: SchedulerOutput, planned: set[str], budget: int) -> None:
        """Give the budget to prefill work in policy order, chunking what does not fit.

        Waiting requests are admitted until the first one that does not fit (blocks,
        `max_num_seqs`, or unchunked over the budget) and not at all in a step that
        preempted (blocks are short: the running requests drain first); requests partway
        through a chunked prefill go on in their turn either way.
        """
        ordering = self.config.ordering(self.num_scheduled_tokens, self.clock(), self.pace)
        policy = self.config.policy
        prefilling = [r for r in self.running if r.request_id not in planned]
        candidates = sorted([*prefilling, *self.waiting], key=lambda r: policy.key(r, ordering))
        admitting = not output.preempted_request_ids
        for request in candidates:
            if budget <= 0:
                return
            if request.status == RequestStatus.RUNNING:
                num_new_tokens = min(remaining_prefill_tokens(request), budget)
                if self._allocate_or_preempt(request, num_new_tokens, output, planned):
                    self._plan(output, planned, request, num_new_tokens)
                    budget -= num_new_tokens
                admitting = admitting and not output.preempted_request_ids
            elif admitting and request in self.waiting:  # (not one preempted just now)
                num_new_tokens = self._admit(request, budget)
                if num_new_tokens is None:
                    admitting = False
                    continue
                self._plan(output, planned, request, num_new_tokens)
                budget -= num_new_tokens

    def _admit(self, request: Request, budget: int) -> int | None:
        """Move a waiting request to running with its first chunk's slots allocated; its
        number of tokens this step, or None when it does not fit now."""
        if len(self.running) >= self.config.max_num_seqs:
            return None
        computed_blocks, num_computed_tokens = self.block_manager.get_computed_blocks(request)
        num_new_tokens = request.num_tokens - num_computed_tokens
        if num_new_tokens > budget:
            if not self.config.enable_chunked_prefill:
                return None
            num_new_tokens = budget
        request.num_computed_tokens = num_computed_tokens  # allocate_slots counts from it
        if self.block_manager.allocate_slots(request, num_new_tokens, computed_blocks) is None:
            request.num_computed_tokens = 0
            return None
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        if request.num_cached_tokens is None:  # first scheduling only, not after preemption
            request.num_cached_tokens = num_computed_tokens
            request.scheduled_time = time.monotonic()
        self.running.append(request)
        return num_new_tokens

    def _allocate_or_preempt(
        self, request: Request, num_new_tokens: int, output: SchedulerOutput, planned: set[str]
    ) -> bool:
        """Allocate a running request's slots, preempting the newest running requests not
        planned in this step until they fit; False if the request itself had to go."""
        while self.block_manager.allocate_slots(request, num_new_tokens) is None:
            # the request itself is running and unplanned, so a victim always exists
            victim = next(r for r in reversed(self.running) if r.request_id not in planned)
            self.running.remove(victim)
            self._preempt(victim)
            output.preempted_request_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    @staticmethod
    def _plan(
        output: SchedulerOutput, planned: set[str], request: Request, num_new_tokens: int
    ) -> None:
        output.scheduled.append(ScheduledRequest.plan(request, num_new_tokens))
        planned.add(request.request_id)

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
        grammar = request.grammar  # complete (nothing may follow) or broken: it ends here
        if grammar is not None and grammar.error is not None:
            return RequestStatus.FINISHED_ABORTED
        if grammar is not None and grammar.is_terminated:
            return RequestStatus.FINISHED_STOPPED
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
