"""Structured outputs as OpenAI and vLLM ask for them, as one `Constraint`.

OpenAI's `response_format` ({"type": "json_object"} or {"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}), vLLM's `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`, and their successor `structured_outputs` ({"json"},
{"regex"}, {"choice"}, {"grammar"}, {"json_object"}). A request sets one at most; the
router compiles it and names the field on failure, which `ParamNames.constraint` turns
back into the one the client used."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pdserve.core.structured_output import Constraint, ConstraintKind
from pdserve.gateways.openai.errors import bad_request
from pdserve.gateways.openai.protocol import SamplingFields, StructuredOutputs

RESPONSE_FORMAT = "response_format"


@dataclass(frozen=True, slots=True)
class AskedConstraint:
    constraint: Constraint
    field: str  # the request's field that asked for it: what errors name


def asked_constraint(request: SamplingFields) -> AskedConstraint | None:
    """The request's constraint, or None; a 400 naming the field when two are set or one
    is malformed in form (the router checks that it compiles)."""
    found = [
        (field, constraint)
        for field, constraint in (
            (RESPONSE_FORMAT, _response_format(request)),
            ("guided_json", _json_schema(request.guided_json, "guided_json")),
            ("guided_regex", _text(ConstraintKind.REGEX, request.guided_regex)),
            ("guided_choice", _choice(request.guided_choice)),
            ("guided_grammar", _text(ConstraintKind.GRAMMAR, request.guided_grammar)),
            ("structured_outputs", _structured_outputs(request.structured_outputs)),
        )
        if constraint is not None
    ]
    if len(found) > 1:
        names = ", ".join(field for field, _ in found)
        raise bad_request(found[1][0], f"one structured output at most; the request sets {names}")
    return AskedConstraint(found[0][1], found[0][0]) if found else None


def _response_format(request: SamplingFields) -> Constraint | None:
    fmt = request.response_format
    if fmt is None or fmt.type == "text":
        if fmt is not None and fmt.json_schema is not None:
            raise bad_request(RESPONSE_FORMAT, "json_schema needs type: json_schema")
        return None
    if fmt.type == "json_object":
        return Constraint(ConstraintKind.JSON_OBJECT)
    if fmt.json_schema is None:
        raise bad_request(RESPONSE_FORMAT, "type json_schema needs json_schema")
    if fmt.json_schema.schema_ is None:  # OpenAI: no schema means any JSON object
        return Constraint(ConstraintKind.JSON_OBJECT)
    return _json_schema(fmt.json_schema.schema_, RESPONSE_FORMAT)


def _structured_outputs(asked: StructuredOutputs | None) -> Constraint | None:
    if asked is None:
        return None
    field = "structured_outputs"
    found = [
        c
        for c in (
            _json_schema(asked.json_, field),
            _text(ConstraintKind.REGEX, asked.regex),
            _choice(asked.choice),
            _text(ConstraintKind.GRAMMAR, asked.grammar),
            Constraint(ConstraintKind.JSON_OBJECT) if asked.json_object else None,
        )
        if c is not None
    ]
    if len(found) != 1:
        raise bad_request(field, "needs exactly one of json, regex, choice, grammar, json_object")
    return found[0]


def _json_schema(schema: dict[str, Any] | str | None, field: str) -> Constraint | None:
    """A schema given as an object or as JSON text; the text is kept as JSON text."""
    if schema is None:
        return None
    if isinstance(schema, str):
        return Constraint(ConstraintKind.JSON_SCHEMA, schema)
    try:
        text = json.dumps(schema, ensure_ascii=False, allow_nan=False)
    except ValueError as exc:
        raise bad_request(field, f"the schema is not JSON: {exc}") from None
    return Constraint(ConstraintKind.JSON_SCHEMA, text)


def _text(kind: ConstraintKind, text: str | None) -> Constraint | None:
    return None if text is None else Constraint(kind, text)


def _choice(choices: list[str] | None) -> Constraint | None:
    return None if choices is None else Constraint(ConstraintKind.CHOICE, choices=tuple(choices))
