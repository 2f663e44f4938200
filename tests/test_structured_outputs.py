"""Structured outputs end to end, on the real model (SmolLM2-135M-Instruct) in a real
cluster: disaggregated (every prompt prefilled on the prefill worker, its first token
sampled there under the constraint, the matcher rebuilt on the decode worker) and
colocated. Through the official `openai` client, 25 requests per placement (50 in all):
JSON schemas of several shapes, greedy and sampled, streamed and not, on chat and
completions, by `response_format` and by vLLM's extras; each answer must be text that
`json.loads` and `jsonschema` accept. The same prompts without the constraint are
mostly not (the constraint does the work). Bad constraints are 400s naming the field,
or INVALID_ARGUMENT on gRPC, and leave no KV block behind.

The outputs are short (schemas with bounded strings and arrays), so a module costs two
cluster start-ups and a few seconds of decoding per placement."""

from __future__ import annotations

import asyncio
import json
import re

import grpc
import jsonschema
import openai
import pytest

from pdserve.client import AsyncClient, PdserveError
from pdserve.cluster.load import is_idle, wait_idle
from pdserve.cluster.local import ClusterShape, LocalCluster
from pdserve.core.checkpoint import default_model
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.structured_output import Constraint, ConstraintKind

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

WORKER_ARGS = ["--num-kv-blocks=512", "--threads=1"]
PLACEMENTS = {
    "disaggregated": (ClusterShape(prefill=1, decode=1), ["--prefill-placement=remote"]),
    "colocated": (ClusterShape(prefill=0, decode=0, colocated=1), []),
}
MAX_TOKENS = 64  # the longest valid answer below is about 40 tokens
NAME = {"type": "string", "minLength": 1, "maxLength": 12}
SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 999},
                    "role": {"enum": ["admin", "editor", "viewer"]},
                },
                "required": ["id", "role"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["colors"],
        "additionalProperties": False,
    },
    "pattern": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
            "score": {"type": "integer", "minimum": 0, "maximum": 10},
        },
        "required": ["code", "score"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "reason": NAME},
        "required": ["answer", "reason"],
        "additionalProperties": False,
    },
}
TASKS = {
    "person": "Invent a person.",
    "nested": "Describe a user account.",
    "array": "Name some colors of the flag of France.",
    "pattern": "Give a product code and a rating.",
    "enum": "Is the sky blue?",
}


@pytest.fixture(scope="module", params=sorted(PLACEMENTS))
def cluster(request, tmp_path_factory):
    """One cluster per placement, in turn (the module holds one at a time)."""
    shape, router_args = PLACEMENTS[request.param]
    run_dir = tmp_path_factory.mktemp(f"structured-{request.param}")
    with LocalCluster(
        str(default_model()),
        shape,
        run_dir,
        worker_args=WORKER_ARGS,
        router_args=router_args,
        http_port=0,
    ) as cluster:
        yield cluster


def messages(name: str) -> list[dict]:
    schema = json.dumps(SCHEMAS[name])
    return [{"role": "user", "content": f"{TASKS[name]} Answer in JSON matching {schema}"}]


def response_format(name: str) -> dict:
    schema = {"name": name, "schema": SCHEMAS[name], "strict": True}
    return {"type": "json_schema", "json_schema": schema}


async def chat(client, name, *, temperature, stream, seed=None, **extra) -> tuple[str, str]:
    """The answer's text and finish reason, streamed or not."""
    asked = dict(model=client.model, messages=messages(name), max_tokens=MAX_TOKENS)
    asked.update(temperature=temperature, seed=seed, **extra)
    if not stream:
        out = await client.chat.completions.create(**asked)
        return out.choices[0].message.content, out.choices[0].finish_reason
    text, reason = "", None
    async for chunk in await client.chat.completions.create(stream=True, **asked):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
    return text, reason


def openai_client(cluster) -> openai.AsyncOpenAI:
    client = openai.AsyncOpenAI(base_url=cluster.openai_url, api_key="unused", max_retries=0)
    client.model = None  # the one model the router serves
    return client


