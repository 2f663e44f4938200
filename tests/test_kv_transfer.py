"""PushKV end to end: a KVPusher against a real grpc.aio server on loopback using receive_push."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc
import numpy as np
import pytest

from pdserve.api.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from pdserve.core import kv_chunk as checksum
from pdserve.core.errors import KVChecksumError
from pdserve.core.kv_chunk import KVLayerChunk
from pdserve.engine import kv_cache
from pdserve.kv import codec, transfer
from pdserve.kv.codec import decode_message, encode_message, split_messages
from pdserve.kv.transfer import (
    ZERO_COPY_PARSERS,
    KVPusher,
    KVPushError,
    channel_options,
    receive_push,
)
from pdserve.rpc.registration import add_servicer

_KV_SERVICE = kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"]
BLOCK_SHAPE = (4, 2, 8)  # block_size, kv_heads, head_dim
BLOCK_BYTES = 4 * int(np.prod(BLOCK_SHAPE))  # float32
KV_BLOCK_BYTES = 2 * BLOCK_BYTES  # one block of K and V
WAIT_S = 10


def make_layer(layer: int, num_blocks: int) -> KVLayerChunk:
    """A layer chunk whose every float says where it came from, so mix-ups show."""
    values = np.arange(2 * num_blocks * int(np.prod(BLOCK_SHAPE)), dtype=np.float32)
    data = (values + 1000 * layer).tobytes()
    return KVLayerChunk(layer, "float32", (2, num_blocks, *BLOCK_SHAPE), data, zlib.crc32(data))


def block_range(chunk: KVLayerChunk, start: int, stop: int) -> bytes:
    """Blocks [start, stop) of a chunk, K then V, as they appear in a split message."""
    v = chunk.num_blocks * BLOCK_BYTES
    return (
        chunk.data[start * BLOCK_BYTES : stop * BLOCK_BYTES]
        + chunk.data[v + start * BLOCK_BYTES : v + stop * BLOCK_BYTES]
    )


class UnknownLeaseError(KeyError):
    pass


# The servicer's one place that turns domain errors into status codes.
STATUS_OF = {
    KVChecksumError: grpc.StatusCode.DATA_LOSS,
    UnknownLeaseError: grpc.StatusCode.NOT_FOUND,
}


class Servicer(kv_transfer_pb2_grpc.KVTransferServicer):
    def __init__(self, on_chunk: Callable[[str, int, KVLayerChunk], None]):
        self.on_chunk = on_chunk
        self.messages_per_stream: list[int] = []

    async def PushKV(self, request_iterator, context):  # noqa: N802 (gRPC's method name)
        try:
            result = await receive_push(request_iterator, self.on_chunk)
        except tuple(STATUS_OF) as error:
            await context.abort(STATUS_OF[type(error)], str(error))
        self.messages_per_stream.append(result.chunks)
        return result


class Recorder:
    def __init__(self) -> None:
        self.chunks: list[tuple[str, int, KVLayerChunk]] = []
        self.first_arrived = threading.Event()

    def __call__(self, lease_id: str, first_block: int, chunk: KVLayerChunk) -> None:
        self.chunks.append((lease_id, first_block, chunk))
        self.first_arrived.set()


def zero_copy(servicer, server) -> None:
    """KVTransfer on the one registration path, with PushKV's zero-copy parser."""
    add_servicer(servicer, _KV_SERVICE, server, parsers=ZERO_COPY_PARSERS)


