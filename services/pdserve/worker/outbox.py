"""The decode side's one delivery path: requests attached to an outgoing call.

A Relay call attaches many requests (see decode.proto), a Stream or Generate call one.
Nothing here runs per request per token but bookkeeping: the engine loop hands a step's
outputs to the attached requests' sinks, which forward them straight into the call's
`Outbox`, and each wake-up of the call sends everything that is due.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

from opentelemetry import context as otel_context
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind

from pdserve.api.v1 import decode_pb2
from pdserve.core.errors import InvalidRequestError, LeaseNotFoundError
from pdserve.engine.outputs import RequestOutput
from pdserve.kv.lease import LeaseState
from pdserve.rpc.wire import sampling_params_from_proto
from pdserve.rpc.wire.worker import deltas_to_proto
from pdserve.telemetry import tracing
from pdserve.worker.leases import AdmittedLease
from pdserve.worker.worker import Worker

# The first token of a lease's request came from the prefill worker: it counts as sent.
NUM_TOKENS_FROM_PREFILL = 1


class PendingDeltas:
    """One request's step outputs not sent yet, and whether a message is due.

    A message goes out once `stream_interval` tokens wait, and the first and the last
    at once; it holds every output waiting then (see StreamRequest.stream_interval), so
    a receiver behind the engine pays per message, not per token.
    """

    __slots__ = ("stream_interval", "num_output_tokens", "deltas", "num_tokens", "sent_any")

    def __init__(self, stream_interval: int, num_output_tokens: int = 0):
        self.stream_interval = stream_interval
        self.num_output_tokens = num_output_tokens  # sent before this request's first delta
        self.deltas: list[RequestOutput] = []
        self.num_tokens = 0  # in `deltas`
        self.sent_any = False

    @property
    def finished(self) -> bool:
        return bool(self.deltas) and self.deltas[-1].finished

    def add(self, delta: RequestOutput) -> None:
        self.deltas.append(delta)
        self.num_tokens += len(delta.token_ids)

    def due(self) -> bool:
        return bool(self.deltas) and (
            not self.sent_any or self.num_tokens >= self.stream_interval or self.finished
        )

    def take(self) -> decode_pb2.TokenDelta:
        self.num_output_tokens += self.num_tokens
        message = deltas_to_proto(self.deltas, self.num_output_tokens)
        self.deltas, self.num_tokens, self.sent_any = [], 0, True
        return message


@dataclass(slots=True, eq=False)
class Attached:
    """A request streaming on one call, from attach until its last item or detach."""

    stream_id: int
    request_id: str
    pending: PendingDeltas
    admitted: AdmittedLease | None  # the lease path; None: a colocated generation
    ended: bool = False
    # its trace: the parent of its span (None: the current context), the span once it
    # decodes here (a lease's from its commit, a colocated one's from the attach)
    trace_parent: otel_context.Context | None = None
    span: Span = INVALID_SPAN
    span_started_at: float = 0.0  # time.monotonic()


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One message for one attached request: a delta, or the error that ends it."""

    stream_id: int
    message: decode_pb2.TokenDelta | BaseException


