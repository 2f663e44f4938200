"""KV blocks from a prefill worker to a decode worker: KVTransfer.PushKV, both ends.

The prefill side's ``KVPusher`` owns a few channels (one TCP connection each) and,
per request, opens one PushKV stream on each. Layers are queued to the streams as
they are produced, so the first layer is on the wire while later ones are still
computing. The decode side's servicer hands its request iterator to ``receive_push``.

Choices, measured by ``bench/kv_transfer_bench.py`` (numbers in docs/benchmarks.md):
- Sync gRPC with one feeding thread per stream beats grpc.aio on the client: the
  caller is a plain thread, and the aio loop adds a hop per message.
- Messages are built by ``codec`` (header by protobuf, payload joined once) and read
  back as memoryviews: protobuf's own path copies each payload three times.
- A layer chunk that fits one message is sent whole with the checksum the engine
  computed; only split chunks get a crc32 per piece on the sending side.
- The receiver verifies every crc32 (``KVChecksumError``) before ``on_chunk`` sees
  the chunk; ``KVCache.import_layer`` checks again, which is cheap next to the copy.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc

from pdserve.api.v1 import kv_transfer_pb2
from pdserve.engine.kv_cache import KVLayerChunk
from pdserve.kv.codec import (
    HEADER_ALLOWANCE_BYTES,
    ReceivedChunk,
    crc32,
    decode_message,
    from_proto,
    split_messages,
)

DEFAULT_NUM_STREAMS = 2
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # payload bytes per KVChunk

_SERVICE = kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"]
PUSH_KV_METHOD = f"/{_SERVICE.full_name}/PushKV"
import json
import os

_EXPERIMENT_OPTIONS = [tuple(x) for x in json.loads(os.environ.get("KVOPTS", "[]"))]
_END = object()  # closes a stream's queue

OnChunk = Callable[[str, int, KVLayerChunk], None]


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """gRPC options for KVTransfer clients and servers carrying ``max_message_bytes`` payloads."""
    limit = max_message_bytes + HEADER_ALLOWANCE_BYTES
    return [
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", limit),
    ] + _EXPERIMENT_OPTIONS


@dataclass(frozen=True, slots=True)
class PushTotals:
    """What the receiver counted for one push: KVChunk messages and payload bytes."""

    chunks: int
    bytes: int


class KVPushError(Exception):
    """A PushKV stream failed; ``code`` and ``details`` are its gRPC status."""

    def __init__(self, code: grpc.StatusCode, details: str | None):
        super().__init__(f"PushKV failed: {code.name}: {details}")
        self.code = code
        self.details = details


class KVChecksumError(ValueError):
    """A received KV chunk's bytes do not match its crc32."""

    def __init__(self, lease_id: str, layer: int, first_block: int):
        super().__init__(
            f"KV chunk of lease {lease_id!r}, layer {layer}, first block {first_block} "
            "fails its crc32"
        )
        self.lease_id, self.layer, self.first_block = lease_id, layer, first_block


class KVPusher:
    """Client side of PushKV: pushes layer chunks over ``num_streams`` parallel streams.

    Channels are created once and reused by every push; call ``close()`` when done.
    ``push`` is blocking and thread-safe (several requests may push at once).
    """

    def __init__(
        self,
        target: str,
        *,
        num_streams: int = DEFAULT_NUM_STREAMS,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ):
        if num_streams < 1:
            raise ValueError(f"num_streams must be at least 1, got {num_streams}")
        if max_message_bytes < 1:
            raise ValueError(f"max_message_bytes must be positive, got {max_message_bytes}")
        self.num_streams, self.max_message_bytes = num_streams, max_message_bytes
        # A local subchannel pool gives each channel its own TCP connection; with the
        # global pool, channels to one target with equal options share one.
        options = [*channel_options(max_message_bytes), ("grpc.use_local_subchannel_pool", 1)]
        self._channels = [grpc.insecure_channel(target, options) for _ in range(num_streams)]
        # Messages arrive already encoded by the codec, so no serializer.
        self._push_kv = [
            channel.stream_unary(PUSH_KV_METHOD, response_deserializer=_parse_result)
            for channel in self._channels
        ]

    def push(
        self,
        lease_id: str,
        chunks: Iterable[tuple[int, KVLayerChunk]],
        *,
        timeout: float | None = None,
    ) -> PushTotals:
        """Send ``(first_block, chunk)`` pairs into ``lease_id``; return the receiver's totals.

        ``chunks`` may block between items (layers still computing): each message is on
        its stream as soon as it is made. Messages go round-robin over the streams.
        Raises ``KVPushError`` with the status of the first stream that failed, after
        cancelling the others; an exception from ``chunks`` cancels all and propagates.
        """
        failed = threading.Event()
        streams = [_Stream(push_kv, timeout, failed) for push_kv in self._push_kv]
        try:
            self._feed(lease_id, chunks, streams, failed)
        except BaseException:
            for stream in streams:
                stream.future.cancel()
            raise
        finally:
            for stream in streams:
                stream.close()
        return _collect(streams)

    def _feed(self, lease_id, chunks, streams: list[_Stream], failed: threading.Event) -> None:
        num_messages = 0
        for first_block, chunk in chunks:
            for _, message in split_messages(lease_id, first_block, chunk, self.max_message_bytes):
                if failed.is_set():
                    return  # _collect reports the failure
                streams[num_messages % len(streams)].send(message)
                num_messages += 1

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> KVPusher:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class _Stream:
    """One PushKV call, fed from a queue by gRPC's own request-consumer thread."""

    def __init__(self, push_kv: grpc.StreamUnaryMultiCallable, timeout, failed: threading.Event):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.future = push_kv.future(iter(self._queue.get, _END), timeout=timeout)
        self.future.add_done_callback(
            lambda future: future.code() != grpc.StatusCode.OK and failed.set()
        )

    def send(self, message: bytes) -> None:
        self._queue.put(message)

    def close(self) -> None:
        self._queue.put(_END)


