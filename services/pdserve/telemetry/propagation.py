"""A request's trace context across processes: W3C trace context in gRPC metadata on
every hop, and per request on a Relay attach (one call carries many requests).
`telemetry/tracing.py` switches it on with its spans (`install`); off, nothing is read
or written.

Context goes out in one place per direction: `outgoing_metadata` on each unary call of a
request, `trace_carrier` where a call carries many requests (a Relay attach) or streams
KV (PushKV's metadata, from the caller's thread); it comes in through `attach_incoming`,
which `rpc.errors.rpc_errors` calls for every handler, and `parent_from` (an attach's).

Under the default propagators (OTEL_PROPAGATORS unset, or naming only `tracecontext`
and `baggage`) a context that is a `traceparent` alone, the one pdserve's own hops
carry, is written and read here (`W3CTraceparent`); a `tracestate`, baggage, any other
propagator, or a header that is not a plain version-00 one go through the SDK's
propagators. A request crosses about ten of these in its processes; through the
composite propagator's layers each cost 25-110 µs on a two-core VM where the code is
cold between requests, about 40% less this way.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping

import grpc
from opentelemetry import baggage, propagate, trace
from opentelemetry import context as otel_context
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags


class _Propagation:
    """Whether context is carried (`on`, while tracing is), the metadata keys the
    propagators read (`fields`), and whether a lone traceparent may skip them (`w3c`)."""

    on: bool = False
    fields: frozenset[str] = frozenset()
    w3c: bool = False


_state = _Propagation()


def install() -> None:
    """Carry context from now on, as the propagators configured now say."""
    _state.fields = frozenset(propagate.get_global_textmap().fields)
    _state.w3c = W3CTraceparent.serves(os.environ.get("OTEL_PROPAGATORS"))
    _state.on = True


def uninstall() -> None:
    _state.on = False


TRACEPARENT = "traceparent"


class W3CTraceparent:
    """A context that is one W3C `traceparent` (version 00, sampled or not) and nothing
    else, written and read without the SDK's propagators: what they would write and read
    for it under the default OTEL_PROPAGATORS (tracecontext, baggage), in a few string
    operations. `write` and `read` answer None for anything else: the caller asks the
    SDK."""

    DEFAULT_PROPAGATORS = frozenset({"tracecontext", "baggage"})
    _FORMAT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")

    @classmethod
    def serves(cls, configured: str | None) -> bool:
        """Whether OTEL_PROPAGATORS (`configured`; None: unset) leaves a lone
        traceparent to the tracecontext propagator alone."""
        if configured is None:
            return True
        names = {name.strip().lower() for name in configured.split(",")}
        return "tracecontext" in names and names <= cls.DEFAULT_PROPAGATORS

    @staticmethod
    def write() -> dict[str, str] | None:
        """The current context's headers; None when it holds more than a span's ids (a
        tracestate, baggage)."""
        span_context = trace.get_current_span().get_span_context()
        if span_context.trace_state or baggage.get_all():
            return None
        if not span_context.is_valid:
            return {}
        trace_id, span_id = span_context.trace_id, span_context.span_id
        flags = span_context.trace_flags
        return {TRACEPARENT: f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"}

    @classmethod
    def read(cls, carrier: Mapping[str, str]) -> otel_context.Context | None:
        """The context of a carrier holding a valid version-00 traceparent and no other
        field; None otherwise."""
        if len(carrier) != 1:
            return None
        match = cls._FORMAT.fullmatch(carrier.get(TRACEPARENT, ""))
        if match is None:
            return None
        trace_id, span_id, flags = (int(group, 16) for group in match.groups())
        if not trace_id or not span_id:
            return None
        span_context = SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags))
        return trace.set_span_in_context(NonRecordingSpan(span_context), otel_context.Context())


def trace_carrier() -> dict[str, str]:
    """The current trace context as W3C headers (traceparent, tracestate); {} when there
    is none. Goes in a RelayAttach, or as metadata on a call of another thread's loop."""
    if not _state.on:
        return {}
    if _state.w3c and (headers := W3CTraceparent.write()) is not None:
        return headers
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


def _extract(carrier: Mapping[str, str]) -> otel_context.Context:
    if _state.w3c and (found := W3CTraceparent.read(carrier)) is not None:
        return found
    return propagate.extract(dict(carrier))  # a plain dict: a proto map has no `keys` view


def parent_from(carrier: Mapping[str, str]) -> otel_context.Context | None:
    """The context a `trace_carrier` holds; None (the current context) when it is empty."""
    if not _state.on or not carrier:
        return None
    return _extract(carrier)


def _carried(metadata: Iterable[tuple[str, object]]) -> dict[str, str]:
    fields = _state.fields
    return {key: value for key, value in metadata if key in fields and isinstance(value, str)}


def attach_incoming(context: grpc.aio.ServicerContext) -> object | None:
    """Make the caller's trace context (from the call's metadata) current for a handler;
    returns the token for `detach`, None when tracing is off or the caller sent none."""
    if not _state.on:
        return None
    carrier = _carried(context.invocation_metadata() or ())
    if not carrier:
        return None
    return otel_context.attach(_extract(carrier))


def detach(token: object | None) -> None:
    if token is not None:
        otel_context.detach(token)


def outgoing_metadata() -> tuple[tuple[str, str], ...] | None:
    """The current trace context as a call's `metadata=`: None (no metadata) when off.

    Passed explicitly on each call that belongs to a request (Admit, Prefill, CommitKV,
    RenewLease, Release) rather than by a channel interceptor: grpc.aio's interceptor
    wrapper costs every call, and on streams would queue writes without bound.
    """
    if not _state.on:
        return None
    return tuple(trace_carrier().items()) or None
