"""KVChunk on the wire without protobuf copying the payload.

A KVChunk is a few header fields and one large ``data`` field. Through protobuf the
payload is copied when the message is built and again when it is serialized, then
when it is parsed and again when the field is read. Here protobuf still writes and
parses the header, but ``data`` is appended after it as field 6 (protobuf accepts
fields in any order, so any KVChunk parser reads these messages) and read back as a
memoryview into the received buffer: one copy to encode (header and payload joined
into the bytes gRPC sends), none to decode.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

from pdserve.api.v1 import kv_transfer_pb2
from pdserve.core.kv_chunk import KVLayerChunk, crc32

_DATA_FIELD = kv_transfer_pb2.KVChunk.DESCRIPTOR.fields_by_name["data"].number
_WIRE_VARINT, _WIRE_I64, _WIRE_LEN, _WIRE_I32 = 0, 1, 2, 5
_DATA_TAG = bytes([_DATA_FIELD << 3 | _WIRE_LEN])
# Room for the header fields on top of the payload: a lease id, a dtype name and a
# five-int shape take well under 1 KiB.
HEADER_ALLOWANCE_BYTES = 64 * 1024


class ReceivedChunk(NamedTuple):
    lease_id: str
    first_block: int  # index into the lease's blocks
    chunk: KVLayerChunk  # chunk.data is a read-only memoryview into the message


def encode_varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_message(
    lease_id: str,
    first_block: int,
    chunk: KVLayerChunk,
    parts: Sequence[bytes | memoryview] | None = None,
) -> bytes:
    """The KVChunk for ``chunk`` as bytes.

    ``parts``, if given, are the payload in pieces, joined in place of ``chunk.data``
    (a split chunk's K and V block ranges, copied once, here).
    """
    parts = (chunk.data,) if parts is None else parts
    header = kv_transfer_pb2.KVChunk(
        lease_id=lease_id,
        layer=chunk.layer,
        first_block=first_block,
        dtype=chunk.dtype,
        shape=chunk.shape,
        crc32=chunk.checksum,
    ).SerializeToString()
    size = sum(len(part) for part in parts)
    return b"".join((header, _DATA_TAG, encode_varint(size), *parts))


def split_messages(
    lease_id: str, first_block: int, chunk: KVLayerChunk, max_data_bytes: int
) -> Iterator[bytes]:
    """Encoded KVChunks covering ``chunk``, each with at most ``max_data_bytes`` of data.

    Pieces split the block dimension, so each is a
    valid chunk of its own: its first block, its num_blocks in the shape, and the
    crc32 of its own bytes. A chunk that fits is sent whole with its own checksum,
    so the common case computes no crc here.
    """
    if len(chunk.data) <= max_data_bytes:
        yield encode_message(lease_id, first_block, chunk)
        return
    # data is [2 (K, V), num_blocks, block bytes...]: a block range is one slice of K
    # and one of V.
    num_blocks = chunk.num_blocks
    block_bytes = len(chunk.data) // (2 * num_blocks)
    blocks_per_message = max_data_bytes // (2 * block_bytes)
    if blocks_per_message < 1:
        raise ValueError(
            f"max_data_bytes={max_data_bytes} is less than one block of K and V "
            f"({2 * block_bytes} bytes)"
        )
    data, v_start = memoryview(chunk.data), num_blocks * block_bytes
    for start in range(0, num_blocks, blocks_per_message):
        stop = min(start + blocks_per_message, num_blocks)
        k = data[start * block_bytes : stop * block_bytes]
        v = data[v_start + start * block_bytes : v_start + stop * block_bytes]
        piece = KVLayerChunk(
            chunk.layer,
            chunk.dtype,
            (2, stop - start, *chunk.shape[2:]),
            b"",
            crc32(v, crc32(k)),
        )
        yield encode_message(lease_id, first_block + start, piece, (k, v))


def decode_message(buffer: bytes) -> ReceivedChunk:
    """Parse a serialized KVChunk; ``data`` stays a view of ``buffer``."""
    view = memoryview(buffer)
    span = _find_data_field(view)
    if span is None:  # no payload, or one written twice (the last one counts): let protobuf do it
        return from_proto(kv_transfer_pb2.KVChunk.FromString(buffer))
    tag_start, data_start, data_end = span
    header = kv_transfer_pb2.KVChunk.FromString(bytes(view[:tag_start]) + bytes(view[data_end:]))
    chunk = KVLayerChunk(
        header.layer, header.dtype, tuple(header.shape), view[data_start:data_end], header.crc32
    )
    return ReceivedChunk(header.lease_id, header.first_block, chunk)


def from_proto(message: kv_transfer_pb2.KVChunk) -> ReceivedChunk:
    chunk = KVLayerChunk(
        message.layer, message.dtype, tuple(message.shape), message.data, message.crc32
    )
    return ReceivedChunk(message.lease_id, message.first_block, chunk)


def _find_data_field(view: memoryview) -> tuple[int, int, int] | None:
    """(tag start, payload start, payload end) of the one data field, or None.

    Walks the top-level fields without looking inside them; a malformed buffer also
    gives None, and protobuf then reports it.
    """
    found, position, size = None, 0, len(view)
    try:
        while position < size:
            tag_start = position
            tag, position = _read_varint(view, position)
            wire_type = tag & 7
            if wire_type == _WIRE_VARINT:
                _, position = _read_varint(view, position)
            elif wire_type == _WIRE_LEN:
                length, position = _read_varint(view, position)
                if tag >> 3 == _DATA_FIELD:
                    if found is not None:
                        return None
                    found = (tag_start, position, position + length)
                position += length
            elif wire_type in (_WIRE_I64, _WIRE_I32):
                position += 8 if wire_type == _WIRE_I64 else 4
            else:
                return None
    except IndexError:
        return None
    return found if position == size else None


def _read_varint(view: memoryview, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = view[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7
