"""The writer's side of the request store: buffers and one batched write per cycle.

`RequestStore` hands every write of the requests this router runs to one
`CheckpointWriter`. Nothing here waits on Redis on the hot path: `append_tokens` and
`update_later` only buffer, and a background task writes the requests that are due in
one MULTI/EXEC round trip (when a request is due, and what a reader may rely on, is in
the docstring of `pdserve.state.requests`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import RedisError, WatchError

from pdserve.core.phase import RequestPhase
from pdserve.state.checkpoints import Keys, delta_fields, end_fields, redis_errors, resume_point
from pdserve.state.record import RequestRecord

log = logging.getLogger(__name__)

# how often the background writer retries while Redis does not answer
RETRY_INTERVAL_S = 0.25
# update/finish/flush wait at most this long for their write to land
FLUSH_WAIT_S = 2.0
# close() keeps trying to write what is buffered for at most this long
CLOSE_FLUSH_TIMEOUT_S = 2.0
# A running request's record is written at least this often, even with nothing new (a
# long prefill queue): its `updated_at` says its router is alive. Readers take a record
# that has not moved for OWNER_LOST_S (checkpoint_reader) as its router's death.
OWNER_REFRESH_S = 1.0


@dataclass(frozen=True, slots=True)
class WriterConfig:
    """How a store writes: the keys' expiry and when a request's changes are due."""

    ttl_s: float  # keys expire this long after a request's last write
    checkpoint_tokens: int  # a request is due once it has this many tokens buffered
    checkpoint_interval_s: float  # ... or once its oldest change is 1-2 intervals old
    max_buffered_deltas: int  # per request while Redis does not answer; then the oldest go

    def __post_init__(self) -> None:
        if self.ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {self.ttl_s}")
        if self.checkpoint_tokens < 1:
            raise ValueError(f"checkpoint_tokens must be >= 1, got {self.checkpoint_tokens}")
        if self.checkpoint_interval_s <= 0:
            raise ValueError(f"checkpoint_interval_s must be > 0, got {self.checkpoint_interval_s}")
        if self.max_buffered_deltas < 1:
            raise ValueError(f"max_buffered_deltas must be >= 1, got {self.max_buffered_deltas}")

    @property
    def ttl_ms(self) -> int:
        return int(self.ttl_s * 1000)


@dataclass(eq=False)
class _Buffer:
    """What this store still owes Redis for one request it runs."""

    record: RequestRecord  # the latest state, written whole
    # deltas not yet written: ids[i] and texts[i] are delta number seq + i
    ids: list[list[int]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    seq: int = 0
    offset: int = 0  # the token offset of ids[0]
    num_buffered_tokens: int = 0
    num_writing: int = 0  # of those, the tokens of the write in flight
    version: int = 0  # bumped on every change of the record
    written_version: int = 0
    finished: bool = False  # the end entry goes out with the last deltas
    due: bool = False  # write at the next cycle, whatever its age
    # when a write cycle first saw it dirty (0.0: clean, or not seen yet); monotonic
    dirty_seen_at: float = 0.0
    # the stream's expiry is set again by the first write from then on (unix seconds)
    renew_expiry_at: float = 0.0

    @property
    def is_dirty(self) -> bool:
        return bool(self.ids) or self.version != self.written_version

    def drop_first(self, num_deltas: int, num_tokens: int) -> None:
        """Forget the oldest deltas (written, or given up on); the next starts after them."""
        del self.ids[:num_deltas]
        del self.texts[:num_deltas]
        self.seq += num_deltas
        self.offset += num_tokens
        self.num_buffered_tokens -= num_tokens


@dataclass(slots=True)
class _Written:
    """What one transaction wrote for a buffer, to drop from it once it landed."""

    num_deltas: int
    num_tokens: int
    version: int
    finished: bool


class CheckpointWriter:
    """Buffers the state of the requests running here; writes it in batches."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, config: WriterConfig):
        self.config = config
        self._redis = redis
        self._keys = keys
        self._buffers: dict[str, _Buffer] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        # resolved (with "it landed") when the next write cycle to start has ended
        self._cycle: asyncio.Future[bool] | None = None
        self._reachable = True  # the last write cycle that talked to Redis succeeded

    async def start(self) -> None:
        if self._task is None:
            self._cycle = asyncio.get_running_loop().create_future()
            self._task = asyncio.create_task(self._write_loop(), name="request-store-writer")

    async def stop(self) -> None:
        """Stop the background writer, then try for CLOSE_FLUSH_TIMEOUT_S to write the rest."""
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        if not self._cycle.done():
            self._cycle.set_result(False)
        await self._drain()

    # -- what RequestStore's writer-side methods do (documented there) ----------------------

    async def create(self, record: RequestRecord) -> bool:
        with redis_errors():
            created = await self._redis.set(
                self._keys.record(record.request_id),
                record.to_json(),
                nx=True,
                px=self.config.ttl_ms,
            )
        if created:
            self._buffers[record.request_id] = _Buffer(dataclasses.replace(record))
        return bool(created)

    async def adopt(self, record: RequestRecord, seen_updated_at: float) -> int | None:
        """Run here a request that stopped running where it was: its router stopped
        writing it (dead), or it failed with a status asking to try again
        (`RequestRecord.may_run_again`). `record` (naming this router) replaces the one
        Redis holds if that one is still as the caller saw it (`updated_at` ==
        `seen_updated_at`). The token stream goes on from its checkpoints, a failed
        one's end entry removed. Returns how many tokens they hold; None if another
        router wrote the request since (it runs it: follow it instead).
        """
        key, tokens_key = self._keys.record(record.request_id), self._keys.tokens(record.request_id)
        with redis_errors():
            async with self._redis.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(key, tokens_key)
                    data = await pipe.get(key)
                    current = None if data is None else RequestRecord.from_json(data)
                    if current is None or current.updated_at != seen_updated_at:
                        return None
                    if current.is_terminal and not current.may_run_again:
                        return None
                    if current.is_terminal:  # the whole stream: its end entry (or two) go
                        entries = await pipe.xrange(tokens_key)
                    else:
                        entries = await pipe.xrevrange(tokens_key, count=1)
                    seq, offset, ends = resume_point(entries)
                    record.completion_tokens, record.updated_at = offset, time.time()
                    pipe.multi()
                    if ends:
                        pipe.xdel(tokens_key, *ends)
                    pipe.set(key, record.to_json(), px=self.config.ttl_ms)
                    await pipe.execute()
                except WatchError:
                    return None
        buffer = _Buffer(dataclasses.replace(record), seq=seq, offset=offset)
        self._buffers[record.request_id] = buffer
        return offset

    async def update(self, request_id: str, fields: dict) -> bool:
        buffer = self._set_fields(request_id, fields)
        if buffer is None:
            return False
        buffer.due = True
        await self._wait_written()
        return True

    def update_later(self, request_id: str, fields: dict, soon: bool) -> bool:
        buffer = self._set_fields(request_id, fields)
        if buffer is not None and soon:
            buffer.due = True
            self._wake.set()
        return buffer is not None

    def append_tokens(self, request_id: str, token_ids: list[int], text: str) -> None:
        buffer = self._running(request_id)
        if buffer is None:
            log.warning("tokens for request %s, which is not running here: dropped", request_id)
            return
        num_tokens = len(token_ids)
        buffer.ids.append(list(token_ids))
        buffer.texts.append(text)
        buffer.num_buffered_tokens += num_tokens
        buffer.record.completion_tokens += num_tokens
        if num_tokens and not buffer.record.first_token_at:
            buffer.record.first_token_at = time.time()
        buffer.version += 1
        num_waiting = buffer.num_buffered_tokens - buffer.num_writing
        if num_waiting >= self.config.checkpoint_tokens and not buffer.due:
            buffer.due = True
            self._wake.set()

    async def finish(self, request_id: str, fields: dict) -> bool:
        """`fields` hold the terminal status, finish_reason and error among the rest."""
        status = RequestPhase(fields["status"])
        if not status.is_terminal:
            raise ValueError(f"finish() needs a terminal status, got {status.value!r}")
        buffer = self._running(request_id)
        if buffer is None:  # e.g. a cancel racing the last delta's finish
            log.debug("finish of request %s, which is not running here: ignored", request_id)
            return False
        buffer.record.assign(fields)
        if not buffer.record.finished_at:
            buffer.record.finished_at = time.time()
        buffer.finished = True
        buffer.due = True
        buffer.version += 1
        await self._wait_written()
        return True

    async def flush(self) -> bool:
        for buffer in self._buffers.values():
            buffer.due = True
        return await self._next_cycle()

    def _set_fields(self, request_id: str, fields: dict) -> _Buffer | None:
        if "status" in fields and RequestPhase(fields["status"]).is_terminal:
            raise ValueError("a terminal status is set by finish()")
        buffer = self._running(request_id)
        if buffer is None:  # e.g. a progress report racing the request's end
            log.debug("update of request %s, which is not running here: ignored", request_id)
            return None
        buffer.record.assign(fields)
        buffer.version += 1
        return buffer

    def _running(self, request_id: str) -> _Buffer | None:
        buffer = self._buffers.get(request_id)
        return None if buffer is None or buffer.finished else buffer

    async def _next_cycle(self) -> bool:
        """Start a write cycle now and wait for it; whether it landed (see `flush`)."""
        if self._task is None:
            raise RuntimeError("RequestStore.start() was not called")
        cycle = self._cycle
        self._wake.set()
        try:
            return await asyncio.wait_for(asyncio.shield(cycle), FLUSH_WAIT_S)
        except TimeoutError:
            return False

    async def _wait_written(self) -> None:
        # While Redis does not answer, the write stays queued and the stream goes on.
        if self._reachable:
            await self._next_cycle()

    # -- the background writer ----------------------------------------------------------------

    async def _write_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.checkpoint_interval_s)
            self._wake.clear()
            cycle, self._cycle = self._cycle, loop.create_future()
            try:
                await self._write_cycle()
            except Exception:  # a bug must not stop checkpoints of every other request
                log.exception("request store: write cycle failed")
            finally:
                cycle.set_result(self._reachable)
            if not self._reachable:
                await asyncio.sleep(RETRY_INTERVAL_S)

    async def _write_cycle(self) -> None:
        try:
            await self._write_due()
        except RedisError as exc:
            if self._reachable:
                log.warning(
                    "Redis unreachable (%s): buffering the state of %d requests",
                    exc,
                    len(self._buffers),
                )
            self._reachable = False
            for buffer in self._buffers.values():
                self._drop_oldest(buffer)
                buffer.renew_expiry_at = 0.0  # Redis may come back empty: set it again
                buffer.num_writing = 0
            return
        if not self._reachable:
            log.warning("Redis reachable again: buffered request state written")
        self._reachable = True

    async def _write_due(self) -> None:
        """Every request that is due, in one transaction (one round trip)."""
        batch = self._due_buffers()
        if not batch:
            return
        now = time.time()
        async with self._redis.pipeline(transaction=True) as pipe:
            written = [self._queue_writes(pipe, buffer, now) for buffer in batch]
            await pipe.execute()
        for buffer, what in zip(batch, written, strict=True):
            self._landed(buffer, what)

    def _due_buffers(self) -> list[_Buffer]:
        """The buffers to write now; marks the dirty ones not due yet as seen."""
        now = time.monotonic()
        # seen by an earlier cycle, normally the previous tick (half: that tick may be early)
        old_enough = now - self.config.checkpoint_interval_s / 2
        refresh_before = time.time() - OWNER_REFRESH_S
        due = []
        for buffer in self._buffers.values():
            if not buffer.is_dirty and buffer.record.updated_at <= refresh_before:
                buffer.version += 1  # nothing new, but readers must see its router alive
                buffer.due = True
            if not buffer.is_dirty:
                continue
            if buffer.due or not self._reachable or 0.0 < buffer.dirty_seen_at <= old_enough:
                due.append(buffer)
            elif not buffer.dirty_seen_at:
                buffer.dirty_seen_at = now
        return due

    def _queue_writes(self, pipe, buffer: _Buffer, now: float) -> _Written:
        record = buffer.record
        tokens_key = self._keys.tokens(record.request_id)
        ttl_ms = self.config.ttl_ms
        num_deltas = len(buffer.ids)
        if num_deltas:
            pipe.xadd(tokens_key, delta_fields(buffer.seq, buffer.offset, buffer.ids, buffer.texts))
        if buffer.finished:
            end_offset = buffer.offset + buffer.num_buffered_tokens
            pipe.xadd(tokens_key, end_fields(buffer.seq + num_deltas, end_offset, record.status))
        record.updated_at = now
        pipe.set(self._keys.record(record.request_id), record.to_json(), px=ttl_ms)
        if buffer.finished or (num_deltas and now >= buffer.renew_expiry_at):
            # XADD keeps a stream's expiry, so this is needed only now and then
            pipe.pexpire(tokens_key, ttl_ms)
            buffer.renew_expiry_at = now + ttl_ms / 2000
        # What changes from now on waits for its own turn.
        buffer.due, buffer.dirty_seen_at = False, 0.0
        buffer.num_writing = buffer.num_buffered_tokens
        return _Written(num_deltas, buffer.num_buffered_tokens, buffer.version, buffer.finished)

    def _landed(self, buffer: _Buffer, what: _Written) -> None:
        buffer.drop_first(what.num_deltas, what.num_tokens)
        buffer.written_version = what.version
        buffer.num_writing = 0
        if what.finished:
            del self._buffers[buffer.record.request_id]

    def _drop_oldest(self, buffer: _Buffer) -> None:
        """Keep at most max_buffered_deltas; readers see the dropped range as lost."""
        excess = len(buffer.ids) - self.config.max_buffered_deltas
        if excess <= 0:
            return
        num_tokens = sum(len(ids) for ids in buffer.ids[:excess])
        log.warning(
            "request %s: Redis still unreachable, dropped tokens %d to %d",
            buffer.record.request_id,
            buffer.offset,
            buffer.offset + num_tokens,
        )
        buffer.drop_first(excess, num_tokens)

    async def _drain(self) -> None:
        deadline = time.monotonic() + CLOSE_FLUSH_TIMEOUT_S
        while any(b.is_dirty for b in self._buffers.values()) and time.monotonic() < deadline:
            await self._write_cycle()
            if not self._reachable:
                await asyncio.sleep(RETRY_INTERVAL_S)
        unwritten = sum(b.is_dirty for b in self._buffers.values())
        if unwritten:
            log.warning("request store closed with the state of %d requests unwritten", unwritten)
