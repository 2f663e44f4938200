"""The router's end of Relay: one call per decode worker carries all its streams.

Each request the router streams from a decode worker attaches to that worker's Relay
call (decode.proto) instead of opening a Stream call of its own. A worker then sends
one message per engine step for all of them, and the router reads one: gRPC's cost per
message (tens of µs of CPU on each side) is paid per step, not per token of each
request. A `RelayStream` ends as the Stream call it replaces would: after the final
TokenDelta, or with `grpc.aio.AioRpcError` carrying the status the worker reported, or
UNAVAILABLE when the call itself broke (the worker died).

A worker that stops without its connection breaking (SIGSTOP, a hung host: the kernel
keeps the TCP connection open) is caught by a progress deadline: once a stream waits for
tokens (its prefill has returned), the call must bring some message, for any of its
streams, every `progress_timeout_s`. When it does not, the router treats the worker as
dead: it ends the call, and every stream on it fails with UNAVAILABLE, which the session
retries elsewhere as for a killed worker. The deadline runs from the call's last message,
so a busy worker (whose other streams keep it talking) is not mistaken for a frozen one,
and not from the attach, so a long prefill queue is not either.

The router ends a call on purpose (that deadline, or its own shutdown) by detaching
every stream on it and then ending its commands: the worker aborts each and frees its
blocks at once. A call that ends with streams attached (this router died) leaves them
running on the worker as orphans (worker/orphans.py) for a router that takes them over
to re-attach (`RelayAttach.reattach`).
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
from collections.abc import Callable

import grpc

from pdserve.api.v1 import decode_pb2, decode_pb2_grpc
from pdserve.rpc.wire import is_final

log = logging.getLogger(__name__)
_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}
# A decode step takes milliseconds to a second; ten seconds without a message for any of
# a worker's waiting streams means it is frozen (measured: docs, reliability notes).
DEFAULT_STREAM_PROGRESS_TIMEOUT_S = 10.0
# How long a call the router ended (its commands closed) may take to end on the worker's
# side before the router cancels it: a frozen worker's connection usually dies sooner, of
# its keepalive; a worker that answers ends the call at once.
CLOSE_GRACE_S = 30.0
SHUTDOWN_GRACE_S = 1.0


class RelayStream:
    """One request's deltas on a shared Relay call.

    `deliver` hands each delta to a callback, called from the call's reader as the batch
    arrives: the router pays no task switch per token for it. Until then (while the
    request prefills) deltas wait here. `cancel()` stops early.
    """

    __slots__ = (
        "_connection",
        "stream_id",
        "_waiting",
        "_consumer",
        "_over",
        "_ended",
        "_deadline",
        "waiting_since",
    )

    def __init__(self, connection: _RelayConnection, stream_id: int, timeout: float | None):
        self._connection, self.stream_id = connection, stream_id
        self._waiting: list = []  # items before `deliver` starts
        self._consumer: Callable[[decode_pb2.TokenDelta], None] | None = None
        self._over = False  # no more items: ended, failed or cancelled
        # Resolves when the request's last delta was delivered, or fails with its error.
        self._ended: asyncio.Future = asyncio.get_running_loop().create_future()
        self._deadline = None
        # loop.time() when `deliver` started: from then on the request waits for tokens
        self.waiting_since: float | None = None
        if timeout is not None:  # the client's deadline: stop here, and detach the worker
            self._deadline = asyncio.get_running_loop().call_later(timeout, self._expire)

    async def deliver(self, consumer: Callable[[decode_pb2.TokenDelta], None]) -> None:
        """Call `consumer` with every delta up to the final one; raise the request's error."""
        self._consumer = consumer
        self.waiting_since = asyncio.get_running_loop().time()
        self._connection.watch()
        waiting, self._waiting = self._waiting, []
        for item in waiting:
            self.put(item)
        await self._ended

    def put(self, item) -> None:
        """From the reader: an item for this stream, or the error that broke the call."""
        if self._over:
            return
        if self._consumer is None:
            self._waiting.append(item)
        elif isinstance(item, BaseException):
            self._end(item, detach=False)
        elif item.error_code:  # the worker ended the request
            code = _STATUS_CODES.get(item.error_code, grpc.StatusCode.UNKNOWN)
            self._end(_status_error(code, item.error_message), detach=False)
        else:
            try:
                self._consumer(item.delta)
            except Exception as exc:  # the consumer's bug: end this request, not the call
                self._end(exc, detach=True)
                return
            if is_final(item.delta):
                self._end(None, detach=False)

    def cancel(self) -> None:
        """Stop early: the worker aborts the request and frees its blocks. No-op once ended."""
        if not self._over:
            self._end(None, detach=True)

    def _expire(self) -> None:
        self._end(_status_error(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"), True)

    def _end(self, error: BaseException | None, detach: bool) -> None:
        if self._over:
            return
        self._over = True
        if not self._ended.done():  # else it was cancelled along with the task awaiting it
            if error is None:
                self._ended.set_result(None)
            else:
                self._ended.set_exception(error)
                if self._consumer is None:  # nobody may ever await it: no "never retrieved"
                    self._ended.exception()
        if self._deadline is not None:
            self._deadline.cancel()
        self._connection.forget(self, detach)


class _RelayConnection:
    """One Relay call: commands go out through an outbox, batches are sorted by stream."""

    def __init__(
        self,
        stub: decode_pb2_grpc.DecodeStub,
        on_closed: Callable[[_RelayConnection], None],
        progress_timeout_s: float | None,
    ):
        self._on_closed = on_closed
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._streams: dict[int, RelayStream] = {}
        self._ids = itertools.count(1)
        self.open = True
        self._loop = asyncio.get_running_loop()
        self._progress_timeout_s = progress_timeout_s
        self._last_message_at = self._loop.time()
        self._watchdog: asyncio.TimerHandle | None = None  # the progress deadline's check
        self._call = stub.Relay(self._commands())
        # In a context of its own: the call serves many requests, not the one that opened it
        # (whose trace its log lines would otherwise name).
        self._reader = asyncio.create_task(self._read(), context=contextvars.Context())

    def attach(self, attach: decode_pb2.RelayAttach, timeout: float | None) -> RelayStream:
        stream = RelayStream(self, next(self._ids), timeout)
        self._streams[stream.stream_id] = stream
        attach.stream_id = stream.stream_id
        self._outbox.put_nowait(decode_pb2.RelayCommand(attach=attach))
        return stream

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def forget(self, stream: RelayStream, detach: bool) -> None:
        if self._streams.pop(stream.stream_id, None) is not None and detach and self.open:
            detach_command = decode_pb2.RelayDetach(stream_id=stream.stream_id)
            self._outbox.put_nowait(decode_pb2.RelayCommand(detach=detach_command))

    def watch(self) -> None:
        """A stream waits for tokens now: make sure the progress deadline is being kept."""
        if self._watchdog is None and self._progress_timeout_s is not None and self.open:
            self._check_progress()

    def _check_progress(self) -> None:
        """End the call if a waiting stream has had nothing, nor has the call, for the
        timeout; else check again when that could first happen. Runs about once per
        timeout, not per message: a message only moves `_last_message_at`."""
        self._watchdog = None
        waiting = [s.waiting_since for s in self._streams.values() if s.waiting_since is not None]
        if not waiting or not self.open:
            return
        timeout = self._progress_timeout_s
        deadline = max(self._last_message_at, min(waiting)) + timeout
        if self._loop.time() < deadline:
            self._watchdog = self._loop.call_at(deadline, self._check_progress)
            return
        why = (
            f"the decode worker sent nothing for {timeout:g} s while {len(waiting)} "
            "request(s) waited for tokens (frozen?)"
        )
        log.warning("ending the relay: %s", why)
        self._end_here(why, CLOSE_GRACE_S)

    def _end_here(self, why: str, grace_s: float) -> None:
        """End the call from this side: its streams fail with UNAVAILABLE now, and its
        commands end, so a worker that reads them aborts what it held; cancelled only if
        the worker has not ended it `grace_s` later."""
        if self.open:
            self._close(why, detach=True)
            self._loop.call_later(grace_s, self._call.cancel)

    async def _commands(self):
        while (command := await self._outbox.get()) is not None:
            yield command

    async def _read(self) -> None:
        # However the call ends, its requests end with UNAVAILABLE (retried elsewhere): a
        # request's own errors come as items, so the call's end means the worker is gone
        # or going (draining; and a worker ending the call while an attach is in flight
        # shows here as INTERNAL "Internal error from Core").
        why = "the decode worker ended the relay (draining)"
        try:
            async for batch in self._call:
                self._last_message_at = self._loop.time()
                streams = self._streams
                for item in batch.items:
                    stream = streams.get(item.stream_id)
                    if stream is not None:  # else it stopped early: drop what was in flight
                        stream.put(item)
        except grpc.aio.AioRpcError as exc:  # the worker died or went away
            why = f"the relay to the decode worker broke ({exc.code().name}: {exc.details()})"
        except asyncio.CancelledError:
            why = "the router is stopping"
            raise
        finally:
            self._close(why)

    def _close(self, why: str, detach: bool = False) -> None:
        """No more streams on this call: each still on it fails with UNAVAILABLE, and
        the command stream ends; `detach`: after detaching each (the worker aborts them)."""
        if not self.open:
            return
        self.open = False
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._on_closed(self)
        streams, self._streams = self._streams, {}
        for stream_id in streams if detach else ():
            detach_command = decode_pb2.RelayDetach(stream_id=stream_id)
            self._outbox.put_nowait(decode_pb2.RelayCommand(detach=detach_command))
        self._outbox.put_nowait(None)  # ends the command stream (it may await forever)
        error = _status_error(grpc.StatusCode.UNAVAILABLE, why)
        for stream in streams.values():  # each ends, and forgets itself (a no-op now)
            stream.put(error)

    async def close(self) -> None:
        """End the call as the router stops: its commands first (the worker aborts what
        is attached), then, if the worker has not ended it meanwhile, cancel it."""
        self._close("the router is stopping", detach=True)
        try:
            await asyncio.wait_for(asyncio.shield(self._reader), SHUTDOWN_GRACE_S)
        except (TimeoutError, asyncio.CancelledError, grpc.aio.AioRpcError):
            pass
        self._call.cancel()
        try:
            await self._reader
        except asyncio.CancelledError:
            pass


class DecodeRelays:
    """The router's Relay call to each decode worker, opened on first use, reopened if it broke."""

    def __init__(
        self,
        channel_for,
        *,
        progress_timeout_s: float | None = DEFAULT_STREAM_PROGRESS_TIMEOUT_S,
    ):
        """`channel_for`: address -> grpc.aio.Channel. `progress_timeout_s`: how long a
        worker may send nothing while a request waits for its tokens (None: forever)."""
        if progress_timeout_s is not None and progress_timeout_s <= 0:
            raise ValueError(f"progress_timeout_s must be > 0, got {progress_timeout_s}")
        self._channel_for = channel_for
        self._progress_timeout_s = progress_timeout_s
        self._connections: dict[str, _RelayConnection] = {}

    def open(
        self, address: str, attach: decode_pb2.RelayAttach, timeout: float | None = None
    ) -> RelayStream:
        """Attach a request (a lease, or a colocated generation) to `address`'s call."""
        connection = self._connections.get(address)
        if connection is None or not connection.open:
            stub = decode_pb2_grpc.DecodeStub(self._channel_for(address))
            connection = self._connections[address] = _RelayConnection(
                stub, lambda closed: self._forget(address, closed), self._progress_timeout_s
            )
        return connection.attach(attach, timeout)

    @property
    def num_streams(self) -> int:
        """Requests attached to the calls now; safe to read from another thread (metrics)."""
        # list() copies the dict's values in one step: the loop may change it meanwhile
        return sum(connection.num_streams for connection in list(self._connections.values()))

    def _forget(self, address: str, closed: _RelayConnection) -> None:
        # Workers come and go (pods move): drop a broken call, unless already replaced.
        if self._connections.get(address) is closed:
            del self._connections[address]

    async def close(self) -> None:
        for connection in list(self._connections.values()):
            await connection.close()
        self._connections.clear()


def _status_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a call of its own would have raised (no metadata: no rich details)."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)
