"""Sampling parameters as Triton's vLLM backend takes them, as the public API's.

They come as the `sampling_parameters` input (a JSON object) or, without it, as the
request's parameters; the names are vLLM's (and the OpenAI API's): those the public
`SamplingParams` has. Values may be numbers or numeric strings, as vLLM accepts them
(clients written for it send `{"temperature": "0.1"}`); a JSON null means the default.
Unset fields take vLLM's defaults, which are pdserve's (temperature 1, max_tokens 16).
Anything else, `n` or `logprobs` included, is an error naming it: pdserve has no
output that would carry its effect.

Structured outputs take vLLM's names: `guided_json` (a schema, as an object or JSON
text), `guided_regex`, `guided_choice`, `guided_grammar`, or one object of them,
`structured_outputs` (or the older `guided_decoding`, as Triton's vLLM backend passes it)
with `json`, `regex`, `choice`, `grammar` or `json_object`; one of them at most.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Mapping

from pdserve.api.inference import grpc_service_pb2 as pb
from pdserve.api.v1 import common_pb2
from pdserve.core.errors import InvalidRequestError
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.structured_output import Constraint, ConstraintKind
from pdserve.rpc.wire import sampling_params_to_proto

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
SEED_MAX = 2**63 - 1
# vLLM's top_k of -1 means what pdserve's 0 means: no top-k filter.
VLLM_NO_TOP_K = -1
# Request parameters that belong to the protocol (Triton's reserved names), not to
# sampling: `priority` and `timeout` are the schedule policy's (`schedule`); the others
# (sequences, binary output) mean nothing here, and requests that carry them from
# tritonclient are served without them.
RESERVED_PARAMETERS = frozenset(
    {"sequence_id", "sequence_start", "sequence_end", "priority", "timeout", "binary_data_output"}
)
RESERVED_PREFIX = "triton_"


class Kind(enum.Enum):
    FLOAT = enum.auto()
    INT = enum.auto()  # an int32 field
    SEED = enum.auto()
    BOOL = enum.auto()
    STRINGS = enum.auto()  # one string or a list of them
    INTS = enum.auto()  # a list of int32s


FIELDS: dict[str, Kind] = {
    "temperature": Kind.FLOAT,
    "top_p": Kind.FLOAT,
    "top_k": Kind.INT,
    "min_p": Kind.FLOAT,
    "repetition_penalty": Kind.FLOAT,
    "frequency_penalty": Kind.FLOAT,
    "presence_penalty": Kind.FLOAT,
    "max_tokens": Kind.INT,
    "min_tokens": Kind.INT,
    "ignore_eos": Kind.BOOL,
    "stop": Kind.STRINGS,
    "stop_token_ids": Kind.INTS,
    "seed": Kind.SEED,
}


def sampling_from_json(data: bytes, field: str) -> common_pb2.SamplingParams:
    """The `sampling_parameters` input's JSON object (`field` names it in errors)."""
    try:
        values = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(field, "is not valid UTF-8") from exc
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(field, f"is not valid JSON ({exc.msg})") from exc
    if not isinstance(values, dict):
        raise InvalidRequestError(field, "must be a JSON object")
    return sampling_from_values(values, field)


def sampling_from_parameters(
    parameters: Mapping[str, pb.InferParameter], field: str
) -> common_pb2.SamplingParams:
    """The request's parameters, the protocol's own (RESERVED_PARAMETERS) left out."""
    values = {
        name: _parameter_value(param) for name, param in parameters.items() if not _reserved(name)
    }
    return sampling_from_values(values, field)


def has_sampling_parameters(parameters: Mapping[str, pb.InferParameter]) -> bool:
    """Whether the request's parameters hold any beside the protocol's own."""
    return not all(_reserved(name) for name in parameters)


def _reserved(name: str) -> bool:
    return name in RESERVED_PARAMETERS or name.startswith(RESERVED_PREFIX)


def _parameter_value(param: pb.InferParameter) -> object:
    which = param.WhichOneof("parameter_choice")
    return None if which is None else getattr(param, which)  # unset: the default


