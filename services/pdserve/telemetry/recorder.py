"""Spans pdserve records itself, handed to the SDK's span processors once they ended.

The SDK's `Tracer.start_span` builds its `_Span` on the request's path: bounded attribute
and event containers behind a lock, every attribute validated, the processors' `on_start`,
and at `end` a frozen copy and the processors' `on_end` (the batch processor's queue and
its lock). In a server, where that code is cold between requests, it cost a request
46-107 µs a span to start (docs/benchmarks/tracing.md), and the router and the prefill
worker start five on every remote request's way to its first token.

A `RecordedSpan` does on the path only what its children and the next hop need at once:
its ids (from the tracer's id generator) and the sampler's decision (the trace flags the
next hop reads), made as the SDK makes them. Its attributes and events go into plain
containers. Once it ends it waits, with every other span ended by then, for a flush
`FLUSH_DELAY_S` later (past its request's first token), which turns each into the
`ReadableSpan` the SDK's own span would have given its processors, attributes and events
bounded by the same limits (pdserve's spans have no links), and calls their `on_end`.
Processors never see a start: the SDK's batch and simple processors do nothing there.

A span the sampler drops is the API's `NonRecordingSpan` with the ids it would have had:
its context (sampled=0) still reaches the next hop, which would otherwise start a trace of
its own.
"""

from __future__ import annotations

import asyncio
import threading
import time
import traceback
from collections.abc import Callable, Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits
from opentelemetry.sdk.trace.sampling import DEFAULT_ON
from opentelemetry.sdk.util import BoundedList
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, TraceFlags
from opentelemetry.util.types import Attributes, AttributeValue

# How long an ended span waits before the processors see it (with every other one ended
# by then): past its request's first token. The work still lands on whatever request runs
# then; it leaves the path of the one that made the span.
FLUSH_DELAY_S = 0.2

