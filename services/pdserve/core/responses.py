"""What the Router API answers, as plain objects: completions, chunks, request and model info.

`pdserve.client` hands these out; `pdserve.rpc.wire` builds them from the messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.core.sampling_params import TokenLogprobs


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens whose KV came from a prefix cache


@dataclass(slots=True)
class Chunk:
    """One streamed message: the tokens from `offset` on, and the final state on the last."""

    request_id: str
    offset: int  # index of token_ids[0] in the whole output
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token, if asked
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last chunk only
    usage: Usage | None = None  # last chunk only
    # the router's per-phase milliseconds (queue_ms, ttft_ms, transfer_ms, decode_ms,
    # total_ms); last chunk only, and None when re-attaching to an existing request
    timings: dict[str, float] | None = None


@dataclass(slots=True)
class Completion:
    """A whole completion (from `resume_from` on, when resuming)."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    usage: Usage
    timings: dict[str, float] | None
    logprobs: list[TokenLogprobs] = field(default_factory=list)

    @classmethod
    def from_chunks(cls, chunks: Sequence[Chunk]) -> Completion:
        """Join a stream's chunks; the final state comes from the last one."""
        if not chunks:
            raise ValueError("a completion needs at least one chunk")
        last = chunks[-1]
        return cls(
            request_id=last.request_id,
            token_ids=[t for c in chunks for t in c.token_ids],
            text="".join(c.text for c in chunks),
            finish_reason=last.finish_reason,
            usage=last.usage or Usage(),
            timings=last.timings,
            logprobs=[lp for c in chunks for lp in c.logprobs],
        )


@dataclass(slots=True)
class RequestInfo:
    """Where a request stands, from the shared request store (any router answers)."""

    request_id: str
    # queued | prefilling | transferring | decoding | finished | failed | cancelled
    status: str
    prefill_worker: str
    decode_worker: str
    usage: Usage
    finish_reason: str | None
    error: str
    created_at: float  # unix seconds
    updated_at: float
    trace_id: str = ""  # 32 hex digits of the request's trace; "" when it was not traced


@dataclass(slots=True)
class ModelInfo:
    model: str
    architecture: str
    vocab_size: int
    max_model_len: int
    model_fingerprint: str
    eos_token_ids: list[int]
