"""A request as the scheduler sees it: token ids and counts, no tensors."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.grammar import GrammarMatcher


class RequestStatus(enum.IntEnum):
    """Ordered so that `is_finished` is one comparison."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # back in the waiting queue, its blocks freed, to be recomputed
    FINISHED_STOPPED = 3  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = 4  # max_tokens or the context window
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = 0.0
    status: RequestStatus = RequestStatus.WAITING
    # prompt + output, appended to as tokens are sampled (never rebuilt per step)
    token_ids: list[int] = field(default_factory=list)
    # tokens whose KV is in the cache; the scheduler advances it after each step
    num_computed_tokens: int = 0
    # prompt tokens served from the prefix cache at first scheduling
    num_cached_tokens: int | None = None
    # time.monotonic() of its first scheduling (queue wait: this - arrival_time); 0.0: not yet
    scheduled_time: float = 0.0
    # the block table: block_ids[i] holds tokens [i*block_size, (i+1)*block_size)
    block_ids: list[int] = field(default_factory=list)
    # chained hashes of this request's full blocks, computed once per block
    block_hashes: list[bytes] = field(default_factory=list)
    num_preemptions: int = 0
    # lower runs first (the public API's `priority`, as in vLLM); see engine/scheduling.py
    priority: int = 0
    # time.monotonic() by which the client wants its first token (its TTFT target, the
    # public API's `ttft_slo_ms`); 0.0: none. See engine/scheduling.py, deadlines.
    ttft_deadline: float = 0.0
    # set by the scheduler when the request is queued: its place in arrival order, and the
    # tokens the engine had computed by then (how long it has waited, in work: aging)
    arrival_index: int = 0
    work_at_arrival: int = 0
    # params.constraint's matcher, advanced with every output token; None: unconstrained
    grammar: GrammarMatcher | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.advance(token_id)  # a rejected token leaves it in error: it stops
