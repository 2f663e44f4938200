"""The server-sent events of a streamed OpenAI response, as bytes: each chunk is OpenAI's
JSON object, in its field order, compact, non-ASCII as it is, whatever the text holds;
the fixed parts encoded once per stream must change nothing of that."""

from __future__ import annotations

import json

import pytest

from pdserve.api.v1 import common_pb2, router_pb2
from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateways.openai.responses import ChatFormat, CompletionFormat, TokenTexts

MODEL = "demo-chat"
REQUEST_ID = "req-1"
# what a token's text may be: quotes and escapes, control characters, JSON's line
# separators, non-ASCII and astral characters, nothing
TEXTS = ["Once", ' "quoted" \\ back', "\n\t\x00\x1f\x7f", "\u2028\u2029", "é漢字😀", ""]
FINISH_REASONS = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}


@pytest.fixture(scope="module")
def texts(demo_model_dir) -> TokenTexts:
    return TokenTexts(Tokenizer.from_dir(demo_model_dir))


def event(payload: dict) -> bytes:
    """An SSE event as OpenAI writes it: compact JSON, non-ASCII not escaped."""
    encoded = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return b"data: " + encoded.encode() + b"\n\n"


def envelope(fmt, object_name: str, choice: dict, include_usage: bool) -> dict:
    payload = {
        "id": fmt.response_id,
        "object": object_name,
        "created": fmt.created,
        "model": MODEL,
        "choices": [choice],
    }
    if include_usage:
        payload["usage"] = None  # every chunk but the usage one has it, null
    return payload


def messages():
    for text in TEXTS:
        for reason, value in FINISH_REASONS.items():
            yield reason, router_pb2.GenerateResponse(text=text, finish_reason=value)


@pytest.mark.parametrize("include_usage", [False, True])
def test_a_completion_chunk_is_openais_json_of_its_choice(texts, include_usage):
    fmt = CompletionFormat(MODEL, texts, logprobs=False, include_usage=include_usage)
    fmt.named_after(REQUEST_ID)
    assert fmt.response_id == "cmpl-" + REQUEST_ID
    for index in (0, 1, 12):
        for reason, message in messages():
            choice = {"index": index, "text": message.text, "logprobs": None}
            choice["finish_reason"] = reason
            expected = event(envelope(fmt, "text_completion", choice, include_usage))
            assert fmt.chunk(index, message) == expected


@pytest.mark.parametrize("include_usage", [False, True])
def test_a_chat_chunk_has_the_role_on_each_choices_first_chunk_only(texts, include_usage):
    fmt = ChatFormat(MODEL, texts, logprobs=False, include_usage=include_usage)
    fmt.named_after(REQUEST_ID)
    assert fmt.response_id == "chatcmpl-" + REQUEST_ID
    for index in (1, 0):
        for i, (reason, message) in enumerate(messages()):
            delta = {"role": "assistant"} if i == 0 else {}
            delta["content"] = message.text
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
            expected = event(envelope(fmt, "chat.completion.chunk", choice, include_usage))
            assert fmt.chunk(index, message) == expected


def test_a_chat_chunk_with_logprobs_carries_each_tokens_entry(texts):
    fmt = ChatFormat(MODEL, texts, logprobs=True, include_usage=False)
    fmt.named_after(REQUEST_ID)
    position = common_pb2.PositionLogprobs(
        sampled=common_pb2.TokenLogprob(token_id=5, logprob=-0.5),
        top=[common_pb2.TokenLogprob(token_id=7, logprob=-1.25)],
    )
    message = router_pb2.GenerateResponse(text="x", logprobs=[position])
    sampled, top = texts[5], texts[7]
    entry = {"token": sampled, "logprob": -0.5, "bytes": list(sampled.encode())}
    entry["top_logprobs"] = [{"token": top, "logprob": -1.25, "bytes": list(top.encode())}]
    choice = {
        "index": 0,
        "delta": {"role": "assistant", "content": "x"},
        "logprobs": {"content": [entry]},
        "finish_reason": None,
    }
    assert fmt.chunk(0, message) == event(envelope(fmt, "chat.completion.chunk", choice, False))
