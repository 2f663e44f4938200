"""Hypothesis strategies for protobuf messages of valid structure and hostile values.

`messages(cls, hints)` draws a `cls` from its descriptor: every field may be absent or
hold an edge of its type (the extremes of its integers, NaN and infinities, empty and
huge strings, unicode that trips parsers up, unknown enum values, long repeated
fields). `hints` map a field's path ("sampling.max_tokens") to plausible values, drawn
more often than hostile ones, so that a message gets past the first check and the
hostile value in another field is what the handler meets.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message_factory import GetMessageClass
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# PDSERVE_FUZZ_FACTOR=N runs N times the examples, with fresh random draws (a longer
# hunt); unset (or at most 1: a quicker look), every run draws the same examples
# (repeatable in CI).
FACTOR = float(os.environ.get("PDSERVE_FUZZ_FACTOR", "1") or "1")
MAX_DEPTH = 3
HUGE_REPEATED = 5000

EDGE_STRINGS = (
    "",
    " ",
    "\x00",
    "a\x00b",
    "\ufeff",  # byte order mark
    "\u202e\u202d",  # right-to-left and left-to-right overrides
    "\u200b\u200c\u200d",  # zero-width space, non-joiner, joiner
    "e\u0301" * 50,  # combining accents
    "\U0001f600\U0001f9d1\u200d\U0001f4bb",  # emoji, a ZWJ sequence
    "\uffff\ufffe\U0010ffff",  # noncharacters
    "ǅǈ",
    "../../etc/passwd",
    "%s%n%x{0}{}",
    "'; DROP TABLE requests; --",
    "<|endoftext|><s></s>",
    "x" * 100_000,
)


def fuzz_settings(max_examples: int) -> settings:
    """Settings for a fuzz test of `max_examples` cases (times PDSERVE_FUZZ_FACTOR)."""
    return settings(
        max_examples=max(1, round(max_examples * FACTOR)),
        deadline=None,  # the machine is shared: a slow example is not a finding
        derandomize=FACTOR <= 1,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


def _integers(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = sorted({v for v in (lo, hi, 0, 1, -1, 2, hi // 2, lo // 2) if lo <= v <= hi})
    return st.one_of(st.sampled_from(edges), st.integers(lo, hi))


FLOAT_EDGES = (0.0, -0.0, 1.0, -1.0, float("nan"), float("inf"), float("-inf"), 3.4e38, 1e-45)
_SCALARS: dict[int, st.SearchStrategy] = {
    FieldDescriptor.TYPE_INT32: _integers(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: _integers(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: _integers(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: _integers(-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: _integers(-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: _integers(-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: _integers(0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: _integers(0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: _integers(0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: _integers(0, 2**64 - 1),
    FieldDescriptor.TYPE_FLOAT: st.one_of(
        st.sampled_from(FLOAT_EDGES), st.floats(width=32, allow_subnormal=True)
    ),
    FieldDescriptor.TYPE_DOUBLE: st.one_of(st.sampled_from(FLOAT_EDGES), st.floats()),
    FieldDescriptor.TYPE_BOOL: st.booleans(),
    # Long strings repeat a short draw: drawing thousands of characters one by one is
    # most of the time a fuzz run would take, and finds nothing a repeat does not.
    FieldDescriptor.TYPE_STRING: st.one_of(
        st.sampled_from(EDGE_STRINGS),
        st.text(max_size=12),
        st.builds(str.__mul__, st.text(min_size=1, max_size=4), st.sampled_from((100, 3000))),
    ),
    FieldDescriptor.TYPE_BYTES: st.one_of(
        st.binary(max_size=64), st.sampled_from((b"", b"\x00" * 100_000))
    ),
    FieldDescriptor.TYPE_ENUM: _integers(-(2**31), 2**31 - 1),
}


@dataclass(frozen=True)
class Exactly:
    """A hint drawn alone, never mixed with hostile values (a target address: the
    worker connects to it, so it stays on this machine)."""

    strategy: st.SearchStrategy


def _hostile(field: FieldDescriptor, path: str, hints, depth: int) -> st.SearchStrategy:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return messages(GetMessageClass(field.message_type), hints, f"{path}.", depth + 1)
    return _SCALARS[field.type]


def _value(field: FieldDescriptor, path: str, hints, depth: int) -> st.SearchStrategy:
    """One value of a singular field, or one element of a repeated one."""
    hostile = _hostile(field, path, hints, depth)
    hint = hints.get(path)
    if isinstance(hint, Exactly):
        return hint.strategy
    return hostile if hint is None else st.one_of(hint, hint, hint, hostile)


def _repeated(field: FieldDescriptor, path: str, hints, depth: int) -> st.SearchStrategy:
    whole = hints.get(path + "[]")  # a plausible whole list (a prompt), beside hostile ones
    element = _value(field, path, hints, depth)
    lists = st.one_of(
        st.lists(element, max_size=6),
        st.builds(lambda e: [e] * HUGE_REPEATED, element) if depth == 0 else st.just([]),
    )
    return lists if whole is None else st.one_of(whole, whole, lists)


def _is_map(field: FieldDescriptor) -> bool:
    message = field.message_type
    return message is not None and message.GetOptions().map_entry


@st.composite
def _message(draw, cls, hints: Mapping[str, st.SearchStrategy], prefix: str, depth: int):
    message = cls()
    if depth > MAX_DEPTH:
        return message
    descriptor = cls.DESCRIPTOR
    chosen = {
        oneof.name: draw(st.sampled_from([None, *oneof.fields])) for oneof in descriptor.oneofs
    }
    for field in descriptor.fields:
        path = prefix + field.name
        if field.containing_oneof is not None:
            if chosen[field.containing_oneof.name] is not field:
                continue
        elif path not in hints and path + "[]" not in hints and not draw(st.booleans()):
            continue  # absent
        _set(draw, message, field, path, hints, depth)
    return message


def _set(draw, message, field: FieldDescriptor, path: str, hints, depth: int) -> None:
    if _is_map(field):
        key_field, value_field = field.message_type.fields
        keys = _SCALARS[key_field.type]
        values = _value(value_field, path, hints, depth)
        for key, value in draw(st.dictionaries(keys, values, max_size=3)).items():
            if value_field.type == FieldDescriptor.TYPE_MESSAGE:
                getattr(message, field.name)[key].CopyFrom(value)
            else:
                getattr(message, field.name)[key] = value
        return
    if field.is_repeated:
        values = draw(_repeated(field, path, hints, depth))
        target = getattr(message, field.name)
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            for value in values:
                target.add().CopyFrom(value)
        else:
            target.extend(values)
        return
    value = draw(_value(field, path, hints, depth))
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        getattr(message, field.name).CopyFrom(value)
    else:
        setattr(message, field.name, value)


def messages(
    cls, hints: Mapping[str, st.SearchStrategy] | None = None, prefix: str = "", depth: int = 0
) -> st.SearchStrategy:
    """Messages of `cls`: valid in structure, hostile in value, `hints` drawn most often."""
    return _message(cls, hints or {}, prefix, depth)
