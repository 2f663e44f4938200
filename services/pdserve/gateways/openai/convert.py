"""OpenAI requests as the router's `GenerateRequest`s: one per prompt and choice.

`n` choices are `n` router requests (the public API has no `n`): each its own session,
its own KV and its own cancellation. With a `seed`, choice 0 samples with that seed (so
`n=1` and the first of `n` agree) and choice `i` with one derived from `(seed, i)`;
without one the router seeds each request itself, so choices differ.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.api.v1 import common_pb2, router_pb2
from pdserve.core.sampling_params import RequestLimits
from pdserve.core.structured_output import ConstraintKind
from pdserve.gateways.chat_template import ChatTemplate
from pdserve.gateways.openai.constraints import RESPONSE_FORMAT, AskedConstraint, asked_constraint
from pdserve.gateways.openai.errors import bad_request
from pdserve.gateways.openai.protocol import (
    INT32_MAX,
    MAX_CHOICES,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
    unsupported_field,
)
from pdserve.router.frontend import PUBLIC_SAMPLING
from pdserve.rpc.wire import constraint_to_proto

DEFAULT_TEMPERATURE = 1.0  # OpenAI's
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's legacy completions; chat: the context left
TEXT_PART = "text"
_CONSTRAINT_FIELDS = frozenset(kind.value for kind in ConstraintKind)
PART_SEPARATOR = "\n"  # between a message's text parts, as vLLM joins them


@dataclass(frozen=True, slots=True)
class ParamNames:
    """How one request names what the router's errors call `prompt...`, `sampling.*`."""

    prompt: str  # "messages" | "prompt"
    max_tokens: str  # "max_tokens" | "max_completion_tokens"
    logprobs: str  # "top_logprobs" | "logprobs"
    constraint: str = RESPONSE_FORMAT  # "response_format" | "guided_json" | ...

    def of(self, field: str) -> str:
        if field.startswith("prompt"):
            return self.prompt
        name = field.removeprefix(PUBLIC_SAMPLING + ".")
        base = name.split("[", 1)[0]
        if base in _CONSTRAINT_FIELDS:
            return self.constraint
        if base == "max_tokens":
            return self.max_tokens
        if base == "logprobs":
            return self.logprobs
        return base if base in ("stop", "logit_bias") else name


@dataclass(frozen=True, slots=True)
class RouterRequests:
    """What one OpenAI request becomes: `n` requests per prompt, prompt-major (choice
    index `prompt * n + j`, as OpenAI numbers them)."""

    requests: list[router_pb2.GenerateRequest]
    n: int
    names: ParamNames


def choice_seeds(seed: int | None, n: int) -> list[int | None]:
    """Each choice's seed: `seed` for the first, one derived from (seed, i) for the others."""
    if seed is None:
        return [None] * n
    return [seed] + [_derived_seed(seed, i) for i in range(1, n)]


