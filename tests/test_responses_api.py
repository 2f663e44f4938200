"""The OpenAI door's Responses API (`/v1/responses`) as the official `openai` package meets
it, against one real cluster (Redis, a prefill and a decode worker, a router with API keys
and its HTTP port) and a second router on the same Redis: the chat completion of the same
messages is the oracle of what a response says; conversations continue from Redis on
either router, and only under the key that made them."""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx
import openai
import pydantic
import pytest
from fuzz_strategies import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st
from openai.types.responses import Response, ResponseStreamEvent
from procs import pdserve_process

from pdserve.cli import build_parser
from pdserve.cluster.local import ClusterShape, LocalCluster, num_healthy_workers
from pdserve.cluster.processes import router_args
from pdserve.core.errors import InvalidRequestError, StateUnavailableError
from pdserve.core.flags import config_from_args
from pdserve.router.auth.caller import KeyLimits
from pdserve.router.auth.keys import new_key, write_key_file
from pdserve.router.config import DEFAULT_RESPONSE_TTL_S, RouterConfig
from pdserve.state.conversations import ResponseStore, StoredResponse

pytestmark = pytest.mark.cluster

MODEL = "demo-responses"
# the demo model's greedy answer to this ends (its end of turn) after a few tokens; to
# most other inputs it runs on to its token limit
STOPPING_INPUT = "would make"
RUNNING_INPUT = "Why split prefill and decode?"
GREEDY = {"model": MODEL, "temperature": 0.0}
STREAM_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
STREAM_END = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]
REGISTRY_WAIT_S = 30


@dataclass
class Door:
    cluster: LocalCluster
    keys: dict[str, str]  # name -> the key
    second_url: str  # the OpenAI base URL of a second router on the same Redis

    def client(self, key: str = "a", url: str | None = None) -> openai.OpenAI:
        url = url or self.cluster.openai_url
        return openai.OpenAI(base_url=url, api_key=self.keys[key], max_retries=0)


@pytest.fixture(scope="module")
def door(demo_model_dir, redis_url, tmp_path_factory):
    made = {name: new_key(name, KeyLimits()) for name in ("a", "b")}
    key_file = tmp_path_factory.mktemp("keys") / "api-keys.json"
    write_key_file(key_file, [entry for _, entry in made.values()])
    keys = {name: key for name, (key, _) in made.items()}
    keyed = ["--api-key-file", str(key_file)]
    run_dir = tmp_path_factory.mktemp("responses-api")
    with LocalCluster(
        str(demo_model_dir),
        ClusterShape(prefill=1, decode=1),
        run_dir,
        redis=redis_url,
        router_args=keyed,
        api_key=keys["a"],
        http_port=0,
        served_model_name=MODEL,
    ) as cluster:
        second_args = router_args(
            str(demo_model_dir), redis_url, keyed, port=0, http_port=0, served_model_name=MODEL
        )
        with pdserve_process(second_args, run_dir) as second:
            deadline = time.monotonic() + REGISTRY_WAIT_S
            while num_healthy_workers(second.address, api_key=keys["a"]) < 2:
                assert time.monotonic() < deadline, "the second router sees no workers"
                time.sleep(0.1)
            yield Door(cluster, keys, f"http://{second.http_address}/v1")


@pytest.fixture(scope="module")
def client(door):
    with door.client() as c:
        yield c


def fresh_instructions() -> str:
    """Instructions no other request had: a prompt's cache hits can only be its own
    conversation's (long enough for a few KV blocks)."""
    return f"Session {time.time_ns()}. Answer as briefly as you can, and " + "be kind. " * 8


def chat_of(client: openai.OpenAI, messages: list[dict], max_tokens: int):
    """The oracle: the chat completion of the same messages."""
    return client.chat.completions.create(messages=messages, max_tokens=max_tokens, **GREEDY)


def test_a_response_says_what_the_chat_of_its_messages_says(client):
    response = client.responses.create(
        input=RUNNING_INPUT, instructions="Be terse.", max_output_tokens=8, **GREEDY
    )
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": RUNNING_INPUT},
    ]
    chat = chat_of(client, messages, 8)
    assert response.output_text == chat.choices[0].message.content
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.model == MODEL and response.instructions == "Be terse."
    assert response.status == "incomplete" and chat.choices[0].finish_reason == "length"
    assert response.incomplete_details.reason == "max_output_tokens"
    [item] = response.output
    assert item.type == "message" and item.role == "assistant" and item.status == "incomplete"
    assert [part.type for part in item.content] == ["output_text"]
    usage = response.usage
    assert usage.input_tokens == chat.usage.prompt_tokens and usage.output_tokens == 8
    assert usage.total_tokens == usage.input_tokens + 8
    assert usage.input_tokens_details.cached_tokens >= 0


