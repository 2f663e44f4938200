"""KV blocks from a prefill worker to a decode worker: KVTransfer.PushKV, both ends.

The prefill side's ``KVPusher`` owns one channel per stream (one TCP connection each)
and, per request, opens one PushKV stream on each. Layers are queued to the streams as
they are produced, so the first layer is on the wire while later ones are still
computing. The decode side's servicer hands its request iterator to ``receive_push``.

Choices, measured by ``bench/kv_transfer_bench.py`` (docs/benchmarks/kv-transfer.md):
- Messages are built by ``codec`` (header by protobuf, payload joined once) and read
  back as memoryviews: protobuf's own path copies each payload three more times.
- A layer chunk that fits one message is sent whole with the checksum the engine
  computed; only split chunks get a crc32 per piece on the sending side.
- The client is grpc.aio on a loop of the pusher's own: it took less CPU than the
  sync stubs, whose request-consumer thread per stream wakes for every message.
- The receiver verifies every crc32 (``KVChecksumError``) before ``on_chunk`` sees a
  chunk, so a corrupt chunk is a DATA_LOSS at the edge whatever on_chunk does.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import grpc

from pdserve.api.v1 import kv_transfer_pb2
from pdserve.core.errors import InvalidRequestError, KVChecksumError
from pdserve.core.kv_chunk import KVLayerChunk, crc32
from pdserve.kv.codec import (
    HEADER_ALLOWANCE_BYTES,
    ReceivedChunk,
    decode_message,
    from_proto,
    split_messages,
)

# From the benchmark's sweep (docs/benchmarks/kv-transfer.md): one stream did as well as two and
# better than four on 2 cores, where every extra stream is CPU the transfer lacks; and
# whole 2 MiB layers beat splitting them into 1 MiB or 512 KiB messages.
DEFAULT_NUM_STREAMS = 1
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # payload bytes per KVChunk
# Encoded messages waiting per stream: enough to keep the stream busy, few enough that
# a producer faster than the network does not hold a second copy of a prompt's KV.
MESSAGES_QUEUED_PER_STREAM = 2

_SERVICE = kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"]
PUSH_KV_METHOD = f"/{_SERVICE.full_name}/PushKV"
_END = object()  # closes a stream's queue
# A chunk's shape: K and V, its blocks, then a block's (engine/kv_cache.py's layout).
KV_CHUNK_DIMENSIONS = ("kv", "block", "slot", "head", "dim")
PUSHER_THREAD = "kv-pusher"  # the name of each pusher's thread

OnChunk = Callable[[str, int, KVLayerChunk], None]
# (target, options) -> a grpc.aio channel; made on the pusher's own loop
ChannelFactory = Callable[[str, Sequence[tuple]], grpc.aio.Channel]


def _insecure_channel(target: str, options: Sequence[tuple]) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(target, options=list(options))


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """gRPC options for KVTransfer clients and servers carrying ``max_message_bytes`` payloads.

    Only the message size limits: the HTTP/2 frame size, stream lookahead, BDP
    probing and TCP read chunk sizes made no difference above the run-to-run noise.
    """
    limit = max_message_bytes + HEADER_ALLOWANCE_BYTES
    return [
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", limit),
    ]


@dataclass(frozen=True, slots=True)
class PushTotals:
    """What the receiver counted for one push: KVChunk messages and payload bytes; and
    the seconds from the first message sent to the receiver's answer."""

    chunks: int
    bytes: int
    seconds: float = 0.0


class KVPushError(Exception):
    """A push failed; ``code`` and ``details`` are the gRPC status of the failed stream."""

    def __init__(self, lease_id: str, code: grpc.StatusCode, details: str | None):
        super().__init__(f"PushKV of lease {lease_id!r} failed: {code.name}: {details}")
        self.lease_id, self.code, self.details = lease_id, code, details


