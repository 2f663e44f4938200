"""The router's answer to a Responses request as OpenAI's `response` object: whole, or as
the Responses API's server-sent events.

A response holds one output item, an assistant `message` with one `output_text` part.
Its id is `resp_` and the router's request id (the message's is `msg_` and the same), so
that the native API finds the request. A response whose output stopped at its token
limit is `incomplete` with `incomplete_details.reason: "max_output_tokens"`.

A stream's events, each `event: TYPE` and `data: {...}` with a `sequence_number` from 0:
`response.created`, `response.in_progress`, `response.output_item.added`,
`response.content_part.added` (all sent once the first token is there, so that what
fails before it still fails with its HTTP status), a `response.output_text.delta` per
router message with text, then `response.output_text.done`, `response.content_part.done`,
`response.output_item.done`, and `response.completed` (`response.incomplete` when the
output was cut) with the whole response. No `[DONE]`: the Responses API ends with the
body. A failure mid-stream is an `error` event.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

from pdserve.api.v1 import common_pb2, router_pb2
from pdserve.gateways.openai.protocol import ResponsesRequest

RESPONSE_PREFIX, MESSAGE_PREFIX = "resp_", "msg_"
COMPLETED, INCOMPLETE, IN_PROGRESS = "completed", "incomplete", "in_progress"
OUTPUT_INDEX, CONTENT_INDEX = 0, 0  # the one output item, and its one part
DEFAULT_TEMPERATURE = DEFAULT_TOP_P = 1.0  # what OpenAI reports when not given
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def response_usage(final: router_pb2.GenerateResponse) -> dict:
    """The Responses API's usage of one request's final message."""
    usage = final.usage
    return {
        "input_tokens": usage.prompt_tokens,
        # the prefix cache fills itself as prompts run: no writes a client asked for
        "input_tokens_details": {
            "cached_tokens": usage.cached_prompt_tokens,
            "cache_write_tokens": 0,
        },
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


class ResponsesFormat:
    """One response: its envelope from the request, its events while it streams.

    It answers what `asgi.GenerationResponse` asks of a format: `named_after`, `opening`,
    `chunk`, `closing`, `failure` and `whole`.
    """

    def __init__(self, model: str, request: ResponsesRequest, *, stream: bool):
        self.model, self.request = model, request
        self.created_at = int(time.time())
        self.response_id = self.message_id = ""
        self._sequence_number = 0
        self._texts: list[str] | None = [] if stream else None  # streamed: the deltas
        self._finished: dict | None = None  # the whole response, once made (stored and sent)

    def named_after(self, request_id: str) -> None:
        self.response_id = RESPONSE_PREFIX + request_id
        self.message_id = MESSAGE_PREFIX + request_id

    def whole(self, finals: Sequence[router_pb2.GenerateResponse], n: int = 1) -> dict:
        """The finished response (streamed or not), the same object each call."""
        if self._finished is not None:
            return self._finished
        [final] = finals  # a Responses request is one router request
        text = final.text if self._texts is None else "".join(self._texts)
        cut = final.finish_reason == common_pb2.FINISH_REASON_LENGTH
        status = INCOMPLETE if cut else COMPLETED
        response = self._envelope(status)
        response["output"] = [self._message(status, text)]
        response["usage"] = response_usage(final)
        if cut:
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            response["completed_at"] = int(time.time())
        self._finished = response
        return response

    def _envelope(self, status: str) -> dict:
        request = self.request
        text_format = (request.text.format if request.text else None) or {"type": "text"}
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": None,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "metadata": request.metadata or {},
            "model": self.model,
            "output": [],
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id,
            "store": request.stores,
            "temperature": _or(request.temperature, DEFAULT_TEMPERATURE),
            "text": {"format": text_format},
            "tool_choice": "none",
            "tools": [],
            "top_p": _or(request.top_p, DEFAULT_TOP_P),
            "truncation": "disabled",
            "usage": None,
            "user": request.user,
        }

    def _message(self, status: str, text: str | None) -> dict:
        content = [] if text is None else [_text_part(text)]
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }

    # -- streaming ----------------------------------------------------------------------------

    def opening(self) -> bytes:
        """The events before the first text: the response and its empty message."""
        started = self._envelope(IN_PROGRESS)
        return b"".join(
            (
                self._event("response.created", response=started),
                self._event("response.in_progress", response=started),
                self._event(
                    "response.output_item.added",
                    output_index=OUTPUT_INDEX,
                    item=self._message(IN_PROGRESS, None),
                ),
                self._event(
                    "response.content_part.added", **self._part_place(), part=_text_part("")
                ),
            )
        )

    def chunk(self, index: int, message: router_pb2.GenerateResponse) -> bytes:
        """A delta event for the message's text (none for a message without text)."""
        if not message.text:
            return b""
        self._texts.append(message.text)
        return self._event(
            "response.output_text.delta", **self._part_place(), delta=message.text, logprobs=[]
        )

    def closing(self, finals: Sequence[router_pb2.GenerateResponse] | None, n: int = 1) -> bytes:
        """The events after the last text, ending with the whole response; nothing when
        the stream broke off (`finals` None: an error event went out)."""
        if finals is None:
            return b""
        response = self.whole(finals)
        [item] = response["output"]
        [part] = item["content"]
        place = self._part_place()
        last = "response.incomplete" if response["status"] == INCOMPLETE else "response.completed"
        return b"".join(
            (
                self._event("response.output_text.done", **place, text=part["text"], logprobs=[]),
                self._event("response.content_part.done", **place, part=part),
                self._event("response.output_item.done", output_index=OUTPUT_INDEX, item=item),
                self._event(last, response=response),
            )
        )

    def failure(self, error_body: dict) -> bytes:
        """An error event (mid-stream: the status went out already)."""
        error = error_body["error"]
        return self._event(
            "error", code=error.get("code"), message=error["message"], param=error.get("param")
        )

    def _part_place(self) -> dict:
        return {
            "item_id": self.message_id,
            "output_index": OUTPUT_INDEX,
            "content_index": CONTENT_INDEX,
        }

    def _event(self, type: str, **fields) -> bytes:
        payload = {"type": type, "sequence_number": self._sequence_number, **fields}
        self._sequence_number += 1
        return b"event: %s\ndata: %s\n\n" % (type.encode(), _ENCODER.encode(payload).encode())


def output_text(response: dict) -> str:
    """The text of a whole response's one message."""
    [item] = response["output"]
    return "".join(part["text"] for part in item["content"])


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _or(value: float | None, default: float) -> float:
    return default if value is None else value