def test_a_response_that_ends_its_turn_is_completed(client):
    response = client.responses.create(input=STOPPING_INPUT, max_output_tokens=24, **GREEDY)
    chat = chat_of(client, [{"role": "user", "content": STOPPING_INPUT}], 24)
    assert chat.choices[0].finish_reason == "stop"
    assert response.status == "completed" and response.incomplete_details is None
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.output_tokens == chat.usage.completion_tokens < 24


def test_input_items_render_as_the_same_chat_messages(client):
    items = [
        {"role": "developer", "content": "Be terse."},  # the template's system role
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
        {"role": "user", "content": RUNNING_INPUT},
    ]
    response = client.responses.create(input=items, max_output_tokens=6, **GREEDY)
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": RUNNING_INPUT},
    ]
    chat = chat_of(client, messages, 6)
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_a_streamed_response_sends_the_events_in_order_and_ends_completed(client):
    whole = client.responses.create(input=STOPPING_INPUT, max_output_tokens=24, **GREEDY)
    with client.responses.stream(input=STOPPING_INPUT, max_output_tokens=24, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [event.type for event in events]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    delta_types = ["response.output_text.delta"] * len(deltas)
    assert types == [*STREAM_EVENTS, *delta_types, *STREAM_END, "response.completed"]
    assert deltas and all(deltas)
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(deltas) == events[-4].text == final.output_text == whole.output_text
    assert final.status == "completed" and final.usage.output_tokens == whole.usage.output_tokens
    # a streamed response is stored as it ended
    assert client.responses.retrieve(final.id).output_text == whole.output_text


def test_a_streamed_response_cut_at_its_limit_ends_incomplete(client):
    with client.responses.stream(input=RUNNING_INPUT, max_output_tokens=5, **GREEDY) as stream:
        events = list(stream)
    last = events[-1]
    assert last.type == "response.incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens"
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert "".join(deltas) == last.response.output_text
    assert last.response.usage.output_tokens == 5


def test_a_follow_up_continues_the_conversation_from_the_prefix_cache(client):
    instructions = fresh_instructions()
    first = client.responses.create(
        input=STOPPING_INPUT, instructions=instructions, max_output_tokens=24, **GREEDY
    )
    follow = client.responses.create(
        input=RUNNING_INPUT,
        instructions=instructions,
        previous_response_id=first.id,
        max_output_tokens=6,
        **GREEDY,
    )
    messages = [
        {"role": "system", "content": instructions},
        {"role": "user", "content": STOPPING_INPUT},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": RUNNING_INPUT},
    ]
    chat = chat_of(client, messages, 6)
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert follow.previous_response_id == first.id
    assert follow.usage.input_tokens == chat.usage.prompt_tokens > first.usage.input_tokens
    assert follow.output_text == chat.choices[0].message.content
    assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 2


def test_another_router_continues_a_conversation_from_redis(door, client):
    instructions = fresh_instructions()
    first = client.responses.create(
        input=STOPPING_INPUT, instructions=instructions, max_output_tokens=24, **GREEDY
    )
    with door.client(url=door.second_url) as second:
        assert second.responses.retrieve(first.id).output_text == first.output_text
        follow = second.responses.create(
            input=RUNNING_INPUT,
            instructions=instructions,
            previous_response_id=first.id,
            max_output_tokens=6,
            **GREEDY,
        )
    messages = [
        {"role": "system", "content": instructions},
        {"role": "user", "content": STOPPING_INPUT},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": RUNNING_INPUT},
    ]
    chat = chat_of(client, messages, 6)
    assert follow.output_text == chat.choices[0].message.content
    assert follow.usage.input_tokens == chat.usage.prompt_tokens
    assert follow.usage.input_tokens_details.cached_tokens > 0
    # and the first router continues the second's
    again = client.responses.create(
        input="Thanks",
        instructions=instructions,
        previous_response_id=follow.id,
        max_output_tokens=4,
        **GREEDY,
    )
    assert again.usage.input_tokens > follow.usage.input_tokens + follow.usage.output_tokens


def test_store_false_keeps_nothing(client):
    response = client.responses.create(
        input=STOPPING_INPUT, store=False, max_output_tokens=4, **GREEDY
    )
    assert response.store is False
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.retrieve(response.id)
    assert missing.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(input="more", previous_response_id=response.id, **GREEDY)
    assert missing.value.body["param"] == "previous_response_id"


def test_get_returns_a_stored_response_and_delete_forgets_it(client):
    response = client.responses.create(
        input=STOPPING_INPUT, metadata={"topic": "test"}, max_output_tokens=4, **GREEDY
    )
    assert response.metadata == {"topic": "test"} and response.store is True
    stored = client.responses.retrieve(response.id)
    assert stored.model_dump() == response.model_dump()
    client.responses.delete(response.id)
    for call in (client.responses.retrieve, client.responses.delete):
        with pytest.raises(openai.NotFoundError) as missing:
            call(response.id)
        assert missing.value.body["code"] == "not_found"
        assert response.id in missing.value.body["message"]


def test_a_stored_response_is_its_keys_alone(door, client):
    response = client.responses.create(input=STOPPING_INPUT, max_output_tokens=4, **GREEDY)
    with door.client("b") as other:
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(response.id)
        with pytest.raises(openai.NotFoundError):
            other.responses.delete(response.id)
        with pytest.raises(openai.NotFoundError):
            other.responses.create(input="more", previous_response_id=response.id, **GREEDY)
    assert client.responses.retrieve(response.id).id == response.id  # still there for a
    url = door.cluster.openai_url
    unkeyed = openai.OpenAI(base_url=url, api_key="wrong", max_retries=0)
    with unkeyed, pytest.raises(openai.AuthenticationError):
        unkeyed.responses.retrieve(response.id)


def bad_request(client: openai.OpenAI, **fields) -> dict:
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**{**GREEDY, "input": RUNNING_INPUT, **fields})
    return refused.value.body


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        # a refused field is refused before the id is looked up
        ({"truncation": "auto", "previous_response_id": "resp_nothing"}, "truncation"),
        ({"input": []}, "input"),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]},
            "input[0].type",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ],
)
def test_a_bad_field_is_a_400_naming_it(client, fields, param):
    body = bad_request(client, **fields)
    assert body["param"] == param and body["type"] == "invalid_request_error"
    assert body["message"] and "Traceback" not in body["message"]


