"""The decode side of Relay: the tokens of many requests on one call (see decode.proto).

A router opens one Relay call per decode worker and attaches each request it streams
from there. Nothing here runs per request per token but bookkeeping: the engine loop
hands a step's outputs to the attached requests' sinks, which forward them straight
into this call's state, and one message per wake-up carries everything that is due.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.api.v1 import decode_pb2
from pdserve.core.errors import InvalidRequestError, LeaseNotFoundError
from pdserve.kv.lease import LeaseState
from pdserve.rpc.errors import to_status
from pdserve.worker.worker import PendingDeltas

if TYPE_CHECKING:
    from pdserve.worker.decode import DecodeServicer, _Admitted

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _Attached:
    """A request streaming on this call, from attach until its last item or detach."""

    stream_id: int
    request_id: str
    pending: PendingDeltas
    admitted: _Admitted | None  # the lease path; None: a colocated generation
    ended: bool = False


class RelayCall:
    """One Relay call: its attached requests and what is ready to send on it."""

    def __init__(self, decode: DecodeServicer):
        self.decode, self.worker = decode, decode.worker
        self.attached: dict[int, _Attached] = {}
        self._due: dict[int, _Attached] = {}  # requests with a message due, in arrival order
        self._ready: list[decode_pb2.RelayItem] = []  # items to send first, in order
        self._wakeup = asyncio.Event()
        self._closed = False  # the caller closed its side

    def wake(self) -> None:
        self._wakeup.set()

    async def serve(self, commands: AsyncIterator[decode_pb2.RelayCommand]):
        """The call's response stream: a batch whenever something is ready."""
        reader = asyncio.create_task(self._read(commands))
        try:
            while True:
                await self._wakeup.wait()
                self._wakeup.clear()
                items = self._take_ready()
                if items:
                    yield decode_pb2.RelayBatch(items=items)
                if self._closed or (self.worker.draining and not self.attached):
                    return
        finally:
            reader.cancel()
            for attached in list(self.attached.values()):
                self._end(attached, aborted=True)

    # -- commands ---------------------------------------------------------------------------

    async def _read(self, commands) -> None:
        try:
            async for command in commands:
                kind = command.WhichOneof("command")
                if kind == "attach":
                    self._attach(command.attach)
                elif kind == "detach":
                    attached = self.attached.get(command.detach.stream_id)
                    if attached is not None:  # else it ended already: nothing to stop
                        self._end(attached, aborted=True)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the call broke; its handler is being cancelled too
            log.debug("relay commands ended: %r", exc)
        self._closed = True
        self.wake()

    def _attach(self, attach: decode_pb2.RelayAttach) -> None:
        stream_id = attach.stream_id
        if stream_id in self.attached:
            self._refuse(stream_id, InvalidRequestError("attach.stream_id", "already in use"))
            return
        kind = attach.WhichOneof("request")
        if kind == "lease_id":
            self._attach_lease(stream_id, attach)
        elif kind == "generate":
            request_id = attach.generate.request_id or uuid.uuid4().hex
            attached = _Attached(stream_id, request_id, PendingDeltas(attach.stream_interval), None)
            self.attached[stream_id] = attached
            self.decode.spawn(self._generate(attached, attach.generate))
        else:
            self._refuse(
                stream_id, InvalidRequestError("attach.request", "set lease_id or generate")
            )

    def _attach_lease(self, stream_id: int, attach: decode_pb2.RelayAttach) -> None:
        admitted = self.decode.admitted.get(attach.lease_id)
        if admitted is None or admitted.stream_attached:
            self._refuse(
                stream_id, LeaseNotFoundError("unknown lease, or its stream is already attached")
            )
            return
        admitted.stream_attached = True
        # The first token came from the prefill worker: the engine's count starts at 1.
        attached = _Attached(
            stream_id, admitted.lease.request_id, PendingDeltas(attach.stream_interval, 1), admitted
        )
        self.attached[stream_id] = attached
        admitted.ready.add_done_callback(lambda ready: self._on_ready(attached, ready))
        admitted.sink.forward_to(lambda item: self._on_item(attached, item))

    async def _generate(self, attached: _Attached, request: decode_pb2.LocalGenerateRequest):
        if attached.ended:  # detached before this task ran
            return
        try:
            sink = await self.worker.start_local(request, attached.request_id)
        except Exception as exc:
            if not attached.ended:
                self._fail(attached, exc)
            return
        if attached.ended:  # detached (or the call ended) while it was being added
            self.worker.loop.close_sink(attached.request_id)
            await self.worker.abort_quietly(attached.request_id)
            return
        sink.forward_to(lambda item: self._on_item(attached, item))

    # -- what the engine produced -------------------------------------------------------------

    def _on_ready(self, attached: _Attached, ready: asyncio.Future) -> None:
        if not ready.cancelled() and ready.exception() is not None and not attached.ended:
            self._fail(attached, ready.exception())

    def _on_item(self, attached: _Attached, item) -> None:
        if attached.ended:
            return
        if isinstance(item, BaseException):
            self._fail(attached, item)
            return
        attached.pending.add(item)
        if attached.pending.due():
            self._due[attached.stream_id] = attached
            self.wake()

    def _take_ready(self) -> list[decode_pb2.RelayItem]:
        items, self._ready = self._ready, []
        due, self._due = self._due, {}
        for attached in due.values():
            if attached.ended:  # its items went out through _ready
                continue
            finished = attached.pending.finished
            items.append(
                decode_pb2.RelayItem(stream_id=attached.stream_id, delta=attached.pending.take())
            )
            if finished:
                self._end(attached, aborted=False)
        return items

    # -- endings ------------------------------------------------------------------------------

    def _refuse(self, stream_id: int, error: Exception) -> None:
        self._ready.append(_error_item(stream_id, error))
        self.wake()

    def _fail(self, attached: _Attached, error: BaseException) -> None:
        """End a request with an error, after whatever it produced before the error."""
        if attached.pending.deltas:
            self._ready.append(
                decode_pb2.RelayItem(stream_id=attached.stream_id, delta=attached.pending.take())
            )
        self._ready.append(_error_item(attached.stream_id, error))
        self._end(attached, aborted=True)

    def _end(self, attached: _Attached, aborted: bool) -> None:
        """Forget the request here; free its lease, or abort it, exactly as Stream would."""
        attached.ended = True
        self.attached.pop(attached.stream_id, None)
        self._due.pop(attached.stream_id, None)
        self.wake()
        if attached.admitted is not None:
            self.decode.spawn(
                self.decode.close_lease(
                    attached.admitted, LeaseState.RELEASED, LeaseNotFoundError("closed")
                )
            )
        else:
            self.worker.loop.close_sink(attached.request_id)
            if aborted:
                self.decode.spawn(self.worker.abort_quietly(attached.request_id))


def _error_item(stream_id: int, error: BaseException) -> decode_pb2.RelayItem:
    status = to_status(error)
    return decode_pb2.RelayItem(
        stream_id=stream_id, error_code=status.code, error_message=status.message
    )
