"""The router's side of the remote-or-colocated decision (`router/disaggregation.py`, pure):
what it measures on its own requests, the remote hop and how far each path's TTFT
estimate fell short, and `LiveColocation`, which reads the workers' reports, asks
`decide`, and learns from what follows.

What it learns ages. A path the decision stopped choosing teaches nothing new, so
without an age its worst spell would keep it out for good; and a path with no recent
request of its own is weighed with the other's error, since most of what the estimates
miss is common to both.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence

from pdserve.api.v1 import decode_pb2
from pdserve.core.workers import WorkerInfo
from pdserve.router.disaggregation import (
    DEFAULT_REMOTE_HOP_MS,
    Decision,
    Placement,
    PlacementMode,
    Snapshot,
    Targets,
    WorkerLoad,
    decide,
)
from pdserve.router.policy import CachedHashSets, ColocationRule, cached_prefix_blocks

# The hop is the median of this many recent remote requests' own.
HOP_SAMPLES = 32
# Each path's estimate error is the median of this many of its recent requests'.
ERROR_SAMPLES = 32
# The hop's and the errors' samples count for this long. A path the decision stopped
# choosing teaches nothing new, so without an age its worst spell would keep it out for
# good (a busy minute's remote requests, say, with every prompt colocated since): once
# its samples are this old it is weighed with the other path's error, is chosen again
# where its plain estimate is the lower, and is measured anew.
SAMPLE_MAX_AGE_S = 20.0


class RecentSamples:
    """The median of the last `maxlen` samples younger than SAMPLE_MAX_AGE_S; None when
    there are none."""

    __slots__ = ("_samples", "_clock")

    def __init__(self, maxlen: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=maxlen)  # (when, value)
        self._clock = clock

    def add(self, value: float) -> None:
        self._samples.append((self._clock(), value))

    @property
    def median(self) -> float | None:
        oldest = self._clock() - SAMPLE_MAX_AGE_S
        while self._samples and self._samples[0][0] < oldest:
            self._samples.popleft()
        if not self._samples:
            return None
        return statistics.median(value for _, value in self._samples)


class RemoteHop:
    """What the remote path adds to a prompt's TTFT, measured on the router's own remote
    requests: the median of the last HOP_SAMPLES within SAMPLE_MAX_AGE_S,
    DEFAULT_REMOTE_HOP_MS when there are none. Each is the router's wait from Admit to
    the first token less the prefill worker's own time (its queue and compute, which the
    estimates model from the load reports)."""

    __slots__ = ("_samples",)

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._samples = RecentSamples(HOP_SAMPLES, clock)

    @property
    def ms(self) -> float:
        measured = self._samples.median
        return DEFAULT_REMOTE_HOP_MS if measured is None else measured

    def observe(self, waited_ms: float, prefill_ms: float) -> None:
        """One remote request: the router waited `waited_ms`, its worker took `prefill_ms`
        (0: a worker that does not say, which teaches nothing)."""
        if prefill_ms <= 0:
            return
        self._samples.add(max(waited_ms - prefill_ms, 0.0))


class EstimateErrors:
    """How far each placement's TTFT estimate fell short of what its requests then waited,
    as the router measured it: per placement, the median of its last ERROR_SAMPLES
    requests' (wait to the first token less the uncorrected estimate the decision made)
    within SAMPLE_MAX_AGE_S. Negative when the estimates ran pessimistic.

    A placement with no such request borrows the other's error, 0 when neither has one.
    Most of what the estimates miss is common to both paths (the router's and the
    worker's own work around a step, a step's fixed cost), so a path that has not been
    chosen lately is weighed with it rather than as exact: an error of 0 against the
    other's +40 ms would send it the next prompts whatever the load (on a 2-core VM, 6
    of 25 short prompts at 0.5 req/s went through the pool that way, at 111 ms to their
    first token against 83 for those colocated, in a variant not kept). Weighed
    alike, the paths differ by their estimates alone, so the one left is tried again
    when the load says it is the faster.

    Only requests whose placement the estimates decided teach it
    (`Decision.placed_by_estimates`): a long prompt sent to the pool because it would
    stall the decode worker is not one, and its wait (seconds in the queue, under
    least-work order) says nothing about a short one's."""

    __slots__ = ("_samples",)

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._samples = {placement: RecentSamples(ERROR_SAMPLES, clock) for placement in Placement}

    @property
    def ms(self) -> dict[Placement, float]:
        own = {placement: samples.median for placement, samples in self._samples.items()}
        known = [error for error in own.values() if error is not None]
        borrowed = statistics.median(known) if known else 0.0  # of the other, with two
        return {placement: borrowed if error is None else error for placement, error in own.items()}

    def observe(self, decision: Decision, waited_ms: float) -> None:
        """One request placed by `decision` waited `waited_ms` from it to its first token."""
        if not decision.placed_by_estimates:
            return
        self._samples[decision.placement].add(waited_ms - decision.estimated_ttft_ms)


