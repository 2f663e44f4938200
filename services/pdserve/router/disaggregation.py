"""Where a prompt is prefilled: on the prefill pool (remote) or on its decode worker itself
(colocated), decided per request from the workers' live load. Pure: no I/O, no clock;
the router's side of it, with what it measures on its own requests (the remote hop and
each path's estimate error), is `router/colocation.py`.

Disaggregation keeps long prefills off the decode workers (their TPOT), at the price of a
hop, and of a queue at the prefill pool that every prompt joins: a short prompt arriving
while the pool works through long ones waits for them. So the router estimates, from
what the workers last reported (`WorkerInfo`: queued prefill tokens, step time, prefill
speed, step token budget, cached prefixes, the shortest running output; with what the
router sent there, and saw end there, since: `router/dispatches.py`), the prompt's
TTFT both ways and what prefilling it would do to the decode worker, and decides:

1. no prefill worker to send it to: colocated;
2. the prefill would hold the decode worker for longer than the TTFT target: remote
   (every prompt colocated there meanwhile would wait behind it and miss its own): a
   long prompt is never colocated;
3. it would push the time per output token of the requests decoding there over the
   TPOT target, and the pool meets the prompt's TTFT target: remote (when the pool
   misses it too, one target is lost either way, and colocating loses less: its stall
   spread over the running outputs, against a wait in the pool's queue for this prompt
   and for every long one behind it). The prompt's target is the router's, or its
   client's when that allows longer (what is left of `ttft_slo_ms`): a client that allows
   seconds lets the decode worker's requests keep their TPOT. A client's target tighter
   than the router's does not colocate more: measured, that put the decode worker's TPOT
   over its target at 5 req/s (docs/benchmarks/scheduling.md);
4. otherwise the faster of the two: a short prompt is prefilled where it is decoded (no
   hop, no transfer) unless the decode worker is the busier, and never waits behind the
   pool's long prefills.

That is conditional disaggregation as Dynamo's and llm-d's routers do it (short prompts
prefilled on the decode worker, long ones on the pool), with the threshold derived from
the targets and the live load instead of fixed. `--prefill-placement remote` sends every
prompt to the pool instead (plain disaggregation: every prefill's KV crosses over).

The estimates, in milliseconds, with `rate` the prefill speed (tokens per second) the
workers measured (the best any of them reports; DEFAULT_PREFILL_TOKENS_PER_S before any
has), `U` a worker's uncached share of the prompt, `Q` its queued prefill tokens, `n` its
queued requests, `D` those of them decoding there (`n` on the decode worker, 0 on a
prefill worker, whose requests decode elsewhere), `B` its step token budget (the
min(..., B) terms drop out when it does not report one) and `step` its recent step time:

    ahead      = min(Q, n * U)               (least-work order: a longer prompt queued
                                              there goes after this one)
    ttft       = (ahead + U) / rate          when nothing is queued there (n = 0), else
                 max(step, min(Q, B) / rate) / 2           the step in progress, then
               + max(step, (ahead + U + D) / rate, min(Q + U + D, B) / rate)
                                             the step the prompt joins: queued work
                                             fills it to the budget, so a short prompt
                                             behind a long one's chunks waits a whole
                                             chunk for its token; and each request
                                             decoding there puts a token in it (a
                                             compute-bound step costs its tokens: on a
                                             2-core VM a 50-token prompt's step took
                                             63 ms alone, 67 ms beside 1 decoding
                                             request and 82 ms beside 9)
    remote     = min over prefill workers of ttft + hop
    colocated  = ttft on the decode worker
    stall      = (Q + U) / rate on the decode worker: what its steps take longer, all
                 together, to prefill the prompt and what is queued before it there
    tpot       = step + stall / (S - 1), with S the shortest max_tokens running there
                 (TPOT averages a request's whole output, so a longer step is shared by
                 its tokens; the one with the fewest feels it most); step alone when
                 the worker does not say (S = 0 with requests there), and 0 when it has
                 none (n = 0): no request there to slow down, and the prompt's own
                 tokens come at the step time wherever it is prefilled

`hop` is what the remote path adds to the prefill worker's own time: the median of the
router's recent remote requests, each its wait from Admit to the first token less the
time the prefill worker says it took (`colocation.RemoteHop`); DEFAULT_REMOTE_HOP_MS
while there is none younger than `colocation.SAMPLE_MAX_AGE_S`.

Both TTFT estimates are then corrected by what each path's own requests showed them to
miss (`colocation.EstimateErrors`): the median, over the router's recent requests placed
that way, of the wait it measured to the first token less the estimate it decided on. A
path the load reports cannot see the cost of moves by it: on a lightly loaded cluster, a
remote prompt lands on a prefill worker that has slept for seconds and wakes one more
process than a colocated one, and takes tens of ms longer than its estimate said (on
2-core VMs, docs/benchmarks/scheduling.md), so short prompts stay where they are decoded
until the decode worker's own estimate, and its error, grow past the pool's. Samples
older than `colocation.SAMPLE_MAX_AGE_S` drop out, so a path that stopped being chosen
after a slow spell goes back to its plain estimate, corrected by the other path's error
(what the estimates miss is mostly common to both), and is tried, and measured, again
once its estimate is the lower: a router's errors do not depend on which path happened
to win its first busy minute.

A fixed `--colocate-below N` replaces the decision, and `--prefill-placement` with it:
prompts under N tokens (or almost entirely cached there) are colocated, the others
remote, whatever the load.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pdserve.core.workers import WorkerInfo
from pdserve.router.policy import ColocationRule, num_queued

# Before any worker measured its prefill speed: a small model on a few CPU cores. Low on
# purpose: a slow guess keeps prompts remote rather than stall a decode worker.
DEFAULT_PREFILL_TOKENS_PER_S = 1000.0
# What the remote path adds to a prompt's TTFT (the Admit and Prefill calls) until the
# router has measured it: a 16-64-token prompt alone took 75 ms to its first token on a
# prefill and a decode worker, 56 ms on one colocated worker (a run of 2026-12, in git).
DEFAULT_REMOTE_HOP_MS = 20.0
DEFAULT_TTFT_TARGET_S = 0.25
DEFAULT_TPOT_TARGET_S = 0.05
MS = 1000.0


class PlacementMode(enum.StrEnum):
    """How the router places prefills (`--prefill-placement`)."""

    LIVE = "live"  # decided per request from live load (`decide`)
    REMOTE = "remote"  # every prompt on the prefill pool, while it has a worker


class Placement(enum.StrEnum):
    REMOTE = "remote"  # a prefill worker computes the prompt and ships its KV
    COLOCATED = "colocated"  # the decode worker computes it: no transfer


class Reason(enum.StrEnum):
    """Why: `routing_decisions_total{reason}` and the span's `pdserve.placement.reason`."""

    NO_PREFILL_WORKER = "no_prefill_worker"
    ALWAYS_REMOTE = "always_remote"  # --prefill-placement remote decided
    DECODE_STALL = "decode_stall"  # colocating would hold the decode worker past the TTFT target
    DECODE_TPOT = "decode_tpot"  # colocating would push TPOT there over the target
    COLOCATED_FASTER = "colocated_faster"
    REMOTE_FASTER = "remote_faster"
    COLOCATE_BELOW = "colocate_below"  # the fixed threshold decided (--colocate-below)


