"""The scheduling policy: in which order prompts get a step's token budget. Pure Python.

Each step the scheduler serves the requests that are decoding first (one token each, in
admission order), then hands what is left of the token budget to the requests that still
have prompt tokens to compute, the waiting ones and the ones partway through a chunked
prefill alike, in the order of their policy key (smallest first):

- FCFS: arrival order.
- PRIORITY: `priority` (lower first, as in vLLM), then arrival order.
- LEAST_WORK (the engine's default): `priority`, then the least remaining prefill work,
  aged. A request's key is

      remaining = num_tokens - num_computed_tokens        (tokens still to compute)
      key       = remaining + aging * work_at_arrival

  where `work_at_arrival` counts the tokens the engine had computed, for every request,
  when this one arrived. Subtracting the common `aging * work_now` shows what it means:
  each token the engine computes while a request waits takes `aging` off its remaining
  work. So a short prompt goes ahead of a long one, and a long one running in chunks
  pauses for the short prompts that arrive, but only for a while:

  **Bound.** A request that arrives with `R` tokens to compute (key `K`) is never
  overtaken by a request arriving after the engine has computed `R / aging` more tokens
  (every later arrival's key exceeds `K`, and a request's key only falls as it runs). So
  what runs before it is what was waiting with a smaller key at its arrival, plus at most
  `R / aging` tokens of later arrivals: with `aging = 0.25`, a 2,048-token prompt waits
  for at most 8,192 tokens of work that came after it. Among requests of one priority
  (a lower priority value always goes first), and as long as it is not preempted (a
  preempted request recomputes from scratch, so its remaining work grows again).

**Deadlines.** With a deadline scale `d` (the engine's `scheduling_deadline_scale`, 0:
off), LEAST_WORK also tells prompts that can still get their first token in time from
those that cannot, on the same clock of work:

      late = (work_now - work_at_arrival) + remaining  >  d * max(prompt tokens, budget)

(the work the engine has done since the prompt arrived, and what it still needs, against
`d` times its own prefill: a relative TTFT target in DistServe's style, a step's token
budget at least). Only a prompt not started yet can be late. A late prompt's key grows
by a penalty `P` (DEADLINE_PENALTY_TOKENS), so it yields to the prompts still on time.
Without that, when a pool falls behind, its prompts share it until every one of them is
late; with it, the ones that can still make their target do, and the late ones, whose
target is lost whatever happens, go after them (docs/benchmarks.md, issue 16, has what
that did to the mixed workload's long prompts on one prefill worker). A waiting prompt
that is late stays late until it starts (its wait only grows), and the bound stays a
bound: a late prompt is overtaken by no request arriving after the engine has computed
`(R + P) / aging` more tokens. The clock counts decode tokens too, which
cost a decode worker more time each than a prompt's: there a deadline comes a little
late.

**Clients' TTFT targets.** A request may come with the client's own target for its first
token (the public API's `ttft_slo_ms`, as llm-d's `x-slo-ttft-ms` header): a deadline
on the wall clock, `ttft_deadline`. Such a request is late, whatever the deadline scale
(0 included), once

      now + remaining * seconds_per_token  >  ttft_deadline

where `seconds_per_token` is the engine's recent pace (`Pace`: wall time per token
computed, over the last steps). Unlike the relative deadline, the target is the one the
client judges by, so a prompt partway through its prefill can be late too: it pauses,
keeping its blocks (and the lease of a KV push it has begun, which its prefill worker
renews), until the prompts that can still make their targets are done; only one with
tokens out already is never late. The bound above holds for it too. On a worker that
also decodes, the pace counts its decode steps, whose tokens each cost more time than a
prompt's: there the estimate runs high and a prompt is late a little early.

The remaining work ignores prefix-cache hits a waiting request would get (looking them up
costs a hash walk per waiting request per step); a hit only makes a prompt shorter than
its key says.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.engine.request import Request

DEFAULT_AGING = 0.25
# A prompt is late once the engine's work since its arrival plus its own remaining work
# passes this many times its prompt (LEAST_WORK's deadlines; engines default to it).
DEFAULT_DEADLINE_SCALE = 2.0
# How much each earlier step weighs in the engine's pace against the one after it.
PACE_DECAY = 0.9
# What a late prompt's key grows by: it goes behind every on-time prompt of up to this
# many tokens that arrived within DEADLINE_PENALTY_TOKENS / aging tokens of work of it.
DEADLINE_PENALTY_TOKENS = 16_384


class SchedulingPolicy(enum.StrEnum):
    """Which prompts get a step's token budget first (see the module docstring)."""

    FCFS = "fcfs"
    PRIORITY = "priority"
    LEAST_WORK = "least_work"

    def key(self, request: Request, ordering: Ordering) -> tuple:
        """The request's place in the order: smallest first; ties cannot happen (the
        arrival index is unique)."""
        return _KEYS[self](request, ordering)