class KVPusher:
    """Client side of PushKV: pushes layer chunks over ``num_streams`` parallel streams.

    grpc.aio runs on an event loop of the pusher's own, in a thread it owns, so ``push``
    is a blocking call for plain threads (not for a coroutine). Channels are created
    once and reused by every push; ``close()`` ends them. ``push`` is thread-safe.
    """

    def __init__(
        self,
        target: str,
        *,
        num_streams: int = DEFAULT_NUM_STREAMS,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        open_channel: ChannelFactory | None = None,
    ):
        if num_streams < 1:
            raise ValueError(f"num_streams must be at least 1, got {num_streams}")
        if max_message_bytes < 1:
            raise ValueError(f"max_message_bytes must be positive, got {max_message_bytes}")
        self.target, self.num_streams = target, num_streams
        self.max_message_bytes = max_message_bytes
        # how each stream's channel is made: plaintext, or mTLS (`rpc.tls.ChannelTls`)
        self._open_channel = open_channel or _insecure_channel
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=PUSHER_THREAD, daemon=True
        )
        self._thread.start()
        self._channels = self._call(self._open_channels())

    def push(
        self,
        lease_id: str,
        chunks: Iterable[tuple[int, KVLayerChunk]],
        *,
        timeout: float | None = None,
        metadata: Sequence[tuple[str, str]] = (),
    ) -> PushTotals:
        """Send ``(first_block, chunk)`` pairs into ``lease_id``; return the receiver's totals.

        ``metadata`` goes with each PushKV call: the caller's trace context, taken on the
        caller's thread (the calls run on the pusher's loop, whose context is its own).

        ``chunks`` may block between items (layers still computing): each message is on
        its stream as soon as it is made. Messages go round-robin over the streams.
        Raises ``KVPushError`` with the status of the first stream that failed, after
        cancelling the others; an exception from ``chunks`` cancels all and propagates.
        """
        push = _Push(lease_id, self._loop, self._channels, timeout, metadata)
        try:
            self._feed(push, chunks)
        except BaseException:
            push.cancel()
            raise
        finally:
            push.close()
        return push.result()

    def _feed(self, push: _Push, chunks: Iterable[tuple[int, KVLayerChunk]]) -> None:
        for first_block, chunk in chunks:
            for message in split_messages(
                push.lease_id, first_block, chunk, self.max_message_bytes
            ):
                if not push.send(message):
                    return  # a stream failed; push.result() raises its status

    def close(self) -> None:
        self._call(self._close_channels())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> KVPusher:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    async def _open_channels(self) -> list[grpc.aio.Channel]:
        # A local subchannel pool gives each channel its own TCP connection; with the
        # global pool, channels to one target with equal options share one.
        options = [*channel_options(self.max_message_bytes), ("grpc.use_local_subchannel_pool", 1)]
        return [self._open_channel(self.target, options) for _ in range(self.num_streams)]

    async def _close_channels(self) -> None:
        for channel in self._channels:
            await channel.close()


class _Push:
    """One push: a PushKV call per channel on the pusher's loop, fed from the caller's thread."""

    def __init__(self, lease_id: str, loop, channels, timeout: float | None, metadata=()):
        self.lease_id, self._loop = lease_id, loop
        self._queues = [asyncio.Queue() for _ in channels]
        self._num_sent = 0
        self._first_sent_at = 0.0  # time.monotonic(); 0.0: nothing sent yet
        self._slots = threading.Semaphore(MESSAGES_QUEUED_PER_STREAM * len(channels))
        self._failed = False  # set on the loop, read by the caller: a plain flag will do
        calls = self._run(channels, timeout, tuple(metadata) or None)
        self._future = asyncio.run_coroutine_threadsafe(calls, loop)

    def send(self, message: bytes) -> bool:
        """Queue a message on the next stream (blocking while they are full).

        Returns False, sending nothing, once a stream has failed.
        """
        self._slots.acquire()
        if self._failed:
            return False
        if not self._num_sent:  # a push's transfer starts with its first layer, not before
            self._first_sent_at = time.monotonic()
        queue = self._queues[self._num_sent % len(self._queues)]
        self._num_sent += 1
        self._loop.call_soon_threadsafe(queue.put_nowait, message)
        return True

    def close(self) -> None:
        for queue in self._queues:
            self._loop.call_soon_threadsafe(queue.put_nowait, _END)

    def cancel(self) -> None:
        self._future.cancel()

    def result(self) -> PushTotals:
        try:
            return self._future.result()
        except grpc.aio.AioRpcError as error:
            raise KVPushError(self.lease_id, error.code(), error.details()) from None

    async def _run(self, channels, timeout: float | None, metadata) -> PushTotals:
        calls = [
            channel.stream_unary(PUSH_KV_METHOD, response_deserializer=_parse_result)(
                timeout=timeout, metadata=metadata
            )
            for channel in channels
        ]
        tasks = [
            asyncio.create_task(self._stream(call, queue))
            for call, queue in zip(calls, self._queues, strict=True)
        ]
        try:
            # The first stream to fail raises here, with its own status.
            results = await asyncio.gather(*tasks)
        finally:  # no-ops after success; after a failure they stop the other streams
            for task in tasks:
                task.cancel()
            for call in calls:
                call.cancel()
        seconds = time.monotonic() - self._first_sent_at if self._first_sent_at else 0.0
        return PushTotals(sum(r.chunks for r in results), sum(r.bytes for r in results), seconds)

    async def _stream(self, call, queue: asyncio.Queue) -> kv_transfer_pb2.PushKVResult:
        try:
            try:
                while (message := await queue.get()) is not _END:
                    await call.write(message)
                    self._slots.release()
                await call.done_writing()
            except Exception:  # noqa: BLE001
                # Writing to a call that has ended raises InvalidStateError or one of
                # grpc.aio's internal errors (messages are bytes, so nothing else can
                # fail here); awaiting the call raises its status, which says why.
                pass
            return await call
        except BaseException:
            self._failed = True
            self._slots.release()  # the sender, if it waits for a slot, sees the failure
            raise


