"""A Responses API request as the chat request `/v1/chat/completions` runs.

A Responses request is one turn of a conversation: its `input` (a text, or message
items), the `instructions` (a system message), and with `previous_response_id` the
conversation stored with that response, which goes before the input so that the client
does not send it again. The turn becomes a `ChatCompletionRequest` that `convert`
turns into the router's requests, rendered by the model's chat template like any chat:
one path for both doors, so routing, limits, auth, metrics and traces are the chat's.

A conversation is stored as chat messages, `{"role", "content"}`, without the
instructions (OpenAI does not carry them to a follow-up: each request gives its own).
A follow-up with the same instructions renders the earlier turns as the same prompt
text, so its prompt begins with the earlier prompt's tokens and the prefix cache has
them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pdserve.core.errors import InvalidRequestError
from pdserve.core.sampling_params import RequestLimits
from pdserve.gateways.chat_template import ChatTemplate
from pdserve.gateways.openai import convert
from pdserve.gateways.openai.errors import OpenAIError, bad_request
from pdserve.gateways.openai.protocol import (
    RESPONSES_UNSUPPORTED_FIELDS,
    ChatCompletionRequest,
    InputItem,
    ResponsesRequest,
    unsupported_field,
)

MESSAGE_ITEM = "message"
# The chat template's roles; OpenAI's `developer` messages are its system messages.
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
# Text parts: what a client writes (`input_text`) and what it passes back of an earlier
# response's output (`output_text`).
TEXT_PARTS = frozenset({"input_text", "output_text"})
# What an output item passed back as input carries besides its message: no effect.
ITEM_EXTRAS = frozenset({"id", "status", "phase"})
# `text.format` as chat's `response_format`: the same dict, structured outputs' one path.
TEXT_FORMAT = "text"
JSON_FORMATS = frozenset({"json_object", "json_schema"})
JSON_SCHEMA_FIELDS = ("name", "schema", "description", "strict")
# The chat request's names for what a Responses request calls otherwise.
RENAMED = {
    "response_format": "text.format",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
}
PARAM_NAMES = convert.ParamNames(
    prompt="input", max_tokens="max_output_tokens", logprobs="top_logprobs"
)

Message = dict  # {"role": str, "content": str | [{"type": "text", "text": str}, ...]}


@dataclass(frozen=True, slots=True)
class Turn:
    """One Responses request as chat messages: the stored conversation it continues,
    its own input, and its instructions."""

    history: list[Message]  # [] without previous_response_id
    inputs: list[Message]
    instructions: str | None

    @property
    def messages(self) -> list[Message]:
        """What the chat template renders: instructions, history, input."""
        system = [] if self.instructions is None else [_message("system", self.instructions)]
        return system + self.history + self.inputs

    def continued(self, output_text: str) -> list[Message]:
        """The conversation after this turn, as a response stores it."""
        return self.history + self.inputs + [_message("assistant", output_text)]


def check_supported(request: ResponsesRequest) -> None:
    """A 400 naming the first field that asks for what pdserve does not do, or a
    `text.format` it does not know: before the request costs a lookup."""
    name = unsupported_field(request, RESPONSES_UNSUPPORTED_FIELDS)
    if name is None and request.text is not None and request.text.verbosity is not None:
        name = "text.verbosity"
    if name is not None:
        raise bad_request(name, f"{name}: not supported by pdserve")
    response_format(request)


def input_messages(input: str | list[InputItem]) -> list[Message]:
    """`input` as chat messages; a 400 naming the item that is not a text message."""
    if isinstance(input, str):
        return [_message("user", input)]
    if not input:
        raise bad_request("input", "must not be empty")
    return [_item_message(i, item) for i, item in enumerate(input)]


def _item_message(index: int, item: InputItem) -> Message:
    where = f"input[{index}]"
    if item.type != MESSAGE_ITEM:
        raise bad_request(f"{where}.type", f"{item.type} items are not supported: only messages")
    extra = sorted((item.model_extra or {}).keys() - ITEM_EXTRAS)
    if extra:
        raise bad_request(f"{where}.{extra[0]}", "not a field of a message pdserve knows")
    if item.role not in ROLES:
        raise bad_request(f"{where}.role", f"must be one of {', '.join(ROLES)}")
    if item.content is None:
        raise bad_request(f"{where}.content", "a message needs content")
    if isinstance(item.content, str):
        return _message(ROLES[item.role], item.content)
    parts = []
    for j, part in enumerate(item.content):
        if part.type not in TEXT_PARTS or part.text is None:
            raise bad_request(
                f"{where}.content[{j}]", f"{part.type} parts are not supported: only text"
            )
        parts.append({"type": convert.TEXT_PART, "text": part.text})
    return {"role": ROLES[item.role], "content": parts}


def _message(role: str, content: str) -> Message:
    return {"role": role, "content": content}


def response_format(request: ResponsesRequest) -> dict | None:
    """`text.format` as chat's `response_format` (None: plain text)."""
    format = request.text.format if request.text is not None else None
    if format is None or format.get("type") == TEXT_FORMAT:
        return None
    kind = format.get("type")
    if kind not in JSON_FORMATS:
        raise bad_request("text.format.type", f"must be text, json_object or json_schema: {kind}")
    if kind == "json_object":
        return {"type": kind}
    schema = {name: format[name] for name in JSON_SCHEMA_FIELDS if name in format}
    return {"type": kind, "json_schema": schema}


def chat_request(request: ResponsesRequest, turn: Turn) -> ChatCompletionRequest:
    """The turn as the chat endpoint's request body (`check_supported` passed)."""
    return ChatCompletionRequest(
        model=request.model,
        messages=turn.messages,
        max_completion_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        stream=request.stream,
        user=request.user,
        safety_identifier=request.safety_identifier,
        response_format=response_format(request),
    )


def router_requests(
    request: ResponsesRequest, turn: Turn, template: ChatTemplate | None, limits: RequestLimits
) -> convert.RouterRequests:
    """The turn as the router's request, through the chat endpoint's conversion; its
    errors name the fields as this request did."""
    chat = chat_request(request, turn)
    try:
        routed = convert.chat_requests(chat, template, limits)
    except OpenAIError as exc:
        raise _renamed(exc.param, exc.message) from None
    except InvalidRequestError as exc:
        raise _renamed(exc.field, f"{exc.field}: {exc.message}") from None
    return replace(routed, names=PARAM_NAMES)


def param_name(param: str) -> str:
    """A chat request's field as a Responses request names it: the messages are
    rendered whole (the template or the prompt limit refuses them), so they are `input`."""
    if param.startswith("messages"):
        return "input"
    return RENAMED.get(param, param)


def _renamed(param: str | None, message: str) -> OpenAIError:
    """A chat conversion's error, naming the field (in its message too) as the client did."""
    if param is None:
        return bad_request(None, message)
    name = param_name(param)
    if message.startswith(param):
        message = name + message.removeprefix(param)
    return bad_request(name, message)
