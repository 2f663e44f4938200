"""Finished spans as an OTLP `ExportTraceServiceRequest`, written straight to protobuf's
wire format: the message the OTLP exporters' own encoder builds, at a third of its cost.

The SDK's encoder makes a protobuf object for every span, attribute and value (48 µs a
span of eight attributes on a two-core VM, three times what the span cost to record),
and the batch span processor's thread runs it in every traced process, beside the
requests. This writes the same bytes with string operations (15 µs), the keys and each
resource and scope written once; `tests/test_otlp_encoding.py` parses the result and
checks it equals the SDK's message, field for field, for spans of every shape.

Grouped as the SDK groups them: by resource, then by instrumentation scope, in the
order they first appear. An attribute value the SDK cannot encode either (an int beyond
64 bits, an unknown type) is left out with a log line, as the SDK does.

`GrpcSpanExporter` is the OTLP/gRPC exporter that uses it (telemetry/trace_export.py
picks it for OTEL_EXPORTER_OTLP_PROTOCOL=grpc, the default); the http/protobuf exporter
encodes inside its `export`, so it keeps the SDK's encoder.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Mapping, Sequence

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanContext

log = logging.getLogger(__name__)

_FIXED64 = struct.Struct("<Q").pack
_FIXED32 = struct.Struct("<I").pack
_DOUBLE = struct.Struct("<d").pack
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# SpanFlags: the span says whether its parent is remote, and whether it is
_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200
_MAX_CACHED_KEYS = 4096  # attribute keys are a small set; a stray flood is not kept
_ONE_BYTE = [bytes((n,)) for n in range(128)]  # a varint below 128 is its own byte


def _varint(value: int) -> bytes:
    if value < 0x80:
        return _ONE_BYTE[value]
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field; `tag` is its key byte (field number << 3 | 2)."""
    return tag + _varint(len(payload)) + payload


def _string(tag: bytes, text: str) -> bytes:
    """A string field; b"" when empty (proto3 leaves defaults out)."""
    return _field(tag, text.encode()) if text else b""


def _any_value(value: object) -> bytes:
    """An AnyValue's body (its value is a oneof: written even when it is the default).
    Raises TypeError or OverflowError for what it cannot hold."""
    if isinstance(value, str):
        return _field(b"\x0a", value.encode())
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise OverflowError(f"{value} does not fit in 64 bits")
        return b"\x18" + _varint(value & 0xFFFFFFFFFFFFFFFF)
    if isinstance(value, float):
        return b"\x21" + _DOUBLE(value)
    if value is None:
        return b""
    if isinstance(value, bytes):
        return _field(b"\x3a", value)
    if isinstance(value, Sequence):
        return _field(b"\x2a", b"".join(_field(b"\x0a", _any_value(v)) for v in value))
    if isinstance(value, Mapping):
        pairs = b"".join(_field(b"\x0a", _key_value(str(k), v)) for k, v in value.items())
        return _field(b"\x32", pairs)
    raise TypeError(f"invalid type {type(value).__name__} of value {value!r}")


_keys: dict[str, bytes] = {}  # each attribute key's KeyValue.key field, written once


def _key_value(key: str, value: object) -> bytes:
    """A KeyValue's body."""
    written = _keys.get(key)
    if written is None:
        written = _string(b"\x0a", key)
        if len(_keys) < _MAX_CACHED_KEYS:
            _keys[key] = written
    return written + _field(b"\x12", _any_value(value))


def _attributes(tag: bytes, attributes: Mapping[str, object] | None) -> bytes:
    """Repeated KeyValue fields under `tag`; a value that cannot be encoded is left out
    (logged), as the SDK's encoder does."""
    if not attributes:
        return b""
    parts = []
    for key, value in attributes.items():
        try:
            pair = _key_value(key, value)
        except (TypeError, OverflowError) as exc:
            log.error("span attribute %s left out of the export: %s", key, exc)
            continue
        parts.append(_field(tag, pair))
    return b"".join(parts)


def _count(tag: bytes, count: int) -> bytes:
    return tag + _varint(count) if count else b""


def _flags(parent: SpanContext | None) -> int:
    if parent is not None and parent.is_remote:
        return _HAS_IS_REMOTE | _IS_REMOTE
    return _HAS_IS_REMOTE


def _trace_state(context: SpanContext) -> str:
    state = context.trace_state
    return ",".join(f"{key}={value}" for key, value in state.items()) if state else ""