@dataclass(frozen=True, slots=True)
class Ordering:
    """What LEAST_WORK's keys read besides the request, for one step's order."""

    aging: float = DEFAULT_AGING
    deadline_scale: float = 0.0  # 0: no deadlines
    min_deadline_tokens: int = 0  # a prompt's deadline is for at least this much work
    deadline_penalty: int = DEADLINE_PENALTY_TOKENS  # what a late prompt's key grows by
    work_now: int = 0  # tokens the engine has computed so far (the clock of work)
    now: float = 0.0  # time.monotonic() as the step is planned (clients' TTFT targets)
    seconds_per_token: float = 0.0  # the engine's recent pace (`Pace`)

    def is_late(self, request: Request) -> bool:
        """Whether the prompt can no longer get its first token within its deadline: its
        client's TTFT target when it has one, else (not started yet) the relative one.
        Without a client's target, one partway through its prefill is never late: pausing
        it would hold its blocks, and a KV push it has begun, for a deadline of our own.
        One with tokens out already (back from a preemption) is never late."""
        if request.num_output_tokens:
            return False
        if request.ttft_deadline:
            done_at = self.now + remaining_prefill_tokens(request) * self.seconds_per_token
            return done_at > request.ttft_deadline
        if not self.deadline_scale or request.num_computed_tokens:
            return False
        waited = self.work_now - request.work_at_arrival
        allowed = self.deadline_scale * max(request.num_prompt_tokens, self.min_deadline_tokens)
        return waited + remaining_prefill_tokens(request) > allowed


class Pace:
    """The engine's recent wall time per token computed (each step timed once, by
    `LLMEngine.step`): what a prompt's remaining work will take, for clients' TTFT
    targets. A decayed ratio of sums over steps (each earlier step weighs `decay` times
    the next), so a full step weighs more than a small one."""

    def __init__(self, decay: float = PACE_DECAY):
        self.decay = decay
        self._seconds = 0.0
        self._tokens = 0.0
        self.last_step = (0, 0.0)  # the last step's tokens and seconds, as recorded

    def record(self, num_tokens: int, seconds: float) -> None:
        """One step that computed `num_tokens` tokens in `seconds`."""
        self._seconds = self.decay * self._seconds + seconds
        self._tokens = self.decay * self._tokens + num_tokens
        self.last_step = (num_tokens, seconds)

    @property
    def seconds_per_token(self) -> float:
        """0.0 until a step has run: deadlines then count the wait alone."""
        return self._seconds / self._tokens if self._tokens else 0.0


def remaining_prefill_tokens(request: Request) -> int:
    """Tokens still to compute before the request samples its next token."""
    return request.num_tokens - request.num_computed_tokens


def _fcfs(request: Request, ordering: Ordering) -> tuple:
    return (request.arrival_index,)


def _priority(request: Request, ordering: Ordering) -> tuple:
    return (request.priority, request.arrival_index)


def _least_work(request: Request, ordering: Ordering) -> tuple:
    aged = remaining_prefill_tokens(request) + ordering.aging * request.work_at_arrival
    if ordering.is_late(request):
        aged += ordering.deadline_penalty
    return (request.priority, aged, request.arrival_index)


_KEYS: dict[SchedulingPolicy, Callable[[Request, Ordering], tuple]] = {
    SchedulingPolicy.FCFS: _fcfs,
    SchedulingPolicy.PRIORITY: _priority,
    SchedulingPolicy.LEAST_WORK: _least_work,
}
