"""The OpenAI API's request bodies as pdserve accepts them (pydantic models).

What the router implements is a typed field; what it does not is a field too, so that
asking for it is a 400 naming it (`unsupported_field`) rather than something silently
ignored; a name OpenAI does not have either is a 400 as well (`extra="forbid"`). Ranges are
checked here only where the proto needs them (an int32, an unsigned seed): the router
checks the rest and names the field, which `convert.ParamNames` turns back into the
name the client used.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

INT32_MAX = 2**31 - 1
SEED_MAX = 2**63 - 1  # the engine's seeds are non-negative int64s
MAX_CHOICES = 128  # prompts x n of one request, as OpenAI caps n

# Fields of OpenAI's API that pdserve does not implement, each with the values that ask
# for nothing beyond what pdserve does anyway (accepted); any other value is a 400.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "metadata": (None, {}),
    "prompt_cache_key": (None,),
    # completions only
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    # inside a chat message
    "tool_calls": (None, []),
    "tool_call_id": (None,),
    "refusal": (None,),
}


# A token id as the proto carries it (int32); the router checks it against the vocabulary.
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
TokenIds = list[TokenId]


def unsupported_field(
    model: BaseModel, fields: dict[str, tuple[Any, ...]] = UNSUPPORTED_FIELDS
) -> str | None:
    """The first field of `model` that asks for something pdserve does not implement
    (`fields`: the names and their inert values, UNSUPPORTED_FIELDS by default)."""
    for name, inert in fields.items():
        if name in type(model).model_fields and getattr(model, name) not in inert:
            return name
    return None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    """OpenAI's `response_format.json_schema`; the schema is always enforced, `strict` or
    not (as vLLM does)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` (the successor of its `guided_*` fields): one of them."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(_Strict):
    """What chat and completions requests share: the model, streaming and sampling."""

    model: str | None = None  # None: the one model this router serves
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None  # the end user's id, for the caller's records: no effect
    safety_identifier: str | None = None  # OpenAI's newer name for `user`
    # vLLM's extra sampling fields
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)  # -1 or 0: no top-k filter
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    stop_token_ids: TokenIds | None = None
    # vLLM's scheduling priority: lower runs first (GenerateRequest.priority, an int32)
    priority: int = Field(0, ge=-INT32_MAX - 1, le=INT32_MAX)
    # structured outputs (gateways/openai/constraints.py): at most one of these
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's extras
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    # token id (as a string, as JSON keys are) -> bias in [-100, 100]
    logit_bias: dict[str, float] | None = None
    # not implemented: see UNSUPPORTED_FIELDS
    service_tier: Any = None
    store: Any = None
    metadata: Any = None
    prompt_cache_key: Any = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ContentPart(BaseModel):
    """One part of a message's content; only text parts are supported (checked later, so
    that the error names the part)."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # not implemented: see UNSUPPORTED_FIELDS
    tool_calls: Any = None
    tool_call_id: Any = None
    function_call: Any = None
    audio: Any = None
    refusal: Any = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=INT32_MAX)
    # not implemented: see UNSUPPORTED_FIELDS
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None


class CompletionRequest(SamplingFields):
    # text, texts, token ids, or lists of token ids: one prompt each
    prompt: str | list[str] | TokenIds | list[TokenIds]
    logprobs: int | None = Field(None, ge=0, le=INT32_MAX)
    # not implemented: see UNSUPPORTED_FIELDS
    echo: Any = None
    best_of: Any = None
    suffix: Any = None


# -- the Responses API (`POST /v1/responses`) -------------------------------------------------

# OpenAI's bounds on a response's metadata, which pdserve stores with the response.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512

# Fields of the Responses API that pdserve does not implement, as UNSUPPORTED_FIELDS is for
# chat: the values that ask for nothing beyond what pdserve does are accepted.
RESPONSES_UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),  # no tool calls yet
    "tool_choice": (None, "none", "auto"),  # with no tools, `auto` asks for nothing
    "include": (None, []),
    "reasoning": (None,),
    "truncation": (None, "disabled"),
    "background": (None, False),
    "conversation": (None,),
    "prompt": (None,),
    "prompt_cache_key": (None,),
    "service_tier": (None, "auto", "default"),
    "max_tool_calls": (None,),
    "top_logprobs": (None, 0),
    "stream_options": (None, {}),
}


class InputItem(BaseModel):
    """One item of a Responses `input` list. Only messages are supported (`type` absent or
    "message"); the conversion checks the rest, naming the item, so a tool call's output
    is refused as such rather than as a message missing its role."""

    model_config = ConfigDict(extra="allow")
    type: str = "message"
    role: str | None = None
    content: str | list[ContentPart] | None = None


class TextConfig(_Strict):
    """`text`: the output's format (`{"type": "text"}`, `json_object`, `json_schema`)."""

    format: dict[str, Any] | None = None
    verbosity: Any = None  # not implemented: only None


class ResponsesRequest(_Strict):
    model: str | None = None  # None: the one model this router serves
    input: str | list[InputItem]
    instructions: str | None = None  # a system message, not carried to follow-ups
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None  # None: true, as OpenAI's default
    previous_response_id: str | None = Field(None, min_length=1, max_length=256)
    metadata: dict[str, str] | None = None
    user: str | None = None  # the end user's id, for the caller's records: no effect
    safety_identifier: str | None = None
    text: TextConfig | None = None
    parallel_tool_calls: bool | None = None  # no effect without tools
    # not implemented: see RESPONSES_UNSUPPORTED_FIELDS
    tools: Any = None
    tool_choice: Any = None
    include: Any = None
    reasoning: Any = None
    truncation: Any = None
    background: Any = None
    conversation: Any = None
    prompt: Any = None
    prompt_cache_key: Any = None
    service_tier: Any = None
    max_tool_calls: Any = None
    top_logprobs: Any = None
    stream_options: Any = None

    @field_validator("metadata")
    @classmethod
    def _bounded_metadata(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        if metadata is None:
            return None
        if len(metadata) > MAX_METADATA_PAIRS:
            raise ValueError(f"at most {MAX_METADATA_PAIRS} pairs, got {len(metadata)}")
        for key, value in metadata.items():
            if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(
                    f"keys are at most {MAX_METADATA_KEY_CHARS} characters and values at "
                    f"most {MAX_METADATA_VALUE_CHARS}"
                )
        return metadata

    @property
    def stores(self) -> bool:
        return self.store is not False