@pytest.mark.parametrize(
    ("text_format", "response_format"),
    [
        ({"type": "json_object"}, {"type": "json_object"}),
        (
            {"type": "json_schema", "name": "n", "schema": {"type": "object"}},
            {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}},
        ),
    ],
)
def test_text_format_is_answered_as_chat_answers_response_format(
    client, text_format, response_format
):
    messages = [{"role": "user", "content": RUNNING_INPUT}]
    try:
        chat = client.chat.completions.create(
            messages=messages, max_tokens=4, response_format=response_format, **GREEDY
        )
    except openai.BadRequestError as refused:  # no structured outputs yet: the same 400
        body = bad_request(client, text={"format": text_format})
        assert refused.body["param"] == "response_format" and body["param"] == "text.format"
        assert body["message"] == refused.body["message"].replace("response_format", "text.format")
    else:
        response = client.responses.create(
            input=RUNNING_INPUT, text={"format": text_format}, max_output_tokens=4, **GREEDY
        )
        assert response.output_text == chat.choices[0].message.content


def test_the_raw_response_and_events_validate_as_the_openai_packages_types(door):
    """The client builds its objects without validating them: here pydantic checks every
    field name and type of what the door sent against the package's own models."""
    headers = {"authorization": f"Bearer {door.keys['a']}"}
    url = f"{door.cluster.openai_url}/responses"
    body = {**GREEDY, "input": STOPPING_INPUT, "max_output_tokens": 24, "metadata": {"k": "v"}}
    whole = httpx.post(url, json=body, headers=headers, timeout=30).json()
    Response.model_validate(whole)
    events = pydantic.TypeAdapter(ResponseStreamEvent)
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=headers) as streamed:
        lines = [line for line in streamed.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines[0::2]]
    payloads = [line.removeprefix("data: ") for line in lines[1::2]]
    validated = [events.validate_json(payload) for payload in payloads]
    assert [event.type for event in validated] == names
    assert validated[-1].type == "response.completed"
    assert validated[-1].response.output_text == Response.model_validate(whole).output_text