@dataclass(frozen=True, slots=True)
class Targets:
    """The router's latency targets (`--ttft-target`, `--tpot-target`), in seconds."""

    ttft_s: float = DEFAULT_TTFT_TARGET_S
    tpot_s: float = DEFAULT_TPOT_TARGET_S

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0:
            raise ValueError(f"targets must be > 0 s, got ttft {self.ttft_s}, tpot {self.tpot_s}")


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """One worker as the decision sees it, for this prompt."""

    address: str
    num_queued: int  # requests running or waiting
    queued_prefill_tokens: int
    step_time_ms: float
    cached_tokens: int  # of this prompt, in its prefix cache (as it last reported)
    step_token_budget: int = 0  # tokens per engine step; 0: not reported (no bound)
    shortest_running_output: int = 0  # the smallest max_tokens running there; 0: none

    @classmethod
    def of(cls, worker: WorkerInfo, cached_tokens: int) -> WorkerLoad:
        return cls(
            worker.address,
            num_queued(worker),
            worker.queued_prefill_tokens,
            worker.step_time_ms,
            cached_tokens,
            worker.step_token_budget,
            worker.shortest_running_output,
        )

    def uncached(self, num_prompt_tokens: int) -> int:
        return num_prompt_tokens - self.cached_tokens

    def ttft_ms(self, num_prompt_tokens: int, rate: float, *, decoding: bool = False) -> float:
        """This prompt's wait for its first token here, remote hop aside; `decoding`: the
        requests here decode here (a decode worker), each a token in every step."""
        uncached, queued = self.uncached(num_prompt_tokens), self.queued_prefill_tokens
        decodes = self.num_queued if decoding else 0
        ahead = min(queued, self.num_queued * uncached)
        compute = (ahead + uncached + decodes) / rate * MS
        if not self.num_queued:
            return compute
        in_progress, joined = self.step_time_ms, 0.0  # a worker that reports no budget
        if budget := self.step_token_budget:
            in_progress = max(in_progress, min(queued, budget) / rate * MS)
            joined = min(queued + uncached + decodes, budget) / rate * MS
        return in_progress / 2 + max(self.step_time_ms, compute, joined)

    def stall_ms(self, num_prompt_tokens: int, rate: float) -> float:
        """How much longer its steps take, all together, to prefill the prompt here."""
        return (self.queued_prefill_tokens + self.uncached(num_prompt_tokens)) / rate * MS

    def tpot_ms(self, stall_ms: float) -> float:
        """The time per output token of the requests running here with `stall_ms` added
        (0: none run here)."""
        if not self.num_queued:
            return 0.0
        if not self.shortest_running_output:
            return self.step_time_ms
        return self.step_time_ms + stall_ms / max(self.shortest_running_output - 1, 1)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What the router knows now about one prompt's candidates."""

    num_prompt_tokens: int
    decode: WorkerLoad  # the decode worker chosen for the request
    prefill: tuple[WorkerLoad, ...]  # the prefill candidates (healthy, not the decode one)
    prefill_tokens_per_s: float  # measured; 0: no worker has yet
    remote_hop_ms: float = DEFAULT_REMOTE_HOP_MS  # what the remote path adds (`RemoteHop`)
    # what each path's requests waited beyond its estimate, lately (`EstimateErrors`)
    remote_error_ms: float = 0.0
    colocated_error_ms: float = 0.0
    # what is left of the client's own TTFT target (`Attempt.ttft_budget_ms`); 0: none
    ttft_budget_ms: float = 0.0

    def pool_ttft_target_ms(self, targets: Targets) -> float:
        """The TTFT the remote path must meet for rule 3: the router's target, or what is
        left of the client's when that is longer."""
        return max(self.ttft_budget_ms, targets.ttft_s * MS)


