"""The readers' side of the request store: any router reads a record and its tokens.

What a reader resuming at a token offset gets, and how a lost range shows, is in the
docstring of `pdserve.state.requests`; `RequestStore`'s reader-side methods call these.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import redis.asyncio as aioredis

from pdserve.core.errors import CheckpointsLostError, UnknownRequestError
from pdserve.state.checkpoints import Cursor, Entry, Keys, redis_errors, stream_entries
from pdserve.state.record import RequestRecord

# follow() blocks in XREAD this long per call, then checks that the request still exists
FOLLOW_BLOCK_S = 0.25
# A running request whose record has not been written for this long has lost its router
# (the writer refreshes it every OWNER_REFRESH_S, 1 s, while it runs): three refreshes.
OWNER_LOST_S = 3.0


class OwnerLostError(Exception):
    """A followed request is still running, but its router stopped writing its record
    (dead): another router may take it over (`RequestStore`'s writer side, `adopt`)."""

    def __init__(self, record: RequestRecord):
        super().__init__(f"request {record.request_id}: router {record.router_id} is gone")
        self.record = record


def _check_offset(offset: int) -> None:
    if offset < 0:
        raise ValueError(f"resume_from must be >= 0, got {offset}")


class CheckpointReader:
    """Reads records and token checkpoints; `follow_redis` is the client for XREAD BLOCK
    (its socket timeout must outlast FOLLOW_BLOCK_S)."""

    def __init__(self, redis: aioredis.Redis, follow_redis: aioredis.Redis, keys: Keys):
        self._redis = redis
        self._follow_redis = follow_redis
        self._keys = keys

    async def get(self, request_id: str) -> RequestRecord | None:
        with redis_errors():
            data = await self._redis.get(self._keys.record(request_id))
        return None if data is None else RequestRecord.from_json(data)

    async def read_tokens(self, request_id: str, offset: int) -> tuple[list[int], str]:
        _check_offset(offset)
        _, entries = await self._snapshot(request_id)
        ids, texts, _ = Cursor(offset).take([entry for _, entry in entries])
        return ids, "".join(texts)

    async def follow(
        self, request_id: str, offset: int
    ) -> AsyncIterator[tuple[list[int], str, RequestRecord | None]]:
        _check_offset(offset)
        cursor = Cursor(offset)
        record, entries = await self._snapshot(request_id)
        last_id = entries[-1][0] if entries else b"0-0"
        ids, texts, ended = cursor.take([entry for _, entry in entries])
        while not ended:
            if ids or any(texts):
                yield ids, "".join(texts), None
            entries = await self._read_after(request_id, last_id)
            if not entries:
                await self._check_alive(request_id)
                ids, texts = [], []
                continue
            last_id = entries[-1][0]
            ids, texts, ended = cursor.take([entry for _, entry in entries])
            record = None
        if record is None:  # the end entry came after the snapshot
            record = await self.get(request_id)
            if record is None:
                raise UnknownRequestError(request_id)
        yield ids, "".join(texts), record

    async def _snapshot(self, request_id: str) -> tuple[RequestRecord, list[tuple[bytes, Entry]]]:
        """The record and the whole stream, read in one transaction."""
        with redis_errors():
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.get(self._keys.record(request_id))
                pipe.xrange(self._keys.tokens(request_id))
                data, raw = await pipe.execute()
        if data is None:
            raise UnknownRequestError(request_id)
        return RequestRecord.from_json(data), [(id_, Entry.parse(f)) for id_, f in raw]

    async def _read_after(self, request_id: str, last_id: bytes) -> list[tuple[bytes, Entry]]:
        with redis_errors():
            reply = await self._follow_redis.xread(
                {self._keys.tokens(request_id): last_id}, block=int(FOLLOW_BLOCK_S * 1000)
            )
        return [(id_, Entry.parse(fields)) for id_, fields in stream_entries(reply)]

    async def _check_alive(self, request_id: str) -> None:
        """Between tokens: the request may have expired, its stream been lost, or its
        router died (OwnerLostError)."""
        record = await self.get(request_id)
        if record is None:
            raise UnknownRequestError(request_id)
        if not record.is_terminal and time.time() - record.updated_at > OWNER_LOST_S:
            raise OwnerLostError(record)
        if record.is_terminal:
            # The end entry lands in the transaction that made the record terminal, so a
            # read after this one must see it.
            entries = await self._read_after(request_id, b"0-0")
            if not any(entry.end for _, entry in entries):
                raise CheckpointsLostError(f"the stream of finished request {request_id} is gone")