class LiveColocation:
    """The router's placement decision: its targets, mode and fixed override, the
    remote hop and the estimate errors it measures, and the prefix-cache sets it reads
    the workers' reports through (built once per report)."""

    def __init__(
        self,
        targets: Targets,
        rule: ColocationRule | None = None,
        mode: PlacementMode = PlacementMode.LIVE,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.targets, self.rule, self.mode = targets, rule or ColocationRule(), mode
        self.hop = RemoteHop(clock)
        self.errors = EstimateErrors(clock)
        self._hash_sets = CachedHashSets()

    def decide(
        self,
        decode: WorkerInfo,
        prefill: Sequence[WorkerInfo],
        block_hashes: Sequence[str],
        num_prompt_tokens: int,
        ttft_budget_ms: float = 0.0,
    ) -> Decision:
        """Where to prefill a prompt whose decode worker is `decode`; `prefill` are the
        prefill candidates (unhealthy ones, and `decode` itself, are left out);
        `ttft_budget_ms` is what is left of its client's TTFT target (0: none)."""
        candidates = [w for w in prefill if w.healthy and w.address != decode.address]
        self._hash_sets.retain([decode, *candidates])
        errors = self.errors.ms
        snapshot = Snapshot(
            num_prompt_tokens,
            self._load(decode, block_hashes, num_prompt_tokens),
            tuple(self._load(w, block_hashes, num_prompt_tokens) for w in candidates),
            max((w.prefill_tokens_per_s for w in (decode, *candidates)), default=0.0),
            self.hop.ms,
            errors[Placement.REMOTE],
            errors[Placement.COLOCATED],
            ttft_budget_ms,
        )
        return decide(snapshot, self.targets, self.rule, self.mode)

    def _load(self, worker: WorkerInfo, hashes: Sequence[str], num_tokens: int) -> WorkerLoad:
        blocks = cached_prefix_blocks(worker, hashes, self._hash_sets)
        # the block holding the last token is always computed (the scheduler's rule)
        cached = min(blocks * worker.block_size, max(num_tokens - 1, 0))
        return WorkerLoad.of(worker, cached)


class FirstTokenTimer:
    """Passes a colocated request's deltas on; at its first (a colocated prompt's first
    token comes with its stream), tells the placement's errors how long it took after
    the decision, and `on_first` that the prompt is computed."""

    __slots__ = ("_deliver", "_errors", "_placement", "_on_first", "_asked")

    def __init__(
        self,
        deliver: Callable[[decode_pb2.TokenDelta], None],
        errors: EstimateErrors,
        placement: Decision,
        on_first: Callable[[], None] = lambda: None,
    ):
        self._deliver, self._errors, self._placement = deliver, errors, placement
        self._on_first = on_first
        self._asked: float | None = time.perf_counter()

    @property
    def seen(self) -> bool:
        """Whether the first delta came."""
        return self._asked is None

    def __call__(self, delta: decode_pb2.TokenDelta) -> None:
        if self._asked is not None:
            self._errors.observe(self._placement, (time.perf_counter() - self._asked) * 1000)
            self._asked = None
            self._on_first()
        self._deliver(delta)
