"""A constraint as each door takes it, and across the wire: the proto's `constraint` oneof
both ways, KServe's `sampling_parameters` (vLLM's names) and the OpenAI door's fields,
each bad form an error naming the field. No model here: the router compiles (see
tests/test_structured_engine.py and tests/test_structured_outputs.py)."""

from __future__ import annotations

import json

import pytest

from pdserve.api.v1 import common_pb2
from pdserve.core.errors import InvalidRequestError
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.structured_output import Constraint, ConstraintKind
from pdserve.gateways.kserve.sampling import sampling_from_values
from pdserve.gateways.openai.constraints import asked_constraint
from pdserve.gateways.openai.errors import OpenAIError
from pdserve.gateways.openai.protocol import ChatCompletionRequest
from pdserve.rpc.wire import sampling_params_from_proto, sampling_params_to_proto

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
EVERY_KIND = [
    Constraint(ConstraintKind.JSON_OBJECT),
    Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA)),
    Constraint(ConstraintKind.REGEX, "[0-9]+"),
    Constraint(ConstraintKind.CHOICE, choices=("yes", "no")),
    Constraint(ConstraintKind.GRAMMAR, 'start: "a"+'),
]


@pytest.mark.parametrize("constraint", EVERY_KIND, ids=[c.kind.value for c in EVERY_KIND])
def test_every_kind_crosses_the_wire_and_back(constraint):
    params = SamplingParams(max_tokens=7, constraint=constraint)
    msg = sampling_params_to_proto(params)
    assert msg.WhichOneof("constraint") == constraint.kind.value
    wire = common_pb2.SamplingParams.FromString(msg.SerializeToString())
    assert sampling_params_from_proto(wire) == params


def test_no_constraint_is_none_and_json_object_false_is_none_too():
    assert sampling_params_from_proto(common_pb2.SamplingParams()).constraint is None
    assert (
        sampling_params_from_proto(common_pb2.SamplingParams(json_object=False)).constraint is None
    )


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"guided_json": SCHEMA}, Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA))),
        (
            {"guided_json": '{"type": "object"}'},
            Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "object"}'),
        ),
        ({"guided_regex": "[a-z]+"}, Constraint(ConstraintKind.REGEX, "[a-z]+")),
        ({"guided_choice": ["x", "y"]}, Constraint(ConstraintKind.CHOICE, choices=("x", "y"))),
        (
            {"structured_outputs": {"grammar": 'start: "a"'}},
            Constraint(ConstraintKind.GRAMMAR, 'start: "a"'),
        ),
        ({"guided_decoding": {"json_object": True}}, Constraint(ConstraintKind.JSON_OBJECT)),
    ],
)
def test_kserve_takes_vllms_names(values, expected):
    sampling = sampling_from_values({"max_tokens": 5, **values}, "sampling_parameters")
    assert sampling_params_from_proto(sampling).constraint == expected


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"guided_choice": "x"}, "sampling_parameters.guided_choice"),
        ({"guided_regex": 5}, "sampling_parameters.guided_regex"),
        (
            {"structured_outputs": {"regex": "a", "json": {}}},
            "sampling_parameters.structured_outputs",
        ),
        ({"guided_regex": "a", "guided_grammar": "b"}, "sampling_parameters.guided_grammar"),
    ],
)
def test_kserve_names_a_bad_structured_output(values, field):
    with pytest.raises(InvalidRequestError) as exc:
        sampling_from_values(values, "sampling_parameters")
    assert exc.value.field == field


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def test_openai_response_format_and_vllms_extras_become_one_constraint():
    schema_format = {
        "type": "json_schema",
        "json_schema": {"name": "a", "schema": SCHEMA, "strict": True},
    }
    cases = [
        (
            chat(response_format={"type": "json_object"}),
            ConstraintKind.JSON_OBJECT,
            "response_format",
        ),
        (chat(response_format=schema_format), ConstraintKind.JSON_SCHEMA, "response_format"),
        (chat(guided_json=SCHEMA), ConstraintKind.JSON_SCHEMA, "guided_json"),
        (chat(guided_regex="a+"), ConstraintKind.REGEX, "guided_regex"),
        (chat(guided_choice=["a"]), ConstraintKind.CHOICE, "guided_choice"),
        (chat(guided_grammar='start: "a"'), ConstraintKind.GRAMMAR, "guided_grammar"),
        (
            chat(structured_outputs={"json": SCHEMA}),
            ConstraintKind.JSON_SCHEMA,
            "structured_outputs",
        ),
    ]
    for request, kind, field in cases:
        asked = asked_constraint(request)
        assert (asked.constraint.kind, asked.field) == (kind, field)
    assert json.loads(asked_constraint(cases[1][0]).constraint.spec) == SCHEMA
    assert asked_constraint(chat(response_format={"type": "text"})) is None
    assert asked_constraint(chat()) is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"guided_regex": "a", "guided_json": SCHEMA}, "guided_regex"),  # the second set
        ({"structured_outputs": {}}, "structured_outputs"),
    ],
)
def test_openai_names_a_malformed_structured_output(fields, param):
    with pytest.raises(OpenAIError) as exc:
        asked_constraint(chat(**fields))
    assert exc.value.param == param
