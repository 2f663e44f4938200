"""The router's `GenerateResponse`s as OpenAI's JSON: chat and text completions, whole or
as server-sent events (`data: {...}` chunks, then `data: [DONE]`).

A chunk is built from one router message: its text, its tokens' logprobs, and on a
choice's last message its finish reason. A message carries several tokens when the
client fell behind (the router coalesces what waited), so an SSE event does too. The
response's id is `chatcmpl-` or `cmpl-` and the router's request id of its first choice,
so that the native API (`GetRequest`, logs, traces) finds the request.

A chunk without logprobs is the most frequent thing the gateway writes (one per token
at stream interval 1), so it is put together from bytes fixed per stream and choice
(the envelope, the choice's opening, its close for each finish reason) around the one
changing part, the text as a JSON string: byte for byte what encoding the chunk's dict
gives, at a fraction of the cost.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from json.encoder import encode_basestring  # what _ENCODER does with a str

from pdserve.api.v1 import common_pb2, router_pb2
from pdserve.engine.tokenizer import Tokenizer
from pdserve.rpc.wire import FINISH_REASON_NAMES

SSE_DONE = b"data: [DONE]\n\n"
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def sse_event(payload: dict) -> bytes:
    return b"data: " + _ENCODER.encode(payload).encode() + b"\n\n"


class TokenTexts:
    """Token ids as logprobs show them: each decoded alone, special tokens included."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}  # at most the vocabulary

    def __getitem__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._texts[token_id] = text
        return text


def usage(finals: Sequence[router_pb2.GenerateResponse], n: int) -> dict:
    """Usage over every choice: each prompt counted once (its choices share it)."""
    per_prompt = finals[::n]
    prompt_tokens = sum(final.usage.prompt_tokens for final in per_prompt)
    completion_tokens = sum(final.usage.completion_tokens for final in finals)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": sum(final.usage.cached_prompt_tokens for final in per_prompt)
        },
    }