@dataclass(frozen=True, slots=True)
class Decision:
    placement: Placement
    reason: Reason
    # the estimates as the load reports and the hop give them, before their errors
    remote_ttft_ms: float  # nan: no prefill worker
    colocated_ttft_ms: float
    decode_stall_ms: float  # what prefilling the prompt there adds to the decode worker's steps
    decode_tpot_ms: float  # TPOT of the requests decoding there with that stall
    snapshot: Snapshot
    targets: Targets

    @property
    def colocated(self) -> bool:
        return self.placement is Placement.COLOCATED

    @property
    def placed_by_estimates(self) -> bool:
        """Whether the TTFT estimates decided it (weighed against each other or the
        target): only such a request says how far its path's estimate was off."""
        return self.reason in _COMPARED

    @property
    def estimated_ttft_ms(self) -> float:
        """The chosen path's estimate, uncorrected: what its errors are measured against."""
        return self.colocated_ttft_ms if self.colocated else self.remote_ttft_ms

    def attributes(self) -> dict[str, object]:
        """The decision and the inputs it weighed, as span attributes: a mode or a missing
        pool decides alone, the fixed threshold reads the prompt and its cached prefix, the
        live rules read the whole snapshot."""
        s = self.snapshot
        attributes: dict[str, object] = {
            "pdserve.placement": self.placement.value,
            "pdserve.placement.reason": self.reason.value,
            "pdserve.placement.prompt_tokens": s.num_prompt_tokens,
        }
        if self.reason in _DECIDED_ALONE:
            return attributes
        attributes["pdserve.placement.decode_cached_tokens"] = s.decode.cached_tokens
        if self.reason is Reason.COLOCATE_BELOW:
            return attributes
        best = min(s.prefill, key=lambda w: w.queued_prefill_tokens, default=None)
        attributes.update(
            {
                "pdserve.placement.remote_ttft_ms": self.remote_ttft_ms,
                "pdserve.placement.colocated_ttft_ms": self.colocated_ttft_ms,
                "pdserve.placement.decode_stall_ms": self.decode_stall_ms,
                "pdserve.placement.decode_tpot_ms": self.decode_tpot_ms,
                "pdserve.placement.ttft_target_ms": self.targets.ttft_s * MS,
                "pdserve.placement.tpot_target_ms": self.targets.tpot_s * MS,
                "pdserve.placement.decode_queued_prefill_tokens": s.decode.queued_prefill_tokens,
                "pdserve.placement.decode_running": s.decode.num_queued,
                "pdserve.placement.decode_step_time_ms": s.decode.step_time_ms,
                "pdserve.placement.prefill_queued_tokens": (
                    best.queued_prefill_tokens if best else 0
                ),
                "pdserve.placement.prefill_tokens_per_s": s.prefill_tokens_per_s,
                "pdserve.placement.remote_hop_ms": s.remote_hop_ms,
                "pdserve.placement.remote_error_ms": s.remote_error_ms,
                "pdserve.placement.colocated_error_ms": s.colocated_error_ms,
            }
        )
        if s.ttft_budget_ms:
            attributes["pdserve.placement.request_ttft_budget_ms"] = s.ttft_budget_ms
        return attributes