FLOATS = st.floats(allow_nan=False, allow_infinity=False)  # what JSON can carry
JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), FLOATS, st.text(max_size=8)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
ITEMS = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "type": st.sampled_from(["message", "function_call_output", "x"]),
            "role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]),
            "content": st.one_of(
                st.text(max_size=12),
                st.lists(
                    st.fixed_dictionaries(
                        {"type": st.sampled_from(["input_text", "output_text", "input_image"])},
                        optional={"text": st.one_of(st.text(max_size=8), JSON)},
                    ),
                    max_size=2,
                ),
                JSON,
            ),
            "id": JSON,
        },
    ),
    max_size=3,
)
BODIES = st.fixed_dictionaries(
    {"model": st.sampled_from([MODEL, "other"]), "max_output_tokens": st.integers(-1, 3)},
    optional={
        "input": st.one_of(st.text(max_size=20), ITEMS, JSON),
        "instructions": st.one_of(st.text(max_size=12), JSON),
        "text": st.one_of(st.fixed_dictionaries({"format": JSON}), JSON),
        "temperature": st.one_of(st.floats(-1, 3), JSON),
        "top_p": st.one_of(st.floats(-1, 2), JSON),
        "store": st.one_of(st.booleans(), JSON),
        "stream": st.booleans(),
        "previous_response_id": st.one_of(st.text(max_size=12), JSON),
        "metadata": JSON,
        "tools": JSON,
    },
)


@fuzz_settings(40)
@given(body=BODIES)
def test_no_body_is_answered_with_a_500_or_a_traceback(door, body):
    headers = {"authorization": f"Bearer {door.keys['a']}"}
    url = f"{door.cluster.openai_url}/responses"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=30) as reply:
        text = reply.read().decode()
    assert reply.status_code in (200, 400, 404), text
    assert "Traceback" not in text
    if reply.status_code != 200:
        error = httpx.Response(reply.status_code, content=text).json()["error"]
        assert error["message"] and error["type"] == "invalid_request_error"
    elif body.get("stream") is True:
        assert "event: response.created" in text and "event: error" not in text
    else:
        assert httpx.Response(200, content=text).json()["object"] == "response"


def test_an_unknown_id_is_a_404_in_openais_shape(door):
    url = f"{door.cluster.openai_url}/responses/resp_nothing"
    reply = httpx.get(url, headers={"authorization": f"Bearer {door.keys['a']}"})
    assert reply.status_code == 404
    assert reply.json()["error"] == {
        "message": "no response with id `resp_nothing`",
        "type": "invalid_request_error",
        "param": "response_id",
        "code": "not_found",
    }


# -- the store itself, on the same real Redis --------------------------------------------------

STORED = StoredResponse({"id": "resp_x", "output": []}, [{"role": "user", "content": "hi"}])


async def test_the_store_keeps_a_response_for_its_ttl_and_forgets_it_on_delete(redis_url):
    store = ResponseStore(redis_url, ttl_s=30, key_prefix="test-responses")
    try:
        await store.put("key/resp_x", STORED)
        assert await store.get("key/resp_x") == STORED
        assert await store.get("other/resp_x") is None
        ttl_ms = await store._redis.pttl("test-responses:resp:key/resp_x")
        assert 29_000 < ttl_ms <= 30_000
        assert await store.delete("key/resp_x") is True
        assert await store.get("key/resp_x") is None
        assert await store.delete("key/resp_x") is False
    finally:
        await store.close()


async def test_the_store_refuses_a_record_over_its_bound_naming_store(redis_url):
    store = ResponseStore(redis_url, ttl_s=30, key_prefix="test-responses", max_record_bytes=64)
    try:
        with pytest.raises(InvalidRequestError) as refused:
            await store.put("resp_big", StoredResponse({"id": "x" * 64}, []))
        assert refused.value.field == "store"
        assert await store.get("resp_big") is None
    finally:
        await store.close()


async def test_the_store_without_redis_is_unavailable_within_a_second():
    store = ResponseStore("redis://127.0.0.1:1", ttl_s=30)
    started = time.monotonic()
    try:
        with pytest.raises(StateUnavailableError):
            await store.get("resp_x")
    finally:
        await store.close()
    assert time.monotonic() - started < 1.5


def test_the_response_ttl_is_a_router_flag_and_a_variable():
    parse = build_parser().parse_args
    base = ["router", "--model", "m", "--redis-url", "redis://r"]
    assert config_from_args(RouterConfig, parse(base), {}).response_ttl_s == DEFAULT_RESPONSE_TTL_S
    flagged = config_from_args(RouterConfig, parse([*base, "--response-ttl", "60"]), {})
    assert flagged.response_ttl_s == 60
    from_env = config_from_args(RouterConfig, parse(base), {"PDSERVE_RESPONSE_TTL": "90"})
    assert from_env.response_ttl_s == 90
    with pytest.raises(ValueError, match="response_ttl_s"):
        RouterConfig(model="m", redis_url="redis://r", response_ttl_s=0)
