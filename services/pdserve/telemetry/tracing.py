"""Traces: a request's spans. Where spans go (the provider and its OTLP exporter, from
the OTEL_* variables): telemetry/trace_export.py; `configure` installs what it makes.
How a request's trace context crosses to the next process: telemetry/propagation.py,
switched on and off with the spans here.

On, spans are the SDK's own, started by its tracer (its sampler decides: by default every
request, or a share of them under `parentbased_traceidratio`) and exported by its batch
span processor off the request's path. A span with no children (`leaf_span`) becomes an
SDK span after its request's first token, with the times it ran (telemetry/leaf_spans.py).
Off, nothing is installed and nothing is exported: `start_span` hands back a span that
records nothing without calling the SDK, channels get no interceptor, handlers attach no
context. Callers build attributes only for a span that `is_recording()`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Mapping

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from pdserve.telemetry import propagation
from pdserve.telemetry.leaf_spans import LeafSpan, leaves
from pdserve.telemetry.trace_export import provider_from_env

TRACER_NAME = "pdserve"
REQUEST_ID = "pdserve.request_id"  # on every span of a request: find its trace from its id
ERROR_TYPE = "error.type"


class _Tracing:
    """The process's tracer and its provider while tracing is on. The SDK's provider is
    process-wide by design; this holds what pdserve took from it, so that "off" costs one
    None check."""

    tracer: trace.Tracer | None = None
    provider: trace.TracerProvider | None = None


_state = _Tracing()


def configure(role: str):
    """Set up tracing for this process from the OTEL_* variables (once, at start-up);
    returns the provider to `shutdown` at the end, or None when tracing is off."""
    provider = provider_from_env(role)  # None: the variables do not ask for traces
    if provider is not None:
        trace.set_tracer_provider(provider)
        install(provider)
    return provider


def install(provider: trace.TracerProvider) -> None:
    """Trace through `provider` from now on (`configure`; tests give an in-memory one)."""
    propagation.install()
    _state.tracer, _state.provider = provider.get_tracer(TRACER_NAME), provider
    leaves.tracer = _state.tracer


def uninstall() -> None:
    """Stop tracing: spans started from now on record nothing (tests)."""
    _state.tracer = _state.provider = leaves.tracer = None
    propagation.uninstall()


def shutdown(provider) -> None:
    """Export what is still queued and stop (at the process's end); None: nothing to do."""
    if provider is not None:
        leaves.flush()
        uninstall()
        provider.shutdown()


def enabled() -> bool:
    return _state.tracer is not None


def flush() -> None:
    """Hand every ended leaf span to the SDK and export every ended span now (tests)."""
    leaves.flush()
    if (provider := _state.provider) is not None:
        provider.force_flush()


# -- spans ------------------------------------------------------------------------------


def start_span(
    name: str,
    request_id: str,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
    parent: otel_context.Context | None = None,
    attributes: Mapping[str, AttributeValue] | None = None,
) -> Span:
    """A span of request `request_id`, child of `parent` (None: of the current span), with
    `attributes` from its start (the sampler sees them); the caller ends it, or uses it as
    a `with` block, which ends it and marks it failed by an exception out of the block (it
    does not go current there: `span` does). With tracing off, a span that records nothing
    and costs nothing."""
    tracer = _state.tracer
    if tracer is None:
        return INVALID_SPAN
    given = {REQUEST_ID: request_id, **attributes} if attributes else {REQUEST_ID: request_id}
    started = tracer.start_span(
        name,
        context=parent,
        kind=kind,
        attributes=given,
        record_exception=False,  # `_FailedOnExit` marks it as pdserve marks every span
        set_status_on_exception=False,
    )
    # A span the sampler dropped is the API's NonRecordingSpan, with the ids it would have
    # had: its context (sampled=0) still reaches the next hop, and its `with` block ends it.
    return _FailedOnExit(started) if started.is_recording() else started


def span(
    name: str,
    request_id: str,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Mapping[str, AttributeValue] | None = None,
) -> contextlib.AbstractContextManager[Span]:
    """A span around a `with` block and current inside it, so that calls made there carry
    it; an exception out of the block marks it failed (`set_error`). With tracing off, a
    shared no-op: the block gets a span that records nothing."""
    if _state.tracer is None:
        return _NO_SPAN
    return _CurrentSpan(name, request_id, kind, attributes)


_NO_SPAN = contextlib.nullcontext(INVALID_SPAN)


class _CurrentSpan:
    """`span`'s block: the span current inside it, ended after it.

    A class rather than a generator (`contextlib.contextmanager` around the SDK's own
    `use_span`, itself one): the router opens four of these per request, and the two
    generator frames cost more than the context switch they wrap.
    """

    __slots__ = ("_start", "_span", "_token")

    def __init__(
        self,
        name: str,
        request_id: str,
        kind: SpanKind,
        attributes: Mapping[str, AttributeValue] | None,
    ):
        self._start = (name, request_id, kind, attributes)  # the span starts on entry
        self._span: Span = INVALID_SPAN
        self._token: object | None = None

    def __enter__(self) -> Span:
        name, request_id, kind, attributes = self._start
        self._span = start_span(name, request_id, kind=kind, attributes=attributes)
        # A span the sampler dropped records nothing but still goes current: its context
        # (sampled=0) must reach the next hop, or that hop would start traces of its own.
        self._token = otel_context.attach(trace.set_span_in_context(self._span))
        return self._span

    def __exit__(self, exc_type, exc, traceback) -> None:
        try:
            if isinstance(exc, Exception):
                set_error(self._span, exc)
        finally:
            otel_context.detach(self._token)
            self._span.end()


class _FailedOnExit(Span):
    """A recording SDK span whose `with` block marks it failed as `set_error` does (status
    ERROR with the message, `error.type`) before it ends; the SDK's own `with` records an
    `exception` event and a status of its own wording instead. Everything else is the SDK
    span's."""

    __slots__ = ("_sdk",)

    def __init__(self, sdk_span: Span):
        self._sdk = sdk_span

    def get_span_context(self) -> trace.SpanContext:
        return self._sdk.get_span_context()

    def is_recording(self) -> bool:
        return self._sdk.is_recording()

    def set_attribute(self, key: str, value: AttributeValue) -> None:
        self._sdk.set_attribute(key, value)

    def set_attributes(self, attributes: Mapping[str, AttributeValue]) -> None:
        self._sdk.set_attributes(attributes)

    def add_event(self, name: str, attributes=None, timestamp: int | None = None) -> None:
        self._sdk.add_event(name, attributes, timestamp)

    def update_name(self, name: str) -> None:
        self._sdk.update_name(name)

    def set_status(self, status, description: str | None = None) -> None:
        self._sdk.set_status(status, description)

    def record_exception(self, exception, attributes=None, timestamp=None, escaped=False):
        self._sdk.record_exception(exception, attributes, timestamp, escaped)

    def end(self, end_time: int | None = None) -> None:
        self._sdk.end(end_time)

    def __exit__(self, exc_type, exc, traceback) -> None:
        if isinstance(exc, Exception):
            set_error(self._sdk, exc)
        self._sdk.end()

    def __repr__(self) -> str:
        return f"_FailedOnExit({self._sdk!r})"


def leaf_span(
    name: str,
    request_id: str,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
    parent: otel_context.Context | None = None,
    attributes: Mapping[str, AttributeValue] | None = None,
) -> LeafSpan | Span:
    """A span with no children, started now and handed to the SDK after its request's
    first token (telemetry/leaf_spans.py), child of `parent` (None: of the current span);
    the caller ends it, or uses it as a `with` block, which ends it and marks it failed
    by an exception out of the block. Off: a span that records nothing and costs nothing."""
    if _state.tracer is None:
        return INVALID_SPAN  # a `with` block too: it ends itself, a no-op
    given = {REQUEST_ID: request_id, **attributes} if attributes else {REQUEST_ID: request_id}
    return LeafSpan(name, kind, parent, given)


def kv_transfer_attributes(num_layers: int, num_chunks: int, num_bytes: int) -> dict[str, int]:
    """A KV transfer span's counts, on either side: layers, KVChunk messages, payload bytes
    (the KV alone: layers x 2 x blocks x block size x KV heads x head dim x dtype size)."""
    return {
        "pdserve.kv_transfer.layers": num_layers,
        "pdserve.kv_transfer.chunks": num_chunks,
        "pdserve.kv_transfer.bytes": num_bytes,
    }


def error_type(error: BaseException) -> str:
    """`error.type` for an exception: a gRPC call's status code name, else the type's name."""
    if isinstance(error, grpc.aio.AioRpcError):
        return error.code().name
    return type(error).__name__


def set_error(target: Span | LeafSpan, error: BaseException) -> None:
    """Mark a span failed by `error`: status ERROR (with the message) and `error.type`."""
    if target.is_recording():
        target.set_status(Status(StatusCode.ERROR, str(error)))
        target.set_attribute(ERROR_TYPE, error_type(error))


def context_with(current: Span) -> contextvars.Context | None:
    """A copy of the current context with `current` as its span, for a task's `context=`:
    the task's calls then carry it. None (the default context) when tracing is off."""
    if _state.tracer is None:
        return None
    copied = contextvars.copy_context()
    copied.run(otel_context.attach, trace.set_span_in_context(current))
    return copied
