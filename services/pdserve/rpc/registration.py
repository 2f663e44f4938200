"""The one way a servicer is registered: lenient parsing, and a parser per method on demand.

gRPC's generated registration parses requests before the handler runs; a message
with invalid UTF-8 in a string field then fails inside gRPC and the client sees an
opaque error. Here parsing failures become an `UndecodableRequest`: for a unary request
the `rpc_errors` wrapper turns it into INVALID_ARGUMENT naming the offending field; a
streamed one raises that error from the handler's request iterator (`checked_requests`).
A method may bring its own parser instead (KVTransfer.PushKV reads its payloads without
copying them: `kv.transfer.ZERO_COPY_PARSERS`); its handler then gets each
`UndecodableRequest` as an item, and decides when to fail (PushKV reads to the end first).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field

import grpc
from google.protobuf import descriptor as _descriptor
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass

from pdserve.core.errors import InvalidRequestError

_HANDLERS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}
_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5


@dataclass(frozen=True, slots=True)
class UndecodableRequest:
    field: str  # the field at fault, as a path ("prompt.text"), or "request"
    message: str


Parser = Callable[[bytes], object]


@dataclass(frozen=True, slots=True)
class Service:
    """One gRPC service a process serves: its servicer, and parsers in place of protobuf's."""

    servicer: object
    descriptor: _descriptor.ServiceDescriptor
    parsers: Mapping[str, Parser] = field(default_factory=dict)  # method name -> parser

    @property
    def name(self) -> str:
        return self.descriptor.full_name


def add_servicer(
    servicer,
    service: _descriptor.ServiceDescriptor,
    server,
    parsers: Mapping[str, Parser] | None = None,
) -> None:
    """Like the generated add_*Servicer_to_server, with lenient parsing of unary requests.

    `parsers` maps a method's name to the function that parses its requests instead.
    Streamed requests reach the handler through its iterator, which raises at one that
    did not parse (unless the method has its own parser: see the module's docstring).
    """
    parsers = parsers or {}
    unknown = set(parsers) - {method.name for method in service.methods}
    if unknown:
        raise ValueError(f"{service.full_name} has no method(s) {sorted(unknown)}")
    handlers = {}
    for method in service.methods:
        request_cls = GetMessageClass(method.input_type)
        response_cls = GetMessageClass(method.output_type)
        make = _HANDLERS[(method.client_streaming, method.server_streaming)]
        handler, parse = getattr(servicer, method.name), parsers.get(method.name)
        if method.client_streaming and parse is None:
            handler = _checked_stream(handler, method.server_streaming)
        handlers[method.name] = make(
            handler,
            request_deserializer=_lenient(request_cls, parse or request_cls.FromString),
            response_serializer=response_cls.SerializeToString,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
    server.add_registered_method_handlers(service.full_name, handlers)


def _checked_stream(handler, server_streaming: bool):
    """`handler` reading its requests through `checked_requests`."""
    if server_streaming:

        async def stream_stream(requests, context):
            async for response in handler(checked_requests(requests), context):
                yield response

        return stream_stream

    async def stream_unary(requests, context):
        return await handler(checked_requests(requests), context)

    return stream_unary


async def checked_requests(requests: AsyncIterator) -> AsyncIterator:
    """A call's streamed requests, raising InvalidRequestError (naming the field) at the
    first one that did not parse: the handler's error mapping makes it INVALID_ARGUMENT."""
    async for request in requests:
        if isinstance(request, UndecodableRequest):
            raise InvalidRequestError(request.field, request.message)
        yield request


def _lenient(message_cls, parse_bytes: Parser):
    """`parse_bytes`, giving an `UndecodableRequest` for bytes that are no `message_cls`
    (a parser that raised fails inside gRPC, and the caller gets an opaque INTERNAL)."""

    def parse(data: bytes):
        try:
            return parse_bytes(data)
        except DecodeError:
            where = bad_utf8_field(message_cls.DESCRIPTOR, data)
            if where is not None:
                return UndecodableRequest(where, "is not valid UTF-8")
            return UndecodableRequest("request", f"is not a valid {message_cls.DESCRIPTOR.name}")

    return parse


def bad_utf8_field(desc: _descriptor.Descriptor, data: bytes, prefix: str = "") -> str | None:
    """The path of a string field holding invalid UTF-8 in wire-format `data`, if any."""
    position = 0
    try:
        while position < len(data):
            key, position = _varint(data, position)
            number, wire_type = key >> 3, key & 7
            if wire_type == _VARINT:
                _, position = _varint(data, position)
            elif wire_type in (_FIXED64, _FIXED32):
                position += 8 if wire_type == _FIXED64 else 4
            elif wire_type == _LENGTH:
                size, position = _varint(data, position)
                payload, position = data[position : position + size], position + size
                found = _check_field(desc.fields_by_number.get(number), payload, prefix)
                if found is not None:
                    return found
            else:
                return None
    except IndexError:
        return None
    return None


def _check_field(field, payload: bytes, prefix: str) -> str | None:
    if field is None:
        return None
    path = prefix + (f"{field.containing_oneof.name}." if field.containing_oneof else "")
    path += field.name
    if field.type == field.TYPE_STRING:
        try:
            payload.decode("utf-8")
        except UnicodeDecodeError:
            return path
    elif field.type == field.TYPE_MESSAGE:
        return bad_utf8_field(field.message_type, payload, path + ".")
    return None


def _varint(data: bytes, position: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7