# reasons no estimate took part in: their span carries the decision and the prompt alone
_DECIDED_ALONE = frozenset({Reason.NO_PREFILL_WORKER, Reason.ALWAYS_REMOTE})
# reasons that weighed the TTFT estimates against each other or the target
_COMPARED = frozenset({Reason.DECODE_TPOT, Reason.COLOCATED_FASTER, Reason.REMOTE_FASTER})


def decide(
    snapshot: Snapshot,
    targets: Targets,
    rule: ColocationRule | None = None,
    mode: PlacementMode = PlacementMode.LIVE,
) -> Decision:
    """Remote or colocated for one prompt (the module docstring's rules); `rule`, when
    enabled, is the fixed threshold that replaces them, and `mode` REMOTE does too."""
    s = snapshot
    rate = s.prefill_tokens_per_s or DEFAULT_PREFILL_TOKENS_PER_S
    n = s.num_prompt_tokens
    colocated_ms = s.decode.ttft_ms(n, rate, decoding=True)
    remote_ms = min((w.ttft_ms(n, rate) + s.remote_hop_ms for w in s.prefill), default=float("nan"))
    stall_ms = s.decode.stall_ms(n, rate)
    tpot_ms = s.decode.tpot_ms(stall_ms)

    def decision(placement: Placement, reason: Reason) -> Decision:
        return Decision(placement, reason, remote_ms, colocated_ms, stall_ms, tpot_ms, s, targets)

    if rule is not None and rule.enabled:
        colocate = rule.should_colocate(n, s.decode.cached_tokens)
        placement = Placement.COLOCATED if colocate else Placement.REMOTE
        return decision(placement, Reason.COLOCATE_BELOW)
    if not s.prefill:
        return decision(Placement.COLOCATED, Reason.NO_PREFILL_WORKER)
    if mode is PlacementMode.REMOTE:
        return decision(Placement.REMOTE, Reason.ALWAYS_REMOTE)
    if stall_ms > targets.ttft_s * MS:
        return decision(Placement.REMOTE, Reason.DECODE_STALL)
    remote_expected_ms = max(remote_ms + s.remote_error_ms, 0.0)
    if tpot_ms > targets.tpot_s * MS and remote_expected_ms <= s.pool_ttft_target_ms(targets):
        return decision(Placement.REMOTE, Reason.DECODE_TPOT)
    if max(colocated_ms + s.colocated_error_ms, 0.0) <= remote_expected_ms:
        return decision(Placement.COLOCATED, Reason.COLOCATED_FASTER)
    return decision(Placement.REMOTE, Reason.REMOTE_FASTER)
