"""Spans with no children, recorded on the request's path and handed to the SDK off it.

A routing decision, a worker's Admit, the receiving side of a KV push, a request's decode:
their context is never handed on, so the SDK span can wait. While it runs a `LeafSpan`
holds a clock reading, its parent context and its attributes; once ended it waits, with
every other one ended by then, for a flush `LEAF_FLUSH_DELAY_S` later (past its request's
first token), which starts and ends the SDK's own span with the times it ran, through the
tracer, its sampler and its processors.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status
from opentelemetry.util.types import AttributeValue

# How long an ended leaf span waits before the SDK sees it (with every other one ended by
# then): past its request's first token. The work still lands on whatever request runs
# then; it leaves the path of the one that made the span.
LEAF_FLUSH_DELAY_S = 0.2


class LeafSpan:
    """A leaf span while it runs, and once ended until the flush makes it the SDK's."""

    __slots__ = ("name", "kind", "parent", "attributes", "start_ns", "end_ns", "status")

    def __init__(
        self,
        name: str,
        kind: SpanKind,
        parent: otel_context.Context | None,
        attributes: dict[str, AttributeValue],
    ):
        self.name, self.kind = name, kind
        self.parent = otel_context.get_current() if parent is None else parent
        self.attributes = attributes  # the caller hands over a dict it made for it
        self.start_ns, self.end_ns = time.time_ns(), 0  # 0: running
        self.status: Status | None = None

    def is_recording(self) -> bool:
        """Whether its parent is sampled (or it has none): the parent-based samplers' rule,
        so that callers build attributes only for a leaf that will be kept. The SDK's
        sampler decides for good at the flush."""
        if self.end_ns:
            return False
        context = trace.get_current_span(self.parent).get_span_context()
        return not context.is_valid or context.trace_flags.sampled

    def set_attribute(self, key: str, value: AttributeValue) -> None:
        self.attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, AttributeValue]) -> None:
        self.attributes.update(attributes)

    def set_status(self, status: Status) -> None:
        self.status = status

    def end(self) -> None:
        """Once; the SDK gets it at the next flush."""
        if not self.end_ns:
            self.end_ns = time.time_ns()
            leaves.add(self)

    def emit(self, tracer: trace.Tracer) -> None:
        """The SDK span, with the times it ran."""
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
            from pdserve.telemetry.tracing import set_error  # tracing imports this module

            set_error(self, exc)
        self.end()


class Leaves:
    """The process's ended leaf spans not yet handed to the SDK, and the one flush due.

    `tracer` is the process's while tracing is on (telemetry/tracing.py sets it). Leaves
    end on event loops: the first to arrive schedules a flush on its loop,
    `LEAF_FLUSH_DELAY_S` later (on another one if that loop stopped first); with no loop
    running, a leaf goes to the SDK at once.
    """

    def __init__(self) -> None:
        self.tracer: trace.Tracer | None = None
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
        tracer = self.tracer
        if tracer is None:
            return  # tracing stopped (tests): they would record nothing now
        for leaf in ended:
            leaf.emit(tracer)


leaves = Leaves()
