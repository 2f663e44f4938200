"""Traces: a request's spans. Where spans go (the provider and its OTLP exporter, from
the OTEL_* variables): telemetry/trace_export.py; `configure` installs what it makes.
How a request's trace context crosses to the next process: telemetry/propagation.py,
switched on and off with the spans here.

Off, nothing is installed and nothing is exported: `start_span` hands back a span that
records nothing without calling the SDK, channels get no interceptor, handlers attach no
context. Callers build attributes only for a span that `is_recording()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
import time
from collections.abc import Mapping

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from pdserve.telemetry import propagation
from pdserve.telemetry.trace_export import provider_from_env

TRACER_NAME = "pdserve"
REQUEST_ID = "pdserve.request_id"  # on every span of a request: find its trace from its id
ERROR_TYPE = "error.type"


class _Tracing:
    """The process's tracer while tracing is on. The SDK's provider is process-wide by
    design; this holds what pdserve took from it, so that "off" costs one None check."""

    tracer: trace.Tracer | None = None


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
    _state.tracer = provider.get_tracer(TRACER_NAME)


def uninstall() -> None:
    """Stop tracing: spans started from now on record nothing (tests)."""
    _state.tracer = None
    propagation.uninstall()


def shutdown(provider) -> None:
    """Export what is still queued and stop (at the process's end); None: nothing to do."""
    if provider is not None:
        flush_leaves()
        uninstall()
        provider.shutdown()


def enabled() -> bool:
    return _state.tracer is not None


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
    `attributes` from its start (one copy into the span, where `set_attributes` after the
    start would make another); the caller ends it. With tracing off, a span that records
    nothing and costs nothing."""
    tracer = _state.tracer
    if tracer is None:
        return INVALID_SPAN
    given = {REQUEST_ID: request_id, **attributes} if attributes else {REQUEST_ID: request_id}
    return tracer.start_span(name, context=parent, kind=kind, attributes=given)


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


# -- leaf spans: recorded on the request's path, handed to the SDK off it -----------------

# How long a finished leaf span waits before the SDK sees it (with every other one finished
# by then): past its request's first token. The work still lands on whatever request runs
# then; it leaves the path of the one that made the span.
LEAF_FLUSH_DELAY_S = 0.2


class LeafSpan:
    """A span that has no children (a routing decision, a worker's Admit, the receiving
    side of a KV push, a request's decode): while it runs it holds a clock reading, its
    parent context and its attributes, nothing of the SDK's. Once it ends it waits in
    `_leaves` and becomes an SDK span, with the times it ran, at the next flush.

    An SDK span started on a request's path costs the request its time there (tens of
    µs a span in a loop, hundreds in a server where the code is cold); a leaf's context
    is never propagated, so nothing needs it to exist sooner. Spans with children start
    through `start_span` / `span`: the next hop needs their ids.
    """

    __slots__ = (
        "name",
        "kind",
        "parent",
        "attributes",
        "start_ns",
        "end_ns",
        "status",
        "_recording",
    )

    def __init__(
        self,
        name: str,
        request_id: str,
        kind: SpanKind,
        parent: otel_context.Context | None,
        attributes: Mapping[str, AttributeValue] | None,
    ):
        self.name, self.kind = name, kind
        self.parent = otel_context.get_current() if parent is None else parent
        self.attributes: dict[str, AttributeValue] = {REQUEST_ID: request_id}
        if attributes:
            self.attributes.update(attributes)
        self.start_ns, self.end_ns = time.time_ns(), 0  # 0: running
        self.status: Status | None = None
        # Under the default samplers (parentbased_*) a child is sampled when its parent
        # is: callers skip building attributes for one that would be dropped.
        context = trace.get_current_span(self.parent).get_span_context()
        self._recording = not context.is_valid or context.trace_flags.sampled

    def is_recording(self) -> bool:
        return self._recording

    def set_attribute(self, key: str, value: AttributeValue) -> None:
        self.attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, AttributeValue]) -> None:
        self.attributes.update(attributes)

    def set_status(self, status: Status) -> None:
        self.status = status

    def end(self) -> None:
        """Once; the SDK gets it at the next flush (and its sampler decides then)."""
        if not self.end_ns:
            self.end_ns = time.time_ns()
            _leaves.add(self)

    def emit(self, tracer: trace.Tracer) -> None:
        """The SDK span, with the times it ran (the sampler decides here, as at a start)."""
        sdk_span = tracer.start_span(
            self.name,
            context=self.parent,
            kind=self.kind,
            attributes=self.attributes,
            start_time=self.start_ns,
        )
        if self.status is not None:
            sdk_span.set_status(self.status)
        sdk_span.end(end_time=self.end_ns)

    def __enter__(self) -> LeafSpan:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if isinstance(exc, Exception):
            set_error(self, exc)
        self.end()


class _Leaves:
    """The process's ended leaf spans not yet handed to the SDK, and the one flush due.

    Leaves end on event loops: the first to arrive schedules a flush on its loop,
    `LEAF_FLUSH_DELAY_S` later (on another one if that loop stopped first); with no loop
    running, a leaf goes to the SDK at once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ended: list[LeafSpan] = []
        self._due_on: asyncio.AbstractEventLoop | None = None  # the loop a flush is due on

    def add(self, leaf: LeafSpan) -> None:
        with self._lock:
            self._ended.append(leaf)
            if self._due_on is not None and self._due_on.is_running():
                return
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            self._due_on = loop
        if loop is None:
            self.flush()
        else:
            loop.call_later(LEAF_FLUSH_DELAY_S, self.flush)

    def flush(self) -> None:
        with self._lock:
            ended, self._ended, self._due_on = self._ended, [], None
        tracer = _state.tracer
        if tracer is None:
            return  # tracing stopped (tests): they would record nothing now
        for leaf in ended:
            leaf.emit(tracer)


_leaves = _Leaves()


def leaf_span(
    name: str,
    request_id: str,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
    parent: otel_context.Context | None = None,
    attributes: Mapping[str, AttributeValue] | None = None,
) -> LeafSpan | Span:
    """A span with no children, started now (see LeafSpan), child of `parent` (None: of
    the current span); the caller ends it, or uses it as a `with` block, which ends it
    and marks it failed by an exception out of the block. Off: a span that records
    nothing and costs nothing."""
    if _state.tracer is None:
        return INVALID_SPAN  # a `with` block too: it ends itself, a no-op
    return LeafSpan(name, request_id, kind, parent, attributes)


def flush_leaves() -> None:
    """Hand every ended leaf span to the SDK now (at shutdown; tests)."""
    _leaves.flush()


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


def set_error(target: Span, error: BaseException) -> None:
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