# A span's trace flags by (sampled, random trace id), made once.
_FLAGS = {
    (sampled, random_id): TraceFlags(
        (TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
        | (TraceFlags.RANDOM_TRACE_ID if random_id else 0)
    )
    for sampled in (False, True)
    for random_id in (False, True)
}
_UNSET = Status()  # immutable: every span starts with this one


class Recorder:
    """What spans need from an SDK tracer (its sampler, id generator, resource, span
    processor), read once when tracing is installed, and the spans ended but not yet
    handed to the processor.

    Spans end on event loops: the first to end schedules a flush on its loop,
    `FLUSH_DELAY_S` later (on another one if that loop stopped first); with no loop
    running, an ended span goes to the processor at once.
    """

    def __init__(
        self, tracer, scope_name: str, mark_failed: Callable[[trace.Span, Exception], None]
    ):
        self.mark_failed = mark_failed  # a span's `with` block ended in this exception
        # an SDK Tracer's public attributes (the API's Tracer has none of them)
        self.sampler = tracer.sampler
        self.id_generator = tracer.id_generator
        self.resource = tracer.resource
        self.processor = tracer.span_processor
        # The SDK's default (parentbased_always_on) decides from the parent alone: a span
        # is sampled when its parent is, or when it has none (a sampler that describes
        # itself so is that one, whatever object OTEL_TRACES_SAMPLER made).
        self._default_sampler = self.sampler.get_description() == DEFAULT_ON.get_description()
        self.scope = InstrumentationScope(scope_name)
        self.limits = SpanLimits()  # the OTEL_*_LIMIT variables, as the provider reads them
        self._lock = threading.Lock()
        self._ended: list[RecordedSpan] = []
        self._due_on: asyncio.AbstractEventLoop | None = None  # the loop a flush is due on

    def start(
        self,
        name: str,
        kind: SpanKind,
        parent: otel_context.Context | None,
        attributes: dict[str, AttributeValue],
    ) -> trace.Span:
        """A span started now, child of the span current in `parent` (None: the current
        context); ids and sampling as `Tracer.start_span` gives them. `attributes` become
        the span's own: the caller hands over a dict it made for it."""
        parent_context = trace.get_current_span(parent).get_span_context()
        ids = self.id_generator
        if parent_context.is_valid:
            trace_id = parent_context.trace_id
            random_id = parent_context.trace_flags.random_trace_id
        else:
            parent_context = None
            trace_id, random_id = ids.generate_trace_id(), ids.is_trace_id_random()
        if self._default_sampler:  # its decision, without its call
            recording = sampled = parent_context is None or parent_context.trace_flags.sampled
            trace_state = parent_context.trace_state if parent_context else None
        else:
            result = self.sampler.should_sample(parent, trace_id, name, kind, attributes)
            recording, sampled = result.decision.is_recording(), result.decision.is_sampled()
            trace_state, attributes = result.trace_state, dict(result.attributes)
        context = SpanContext(
            trace_id,
            ids.generate_span_id(),
            is_remote=False,
            trace_flags=_FLAGS[sampled, random_id],
            trace_state=trace_state,
        )
        if not recording:
            return trace.NonRecordingSpan(context)
        return RecordedSpan(self, name, kind, context, parent_context, attributes)

    def ended(self, span: RecordedSpan) -> None:
        with self._lock:
            self._ended.append(span)
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
            loop.call_later(FLUSH_DELAY_S, self.flush)

    def flush(self) -> None:
        """Hand every ended span to the processor now."""
        with self._lock:
            ended, self._ended, self._due_on = self._ended, [], None
        for span in ended:
            self.processor.on_end(span.readable())

    def bounded(self, attributes: Attributes, max_count: int | None) -> BoundedAttributes:
        """Attributes cleaned and bounded as the SDK's span bounds them, frozen."""
        return BoundedAttributes(
            max_count, attributes, immutable=True, max_value_len=self.limits.max_attribute_length
        )


class RecordedSpan(trace.Span):
    """A sampled span while it runs: its context, its parent's, the clock readings and
    what was set on it, nothing of the SDK's (see the module docstring). Not thread-safe:
    a span is written by the task that runs its work."""

    __slots__ = (
        "_recorder",
        "_name",
        "_kind",
        "_context",
        "_parent",
        "_attributes",
        "_events",
        "_status",
        "_start_ns",
        "_end_ns",
    )

    def __init__(
        self,
        recorder: Recorder,
        name: str,
        kind: SpanKind,
        context: SpanContext,
        parent: SpanContext | None,
        attributes: dict[str, AttributeValue],
    ):
        self._recorder, self._name, self._kind = recorder, name, kind
        self._context, self._parent = context, parent
        self._attributes = attributes
        self._events: list[tuple[str, Attributes, int]] = []
        self._status = _UNSET
        self._start_ns, self._end_ns = time.time_ns(), 0  # 0: running

    def get_span_context(self) -> SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return not self._end_ns

    def set_attribute(self, key: str, value: AttributeValue) -> None:
        self._attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, AttributeValue]) -> None:
        self._attributes.update(attributes)

    def add_event(self, name: str, attributes: Attributes = None, timestamp: int | None = None):
        copied = dict(attributes) if attributes else None  # the caller's dict may change
        self._events.append((name, copied, timestamp or time.time_ns()))

    def update_name(self, name: str) -> None:
        self._name = name

    def set_status(self, status: Status | object, description: str | None = None) -> None:
        self._status = status if isinstance(status, Status) else Status(status, description)

    def record_exception(
        self,
        exception: BaseException,
        attributes: Attributes = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        """The `exception` event, with the semantic conventions' attributes."""
        kind = type(exception)
        module = kind.__module__
        recorded: dict[str, AttributeValue] = {
            "exception.type": kind.__qualname__
            if module in ("builtins", "")
            else f"{module}.{kind.__qualname__}",
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped),
        }
        self.add_event("exception", {**recorded, **(attributes or {})}, timestamp)

    def end(self, end_time: int | None = None) -> None:
        """Once; the processors get it at the recorder's next flush."""
        if not self._end_ns:
            self._end_ns = end_time or time.time_ns()
            self._recorder.ended(self)

    def __exit__(self, exc_type, exc, tb) -> None:
        """A `with` block's end: the span ends, failed by an exception out of the block."""
        if isinstance(exc, Exception):
            self._recorder.mark_failed(self, exc)
        self.end()

    def readable(self) -> ReadableSpan:
        """What the SDK's own span would hand its processors at its end."""
        r, limits = self._recorder, self._recorder.limits
        events = [
            Event(name, r.bounded(attributes, limits.max_event_attributes), timestamp)
            for name, attributes, timestamp in self._events
        ]
        return ReadableSpan(
            name=self._name,
            context=self._context,
            parent=self._parent,
            resource=r.resource,
            attributes=r.bounded(self._attributes, limits.max_span_attributes),
            events=BoundedList.from_seq(limits.max_events, events),
            kind=self._kind,
            status=self._status,
            start_time=self._start_ns,
            end_time=self._end_ns,
            instrumentation_scope=r.scope,
        )

    def __repr__(self) -> str:
        return f"RecordedSpan({self._name!r}, {self._context!r})"