@contextmanager
def running_server(servicer: Servicer, register=zero_copy) -> Iterator[str]:
    """A grpc.aio server on a free loopback port, in its own thread's event loop."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        server = grpc.aio.server(options=channel_options())
        register(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(WAIT_S)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(grace=None), loop).result(WAIT_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(WAIT_S)
        loop.close()


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def servicer(recorder) -> Servicer:
    return Servicer(recorder)


@pytest.fixture
def target(servicer) -> Iterator[str]:
    with running_server(servicer) as address:
        yield address


@pytest.mark.parametrize(
    "register",
    [zero_copy, kv_transfer_pb2_grpc.add_KVTransferServicer_to_server],
    ids=["zero-copy", "generated"],
)
def test_split_chunks_arrive_byte_identical_at_their_blocks(recorder, register):
    layers = [make_layer(layer, num_blocks=5) for layer in range(3)]
    with (
        running_server(Servicer(recorder), register) as address,
        KVPusher(address, num_streams=2, max_message_bytes=2 * KV_BLOCK_BYTES) as pusher,
    ):
        totals = pusher.push("lease-a", ((7, layer) for layer in layers))

    assert (totals.chunks, totals.bytes) == (9, sum(len(layer.data) for layer in layers))
    assert totals.seconds > 0  # first message sent to the receiver's answer
    received = sorted((c.layer, first, c) for lease, first, c in recorder.chunks)
    expected = [
        (layer.layer, 7 + start, start, min(start + 2, 5))
        for layer in layers
        for start in (0, 2, 4)
    ]
    assert [(layer, first) for layer, first, _ in received] == [e[:2] for e in expected]
    for (_, _, chunk), (layer, _, start, stop) in zip(received, expected, strict=True):
        assert chunk.shape == (2, stop - start, *BLOCK_SHAPE)
        assert bytes(chunk.data) == block_range(layers[layer], start, stop)
        assert chunk.checksum == zlib.crc32(chunk.data)
    assert {lease for lease, _, _ in recorder.chunks} == {"lease-a"}


def test_no_message_exceeds_max_message_bytes(recorder, target):
    max_message_bytes = 3 * KV_BLOCK_BYTES + 100  # not a whole number of blocks
    with KVPusher(target, max_message_bytes=max_message_bytes) as pusher:
        pusher.push("lease-b", [(0, make_layer(0, num_blocks=10))])
    sizes = sorted((len(chunk.data) for _, _, chunk in recorder.chunks), reverse=True)
    assert sizes == [3 * KV_BLOCK_BYTES] * 3 + [KV_BLOCK_BYTES]


def test_a_chunk_that_fits_travels_whole_with_its_own_checksum(recorder, target):
    layer = make_layer(2, num_blocks=4)
    with KVPusher(target, max_message_bytes=len(layer.data)) as pusher:
        pusher.push("lease-c", [(3, layer)])
    [(lease, first_block, chunk)] = recorder.chunks
    assert (lease, first_block, chunk.shape, chunk.checksum) == (
        "lease-c",
        3,
        layer.shape,
        layer.checksum,
    )
    assert bytes(chunk.data) == layer.data


def test_messages_are_spread_over_the_streams(servicer, target):
    with KVPusher(target, num_streams=3) as pusher:
        pusher.push("lease-d", [(0, make_layer(layer, num_blocks=2)) for layer in range(6)])
    assert sorted(servicer.messages_per_stream) == [2, 2, 2]


def test_a_corrupt_chunk_is_rejected_before_on_chunk(recorder, target):
    layer = make_layer(0, num_blocks=2)
    corrupt = dataclasses.replace(layer, checksum=layer.checksum ^ 1)
    with KVPusher(target) as pusher, pytest.raises(KVPushError) as raised:
        pusher.push("lease-e", [(0, corrupt)])
    assert raised.value.code == grpc.StatusCode.DATA_LOSS
    assert "crc32" in raised.value.details
    assert recorder.chunks == []


def test_an_error_from_on_chunk_ends_the_push_with_its_status():
    def reject(lease_id: str, first_block: int, chunk: KVLayerChunk) -> None:
        raise UnknownLeaseError(f"no lease {lease_id!r}")

    # Many layers after the rejected first one: the pusher is still writing when the
    # receiver fails, which is when a status can get lost (receive_push's docstring).
    with running_server(Servicer(reject)) as address, KVPusher(address, num_streams=2) as pusher:
        for attempt in range(5):
            with pytest.raises(KVPushError) as raised:
                layers = [(0, make_layer(layer % 4, num_blocks=2)) for layer in range(32)]
                pusher.push(f"gone-{attempt}", layers)
            assert raised.value.code == grpc.StatusCode.NOT_FOUND
            assert f"no lease 'gone-{attempt}'" in raised.value.details


def test_the_first_layer_is_delivered_while_later_ones_are_still_computing(recorder, target):
    arrived_before_next: list[bool] = []

    def layers_as_computed():
        for layer in range(3):
            yield 0, make_layer(layer, num_blocks=2)
            # The next layer "computes" until the first has reached the decode side.
            arrived_before_next.append(recorder.first_arrived.wait(WAIT_S))

    with KVPusher(target) as pusher:
        totals = pusher.push("lease-f", layers_as_computed())
    assert arrived_before_next == [True, True, True]
    assert totals.chunks == 3


def test_an_error_in_the_chunk_source_cancels_the_push_and_propagates(target):
    def failing_source():
        yield 0, make_layer(0, num_blocks=2)
        raise RuntimeError("model crashed")

    with KVPusher(target) as pusher:
        with pytest.raises(RuntimeError, match="model crashed"):
            pusher.push("lease-g", failing_source())
        # The pusher's channels are still good for the next request.
        assert pusher.push("lease-h", [(0, make_layer(0, num_blocks=1))]).chunks == 1


def test_a_dead_receiver_is_an_unavailable_push_error():
    with running_server(Servicer(Recorder())) as address:
        pass  # stopped: nothing listens on the port any more
    with KVPusher(address) as pusher, pytest.raises(KVPushError) as raised:
        pusher.push("lease-i", [(0, make_layer(0, num_blocks=1))], timeout=WAIT_S)
    assert raised.value.code == grpc.StatusCode.UNAVAILABLE


# -- the wire format, without a server ------------------------------------------------------


def test_codec_messages_are_plain_kvchunks_for_protobuf():
    layer = make_layer(5, num_blocks=3)
    parsed = kv_transfer_pb2.KVChunk.FromString(encode_message("lease", 11, layer))
    assert (parsed.lease_id, parsed.layer, parsed.first_block, parsed.dtype) == (
        "lease",
        5,
        11,
        "float32",
    )
    assert (tuple(parsed.shape), parsed.data, parsed.crc32) == (
        layer.shape,
        layer.data,
        layer.checksum,
    )


def test_codec_reads_kvchunks_serialized_by_protobuf():
    layer = make_layer(1, num_blocks=2)
    message = kv_transfer_pb2.KVChunk(
        lease_id="x",
        layer=1,
        first_block=4,
        dtype="float32",
        shape=layer.shape,
        data=layer.data,
        crc32=layer.checksum,
    ).SerializeToString()
    lease_id, first_block, chunk = decode_message(message)
    assert (lease_id, first_block, chunk.layer, chunk.shape, chunk.checksum) == (
        "x",
        4,
        1,
        layer.shape,
        layer.checksum,
    )
    assert bytes(chunk.data) == layer.data


def test_splitting_below_one_block_is_refused():
    layer = make_layer(0, num_blocks=2)
    with pytest.raises(ValueError, match="less than one block"):
        list(split_messages("lease", 0, layer, KV_BLOCK_BYTES - 1))


# -- the checksum -------------------------------------------------------------------------


def test_the_kv_checksum_gives_zlibs_crc32_values():
    # Chunks checksummed with zlib (a peer on an older release, these tests) must verify.
    data = np.random.default_rng(0).bytes(3 * 1024 * 1024 + 7)
    view = memoryview(data)[5:]
    assert checksum.crc32(data) == zlib.crc32(data)
    assert checksum.crc32(view) == zlib.crc32(view)
    assert checksum.crc32(view[1000:], checksum.crc32(view[:1000])) == zlib.crc32(view)
    assert checksum.crc32(b"") == zlib.crc32(b"") == 0


def test_engine_codec_and_receiver_use_the_one_checksum_function():
    assert kv_cache.crc32 is codec.crc32 is transfer.crc32 is checksum.crc32
