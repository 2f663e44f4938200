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

The remaining work ignores prefix-cache hits a waiting request would get (looking them up
costs a hash walk per waiting request per step); a hit only makes a prompt shorter than
its key says.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from pdserve.engine.request import Request

DEFAULT_AGING = 0.25


class SchedulingPolicy(enum.StrEnum):
    """Which prompts get a step's token budget first (see the module docstring)."""

    FCFS = "fcfs"
    PRIORITY = "priority"
    LEAST_WORK = "least_work"

    def key(self, request: Request, aging: float) -> tuple:
        """The request's place in the order: smallest first; ties cannot happen (the
        arrival index is unique)."""
        return _KEYS[self](request, aging)


def remaining_prefill_tokens(request: Request) -> int:
    """Tokens still to compute before the request samples its next token."""
    return request.num_tokens - request.num_computed_tokens


def _fcfs(request: Request, aging: float) -> tuple:
    return (request.arrival_index,)


def _priority(request: Request, aging: float) -> tuple:
    return (request.priority, request.arrival_index)


def _least_work(request: Request, aging: float) -> tuple:
    aged = remaining_prefill_tokens(request) + aging * request.work_at_arrival
    return (request.priority, aged, request.arrival_index)


_KEYS: dict[SchedulingPolicy, Callable[[Request, float], tuple]] = {
    SchedulingPolicy.FCFS: _fcfs,
    SchedulingPolicy.PRIORITY: _priority,
    SchedulingPolicy.LEAST_WORK: _least_work,
}