def _parse_result(buffer: bytes) -> kv_transfer_pb2.PushKVResult:
    return kv_transfer_pb2.PushKVResult.FromString(buffer)


async def receive_push(request_iterator, on_chunk: OnChunk) -> kv_transfer_pb2.PushKVResult:
    """Consume one PushKV stream on a grpc.aio server: verify each chunk, pass it on.

    Requests are ``ReceivedChunk`` (servicers registered with ``add_kv_transfer_servicer``:
    no copies) or ``KVChunk`` protos (the generated registration), or the exception that
    parsing a message gave (it fails the push like a bad chunk). ``on_chunk(lease_id,
    first_block, chunk)`` runs on the event loop for each message in order, after its
    crc32 matched. An exception from it, or ``KVChecksumError``, ends the push: it
    propagates to the servicer, whose error mapping turns it into a status.

    The status is raised only once the sender has half-closed; until then the rest of
    the stream is read and dropped. Ending the call earlier races the sender's next
    write, and grpc.aio reports a write into an ended call as INTERNAL "Internal error
    from Core" in place of the status we sent. What draining costs is the rest of one
    prompt's KV on the wire, which the prefill worker computes for its first token anyway.
    """
    num_chunks = num_bytes = 0
    failure: Exception | None = None
    async for request in request_iterator:
        if failure is not None:
            continue
        if isinstance(request, Exception):  # a message that did not parse: why not
            failure = request
            continue
        lease_id, first_block, chunk = (
            request if isinstance(request, ReceivedChunk) else from_proto(request)
        )
        try:
            # Inline: on_chunk (the cache import) runs on the loop anyway, and handing the
            # crc to an executor thread cost more CPU than it saved on the 2-core benchmark.
            _check_header(chunk)
            if crc32(chunk.data) != chunk.checksum:
                raise KVChecksumError(
                    f"KV chunk of lease {lease_id!r}, layer {chunk.layer}, first block "
                    f"{first_block} fails its crc32"
                )
            on_chunk(lease_id, first_block, chunk)
        except Exception as exc:  # noqa: BLE001 - raised below, after the sender is done
            failure = exc
            continue
        num_chunks += 1
        num_bytes += len(chunk.data)
    if failure is not None:
        raise failure
    return kv_transfer_pb2.PushKVResult(chunks=num_chunks, bytes=num_bytes)


def _check_header(chunk: KVLayerChunk) -> None:
    """What every later check takes for granted: a shape of the cache's five dimensions.

    The receiver compares the rest with its own cache (engine/kv_cache.py)."""
    if len(chunk.shape) != len(KV_CHUNK_DIMENSIONS):
        raise InvalidRequestError(
            "kv_chunk.shape",
            f"has {len(chunk.shape)} dimensions, expected {len(KV_CHUNK_DIMENSIONS)} "
            f"[{', '.join(KV_CHUNK_DIMENSIONS)}]",
        )


# KVTransfer's requests parsed without copying their payloads (`add_servicer`'s option):
# the servicer's PushKV then receives ``ReceivedChunk`` items, whose payloads are views of
# the received messages, instead of parsed ``KVChunk`` protos.
ZERO_COPY_PARSERS = {"PushKV": decode_message}


# glibc hands freed blocks of 128 KiB and more straight back to the kernel, so a process
# that sends or receives multi-MiB messages page-faults every byte of every message
# into fresh zeroed pages: about a third of the receiver's CPU time in the benchmark.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameter numbers (malloc.h)
_MMAP_THRESHOLD_BYTES = 32 << 20  # the largest glibc accepts
_TRIM_THRESHOLD_BYTES = 1 << 30


def keep_freed_memory() -> bool:
    """Make glibc reuse freed message buffers instead of unmapping them; process-wide.

    Allocations under 32 MiB come from the heap, and up to 1 GiB of freed heap stays
    mapped for reuse. Call once at start-up in processes that send or receive KV.
    Returns False, changing nothing, where the C library is not glibc.
    """
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
        and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES)
    )
