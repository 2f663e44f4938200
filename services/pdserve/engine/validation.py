"""Request checks shared by the engine and the router, so both name the same fields."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.sampling_params import SamplingParams


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