class Outbox:
    """The requests attached to one call and what is ready to send on it, in order."""

    def __init__(self, worker: Worker):
        self.worker = worker
        self.attached: dict[int, Attached] = {}  # by stream id
        self._due: dict[int, Attached] = {}  # requests with a message due, in arrival order
        self._ready: list[Outgoing] = []  # to send before the due ones, in order
        self._wakeup = asyncio.Event()

    def wake(self) -> None:
        self._wakeup.set()

    async def next_ready(self) -> list[Outgoing]:
        """Wait to be woken; then what is ready to send (maybe nothing), in order."""
        await self._wakeup.wait()
        self._wakeup.clear()
        items, self._ready = self._ready, []
        due, self._due = self._due, {}
        for attached in due.values():
            if attached.ended:  # its items went out through _ready
                continue
            finished = attached.pending.finished
            items.append(Outgoing(attached.stream_id, attached.pending.take()))
            if finished:
                self._end(attached, aborted=False)
        return items

    # -- attaching ----------------------------------------------------------------------------

    def attach_lease(
        self,
        stream_id: int,
        lease_id: str,
        stream_interval: int,
        trace_context: Mapping[str, str] | None = None,
    ) -> Attached:
        """Deliver an admitted lease's request once its KV is committed; `trace_context`:
        the request's (a Relay attach's), None: the caller's.

        Raises InvalidRequestError if the stream id is in use, LeaseNotFoundError unless
        the lease is admitted and has no stream yet.
        """
        self._check_unused(stream_id)
        admitted = self.worker.leases.attach_stream(lease_id)
        pending = PendingDeltas(stream_interval, NUM_TOKENS_FROM_PREFILL)
        attached = Attached(stream_id, admitted.lease.request_id, pending, admitted)
        attached.trace_parent = tracing.parent_from(trace_context or {})
        self.attached[stream_id] = attached
        admitted.ready.add_done_callback(lambda ready: self._on_ready(attached, ready))
        admitted.sink.forward_to(lambda item: self._on_item(attached, item))
        return attached

    def attach_generate(
        self,
        stream_id: int,
        request: decode_pb2.LocalGenerateRequest,
        stream_interval: int,
        trace_context: Mapping[str, str] | None = None,
    ) -> Attached:
        """Start a colocated generation (prefill and decode here) and deliver it.

        It starts in the background; a refusal (an invalid request, a draining worker)
        is then its one item. Raises InvalidRequestError if the stream id is in use.
        """
        self._check_unused(stream_id)
        request_id = request.request_id or uuid.uuid4().hex
        attached = Attached(stream_id, request_id, PendingDeltas(stream_interval), None)
        attached.trace_parent = tracing.parent_from(trace_context or {})
        _start_span(attached, "generate")
        self.attached[stream_id] = attached
        self.worker.leases.spawn(self._start_generate(attached, request))
        return attached

    async def _start_generate(
        self, attached: Attached, request: decode_pb2.LocalGenerateRequest
    ) -> None:
        if attached.ended:  # detached before this task ran
            return
        worker = self.worker
        prompt = list(request.prompt_token_ids)
        params = sampling_params_from_proto(request.sampling)
        try:
            sink = await worker.start_local(prompt, params, attached.request_id, request.priority)
        except Exception as exc:  # a refusal, or the engine's error: the request's last item
            if not attached.ended:
                self.fail(attached, exc)
            return
        if attached.ended:  # detached (or the call ended) while it was being added
            worker.loop.close_sink(attached.request_id)
            await worker.loop.abort(attached.request_id)
            return
        sink.forward_to(lambda item: self._on_item(attached, item))

    def _check_unused(self, stream_id: int) -> None:
        if stream_id in self.attached:
            raise InvalidRequestError("attach.stream_id", "already in use")

    # -- what the engine produced -------------------------------------------------------------

    def _on_ready(self, attached: Attached, ready: asyncio.Future) -> None:
        if ready.cancelled() or attached.ended:
            return
        if ready.exception() is not None:
            self.fail(attached, ready.exception())
        else:  # the KV is committed: decoding starts
            _start_span(attached, "decode")

    def _on_item(self, attached: Attached, item: RequestOutput | BaseException) -> None:
        if attached.ended:
            return
        if isinstance(item, BaseException):
            self.fail(attached, item)
            return
        attached.pending.add(item)
        if attached.pending.due():
            self._due[attached.stream_id] = attached
            self.wake()

    # -- endings ------------------------------------------------------------------------------

    def refuse(self, stream_id: int, error: Exception) -> None:
        """Answer an attach that failed with its error alone."""
        self._ready.append(Outgoing(stream_id, error))
        self.wake()

    def fail(self, attached: Attached, error: BaseException) -> None:
        """End a request with an error, after whatever it produced before the error."""
        tracing.set_error(attached.span, error)
        if attached.pending.deltas:
            self._ready.append(Outgoing(attached.stream_id, attached.pending.take()))
        self._ready.append(Outgoing(attached.stream_id, error))
        self._end(attached, aborted=True)

    def detach(self, stream_id: int) -> None:
        """Stop a request the caller no longer wants (nothing to do if it ended already)."""
        attached = self.attached.get(stream_id)
        if attached is not None:
            self._end(attached, aborted=True)

    def close(self) -> None:
        """The call is over: stop every request still attached."""
        for attached in list(self.attached.values()):
            self._end(attached, aborted=True)

    def _end(self, attached: Attached, aborted: bool) -> None:
        """Forget the request here; free its lease, or abort it if it did not finish."""
        attached.ended = True
        _end_span(attached)
        self.attached.pop(attached.stream_id, None)
        self._due.pop(attached.stream_id, None)
        self.wake()
        worker = self.worker
        if attached.admitted is not None:
            closed = LeaseNotFoundError("closed")
            worker.leases.spawn(
                worker.leases.close_lease(attached.admitted, LeaseState.RELEASED, closed)
            )
        else:
            worker.loop.close_sink(attached.request_id)
            if aborted:
                worker.leases.spawn(worker.loop.abort(attached.request_id))


def _start_span(attached: Attached, name: str) -> None:
    attached.span = tracing.start_span(
        name, attached.request_id, kind=SpanKind.SERVER, parent=attached.trace_parent
    )
    attached.span_started_at = time.monotonic()


def _end_span(attached: Attached) -> None:
    """End the request's span with the tokens it produced here and their time per token."""
    span = attached.span
    if span.is_recording():
        num_tokens = attached.pending.num_output_tokens
        if attached.admitted is not None:  # the first one came from the prefill worker
            num_tokens -= NUM_TOKENS_FROM_PREFILL
        elapsed = time.monotonic() - attached.span_started_at
        span.set_attribute("gen_ai.usage.output_tokens", num_tokens)
        span.set_attribute("pdserve.decode.time_per_output_token", elapsed / max(num_tokens, 1))
    span.end()
    attached.span = INVALID_SPAN  # ended once


async def deliver_one(outbox: Outbox, attached: Attached) -> AsyncIterator[decode_pb2.TokenDelta]:
    """A call with one request (Stream, Generate): its deltas; raises the error that ends it.

    If the consumer goes away (the call is cancelled), the request stops at once.
    """
    try:
        while True:
            for item in await outbox.next_ready():
                if isinstance(item.message, BaseException):
                    raise item.message
                yield item.message
            if attached.ended:
                return
    finally:
        outbox.close()