# vLLM's flat fields of structured outputs, and the objects that hold one of them
CONSTRAINT_FIELDS = {
    "guided_json": ConstraintKind.JSON_SCHEMA,
    "guided_regex": ConstraintKind.REGEX,
    "guided_choice": ConstraintKind.CHOICE,
    "guided_grammar": ConstraintKind.GRAMMAR,
}
CONSTRAINT_OBJECTS = ("structured_outputs", "guided_decoding")
OBJECT_KEYS = {
    "json": ConstraintKind.JSON_SCHEMA,
    "regex": ConstraintKind.REGEX,
    "choice": ConstraintKind.CHOICE,
    "grammar": ConstraintKind.GRAMMAR,
    "json_object": ConstraintKind.JSON_OBJECT,
}


def sampling_from_values(values: Mapping[str, object], field: str) -> common_pb2.SamplingParams:
    """Named values as the public API's sampling parameters (checked by the frontend)."""
    values = dict(values)
    constraint = _constraint(values, field)  # takes its fields out of `values`
    unknown = sorted(name for name in values if name not in FIELDS)
    if unknown:
        supported = ", ".join(FIELDS)
        raise InvalidRequestError(
            field, f"unknown or unsupported: {', '.join(unknown)} (supported: {supported})"
        )
    params = SamplingParams()
    for name, value in values.items():
        if value is None:
            continue
        try:
            setattr(params, name, _COERCE[FIELDS[name]](value))
        except (TypeError, ValueError, OverflowError) as exc:
            raise InvalidRequestError(f"{field}.{name}", str(exc)) from exc
    if params.top_k == VLLM_NO_TOP_K:
        params.top_k = 0
    params.constraint = constraint
    return sampling_params_to_proto(params)


def _constraint(values: dict[str, object], field: str) -> Constraint | None:
    """The one structured output among `values` (removed from them), or None."""
    asked = [
        (name, CONSTRAINT_FIELDS[name], values.pop(name))
        for name in list(values)
        if name in CONSTRAINT_FIELDS and values[name] is not None
    ]
    for name in CONSTRAINT_OBJECTS:
        held = values.pop(name, None)
        if held is None:
            continue
        if not isinstance(held, dict) or len(held) != 1 or next(iter(held)) not in OBJECT_KEYS:
            keys = ", ".join(OBJECT_KEYS)
            raise InvalidRequestError(f"{field}.{name}", f"must be an object of one of {keys}")
        [(key, value)] = held.items()
        asked.append((f"{name}.{key}", OBJECT_KEYS[key], value))
    if len(asked) > 1:
        raise InvalidRequestError(f"{field}.{asked[1][0]}", "one structured output at most")
    if not asked:
        return None
    [(name, kind, value)] = asked
    try:
        return _constraint_of(kind, value)
    except TypeError as exc:
        raise InvalidRequestError(f"{field}.{name}", str(exc)) from None


def _constraint_of(kind: ConstraintKind, value: object) -> Constraint | None:
    if kind is ConstraintKind.JSON_OBJECT:
        return Constraint(kind) if _bool(value) else None
    if kind is ConstraintKind.CHOICE:
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise TypeError(f"must be a list of strings, got {value!r}")
        return Constraint(kind, choices=tuple(value))
    if kind is ConstraintKind.JSON_SCHEMA and isinstance(value, dict | bool):
        return Constraint(kind, json.dumps(value, ensure_ascii=False))
    if not isinstance(value, str):
        raise TypeError(f"must be a string, got {value!r}")
    return Constraint(kind, value)


def _float(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise TypeError(f"must be a number, got {value!r}")
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"must be a number, got {value!r}") from None


def _integer(value: object, low: int = INT32_MIN, high: int = INT32_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise TypeError(f"must be an integer, got {value!r}")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"must be an integer, got {value!r}")
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"must be an integer, got {value!r}") from None
    if not low <= number <= high:
        raise ValueError(f"must be in [{low}, {high}], got {number}")
    return number


def _seed(value: object) -> int:
    return _integer(value, 0, SEED_MAX)


def _bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise TypeError(f"must be true or false, got {value!r}")


def _strings(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return value
    raise TypeError(f"must be a string or a list of strings, got {value!r}")


def _integers(value: object) -> list[int]:
    if not isinstance(value, list):
        raise TypeError(f"must be a list of integers, got {value!r}")
    return [_integer(item) for item in value]


_COERCE: dict[Kind, Callable[[object], object]] = {
    Kind.FLOAT: _float,
    Kind.INT: _integer,
    Kind.SEED: _seed,
    Kind.BOOL: _bool,
    Kind.STRINGS: _strings,
    Kind.INTS: _integers,
}