class ResponseFormat:
    """One response's envelope (id, object, created, model) and its choices' state."""

    id_prefix = ""
    object_name = ""  # of the whole response
    chunk_object_name = ""
    # the choice's JSON after its text: `}` where the text is inside an object (a delta)
    _text_end = b""

    def __init__(self, model: str, texts: TokenTexts, *, logprobs: bool, include_usage: bool):
        self.model, self.texts = model, texts
        self.logprobs, self.include_usage = logprobs, include_usage
        self.created = int(time.time())
        self.response_id = self.id_prefix

        self._chunk_head, self._chunk_tail = b"", b""
        self._opens: dict[int, bytes] = {}  # per choice: head and the choice up to its text
        self._closes: dict[int, bytes] = {}  # per finish reason: what follows the text

    def named_after(self, request_id: str) -> None:
        """Set the response's id; the chunks' fixed parts are encoded once, from then on."""
        self.response_id = self.id_prefix + request_id
        head = _ENCODER.encode(self._envelope(self.chunk_object_name, []))
        self._chunk_head = b"data: " + head.removesuffix("[]}").encode() + b"["
        # as OpenAI: with include_usage every chunk has `usage`, null but the last
        self._chunk_tail = b'],"usage":null}\n\n' if self.include_usage else b"]}\n\n"
        self._opens.clear()
        self._closes = {
            reason: b"%s,%s}%s" % (self._text_end, _finish_fields(name), self._chunk_tail)
            for reason, name in FINISH_REASON_NAMES.items()
        }

    def chunk(self, index: int, message: router_pb2.GenerateResponse) -> bytes:
        """One event: the envelope around this message's choice (one per event)."""
        if self.logprobs:
            choice = _ENCODER.encode(self._chunk_choice(index, message)).encode()
            return self._chunk_head + choice + self._chunk_tail
        opening = self._opens.get(index) or self._chunk_opening(index)
        text = encode_basestring(message.text).encode()
        return opening + text + self._closes[message.finish_reason]

    def _chunk_opening(self, index: int) -> bytes:
        """The event's bytes before the choice's text (kept in `_opens` when they are the
        same for the choice's later chunks)."""
        raise NotImplementedError

    def opening(self) -> bytes:
        """What a stream sends before its first chunk: nothing, for chat and completions."""
        return b""

    def closing(self, finals: Sequence[router_pb2.GenerateResponse] | None, n: int) -> bytes:
        """What ends a stream: the usage chunk (with include_usage), then [DONE]; `finals`
        is None when the stream broke off (an error event went out)."""
        if finals is not None and self.include_usage:
            return self.usage_chunk(finals, n) + SSE_DONE
        return SSE_DONE

    def failure(self, error_body: dict) -> bytes:
        """The event that says a stream failed once its status went out."""
        return sse_event(error_body)

    def usage_chunk(self, finals: Sequence[router_pb2.GenerateResponse], n: int) -> bytes:
        payload = self._envelope(self.chunk_object_name, [])
        payload["usage"] = usage(finals, n)
        return sse_event(payload)

    def whole(self, finals: Sequence[router_pb2.GenerateResponse], n: int) -> dict:
        """The response to a request that did not stream: one message per choice."""
        choices = [self._whole_choice(i, final) for i, final in enumerate(finals)]
        payload = self._envelope(self.object_name, choices)
        payload["usage"] = usage(finals, n)
        payload["system_fingerprint"] = None
        return payload

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {
            "id": self.response_id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _chunk_choice(self, index: int, message: router_pb2.GenerateResponse) -> dict:
        raise NotImplementedError

    def _whole_choice(self, index: int, message: router_pb2.GenerateResponse) -> dict:
        raise NotImplementedError


def _finish_reason(message: router_pb2.GenerateResponse) -> str | None:
    return FINISH_REASON_NAMES[message.finish_reason]


def _finish_fields(name: str | None) -> bytes:
    """A chunk's fields after its text when it has no logprobs."""
    return b'"logprobs":null,"finish_reason":' + _ENCODER.encode(name).encode()


class ChatFormat(ResponseFormat):
    id_prefix = "chatcmpl-"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    _text_end = b"}"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._started: set[int] = set()  # choices whose role went out (on their first chunk)

    def _chunk_opening(self, index: int) -> bytes:
        if index not in self._started:  # the role, on the choice's first chunk only
            self._started.add(index)
            return self._chunk_head + b'{"index":%d,"delta":{"role":"assistant","content":' % index
        opening = self._chunk_head + b'{"index":%d,"delta":{"content":' % index
        self._opens[index] = opening
        return opening

    def _chunk_choice(self, index: int, message: router_pb2.GenerateResponse) -> dict:
        delta = {"content": message.text}
        if index not in self._started:
            self._started.add(index)
            delta = {"role": "assistant", "content": message.text}
        return {
            "index": index,
            "delta": delta,
            "logprobs": self._logprobs(message),
            "finish_reason": _finish_reason(message),
        }

    def _whole_choice(self, index: int, message: router_pb2.GenerateResponse) -> dict:
        return {
            "index": index,
            "message": {"role": "assistant", "content": message.text},
            "logprobs": self._logprobs(message),
            "finish_reason": _finish_reason(message),
        }

    def _logprobs(self, message: router_pb2.GenerateResponse) -> dict | None:
        if not self.logprobs:
            return None
        return {"content": [self._position(position) for position in message.logprobs]}

    def _position(self, position: common_pb2.PositionLogprobs) -> dict:
        entry = self._entry(position.sampled)
        entry["top_logprobs"] = [self._entry(top) for top in position.top]
        return entry

    def _entry(self, token: common_pb2.TokenLogprob) -> dict:
        text = self.texts[token.token_id]
        return {"token": text, "logprob": token.logprob, "bytes": list(text.encode())}


class CompletionFormat(ResponseFormat):
    id_prefix = "cmpl-"
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._text_offsets: dict[int, int] = {}  # per choice: where its next token starts

    def _chunk_opening(self, index: int) -> bytes:
        opening = self._chunk_head + b'{"index":%d,"text":' % index
        self._opens[index] = opening
        return opening

    def _chunk_choice(self, index: int, message: router_pb2.GenerateResponse) -> dict:
        return self._whole_choice(index, message)

    def _whole_choice(self, index: int, message: router_pb2.GenerateResponse) -> dict:
        return {
            "index": index,
            "text": message.text,
            "logprobs": self._logprobs(index, message),
            "finish_reason": _finish_reason(message),
        }

    def _logprobs(self, index: int, message: router_pb2.GenerateResponse) -> dict | None:
        """The legacy shape: parallel lists of tokens, their logprobs, top-N maps and the
        offset of each token's text in the choice's text."""
        if not self.logprobs:
            return None
        texts, offset = self.texts, self._text_offsets.get(index, 0)
        tokens, offsets = [], []
        for position in message.logprobs:
            text = texts[position.sampled.token_id]
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        self._text_offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [position.sampled.logprob for position in message.logprobs],
            "top_logprobs": [
                {texts[top.token_id]: top.logprob for top in position.top}
                for position in message.logprobs
            ],
            "text_offset": offsets,
        }
