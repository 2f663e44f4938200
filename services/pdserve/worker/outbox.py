"""The decode side's one delivery path: requests attached to an outgoing call.

A Relay call attaches many requests (see decode.proto), a Stream or Generate call one.
Nothing here runs per request per token but bookkeeping: the engine loop hands a step's
outputs to the attached requests' sinks, which forward them straight into the call's
`Outbox`, and each wake-up of the call sends everything that is due.

A request's `Attached` is its one object from attach to end; its `owner` is the call
delivering it, or, once a Relay call broke with it attached, the worker's `Orphans`
(worker/orphans.py) until a new call re-attaches it or its time runs out.
"""

from __future__ import annotations

import asyncio
import enum
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from opentelemetry import context as otel_context
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind

from pdserve.api.v1 import decode_pb2
from pdserve.core.errors import InvalidRequestError, LeaseNotFoundError
from pdserve.engine.outputs import RequestOutput
from pdserve.kv.lease import LeaseState
from pdserve.rpc.wire import sampling_params_from_proto
from pdserve.rpc.wire.worker import deltas_to_proto, ttft_deadline_from_proto
from pdserve.telemetry import propagation, tracing
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

    __slots__ = (
        "stream_interval",
        "num_output_tokens",
        "deltas",
        "num_tokens",
        "sent_any",
        "history_start",
        "history",
    )

    def __init__(self, stream_interval: int, num_output_tokens: int = 0, keep: bool = False):
        self.stream_interval = stream_interval
        self.num_output_tokens = num_output_tokens  # sent before this request's first delta
        self.deltas: list[RequestOutput] = []
        self.num_tokens = 0  # in `deltas`
        self.sent_any = False
        # `keep`: every message sent, from output token `history_start` on, for a router
        # that re-attaches the request once its call broke (bounded by its max_tokens)
        self.history_start = num_output_tokens
        self.history: list[decode_pb2.TokenDelta] | None = [] if keep else None

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
        if self.history is not None:
            self.history.append(message)
        return message


class StreamState(enum.Enum):
    """Where a request's deltas go."""

    ATTACHED = enum.auto()  # to the call it is attached to
    ORPHANED = enum.auto()  # kept: its Relay call broke (worker/orphans.py)
    ENDED = enum.auto()  # nowhere: it ended or was stopped


class Owner(Protocol):
    """Who a request's deltas and KV commit go to: its call's Outbox, or Orphans."""

    def on_item(self, attached: Attached, item: RequestOutput | BaseException) -> None: ...

    def on_ready(self, attached: Attached, ready: asyncio.Future) -> None: ...


