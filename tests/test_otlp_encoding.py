"""The OTLP wire encoder: for spans of every shape, the bytes it writes parse into the
very message the OTLP exporters' own encoder builds."""

from __future__ import annotations

import logging

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
    set_span_in_context,
)

from pdserve.telemetry.otlp_encoding import GrpcSpanExporter, encode_spans

REMOTE = SpanContext(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, True, TraceFlags(1))


def finished(resource: Resource | None = None, limits: SpanLimits | None = None):
    """A tracer whose ended spans land in the returned exporter."""
    caught = InMemorySpanExporter()
    provider = TracerProvider(resource=resource or Resource.create({}), span_limits=limits)
    provider.add_span_processor(SimpleSpanProcessor(caught))
    return provider, caught


def same_as_the_sdk(spans) -> ExportTraceServiceRequest:
    ours = ExportTraceServiceRequest.FromString(encode_spans(spans))
    assert ours == sdk_encode(spans)
    return ours


def test_every_kind_of_attribute_value_is_written_as_the_sdk_writes_it():
    provider, caught = finished(Resource.create({"service.name": "pdserve-router"}))
    values = {
        "s": "text",
        "empty": "",
        "t": True,
        "f": False,
        "zero": 0,
        "i": 42,
        "negative": -7,
        "big": 2**63 - 1,
        "smallest": -(2**63),
        "d": 0.25,
        "d0": 0.0,
        "strings": ("a", "", "c"),
        "ints": [1, -2, 0],
        "floats": (0.5, 0.0),
        "bools": [True, False],
        "none": (),
        "ünïcode": "ключ",
    }
    provider.get_tracer("t").start_span("values", attributes=values).end()
    request = same_as_the_sdk(caught.get_finished_spans())
    assert len(request.resource_spans[0].scope_spans[0].spans[0].attributes) == len(values)


def test_a_span_tree_with_events_links_status_and_trace_state():
    provider, caught = finished()
    tracer = provider.get_tracer("pdserve", "1.2.3", schema_url="https://opentelemetry.io/s")
    state = TraceState([("vendor", "v1"), ("other", "x")])
    parent = SpanContext(REMOTE.trace_id, REMOTE.span_id, True, TraceFlags(1), state)
    root = tracer.start_span(
        "text_completion m",
        context=set_span_in_context(NonRecordingSpan(parent)),
        kind=SpanKind.SERVER,
        links=[Link(REMOTE, {"why": "resumed"}), Link(REMOTE)],
    )
    root.add_event("retry", {"attempt": 2, "error.type": "UNAVAILABLE"})
    root.add_event("pdserve.placement")
    for kind in SpanKind:
        child = tracer.start_span(kind.name, context=set_span_in_context(root), kind=kind)
        child.set_status(Status(StatusCode.ERROR, "worker gone"))
        child.end()
    root.set_status(Status(StatusCode.OK))
    root.end()
    local_root = tracer.start_span("")  # no parent, no name
    local_root.end()
    same_as_the_sdk(caught.get_finished_spans())


def test_dropped_counts_and_several_resources_and_scopes_keep_the_sdks_grouping():
    limits = SpanLimits(max_span_attributes=2, max_events=1, max_links=1)
    router, router_spans = finished(Resource.create({"service.name": "pdserve-router"}), limits)
    worker, worker_spans = finished(Resource.create({"service.name": "pdserve-decode"}))
    one = router.get_tracer("a").start_span("a", attributes={"x": 1, "y": 2, "z": 3})
    one.add_event("e1")
    one.add_event("e2", {"k": "v"})
    one.end()
    router.get_tracer("b").start_span("b", links=[Link(REMOTE), Link(REMOTE)]).end()
    worker.get_tracer("a").start_span("c").end()
    router.get_tracer("a").start_span("d").end()
    spans = [*router_spans.get_finished_spans(), *worker_spans.get_finished_spans()]
    spans.insert(1, spans.pop())  # resources interleaved: grouped in first-seen order
    request = same_as_the_sdk(spans)
    assert [len(r.scope_spans) for r in request.resource_spans] == [2, 1]


def test_a_value_it_cannot_write_is_left_out_as_the_sdk_leaves_it(caplog):
    provider, caught = finished()
    span = provider.get_tracer("t").start_span("s", attributes={"kept": 1})
    span._attributes._dict["huge"] = 2**64  # past the SDK's checks, as a processor might
    span.end()
    with caplog.at_level(logging.ERROR, logger="pdserve.telemetry.otlp_encoding"):
        request = same_as_the_sdk(caught.get_finished_spans())
    attributes = request.resource_spans[0].scope_spans[0].spans[0].attributes
    assert [a.key for a in attributes] == ["kept"]
    assert "huge" in caplog.text


def test_no_spans_is_an_empty_request():
    assert encode_spans([]) == b""
    assert ExportTraceServiceRequest.FromString(b"") == sdk_encode([])


@pytest.mark.parametrize("num_spans", [1, 64])
def test_the_bytes_are_the_messages_own_serialization(num_spans):
    """Byte for byte too, not only equal once parsed (the field order protobuf writes)."""
    provider, caught = finished(Resource.create({"service.name": "s"}))
    tracer = provider.get_tracer("pdserve")
    for i in range(num_spans):
        tracer.start_span(f"span {i}", attributes={"pdserve.request_id": f"r{i}", "n": i}).end()
    spans = caught.get_finished_spans()
    assert encode_spans(spans) == sdk_encode(spans).SerializeToString()


def test_the_grpc_exporter_sends_the_sdks_message():
    provider, caught = finished(Resource.create({"service.name": "pdserve-prefill"}))
    provider.get_tracer("pdserve").start_span("prefill", attributes={"a": 1}).end()
    spans = caught.get_finished_spans()
    exporter = GrpcSpanExporter(endpoint="http://127.0.0.1:1", insecure=True)
    try:
        assert exporter._translate_data(spans) == sdk_encode(spans)
    finally:
        exporter.shutdown()
