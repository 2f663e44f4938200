"""Tensors as the KServe v2 protocol carries them: the few datatypes pdserve's model uses.

A request's input elements come either as raw bytes (`raw_input_contents`, one entry per
input in the order of `inputs`, as tritonclient sends them) or typed (`contents`); a
response's go out raw (`raw_output_contents`), as Triton sends them. Raw encoding is
little-endian; a BYTES element is led by its length as a 4-byte little-endian integer,
a BOOL element is one byte (0 or 1). Every error names the tensor.
"""

from __future__ import annotations

import enum
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pdserve.api.inference import grpc_service_pb2 as pb
from pdserve.core.errors import InvalidRequestError

_LENGTH = struct.Struct("<I")  # a BYTES element's length prefix
_UINT32 = struct.Struct("<I")
_RAW_INPUTS = "raw_input_contents"


class DataType(enum.StrEnum):
    """The protocol's names of the element types pdserve's model takes and gives."""

    BOOL = "BOOL"
    UINT32 = "UINT32"
    BYTES = "BYTES"


Element = bytes | bool | int


@dataclass(frozen=True, slots=True)
class InputTensor:
    """One input of a request, checked and decoded: its type, shape and elements."""

    name: str
    datatype: DataType
    shape: tuple[int, ...]
    elements: tuple[Element, ...]


def read_inputs(request: pb.ModelInferRequest, types: Mapping[str, DataType]) -> list[InputTensor]:
    """The request's inputs with their elements, each decoded as its datatype in `types`
    (the model's inputs by name): an unknown, repeated or ill-typed input is an error."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidRequestError(
            _RAW_INPUTS, f"{len(raw)} entries for {len(request.inputs)} inputs: give one per input"
        )
    tensors, seen = [], set()
    for index, tensor in enumerate(request.inputs):
        datatype = _check_input(tensor, types, seen)
        if raw:
            if tensor.HasField("contents"):
                raise InvalidRequestError(
                    tensor.name, f"give its elements in contents or {_RAW_INPUTS}, not both"
                )
            elements = _DECODERS[datatype](tensor.name, raw[index])
        else:
            elements = _typed_contents(tensor.name, datatype, tensor.contents)
        shape = tuple(tensor.shape)
        if math.prod(shape) != len(elements):
            raise InvalidRequestError(
                tensor.name, f"shape {list(shape)} does not hold its {len(elements)} element(s)"
            )
        tensors.append(InputTensor(tensor.name, datatype, shape, elements))
    return tensors


def _check_input(
    tensor: pb.ModelInferRequest.InferInputTensor, types: Mapping[str, DataType], seen: set[str]
) -> DataType:
    """The input's datatype as the model takes it, once its name and type are checked."""
    datatype = types.get(tensor.name)
    if datatype is None:
        known = ", ".join(types)
        raise InvalidRequestError(tensor.name or "inputs", f"unknown input (the model's: {known})")
    if tensor.name in seen:
        raise InvalidRequestError(tensor.name, "given more than once")
    seen.add(tensor.name)
    if tensor.datatype != datatype:
        raise InvalidRequestError(
            tensor.name, f"datatype must be {datatype.value}, got {tensor.datatype!r}"
        )
    return datatype


def _decode_bytes(name: str, data: bytes) -> tuple[bytes, ...]:
    """BYTES elements from their raw form: each led by its 4-byte little-endian length."""
    elements, position = [], 0
    while position < len(data):
        if position + _LENGTH.size > len(data):
            raise InvalidRequestError(name, "raw BYTES end inside an element's length prefix")
        (size,) = _LENGTH.unpack_from(data, position)
        position += _LENGTH.size
        if position + size > len(data):
            raise InvalidRequestError(name, "raw BYTES end inside an element")
        elements.append(data[position : position + size])
        position += size
    return tuple(elements)


def _decode_bools(name: str, data: bytes) -> tuple[bool, ...]:
    if any(byte > 1 for byte in data):
        raise InvalidRequestError(name, "a raw BOOL element is one byte, 0 or 1")
    return tuple(bool(byte) for byte in data)


_DECODERS = {DataType.BYTES: _decode_bytes, DataType.BOOL: _decode_bools}
# Where `contents` holds a tensor's elements, by datatype.
_CONTENTS = {
    DataType.BOOL: "bool_contents",
    DataType.UINT32: "uint_contents",
    DataType.BYTES: "bytes_contents",
}


def _typed_contents(
    name: str, datatype: DataType, contents: pb.InferTensorContents
) -> tuple[Element, ...]:
    field = _CONTENTS[datatype]
    if any(given.name != field for given, _ in contents.ListFields()):
        raise InvalidRequestError(name, f"a {datatype.value} tensor's contents are {field}")
    return tuple(getattr(contents, field))


@dataclass(frozen=True, slots=True)
class OutputTensor:
    """One output of a response: a flat list of elements of one type."""

    name: str
    datatype: DataType
    elements: Sequence[Element]

    def encode(self) -> bytes:
        """The elements as `raw_output_contents` carries them."""
        if self.datatype is DataType.BYTES:
            return b"".join(_LENGTH.pack(len(value)) + value for value in self.elements)
        if self.datatype is DataType.BOOL:
            return bytes(bool(value) for value in self.elements)
        return b"".join(_UINT32.pack(value) for value in self.elements)


def add_outputs(response: pb.ModelInferResponse, outputs: Sequence[OutputTensor]) -> None:
    """Append `outputs` to `response`: each a 1-D tensor, its elements raw."""
    for output in outputs:
        response.outputs.add(
            name=output.name, datatype=output.datatype.value, shape=[len(output.elements)]
        )
        response.raw_output_contents.append(output.encode())
