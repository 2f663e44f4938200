"""Orphans: requests whose Relay call broke, kept running for a router to re-attach.

A router that dies leaves its requests on the decode worker with no one to read them.
Rather than abort them, the worker keeps each (its `Attached`, with every message it
sent and every delta since) under its name here for `--orphan-timeout` seconds: a router
taking the request over re-attaches it on its own Relay call (`RelayAttach.reattach`)
and gets its tokens from the position its client's checkpoints end at, then the live
ones, so nothing runs twice. Nobody in time: the request is aborted and its KV blocks
freed. A request that finishes meanwhile gives its blocks back at once and keeps only
its messages. A detach aborts its request at once. To the worker a call its router
closed and one that broke look alike (the commands end), so a router ending a call on
purpose (shutdown, a frozen worker's progress deadline) detaches what is on it first.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from pdserve.api.v1 import decode_pb2
from pdserve.core.errors import InvalidRequestError, UnknownRequestError
from pdserve.engine.outputs import RequestOutput
from pdserve.rpc.wire import drop_first_tokens, is_final
from pdserve.worker.outbox import (
    Attached,
    Outbox,
    PendingDeltas,
    StreamState,
    end_request,
    end_request_span,
    release_request,
    start_request_span,
)
from pdserve.worker.worker import Worker

log = logging.getLogger(__name__)


class ReattachRangeError(InvalidRequestError):
    """The orphan's kept tokens do not reach back to (or forward to) the offset asked."""

    out_of_range = True


@dataclass(eq=False, slots=True)
class _Kept:
    attached: Attached
    expiry: asyncio.TimerHandle


class Orphans:
    """This worker's orphans by request name; lives on the event loop."""

    def __init__(self, worker: Worker, timeout_s: float):
        self.worker = worker
        self.timeout_s = timeout_s  # 0: none are kept (a broken call aborts its requests)
        self._kept: dict[str, _Kept] = {}
        self.num_expired = 0  # aborted (or dropped, finished) with nobody re-attaching
        self.num_reattached = 0

    def __len__(self) -> int:
        return len(self._kept)

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0

    def keep(self, attached: Attached) -> bool:
        """Take a request off a call that ended with it attached; False when orphans are
        not kept."""
        if not self.enabled or attached.ended:
            return False
        old = self._kept.pop(attached.request_id, None)
        if old is not None:  # the same name orphaned twice: the newer one is the live run
            self._expire_now(old)
        attached.state, attached.owner = StreamState.ORPHANED, self
        end_request_span(attached)  # its call's span; a re-attach starts another
        expiry = asyncio.get_running_loop().call_later(
            self.timeout_s, self._expire, attached.request_id
        )
        self._kept[attached.request_id] = _Kept(attached, expiry)
        if attached.pending.finished:
            release_request(self.worker, attached, aborted=False)
        log.info(
            "request %s orphaned (its relay call ended); kept %gs for a re-attach",
            attached.request_id,
            self.timeout_s,
        )
        return True

    # -- what the engine produces meanwhile (Owner) --------------------------------------

    def on_item(self, attached: Attached, item: RequestOutput | BaseException) -> None:
        if attached.state is not StreamState.ORPHANED or attached.error is not None:
            return
        if isinstance(item, BaseException):
            attached.error = item
            release_request(self.worker, attached, aborted=True)
            return
        attached.pending.add(item)
        if item.finished:  # its blocks are free; its messages wait for a re-attach
            release_request(self.worker, attached, aborted=False)

    def on_ready(self, attached: Attached, ready: asyncio.Future) -> None:
        if ready.cancelled() or attached.state is not StreamState.ORPHANED:
            return
        if ready.exception() is not None and attached.error is None:
            attached.error = ready.exception()  # its lease ended before its KV came

    # -- re-attaching ----------------------------------------------------------------------

    def reattach(
        self, outbox: Outbox, stream_id: int, reattach: decode_pb2.RelayReattach, interval: int
    ) -> None:
        """Deliver orphan `reattach.request_id` on `outbox`'s call from its token
        `reattach.from_token` on. UnknownRequestError if no orphan has the name,
        ReattachRangeError (the orphan aborted: the caller runs it again) if its kept
        tokens do not cover the offset; InvalidRequestError if the stream id is taken."""
        if stream_id in outbox.attached:
            raise InvalidRequestError("attach.stream_id", "already in use")
        kept = self._kept.pop(reattach.request_id, None)
        if kept is None:
            raise UnknownRequestError(reattach.request_id)
        kept.expiry.cancel()
        attached = kept.attached
        try:
            messages = kept_from(attached.pending, reattach.from_token)
        except ReattachRangeError:
            end_request(self.worker, attached, aborted=True)
            raise
        self.num_reattached += 1
        outbox.adopt(stream_id, attached, interval)
        start_request_span(attached, "decode")
        for message in messages:
            outbox.send(attached, message)
        if attached.error is not None:
            outbox.send(attached, attached.error)
            outbox.end(attached, aborted=True)
        elif messages and is_final(messages[-1]):
            outbox.end(attached, aborted=False)
        log.info("request %s re-attached from token %d", attached.request_id, reattach.from_token)

    def _expire(self, request_id: str) -> None:
        kept = self._kept.pop(request_id, None)
        if kept is not None:
            log.info("orphan %s: no router re-attached it; aborted", request_id)
            self.num_expired += 1
            self._expire_now(kept)

    def _expire_now(self, kept: _Kept) -> None:
        kept.expiry.cancel()
        end_request(self.worker, kept.attached, aborted=True)


def kept_from(pending: PendingDeltas, position: int) -> list[decode_pb2.TokenDelta]:
    """The request's messages from output token `position` on (the first one cut to
    start there, exactly, text included), what waited unsent included; raises
    ReattachRangeError unless the kept messages cover `position`."""
    if pending.deltas:
        pending.take()  # into the history, with the rest
    history = pending.history or []
    if not pending.history_start <= position <= pending.num_output_tokens:
        raise ReattachRangeError(
            "attach.reattach.from_token",
            f"{position} is outside the tokens kept, "
            f"[{pending.history_start}, {pending.num_output_tokens}]",
        )
    messages, start = [], pending.history_start
    for message in history:
        end = start + len(message.token_ids)
        if end > position or start >= position or is_final(message):
            copy = decode_pb2.TokenDelta()
            copy.CopyFrom(message)
            if position > start:
                drop_first_tokens(copy, position - start)
            messages.append(copy)
        start = end
    return messages
