"""The OpenAI API's errors as the official `openai` package raises them: OpenAI's error
shape, the field named, the right status (400, 404, 429 and 503 with Retry-After)."""

from __future__ import annotations

import httpx
import openai
import pytest
from procs import pdserve_process

from pdserve.cluster.local import ClusterShape, LocalCluster
from pdserve.cluster.processes import router_args
from pdserve.router.config import DiscoveryKind

pytestmark = pytest.mark.cluster

MODEL = "demo-errors"
MESSAGES = [{"role": "user", "content": "Hello"}]
MAX_INFLIGHT = 2
LONG = {"max_tokens": 3000, "temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    with LocalCluster(
        str(demo_model_dir),
        ClusterShape(prefill=0, decode=0, colocated=1),
        tmp_path_factory.mktemp("openai-errors"),
        http_port=0,
        served_model_name=MODEL,
        # no admission queue: past the limit a request is refused at once
        router_args=["--max-inflight", str(MAX_INFLIGHT), "--max-queued-requests", "0"],
    ) as local:
        yield local


@pytest.fixture(scope="module")
def client(cluster):
    with openai.OpenAI(base_url=cluster.openai_url, api_key="unused", max_retries=0) as c:
        yield c


IMAGE = {"type": "image_url", "image_url": {"url": "data:,"}}
# (the fields of the request, the parameter the error names)
BAD_CHATS = [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),  # without one
    ({"logit_bias": {"five": 10}}, "logit_bias"),  # not a token id
    ({"logit_bias": {"5": 101}}, "logit_bias"),  # past OpenAI's [-100, 100]
    ({"logit_bias": {str(10**6): 1}}, "logit_bias"),  # outside the vocabulary
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"seed": -1}, "seed"),
    ({"n": 0}, "n"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"max_tokens": 10**6}, "max_tokens"),
    ({"max_completion_tokens": 10**6}, "max_completion_tokens"),
    ({"stop": [""]}, "stop"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [IMAGE]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "t"}]}, "messages[0]"),
    ({"extra_body": {"guided_json": {"type": "wat"}}}, "guided_json"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_CHATS, ids=[p for _, p in BAD_CHATS])
def test_a_bad_chat_request_is_a_400_naming_the_parameter(client, fields, param):
    request = {"model": MODEL, "messages": MESSAGES, **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**request)
    error = caught.value.body
    assert error["type"] == "invalid_request_error"
    assert error["param"].startswith(param), error
    assert error["message"]


BAD_COMPLETIONS = [
    ({"prompt": ""}, "prompt"),
    ({"prompt": [999_999]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "best_of": 2}, "best_of"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "extra_body": {"min_tokens": 99}}, "min_tokens"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_COMPLETIONS, ids=[p for _, p in BAD_COMPLETIONS])
def test_a_bad_completion_request_is_a_400_naming_the_parameter(client, fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, **fields)
    assert caught.value.body["param"] == param, caught.value.body


def test_another_model_is_a_404_in_openais_shape(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert caught.value.body["code"] == "model_not_found"
    assert caught.value.body["param"] == "model"


def test_an_unknown_route_and_a_malformed_body_answer_in_openais_shape(cluster):
    missing = httpx.get(f"{cluster.openai_url}/embeddings")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    malformed = httpx.post(
        f"{cluster.openai_url}/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert malformed.status_code == 400
    assert malformed.json()["error"]["type"] == "invalid_request_error"


def _chunks(total: int, size: int = 64 << 10):
    for _ in range(total // size):
        yield b" " * size


def test_a_body_past_the_limit_is_a_413_declared_or_chunked_and_the_server_serves_on(cluster):
    url = f"{cluster.openai_url}/completions"
    headers = {"content-type": "application/json"}
    declared = httpx.post(url, content=b" " * (8 << 20), headers=headers)
    chunked = httpx.post(url, content=_chunks(8 << 20), headers=headers)  # no Content-Length
    for reply in (declared, chunked):
        assert reply.status_code == 413
        error = reply.json()["error"]
        assert error["code"] == "body_too_large" and "bytes" in error["message"]
    assert httpx.get(f"{cluster.openai_url}/models").status_code == 200


def test_a_chat_past_the_prompt_bytes_limit_is_a_400_naming_messages(client):
    # within the body's limit, past --max-prompt-bytes once rendered: refused before
    # it is tokenized
    long = [{"role": "user", "content": "word " * 100_000}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=long, max_tokens=1)
    assert caught.value.body["param"] == "messages"
    assert "bytes" in caught.value.body["message"]


def test_overload_is_a_429_with_retry_after_and_the_streams_go_on(client):
    streams = [
        client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **LONG)
        for _ in range(MAX_INFLIGHT)
    ]
    try:
        firsts = [next(stream) for stream in streams]  # each has its first token: running
        with pytest.raises(openai.RateLimitError) as caught:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
        assert caught.value.response.headers["retry-after"] == "1"
        assert caught.value.body["type"] == "rate_limit_error"
        assert all(next(stream).choices for stream in streams)
        assert len({first.id for first in firsts}) == MAX_INFLIGHT
    finally:
        for stream in streams:
            stream.close()


def test_no_reachable_worker_is_a_503_with_retry_after(demo_model_dir, redis_url, tmp_path):
    nowhere = ["127.0.0.1:9"]  # the discard port: nothing answers there
    args = router_args(
        str(demo_model_dir),
        redis_url,
        port=0,
        http_port=0,
        discovery=DiscoveryKind.STATIC,
        prefill=nowhere,
        decode=nowhere,
    )
    with (
        pdserve_process(args, tmp_path) as router,
        openai.OpenAI(
            base_url=f"http://{router.http_address}/v1", api_key="unused", max_retries=0
        ) as lonely,
        pytest.raises(openai.InternalServerError) as caught,
    ):
        lonely.completions.create(model=demo_model_dir.name, prompt="Hello", max_tokens=4)
    assert caught.value.status_code == 503
    assert caught.value.response.headers["retry-after"] == "1"
    assert caught.value.body["type"] == "service_unavailable"
