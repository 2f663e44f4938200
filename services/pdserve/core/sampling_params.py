"""What a request asks of sampling and stopping, validated field by field."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.core.errors import InvalidRequestError

MAX_LOGPROBS = 20


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k filter
    top_p: float = 1.0  # nucleus mass, in (0, 1]
    min_p: float = 0.0  # drop tokens below min_p * p(max), in [0, 1]
    repetition_penalty: float = 1.0  # HF/CTRL style, on prompt and output tokens, > 0
    frequency_penalty: float = 0.0  # OpenAI style, on output tokens, in [-2, 2]
    presence_penalty: float = 0.0  # OpenAI style, on output tokens, in [-2, 2]
    max_tokens: int = 16
    min_tokens: int = 0  # EOS and stop tokens are ignored until this many are out
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings, not returned in text
    seed: int | None = None
    logprobs: int | None = None  # None: none; N: sampled token plus top-N (N <= 20)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidRequestError naming the first invalid field."""
        _finite("temperature", self.temperature, low=0.0)
        _finite("top_p", self.top_p, low=0.0, low_open=True, high=1.0)
        _finite("min_p", self.min_p, low=0.0, high=1.0)
        _finite("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True)
        _finite("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        _finite("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _integer("top_k", self.top_k, low=0)
        _integer("max_tokens", self.max_tokens, low=1)
        _integer("min_tokens", self.min_tokens, low=0)
        if self.min_tokens > self.max_tokens:
            raise _invalid("min_tokens", f"{self.min_tokens} exceeds max_tokens {self.max_tokens}")
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        if self.seed is not None:
            _integer("seed", self.seed, low=0, high=2**63 - 1)
        for i, token_id in enumerate(self.stop_token_ids):
            _integer(f"stop_token_ids[{i}]", token_id, low=0, high=vocab_size - 1)
        for i, text in enumerate(self.stop):
            if not isinstance(text, str) or not text:
                raise _invalid(f"stop[{i}]", "must be a non-empty string")


def _invalid(name: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"sampling_params.{name}", message)


def _finite(name, value, low=None, high=None, low_open=False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _invalid(name, f"must be a finite number, got {value!r}")
    if low is not None and (value <= low if low_open else value < low):
        bound = f"> {low}" if low_open else f">= {low}"
        raise _invalid(name, f"must be {bound}, got {value}")
    if high is not None and value > high:
        raise _invalid(name, f"must be <= {high}, got {value}")


def _integer(name, value, low=None, high=None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid(name, f"must be an integer, got {value!r}")
    if low is not None and value < low:
        raise _invalid(name, f"must be >= {low}, got {value}")
    if high is not None and value > high:
        raise _invalid(name, f"must be <= {high}, got {value}")


def check_prompt_token_ids(
    prompt: Sequence[int], vocab_size: int, field: str = "prompt_token_ids"
) -> list[int]:
    """The ids as a list, or InvalidRequestError naming the first bad one (`field[i]`)."""
    ids = list(prompt)
    if not ids:
        raise InvalidRequestError(field, "must not be empty")
    for i, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise InvalidRequestError(
                f"{field}[{i}]", f"{token!r} is outside the vocabulary [0, {vocab_size})"
            )
    return ids


def check_request(
    prompt_ids: Sequence[int], params: SamplingParams, vocab_size: int, max_model_len: int
) -> None:
    """Sampling parameters valid, and prompt plus max_tokens inside the context window."""
    params.validate(vocab_size)
    n = len(prompt_ids)
    if n >= max_model_len:
        raise InvalidRequestError("prompt", f"{n} tokens; the context window is {max_model_len}")
    if n + params.max_tokens > max_model_len:
        raise InvalidRequestError(
            "sampling_params.max_tokens",
            f"{params.max_tokens} plus the {n}-token prompt exceeds the context window "
            f"of {max_model_len}",
        )


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float  # of token_id under the raw distribution
    top: list[tuple[int, float]]  # params.logprobs (token_id, logprob) pairs, best first
