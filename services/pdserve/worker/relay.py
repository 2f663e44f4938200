"""The decode side of Relay: the tokens of many requests on one call (see decode.proto).

A router opens one Relay call per decode worker and attaches each request it streams
from there. The call's `Outbox` (worker/outbox.py, the path Stream and Generate take
with one request) collects what is due; one batch per wake-up carries all of it.

A detach aborts its request at once. A request still attached when the call ends (its
router died, or the connection did: the worker cannot tell that from a router closing
the call, so a router detaches what it stops first) is left to the worker's `Orphans`
(worker/orphans.py) for a router taking it over to re-attach, for `--orphan-timeout`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from pdserve.api.v1 import decode_pb2
from pdserve.core.errors import InvalidRequestError, LeaseNotFoundError, UnknownRequestError
from pdserve.rpc.wire.worker import relay_item
from pdserve.worker.orphans import Orphans
from pdserve.worker.outbox import Outbox
from pdserve.worker.worker import Worker

log = logging.getLogger(__name__)


class RelayCall:
    """One Relay call: commands in, the attached requests' items out in batches."""

    def __init__(self, worker: Worker, orphans: Orphans):
        self.worker, self.orphans = worker, orphans
        self.outbox = Outbox(worker, keep_history=orphans.enabled)
        self._closed = False  # the caller's commands ended, or broke

    def wake(self) -> None:
        self.outbox.wake()

    async def serve(self, commands: AsyncIterator[decode_pb2.RelayCommand]):
        """The call's response stream: a batch whenever something is ready."""
        reader = asyncio.create_task(self._read(commands))
        try:
            while True:
                items = await self.outbox.next_ready()
                if items:
                    yield decode_pb2.RelayBatch(
                        items=[relay_item(item.stream_id, item.message) for item in items]
                    )
                if self._closed or (self.worker.draining and not self.outbox.attached):
                    return
        finally:
            reader.cancel()
            self.outbox.close(self.orphans)  # what is still attached: orphans now

    async def _read(self, commands: AsyncIterator[decode_pb2.RelayCommand]) -> None:
        try:
            async for command in commands:
                kind = command.WhichOneof("command")
                if kind == "attach":
                    self._attach(command.attach)
                elif kind == "detach":
                    self.outbox.detach(command.detach.stream_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the call broke; its handler is being cancelled too
            log.debug("relay commands ended: %r", exc)
        self._closed = True
        self.outbox.wake()

    def _attach(self, attach: decode_pb2.RelayAttach) -> None:
        """Attach a request; a bad attach gets its error on its stream id alone."""
        outbox, kind = self.outbox, attach.WhichOneof("request")
        try:
            # each attach carries its request's trace context: the call carries many
            if kind == "reattach":
                self.orphans.reattach(
                    outbox, attach.stream_id, attach.reattach, attach.stream_interval
                )
            elif kind == "lease_id":
                outbox.attach_lease(
                    attach.stream_id, attach.lease_id, attach.stream_interval, attach.trace_context
                )
            elif kind == "generate":
                outbox.attach_generate(
                    attach.stream_id, attach.generate, attach.stream_interval, attach.trace_context
                )
            else:
                raise InvalidRequestError("attach.request", "set lease_id, generate or reattach")
        except (InvalidRequestError, LeaseNotFoundError, UnknownRequestError) as exc:
            outbox.refuse(attach.stream_id, exc)
