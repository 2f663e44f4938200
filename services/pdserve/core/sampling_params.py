"""What a request asks of sampling and stopping, validated field by field."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.core.errors import InvalidRequestError
from pdserve.core.structured_output import MAX_CONSTRAINT_BYTES, Constraint

MAX_LOGPROBS = 20
# Hard caps every engine enforces, whatever the router's own (lower) limits say: the stop
# matcher's automaton holds at most MAX_STOP_STRINGS * MAX_STOP_LENGTH characters.
MAX_STOP_STRINGS = 64
MAX_STOP_LENGTH = 1024  # characters of one stop string
MAX_LOGIT_BIAS = 1024  # token ids one request may bias
LOGIT_BIAS_RANGE = 100.0  # each bias in [-100, 100], as OpenAI's API bounds it


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
    # what the output must match (structured outputs); None: free text
    constraint: Constraint | None = None
    # added to these tokens' logits before sampling (OpenAI's logit_bias): token id -> bias
    logit_bias: dict[int, float] = field(default_factory=dict)

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
        check_stop_strings(self.stop, MAX_STOP_STRINGS, MAX_STOP_LENGTH)
        self._check_logit_bias(vocab_size)
        if self.constraint is not None:
            self.constraint.validate(f"sampling_params.{self.constraint.kind.value}")

    def _check_logit_bias(self, vocab_size: int) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise _invalid(
                "logit_bias", f"{len(self.logit_bias)} tokens; the limit is {MAX_LOGIT_BIAS}"
            )
        for token_id, bias in self.logit_bias.items():
            _integer(f"logit_bias[{token_id}]", token_id, low=0, high=vocab_size - 1)
            _finite(f"logit_bias[{token_id}]", bias, low=-LOGIT_BIAS_RANGE, high=LOGIT_BIAS_RANGE)


def check_stop_strings(
    stop: Sequence[str], max_count: int, max_length: int, field: str = "sampling_params.stop"
) -> None:
    """At most `max_count` non-empty strings of at most `max_length` characters each, or
    InvalidRequestError naming `field` (the list) or `field[i]` (one string)."""
    if len(stop) > max_count:
        raise InvalidRequestError(field, f"{len(stop)} stop strings; the limit is {max_count}")
    for i, text in enumerate(stop):
        if not isinstance(text, str) or not text:
            raise InvalidRequestError(f"{field}[{i}]", "must be a non-empty string")
        if len(text) > max_length:
            raise InvalidRequestError(
                f"{field}[{i}]", f"{len(text)} characters; the limit is {max_length}"
            )


def _invalid(name: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"sampling_params.{name}", message)


def _finite(
    name: str,
    value: object,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _invalid(name, f"must be a finite number, got {value!r}")
    if low is not None and (value <= low if low_open else value < low):
        bound = f"> {low}" if low_open else f">= {low}"
        raise _invalid(name, f"must be {bound}, got {value}")
    if high is not None and value > high:
        raise _invalid(name, f"must be <= {high}, got {value}")


def _integer(name: str, value: object, low: int | None = None, high: int | None = None) -> None:
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


# The default bound on a prompt's text, per token of the context window. English BPE text
# is about 4 UTF-8 bytes a token and CJK about 3.6 (3 bytes a character); a vocabulary's
# longest tokens (runs of spaces or '=') reach 16-128 bytes. 32 lets through any realistic
# prompt that fits the window and refuses a 15 MB one for a 4k window before tokenizing it.
PROMPT_BYTES_PER_TOKEN = 32
_MAX_UTF8_BYTES_PER_CHAR = 4
_MAX_VARINT_BYTES = 5  # a token id or a length on the wire
# A request's fields beside its prompt and stop strings: sampling, ids, KServe's tensor
# names and parameters.
REQUEST_OVERHEAD_BYTES = 64 << 10


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What one request may hold, checked before its prompt is tokenized: tokenizing costs
    about a microsecond and several hundred bytes of memory per byte of text."""

    max_prompt_bytes: int  # UTF-8 bytes of a prompt's text
    max_model_len: int  # the context window: a prompt must leave room for one token
    max_stop_strings: int = MAX_STOP_STRINGS
    max_stop_length: int = MAX_STOP_LENGTH  # characters

    def __post_init__(self) -> None:
        for name in ("max_prompt_bytes", "max_model_len", "max_stop_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.max_stop_strings <= MAX_STOP_STRINGS:
            raise ValueError(f"max_stop_strings must be in [0, {MAX_STOP_STRINGS}]")
        if self.max_stop_length > MAX_STOP_LENGTH:
            raise ValueError(f"max_stop_length must be <= {MAX_STOP_LENGTH}")

    def max_message_bytes(self) -> int:
        """The largest request message a router takes: the longest prompt these limits
        allow (text or token ids), its stop strings, and room for the rest. gRPC refuses a
        larger one before parsing it, so no field is ever held far past its limit."""
        prompt = max(self.max_prompt_bytes, _MAX_VARINT_BYTES * self.max_model_len)
        stop = self.max_stop_strings * (4 * self.max_stop_length + _MAX_VARINT_BYTES + 1)
        return prompt + stop + MAX_CONSTRAINT_BYTES + REQUEST_OVERHEAD_BYTES

    def max_json_body_bytes(self) -> int:
        """The same request as an HTTP JSON body: a JSON string spends at most 6 bytes
        (`\\u00XX`) on a byte of text, and a token id at most 11 (`4294967295,`)."""
        return max(6 * self.max_message_bytes(), 11 * self.max_model_len + REQUEST_OVERHEAD_BYTES)

    def check_text(self, text: str, field: str) -> None:
        """InvalidRequestError naming `field` if `text` is over max_prompt_bytes in UTF-8."""
        limit = self.max_prompt_bytes
        # characters <= UTF-8 bytes <= 4 x characters: only a text near the limit is encoded
        if len(text) > limit or (
            len(text) * _MAX_UTF8_BYTES_PER_CHAR > limit and len(text.encode()) > limit
        ):
            raise InvalidRequestError(field, f"exceeds the limit of {limit} bytes (UTF-8)")

    def check_num_tokens(self, num_tokens: int, field: str) -> None:
        """InvalidRequestError naming `field` if a prompt leaves no room in the window."""
        if num_tokens >= self.max_model_len:
            raise InvalidRequestError(
                field, f"{num_tokens} tokens; the context window is {self.max_model_len}"
            )

    def check_stop(self, stop: Sequence[str], field: str) -> None:
        check_stop_strings(stop, self.max_stop_strings, self.max_stop_length, field)


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float  # of token_id under the raw distribution
    top: list[tuple[int, float]]  # params.logprobs (token_id, logprob) pairs, best first