def is_valid(text: str, name: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


async def constrained_answers(cluster) -> list[tuple[str, str, str, str]]:
    """(schema, how it was asked, text, finish reason) for 25 requests at once."""
    client = openai_client(cluster)
    calls = []
    for i, name in enumerate(SCHEMAS):
        for temperature, stream in ((0.0, False), (0.0, True), (1.0, False), (1.0, True)):
            how = f"response_format t={temperature} stream={stream}"
            call = chat(
                client,
                name,
                temperature=temperature,
                stream=stream,
                seed=i,
                response_format=response_format(name),
            )
            calls.append((name, how, call))
    extras = {
        "person": {"guided_json": SCHEMAS["person"]},
        "nested": {"structured_outputs": {"json": SCHEMAS["nested"]}},
        "array": {"guided_json": json.dumps(SCHEMAS["array"])},
    }
    for name, body in extras.items():
        calls.append(
            (
                name,
                str(body)[:40],
                chat(client, name, temperature=0.7, stream=False, seed=3, extra_body=body),
            )
        )
    calls.append(("pattern", "completions", completion(client, "pattern")))
    calls.append(("enum", "completions streamed", completion(client, "enum", stream=True)))
    results = await asyncio.gather(*(call for _, _, call in calls))
    await client.close()
    return [(name, how, *result) for (name, how, _), result in zip(calls, results, strict=True)]


async def completion(client, name: str, stream: bool = False) -> tuple[str, str]:
    prompt = f"{TASKS[name]} JSON matching {json.dumps(SCHEMAS[name])}:\n"
    asked = dict(model=client.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0)
    body = {"response_format": response_format(name)}
    if not stream:
        out = await client.completions.create(extra_body=body, **asked)
        return out.choices[0].text, out.choices[0].finish_reason
    text, reason = "", None
    async for chunk in await client.completions.create(stream=True, extra_body=body, **asked):
        text += chunk.choices[0].text
        reason = chunk.choices[0].finish_reason or reason
    return text, reason


def test_every_constrained_answer_is_json_its_schema_accepts(cluster):
    answers = asyncio.run(constrained_answers(cluster))
    assert len(answers) == 25
    bad = [
        (name, how, text, reason) for name, how, text, reason in answers if not is_valid(text, name)
    ]
    assert not bad, bad
    assert all(reason == "stop" for *_, reason in answers)  # the constraint ended each one
    assert_no_kv_held(cluster)


def assert_no_kv_held(cluster) -> None:
    """Every worker idle, every KV block free, no lease open."""
    for worker in cluster.workers:
        assert is_idle(wait_idle(worker.address, worker.role)), worker.name


def test_without_the_constraint_most_answers_are_not_valid(cluster, request):
    """The same chats, greedy, without the constraint: SmolLM2 wraps its JSON in prose
    and fences, or strays from the schema. The model's text is the same in either
    placement, so one of them shows it."""
    if request.node.callspec.params["cluster"] != "disaggregated":
        pytest.skip("the same model and prompts as in the disaggregated placement")

    async def free_answers():
        client = openai_client(cluster)
        calls = [chat(client, name, temperature=0.0, stream=False) for name in SCHEMAS]
        answers = await asyncio.gather(*calls)
        await client.close()
        return [text for text, _ in answers]

    answers = asyncio.run(free_answers())
    invalid = [
        text for name, text in zip(SCHEMAS, answers, strict=True) if not is_valid(text, name)
    ]
    assert len(invalid) >= 3, answers  # of 5; with the constraint: none (the test above)


def test_the_native_client_takes_a_regex_and_a_choice(cluster):
    async def run():
        async with AsyncClient(cluster.router_address) as client:
            date = Constraint(ConstraintKind.REGEX, r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
            choice = Constraint(ConstraintKind.CHOICE, choices=("Paris", "Lyon", "Nice"))
            return await asyncio.gather(
                client.generate(
                    "Today's date is ",
                    SamplingParams(max_tokens=16, temperature=0.0, constraint=date),
                ),
                client.generate(
                    "The capital of France is ",
                    SamplingParams(max_tokens=8, temperature=1.0, seed=2, constraint=choice),
                ),
            )

    date, capital = asyncio.run(run())
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", date.text)
    assert capital.text in ("Paris", "Lyon", "Nice")


BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "wat"}}}
TOO_LARGE = {"type": "object", "description": "x" * (40 << 10)}
BAD_CONSTRAINTS = [
    (
        "response_format",
        {
            "response_format": response_format("person")
            | {"json_schema": {"name": "x", "schema": BAD_SCHEMA}}
        },
    ),
    (
        "response_format",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": TOO_LARGE},
            }
        },
    ),
    ("guided_json", {"guided_json": BAD_SCHEMA}),
    ("guided_json", {"guided_json": "{not json"}),
    ("guided_regex", {"guided_regex": "[a-"}),
    ("guided_grammar", {"guided_grammar": "start: undefined_rule"}),
    ("guided_choice", {"guided_choice": []}),
    ("structured_outputs", {"structured_outputs": {"regex": "a", "choice": ["b"]}}),
    ("guided_choice", {"guided_regex": "a", "guided_choice": ["b"]}),
]


def test_a_bad_constraint_is_a_400_naming_its_field_and_reserves_no_kv(cluster):
    client = openai.OpenAI(base_url=cluster.openai_url, api_key="unused", max_retries=0)
    for field, body in BAD_CONSTRAINTS:
        for create in (client.chat.completions.create, client.completions.create):
            prompt = (
                {"messages": messages("person")}
                if create == client.chat.completions.create
                else {"prompt": "JSON:"}
            )
            with pytest.raises(openai.BadRequestError) as exc:
                create(model=None, max_tokens=8, extra_body=body, **prompt)
            assert exc.value.param == field, (field, exc.value.body)
            assert "Traceback" not in exc.value.message
    assert_no_kv_held(cluster)


def test_a_bad_constraint_on_grpc_is_invalid_argument_naming_the_field(cluster):
    async def run(constraint):
        async with AsyncClient(cluster.router_address) as client:
            await client.generate("JSON:", SamplingParams(max_tokens=8, constraint=constraint))

    for constraint, field in (
        (Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(BAD_SCHEMA)), "sampling.json_schema"),
        (Constraint(ConstraintKind.REGEX, "(unclosed"), "sampling.regex"),
        (Constraint(ConstraintKind.CHOICE, choices=("a", "")), "sampling.choice[1]"),
    ):
        with pytest.raises(PdserveError) as exc:
            asyncio.run(run(constraint))
        assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
        [(named, _)] = exc.value.field_violations
        assert named == field
    assert_no_kv_held(cluster)