@dataclass(slots=True, eq=False)
class Attached:
    """A request streaming on one call, from attach until its last item or detach."""

    stream_id: int
    request_id: str
    pending: PendingDeltas
    admitted: AdmittedLease | None  # the lease path; None: a colocated generation
    owner: Owner
    state: StreamState = StreamState.ATTACHED
    error: BaseException | None = None  # what ended it while orphaned
    # its trace: the parent of its span (None: the current context), the span once it
    # decodes here (a lease's from its commit, a colocated one's from the attach)
    trace_parent: otel_context.Context | None = None
    span: Span | tracing.LeafSpan = INVALID_SPAN
    span_started_at: float = 0.0  # time.monotonic()

    @property
    def ended(self) -> bool:
        return self.state is StreamState.ENDED

    def on_item(self, item: RequestOutput | BaseException) -> None:
        """The consumer of its sink: passes each item on to its owner now."""
        self.owner.on_item(self, item)

    def on_ready(self, ready: asyncio.Future) -> None:
        self.owner.on_ready(self, ready)


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One message for one attached request: a delta, or the error that ends it."""

    stream_id: int
    message: decode_pb2.TokenDelta | BaseException


class Outbox:
    """The requests attached to one call and what is ready to send on it, in order."""

    def __init__(self, worker: Worker, *, keep_history: bool = False):
        self.worker = worker
        self.keep_history = keep_history  # for re-attaching once the call broke (Relay)
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
                self.end(attached, aborted=False)
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
        pending = PendingDeltas(stream_interval, NUM_TOKENS_FROM_PREFILL, self.keep_history)
        attached = Attached(stream_id, admitted.lease.request_id, pending, admitted, self)
        attached.trace_parent = propagation.parent_from(trace_context or {})
        self.attached[stream_id] = attached
        admitted.ready.add_done_callback(attached.on_ready)
        admitted.sink.forward_to(attached.on_item)
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
        pending = PendingDeltas(stream_interval, keep=self.keep_history)
        attached = Attached(stream_id, request_id, pending, None, self)
        attached.trace_parent = propagation.parent_from(trace_context or {})
        start_request_span(attached, "generate")
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
        deadline = ttft_deadline_from_proto(request.ttft_budget_ms, time.monotonic())
        try:
            sink = await worker.start_local(
                prompt, params, attached.request_id, request.priority, deadline
            )
        except Exception as exc:  # a refusal, or the engine's error: the request's last item
            if not attached.ended:
                attached.on_item(exc)  # to its owner now (an orphan's, if its call broke)
            return
        if attached.ended:  # detached (or the call ended) while it was being added
            worker.loop.close_sink(attached.request_id)
            await worker.loop.abort(attached.request_id)
            return
        sink.forward_to(attached.on_item)

    def adopt(self, stream_id: int, attached: Attached, stream_interval: int) -> None:
        """Deliver an orphan on this call (worker/orphans.py took what it kept off it)."""
        self._check_unused(stream_id)
        attached.stream_id, attached.owner = stream_id, self
        attached.state = StreamState.ATTACHED
        attached.pending.stream_interval = stream_interval
        self.attached[stream_id] = attached

    def send(self, attached: Attached, message: decode_pb2.TokenDelta | BaseException) -> None:
        """Send a message of the request's before whatever it has due."""
        self._ready.append(Outgoing(attached.stream_id, message))
        self.wake()

    def _check_unused(self, stream_id: int) -> None:
        if stream_id in self.attached:
            raise InvalidRequestError("attach.stream_id", "already in use")

    # -- what the engine produced -------------------------------------------------------------

    def on_ready(self, attached: Attached, ready: asyncio.Future) -> None:
        if ready.cancelled() or attached.ended:
            return
        if ready.exception() is not None:
            self.fail(attached, ready.exception())
        else:  # the KV is committed: decoding starts
            start_request_span(attached, "decode")

    def on_item(self, attached: Attached, item: RequestOutput | BaseException) -> None:
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
        self.end(attached, aborted=True)

    def detach(self, stream_id: int) -> None:
        """Stop a request the caller no longer wants (nothing to do if it ended already)."""
        attached = self.attached.get(stream_id)
        if attached is not None:
            self.end(attached, aborted=True)

    def close(self, orphans: Orphanage | None = None) -> None:
        """The call is over: stop every request still attached, or, with `orphans` (the
        call broke: its router may be gone), hand each to them to keep for a while."""
        for attached in list(self.attached.values()):
            self.attached.pop(attached.stream_id, None)
            self._due.pop(attached.stream_id, None)
            if orphans is None or not orphans.keep(attached):
                self.end(attached, aborted=True)

    def end(self, attached: Attached, aborted: bool) -> None:
        """Forget the request here; free its lease, or abort it if it did not finish."""
        self.attached.pop(attached.stream_id, None)
        self._due.pop(attached.stream_id, None)
        self.wake()
        end_request(self.worker, attached, aborted)


class Orphanage(Protocol):
    """Where a broken call's requests go (`worker.orphans.Orphans`)."""

    def keep(self, attached: Attached) -> bool:
        """Keep it for a re-attach (False: it is not kept, and the caller ends it)."""


def end_request(worker: Worker, attached: Attached, aborted: bool) -> None:
    """The request is over here: free its lease (aborting it if it runs), or abort a
    colocated one that did not finish. Idempotent."""
    attached.state = StreamState.ENDED
    end_request_span(attached)
    release_request(worker, attached, aborted)


def release_request(worker: Worker, attached: Attached, aborted: bool) -> None:
    """Give back what the request holds on the engine (its lease, its sink); `aborted`:
    stop it if it still runs. Closing a lease twice is a no-op."""
    if attached.admitted is not None:
        closed = LeaseNotFoundError("closed")
        worker.leases.spawn(
            worker.leases.close_lease(attached.admitted, LeaseState.RELEASED, closed)
        )
    else:
        worker.loop.close_sink(attached.request_id)
        if aborted:
            worker.leases.spawn(worker.loop.abort(attached.request_id))


def start_request_span(attached: Attached, name: str) -> None:
    attached.span = tracing.leaf_span(
        name, attached.request_id, kind=SpanKind.SERVER, parent=attached.trace_parent
    )
    attached.span_started_at = time.monotonic()


def end_request_span(attached: Attached) -> None:
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
