"""What a request asks its output to match (structured outputs): JSON, a JSON Schema, a
regular expression, one of a list of strings, or a grammar. A plain value that crosses
process boundaries; the engine compiles it (`engine/grammar.py`)."""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from pdserve.core.errors import InvalidRequestError

# Bounds on what one constraint may hold, whatever the compiler would take: the text of a
# schema, pattern or grammar (UTF-8 bytes), and the choices of a CHOICE (each one's bytes
# count toward the same total).
MAX_CONSTRAINT_BYTES = 32 << 10
MAX_CHOICES = 256


class ConstraintKind(enum.StrEnum):
    """A str enum, so that SamplingParams stays JSON (`state.record.request_digest`)."""

    JSON_OBJECT = "json_object"  # any JSON object
    JSON_SCHEMA = "json_schema"  # `spec`: a JSON Schema, as JSON text
    REGEX = "regex"  # `spec`: a regular expression the whole output matches
    CHOICE = "choice"  # `choices`: the output is exactly one of them
    GRAMMAR = "grammar"  # `spec`: a grammar, Lark (llguidance's) or GBNF (llama.cpp's)


@dataclass(frozen=True, slots=True)
class Constraint:
    kind: ConstraintKind
    spec: str = ""  # JSON_SCHEMA, REGEX, GRAMMAR; empty for the others
    choices: tuple[str, ...] = ()  # CHOICE only

    @property
    def key(self) -> str:
        """A digest naming the constraint: what compiled grammars are cached under."""
        text = json.dumps([self.kind.value, self.spec, list(self.choices)], ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()

    def validate(self, field: str) -> None:
        """Its form and size, before anything compiles it; InvalidRequestError names `field`
        (the constraint's field as the caller knows it)."""
        if not isinstance(self.kind, ConstraintKind):
            raise InvalidRequestError(field, f"unknown constraint kind {self.kind!r}")
        size = len(self.spec.encode()) + sum(len(c.encode()) for c in self.choices)
        if size > MAX_CONSTRAINT_BYTES:
            raise InvalidRequestError(
                field, f"{size} bytes; the limit is {MAX_CONSTRAINT_BYTES} (UTF-8)"
            )
        takes_spec = self.kind in (
            ConstraintKind.JSON_SCHEMA,
            ConstraintKind.REGEX,
            ConstraintKind.GRAMMAR,
        )
        if takes_spec and not self.spec:
            raise InvalidRequestError(field, f"{self.kind.value} must not be empty")
        if not takes_spec and self.spec:
            raise InvalidRequestError(field, f"{self.kind.value} takes no text")
        if self.kind is ConstraintKind.CHOICE:
            _check_choices(self.choices, field)
        elif self.choices:
            raise InvalidRequestError(field, f"{self.kind.value} takes no choices")
        if self.kind is ConstraintKind.JSON_SCHEMA:
            schema_object(self.spec, field)


def schema_object(spec: str, field: str) -> dict[str, Any] | bool:
    """The schema `spec` holds: a JSON object (or true/false, as JSON Schema allows)."""
    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(field, f"not valid JSON: {exc}") from None
    if not isinstance(schema, dict | bool):
        raise InvalidRequestError(field, "a JSON Schema must be an object")
    return schema


def _check_choices(choices: tuple[str, ...], field: str) -> None:
    if not choices:
        raise InvalidRequestError(field, "needs at least one choice")
    if len(choices) > MAX_CHOICES:
        raise InvalidRequestError(field, f"{len(choices)} choices; the limit is {MAX_CHOICES}")
    for i, choice in enumerate(choices):
        if not isinstance(choice, str) or not choice:
            raise InvalidRequestError(f"{field}[{i}]", "must be a non-empty string")