def _collect(streams: list[_Stream]) -> PushTotals:
    try:
        results = [stream.future.result() for stream in streams]
    except grpc.RpcError:
        for stream in streams:
            stream.future.cancel()
        # Streams we cancelled report CANCELLED; the cause is the one that did not.
        failures = [s.future for s in streams if s.future.code() != grpc.StatusCode.OK]
        cause = next((f for f in failures if f.code() != grpc.StatusCode.CANCELLED), failures[0])
        raise KVPushError(cause.code(), cause.details()) from None
    return PushTotals(sum(r.chunks for r in results), sum(r.bytes for r in results))


def _parse_result(buffer: bytes) -> kv_transfer_pb2.PushKVResult:
    return kv_transfer_pb2.PushKVResult.FromString(buffer)


async def receive_push(request_iterator, on_chunk: OnChunk) -> kv_transfer_pb2.PushKVResult:
    """Consume one PushKV stream on a grpc.aio server: verify each chunk, pass it on.

    Requests are ``ReceivedChunk`` (servicers registered with ``add_kv_transfer_servicer``,
    zero-copy) or ``KVChunk`` protos (the generated registration). ``on_chunk(lease_id,
    first_block, chunk)`` runs for each message in order, after its crc32 matched; an
    exception from it, or ``KVChecksumError``, ends the stream with that exception for
    the servicer's error mapping to turn into a status.
    """
    num_chunks = num_bytes = 0
    async for request in request_iterator:
        lease_id, first_block, chunk = (
            request if isinstance(request, ReceivedChunk) else from_proto(request)
        )
        if crc32(chunk.data) != chunk.checksum:
            raise KVChecksumError(lease_id, chunk.layer, first_block)
        on_chunk(lease_id, first_block, chunk)
        num_chunks += 1
        num_bytes += len(chunk.data)
    return kv_transfer_pb2.PushKVResult(chunks=num_chunks, bytes=num_bytes)


def add_kv_transfer_servicer(servicer, server) -> None:
    """Register a KVTransfer servicer like the generated function, with PushKV zero-copy.

    The servicer's PushKV receives ``ReceivedChunk`` items (payloads are views of the
    received messages) instead of parsed ``KVChunk`` protos.
    """
    pb = kv_transfer_pb2
    handlers = {
        "Handshake": grpc.unary_unary_rpc_method_handler(
            servicer.Handshake, pb.HandshakeRequest.FromString,
            pb.HandshakeResponse.SerializeToString,
        ),
        "PushKV": grpc.stream_unary_rpc_method_handler(
            servicer.PushKV, decode_message, pb.PushKVResult.SerializeToString
        ),
        "CommitKV": grpc.unary_unary_rpc_method_handler(
            servicer.CommitKV, pb.CommitKVRequest.FromString,
            pb.CommitKVResponse.SerializeToString,
        ),
    }  # fmt: skip
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(_SERVICE.full_name, handlers),)
    )
    server.add_registered_method_handlers(_SERVICE.full_name, handlers)


# glibc returns freed blocks of 128 KiB or more to the kernel at once, and a process
# that receives (or sends) 4 MiB messages then page-faults every byte of every message
# into fresh zeroed memory: about a third of the receiver's CPU time in the benchmark.
_MALLOC_TRIM_THRESHOLD, _MALLOC_MMAP_THRESHOLD = -1, -3  # mallopt parameter numbers
_MALLOC_KEEP_BYTES = 1 << 30
_MALLOC_MMAP_BYTES = 32 << 20  # glibc's largest allowed threshold


def keep_freed_memory() -> bool:
    """Ask glibc to reuse freed message buffers instead of unmapping them; process-wide.

    Call once at start-up in processes that send or receive KV. Returns False where
    the C library is not glibc (nothing changed).
    """
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(
        libc.mallopt(_MALLOC_MMAP_THRESHOLD, _MALLOC_MMAP_BYTES)
        and libc.mallopt(_MALLOC_TRIM_THRESHOLD, _MALLOC_KEEP_BYTES)
    )