def _derived_seed(seed: int, index: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # 63 bits: the engine's seeds are int64 >= 0


def chat_requests(
    request: ChatCompletionRequest, template: ChatTemplate | None, limits: RequestLimits
) -> RouterRequests:
    """The chat's prompt rendered and tokenized here (the router gets token ids); the
    rendered text is held to --max-prompt-bytes before it is tokenized."""
    _check_common(request, num_prompts=1)
    if template is None:
        raise bad_request("messages", "this model has no chat template: use /v1/completions")
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs", "needs logprobs: true")
    text = template.render([_message(i, m) for i, m in enumerate(request.messages)])
    limits.check_text(text, "messages")
    prompt_ids = template.encode(text)
    max_model_len = limits.max_model_len
    max_tokens = request.max_completion_tokens
    if max_tokens is None:
        max_tokens = request.max_tokens
    if max_tokens is None:  # the rest of the context window (a prompt too long fails there)
        max_tokens = max(max_model_len - len(prompt_ids), 1)
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    uses_completion_tokens = request.max_completion_tokens is not None
    asked = asked_constraint(request)
    names = ParamNames(
        prompt="messages",
        max_tokens="max_completion_tokens" if uses_completion_tokens else "max_tokens",
        logprobs="top_logprobs" if request.top_logprobs is not None else "logprobs",
        constraint=_constraint_field(asked),
    )
    prompt = router_pb2.TokenIds(ids=prompt_ids)
    sampling = _sampling(request, max_tokens, logprobs, asked)
    requests = [
        _request(sampling, seed, request.stream, token_ids=prompt, priority=request.priority)
        for seed in choice_seeds(request.seed, request.n)
    ]
    return RouterRequests(requests, request.n, names)


def completion_requests(request: CompletionRequest) -> RouterRequests:
    """Each prompt (text or token ids) as the router takes it, `n` times."""
    prompts = _prompts(request.prompt)
    _check_common(request, num_prompts=len(prompts))
    max_tokens = request.max_tokens
    asked = asked_constraint(request)
    sampling = _sampling(
        request,
        DEFAULT_COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens,
        request.logprobs,
        asked,
    )
    seeds = choice_seeds(request.seed, request.n)
    requests = [
        _request(sampling, seed, request.stream, priority=request.priority, **prompt)
        for prompt in prompts
        for seed in seeds
    ]
    names = ParamNames("prompt", "max_tokens", "logprobs", _constraint_field(asked))
    return RouterRequests(requests, request.n, names)


def _constraint_field(asked: AskedConstraint | None) -> str:
    return RESPONSE_FORMAT if asked is None else asked.field


def _check_common(request: SamplingFields, num_prompts: int) -> None:
    name = unsupported_field(request)
    if name is not None:
        raise bad_request(name, f"{name}: not supported by pdserve")
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options", "only with stream: true")
    if num_prompts * request.n > MAX_CHOICES:
        raise bad_request("n", f"{num_prompts} prompts x n={request.n} exceeds {MAX_CHOICES}")


def _message(index: int, message: ChatMessage) -> dict:
    """A message as chat templates read it: role, content as text, name if given."""
    name = unsupported_field(message)
    if name is not None:
        raise bad_request(f"messages[{index}].{name}", f"{name}: not supported by pdserve")
    content = message.content
    if isinstance(content, list):
        for j, part in enumerate(content):
            if part.type != TEXT_PART or part.text is None:
                field = f"messages[{index}].content[{j}]"
                raise bad_request(field, f"{part.type} parts are not supported: only text")
        content = PART_SEPARATOR.join(part.text for part in content)
    return {"role": message.role, "content": content, "name": message.name}


def _prompts(prompt: str | list) -> list[dict]:
    """GenerateRequest prompt fields, one per prompt of the request."""
    if isinstance(prompt, str):
        return [{"text": prompt}]
    if not prompt:
        raise bad_request("prompt", "must not be empty")
    if all(isinstance(item, str) for item in prompt):
        return [{"text": text} for text in prompt]
    if all(isinstance(item, int) for item in prompt):
        return [{"token_ids": router_pb2.TokenIds(ids=prompt)}]
    return [{"token_ids": router_pb2.TokenIds(ids=ids)} for ids in prompt]


def _stops(stop: str | Sequence[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias, its keys token ids written as strings (JSON's keys are)."""
    parsed = {}
    for key, value in (bias or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request("logit_bias", f"key {key!r} is not a token id") from None
        if not 0 <= token_id <= INT32_MAX:
            raise bad_request("logit_bias", f"token id {token_id} is out of range")
        parsed[token_id] = value
    return parsed


def _sampling(
    request: SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    asked: AskedConstraint | None = None,
) -> common_pb2.SamplingParams:
    """The request's sampling, as the router takes it (it checks every value)."""
    sampling = common_pb2.SamplingParams(
        temperature=DEFAULT_TEMPERATURE if request.temperature is None else request.temperature,
        top_k=max(request.top_k or 0, 0),  # vLLM's -1 is the proto's 0: no filter
        min_p=request.min_p or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        presence_penalty=request.presence_penalty or 0.0,
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        ignore_eos=request.ignore_eos,
        stop_token_ids=request.stop_token_ids or [],
        stop=_stops(request.stop),
        logit_bias=_logit_bias(request.logit_bias),
    )
    if request.top_p is not None:
        sampling.top_p = request.top_p
    if request.repetition_penalty is not None:
        sampling.repetition_penalty = request.repetition_penalty
    if logprobs is not None:
        sampling.logprobs = logprobs
    if asked is not None:
        constraint_to_proto(asked.constraint, sampling)
    return sampling


def _request(
    sampling: common_pb2.SamplingParams,
    seed: int | None,
    stream: bool,
    *,
    priority: int = 0,
    **prompt,
) -> router_pb2.GenerateRequest:
    request = router_pb2.GenerateRequest(
        sampling=sampling, stream=stream, priority=priority, **prompt
    )
    if seed is not None:
        request.sampling.seed = seed
    return request