def _span(span: ReadableSpan) -> bytes:
    """One Span message's body."""
    context, parent = span.get_span_context(), span.parent
    parts = [
        b"\x0a\x10" + context.trace_id.to_bytes(16, "big"),
        b"\x12\x08" + context.span_id.to_bytes(8, "big"),
        _string(b"\x1a", _trace_state(context)),
        b"\x22\x08" + parent.span_id.to_bytes(8, "big") if parent else b"",
        _string(b"\x2a", span.name),
        b"\x30" + _varint(span.kind.value + 1),  # SpanKind's proto values start at 1
        b"\x39" + _FIXED64(span.start_time) if span.start_time else b"",
        b"\x41" + _FIXED64(span.end_time) if span.end_time else b"",
        _attributes(b"\x4a", span.attributes),
        _count(b"\x50", span.dropped_attributes),
    ]
    for event in span.events:
        body = (b"\x09" + _FIXED64(event.timestamp) if event.timestamp else b"") + b"".join(
            (
                _string(b"\x12", event.name),
                _attributes(b"\x1a", event.attributes),
                _count(b"\x20", event.dropped_attributes),
            )
        )
        parts.append(_field(b"\x5a", body))
    parts.append(_count(b"\x60", span.dropped_events))
    for link in span.links:
        body = b"".join(
            (
                b"\x0a\x10" + link.context.trace_id.to_bytes(16, "big"),
                b"\x12\x08" + link.context.span_id.to_bytes(8, "big"),
                _attributes(b"\x22", link.attributes),
                _count(b"\x28", link.dropped_attributes),
                b"\x35" + _FIXED32(_flags(link.context)),
            )
        )
        parts.append(_field(b"\x6a", body))
    parts.append(_count(b"\x70", span.dropped_links))
    status = span.status
    status_body = _string(b"\x12", status.description or "") + _count(
        b"\x18", status.status_code.value
    )
    parts.append(_field(b"\x7a", status_body))
    parts.append(b"\x85\x01" + _FIXED32(_flags(parent)))  # flags: field 16, fixed32
    return b"".join(parts)


class _Headers:
    """Each resource's and scope's message, written once (both are immutable)."""

    def __init__(self) -> None:
        self._resources: dict[object, bytes] = {}
        self._scopes: dict[object, bytes] = {}

    def resource(self, resource) -> bytes:
        if (written := self._resources.get(resource)) is None:
            written = _field(b"\x0a", _attributes(b"\x0a", resource.attributes))
            self._resources[resource] = written
        return written

    def scope(self, scope) -> bytes:
        if (written := self._scopes.get(scope)) is None:
            body = b""
            if scope is not None:
                body = _string(b"\x0a", scope.name) + _string(b"\x12", scope.version or "")
                body += _attributes(b"\x1a", scope.attributes)
            written = self._scopes[scope] = _field(b"\x0a", body)
        return written


_headers = _Headers()


def encode_spans(spans: Sequence[ReadableSpan]) -> bytes:
    """The serialized `ExportTraceServiceRequest` holding `spans`."""
    grouped: dict[object, dict[object, list[bytes]]] = {}
    resource = scopes = None
    for span in spans:
        if span.resource is not resource:  # hashing a Resource writes it as JSON
            resource = span.resource
            scopes = grouped.setdefault(resource, {})
        scopes.setdefault(span.instrumentation_scope or None, []).append(
            _field(b"\x12", _span(span))
        )
    resource_spans = []
    for resource, scopes in grouped.items():
        scope_spans = [
            _field(
                b"\x12",
                _headers.scope(scope)
                + b"".join(encoded)
                + _string(b"\x1a", (scope.schema_url if scope else "") or ""),
            )
            for scope, encoded in scopes.items()
        ]
        body = _headers.resource(resource) + b"".join(scope_spans)
        resource_spans.append(_field(b"\x0a", body + _string(b"\x1a", resource.schema_url or "")))
    return b"".join(resource_spans)


class GrpcSpanExporter(OTLPSpanExporter):
    """The SDK's OTLP/gRPC span exporter (its channel, retries, headers, TLS, every
    OTEL_EXPORTER_OTLP_* variable), with each batch's request written by `encode_spans`.
    (gRPC takes a message: the bytes are parsed back into one, which costs about 1 µs a
    span in protobuf's C code.)"""

    def _translate_data(self, data: Sequence[ReadableSpan]) -> ExportTraceServiceRequest:
        return ExportTraceServiceRequest.FromString(encode_spans(data))
