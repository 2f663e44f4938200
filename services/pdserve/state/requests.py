"""The router's request state in Redis: one record per request, and token checkpoints.

Several routers share one Redis. The router that runs a request is its only writer
(`create`, `update`, `append_tokens`, `finish`); any router reads it (`get`,
`read_tokens`, `follow`), so a client can re-attach through another router from a
token offset, even while the request still runs.

Keys (prefix `pdserve` by default), both expiring ttl_s after a request's last write
(while it runs, the stream's expiry is renewed every ttl_s / 2, not on every write):

    {prefix}:req:{id}      string, the RequestRecord as JSON; created with SET NX
    {prefix}:tokens:{id}   stream of checkpoint entries, oldest first

A checkpoint entry holds consecutive deltas (one per engine step: token ids and the
text they completed). Its fields:

    seq      index of its first delta among the request's deltas
    offset   index of its first token within the output
    ids      JSON list with one list of token ids per delta
    texts    JSON list with one text per delta

`finish` ends the stream with an entry whose `seq` and `offset` count all deltas and
tokens and whose `end` holds the terminal status.

Writes are batched: `append_tokens` and `update_later` only buffer, and a background
task writes the requests that are due in ONE MULTI/EXEC round trip. A request is due
once it has checkpoint_tokens buffered, when it finishes or an `update` waits, and
otherwise when its oldest unwritten change is one to two checkpoint_interval_s old (the
task looks every interval). So each write carries many tokens, however many requests
run. A request's record is written whole in the same transaction as its new entries,
so no reader sees a status or a count ahead of the stream: once a record is terminal
its end entry is there.

Resume. Reading from token offset k gives every token from k on, the text of each
delta that holds one of them, and the text of token-less deltas at position k or later
(the engine emits one when it flushes held-back text at the end). A client that got
whole deltas holding k tokens thus gets exactly the rest of the uninterrupted stream's
text. A delta is never split: if k falls inside one, its remaining tokens come with
all of its text.

Outages. `create`, `get`, `read_tokens` and `follow` raise StateUnavailableError
within about a second when Redis does not answer. The writer's side never raises:
new deltas and the latest record stay in memory (at most max_buffered_deltas per
request; beyond that the oldest are dropped with a warning) and land when Redis
answers again. The record is rewritten whole, so it comes back even if Redis returned
empty. Readers see a missing range (lost with Redis' memory, or dropped) as a jump in
`seq`, and raise CheckpointsLostError if it holds tokens from their offset on. A write
retried after an ambiguous failure may store a range twice; readers take each delta
once, by `seq`.

The batch spans requests, so it needs a single Redis (or a proxy), not Redis Cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from pdserve.core.errors import CheckpointsLostError, StateUnavailableError, UnknownRequestError
from pdserve.core.phase import RequestPhase

log = logging.getLogger(__name__)

# A new request should hear UNAVAILABLE within a second, so no retries and short
# timeouts (the writer's side retries by itself, in the background).
CONNECT_TIMEOUT_S = 0.25
SOCKET_TIMEOUT_S = 0.5
# follow() blocks in XREAD this long per call, then checks that the request still exists
FOLLOW_BLOCK_S = 0.25
# how often the background writer retries while Redis does not answer
RETRY_INTERVAL_S = 0.25
# update/finish/flush wait at most this long for their write to land
FLUSH_WAIT_S = 2.0
# How long a running request's new tokens may wait for their checkpoint (about; up to
# twice this). Readers following a running request lag by as much.
CHECKPOINT_INTERVAL_S = 0.25
# close() keeps trying to write what is buffered for at most this long
CLOSE_FLUSH_TIMEOUT_S = 2.0
MAX_BUFFERED_DELTAS = 65_536


@dataclass
class RequestRecord:
    """A request as every router sees it. Times are unix seconds; 0.0 means not yet."""

    request_id: str
    status: RequestPhase
    prompt_tokens: int
    # output tokens appended so far; in Redis, exactly those checkpointed with the record
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    prefill_worker: str = ""
    decode_worker: str = ""
    router_id: str = ""  # the router running it: the only writer
    finish_reason: str = ""  # "stop" | "length" | "abort" | ""
    error: str = ""  # for FAILED: "CODE: message"
    created_at: float = field(default_factory=time.time)
    updated_at: float = 0.0  # the last write
    first_token_at: float = 0.0  # set by the first append_tokens with tokens
    finished_at: float = 0.0
    # sampling params and prompt form, so another router can check that an idempotent
    # retry asks for the same thing
    params_json: str = ""

    def __post_init__(self) -> None:
        self.status = RequestPhase(self.status)
        if not self.updated_at:
            self.updated_at = self.created_at

    @property
    def is_terminal(self) -> bool:
        return self.status.is_terminal

    def to_json(self) -> str:
        # Every field is a plain value (status a str), so no dataclasses.asdict deep copy.
        fields = {name: getattr(self, name) for name in _RECORD_FIELD_NAMES}
        return json.dumps(fields, separators=(",", ":"))

    @classmethod
    def from_json(cls, data: bytes | str) -> RequestRecord:
        """Decode `to_json`'s output; unknown fields (a newer router's) are ignored."""
        fields = json.loads(data)
        return cls(**{name: value for name, value in fields.items() if name in _RECORD_FIELDS})


_RECORD_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(RequestRecord))
_RECORD_FIELDS = frozenset(_RECORD_FIELD_NAMES)
_UPDATABLE = _RECORD_FIELDS - {"request_id", "created_at", "updated_at"}


@dataclass(eq=False)
class _Writer:
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


@dataclass(slots=True)
class _Written:
    """What one transaction wrote for a writer, to drop from its buffer once it landed."""

    num_deltas: int
    num_tokens: int
    version: int
    finished: bool


@dataclass(slots=True)
class _Entry:
    seq: int
    offset: int
    ids: list[list[int]]
    texts: list[str]
    end: str  # the terminal status on the end entry, else ""

    @classmethod
    def parse(cls, fields: dict[bytes, bytes]) -> _Entry:
        return cls(
            seq=int(fields[b"seq"]),
            offset=int(fields[b"offset"]),
            ids=json.loads(fields.get(b"ids", b"[]")),
            texts=json.loads(fields.get(b"texts", b"[]")),
            end=fields.get(b"end", b"").decode(),
        )


@dataclass
class _Cursor:
    """Walks a stream's entries in order, keeping what a reader resuming at `offset` gets."""

    offset: int
    next_seq: int = 0  # the first delta not walked past yet
    num_tokens: int = 0  # tokens in the deltas walked past: the offset of delta next_seq

    def take(self, entries: list[_Entry]) -> tuple[list[int], list[str], bool]:
        """(token ids, texts of the deltas that hold them, whether the end was reached)."""
        ids: list[int] = []
        texts: list[str] = []
        for entry in entries:
            if entry.seq > self.next_seq:  # deltas are missing
                if entry.offset > self.offset:
                    raise CheckpointsLostError(
                        f"tokens {self.num_tokens} to {entry.offset} of the stream were lost"
                    )
                # All before the reader's offset. (A lost token-less delta at exactly the
                # offset would go unnoticed; the engine emits those only at the end.)
                self.next_seq, self.num_tokens = entry.seq, entry.offset
            if entry.end:
                if self.offset > self.num_tokens:
                    raise ValueError(
                        f"resume_from beyond the stream: {self.offset} > {self.num_tokens} tokens"
                    )
                return ids, texts, True
            skip = self.next_seq - entry.seq  # > 0 for a range written twice
            for delta_ids, text in zip(entry.ids[skip:], entry.texts[skip:], strict=True):
                self._walk(delta_ids, text, ids, texts)
        return ids, texts, False

    def _walk(self, delta_ids: list[int], text: str, ids: list[int], texts: list[str]) -> None:
        start = self.num_tokens
        self.num_tokens += len(delta_ids)
        self.next_seq += 1
        if start >= self.offset or self.num_tokens > self.offset:
            ids.extend(delta_ids[max(0, self.offset - start) :])
            texts.append(text)


@contextlib.contextmanager
def _redis_errors() -> Iterator[None]:
    try:
        yield
    except RedisError as exc:
        raise StateUnavailableError(f"request state unavailable: {exc}") from exc


def _check_offset(offset: int) -> None:
    if offset < 0:
        raise ValueError(f"resume_from must be >= 0, got {offset}")


def _stream_entries(reply) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """The entries of XREAD's reply for one stream (RESP2 list or RESP3 map)."""
    if not reply:
        return []
    streams = reply.values() if isinstance(reply, dict) else [item[1] for item in reply]
    return [entry for entries in streams for entry in entries]


class RequestStore:
    """Request records and token checkpoints in Redis (layout in the module docstring)."""

    def __init__(
        self,
        redis_url: str,
        *,
        ttl_s: float = 3600,
        checkpoint_tokens: int = 32,
        checkpoint_interval_s: float = CHECKPOINT_INTERVAL_S,
        key_prefix: str = "pdserve",
        max_buffered_deltas: int = MAX_BUFFERED_DELTAS,
    ):
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if checkpoint_tokens < 1:
            raise ValueError(f"checkpoint_tokens must be >= 1, got {checkpoint_tokens}")
        if checkpoint_interval_s <= 0:
            raise ValueError(f"checkpoint_interval_s must be > 0, got {checkpoint_interval_s}")
        if max_buffered_deltas < 1:
            raise ValueError(f"max_buffered_deltas must be >= 1, got {max_buffered_deltas}")
        self.ttl_ms = int(ttl_s * 1000)
        self.checkpoint_tokens = checkpoint_tokens
        self.checkpoint_interval_s = checkpoint_interval_s
        self.key_prefix = key_prefix
        self.max_buffered_deltas = max_buffered_deltas
        fail_fast = dict(socket_connect_timeout=CONNECT_TIMEOUT_S, retry=Retry(NoBackoff(), 0))
        self._redis = aioredis.Redis.from_url(
            redis_url, socket_timeout=SOCKET_TIMEOUT_S, **fail_fast
        )
        # XREAD BLOCK holds its connection for FOLLOW_BLOCK_S before the reply
        self._follow_redis = aioredis.Redis.from_url(
            redis_url, socket_timeout=FOLLOW_BLOCK_S + SOCKET_TIMEOUT_S, **fail_fast
        )
        self._writers: dict[str, _Writer] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        # resolved (with "it landed") when the next write cycle to start has ended
        self._cycle: asyncio.Future[bool] | None = None
        self._reachable = True  # the last write cycle that talked to Redis succeeded

    def _record_key(self, request_id: str) -> str:
        return f"{self.key_prefix}:req:{request_id}"

    def _tokens_key(self, request_id: str) -> str:
        return f"{self.key_prefix}:tokens:{request_id}"

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is None:
            self._cycle = asyncio.get_running_loop().create_future()
            self._task = asyncio.create_task(self._write_loop(), name="request-store-writer")

    async def close(self) -> None:
        """Stop the background writer, then try for CLOSE_FLUSH_TIMEOUT_S to write the rest."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
            if not self._cycle.done():
                self._cycle.set_result(False)
            await self._drain()
        await self._redis.aclose()
        await self._follow_redis.aclose()

    async def __aenter__(self) -> RequestStore:
        await self.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    # -- the writer's side: this store runs the request ---------------------------------------

    async def create(self, record: RequestRecord) -> bool:
        """Store a new request and run it here; False if the id exists (an idempotent retry).

        Raises StateUnavailableError when Redis does not answer.
        """
        with _redis_errors():
            created = await self._redis.set(
                self._record_key(record.request_id), record.to_json(), nx=True, px=self.ttl_ms
            )
        if created:
            self._writers[record.request_id] = _Writer(dataclasses.replace(record))
        return bool(created)

    async def update(self, request_id: str, **fields) -> bool:
        """Set record fields of a request running here (a terminal status: use `finish`).

        Returns once the write landed, or at once, the write queued, while Redis does not
        answer. False, with nothing written, if the request is not running here.
        """
        writer = self._set_fields(request_id, fields)
        if writer is None:
            return False
        writer.due = True
        await self._wait_written()
        return True

    def update_later(self, request_id: str, *, soon: bool = False, **fields) -> bool:
        """Like `update`, but without waiting: the fields land with the request's next
        checkpoint, or with the next write cycle (started now) if `soon`.

        For progress reports on the hot path: most cost no Redis write of their own.
        """
        writer = self._set_fields(request_id, fields)
        if writer is not None and soon:
            writer.due = True
            self._wake.set()
        return writer is not None

    def _set_fields(self, request_id: str, fields: dict) -> _Writer | None:
        if "status" in fields and RequestPhase(fields["status"]).is_terminal:
            raise ValueError("a terminal status is set by finish()")
        writer = self._running_writer(request_id)
        if writer is None:  # e.g. a progress report racing the request's end
            log.debug("update of request %s, which is not running here: ignored", request_id)
            return None
        _assign(writer.record, fields)
        writer.version += 1
        return writer

    def append_tokens(self, request_id: str, token_ids: list[int], text: str) -> None:
        """Buffer one delta (no Redis call); the background writer checkpoints it.

        Call from the event loop's thread. `text` is the text this delta completed.
        """
        writer = self._running_writer(request_id)
        if writer is None:
            log.warning("tokens for request %s, which is not running here: dropped", request_id)
            return
        num_tokens = len(token_ids)
        writer.ids.append(list(token_ids))
        writer.texts.append(text)
        writer.num_buffered_tokens += num_tokens
        writer.record.completion_tokens += num_tokens
        if num_tokens and not writer.record.first_token_at:
            writer.record.first_token_at = time.time()
        writer.version += 1
        num_waiting = writer.num_buffered_tokens - writer.num_writing
        if num_waiting >= self.checkpoint_tokens and not writer.due:
            writer.due = True
            self._wake.set()

    async def finish(
        self, request_id: str, status: RequestPhase, finish_reason: str, error: str = "", **fields
    ) -> bool:
        """End a request running here: its buffered deltas, then the end entry and record.

        Both go out in one transaction, in that order. Waits like `update`. False if the
        request is not running here (never created here, or finished already).
        """
        status = RequestPhase(status)
        if not status.is_terminal:
            raise ValueError(f"finish() needs a terminal status, got {status.value!r}")
        writer = self._running_writer(request_id)
        if writer is None:  # e.g. a cancel racing the last delta's finish
            log.debug("finish of request %s, which is not running here: ignored", request_id)
            return False
        _assign(
            writer.record,
            {**fields, "status": status, "finish_reason": finish_reason, "error": error},
        )
        if not writer.record.finished_at:
            writer.record.finished_at = time.time()
        writer.finished = True
        writer.due = True
        writer.version += 1
        await self._wait_written()
        return True

    async def flush(self) -> bool:
        """Write everything buffered now. True if it landed; False if Redis did not take it
        (it stays buffered) or the wait ran past FLUSH_WAIT_S."""
        for writer in self._writers.values():
            writer.due = True
        return await self._next_cycle()

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

    def _running_writer(self, request_id: str) -> _Writer | None:
        writer = self._writers.get(request_id)
        return None if writer is None or writer.finished else writer

    async def _wait_written(self) -> None:
        # While Redis does not answer, the write stays queued and the stream goes on.
        if self._reachable:
            await self._next_cycle()

    # -- the background writer ----------------------------------------------------------------

    async def _write_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.checkpoint_interval_s)
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
            await self._write_dirty()
        except RedisError as exc:
            if self._reachable:
                log.warning(
                    "Redis unreachable (%s): buffering the state of %d requests",
                    exc,
                    len(self._writers),
                )
            self._reachable = False
            for writer in self._writers.values():
                self._drop_oldest(writer)
                writer.renew_expiry_at = 0.0  # Redis may come back empty: set it again
                writer.num_writing = 0
            return
        if not self._reachable:
            log.warning("Redis reachable again: buffered request state written")
        self._reachable = True

    async def _write_dirty(self) -> None:
        """Every request that is due, in one transaction (one round trip)."""
        batch = self._due_writers()
        if not batch:
            return
        now = time.time()
        async with self._redis.pipeline(transaction=True) as pipe:
            written = [self._queue_writes(pipe, writer, now) for writer in batch]
            await pipe.execute()
        for writer, what in zip(batch, written, strict=True):
            self._landed(writer, what)

    def _due_writers(self) -> list[_Writer]:
        """The writers to write now; marks the dirty ones not due yet as seen."""
        now = time.monotonic()
        # seen by an earlier cycle, normally the previous tick (half: that tick may be early)
        old_enough = now - self.checkpoint_interval_s / 2
        due = []
        for writer in self._writers.values():
            if not writer.is_dirty:
                continue
            if writer.due or not self._reachable or 0.0 < writer.dirty_seen_at <= old_enough:
                due.append(writer)
            elif not writer.dirty_seen_at:
                writer.dirty_seen_at = now
        return due

    def _queue_writes(self, pipe, writer: _Writer, now: float) -> _Written:
        record = writer.record
        tokens_key = self._tokens_key(record.request_id)
        num_deltas = len(writer.ids)
        if num_deltas:
            pipe.xadd(
                tokens_key,
                {
                    "seq": writer.seq,
                    "offset": writer.offset,
                    "ids": json.dumps(writer.ids, separators=(",", ":")),
                    "texts": json.dumps(writer.texts, separators=(",", ":")),
                },
            )
        if writer.finished:
            end_offset = writer.offset + writer.num_buffered_tokens
            pipe.xadd(
                tokens_key,
                {"seq": writer.seq + num_deltas, "offset": end_offset, "end": record.status.value},
            )
        record.updated_at = now
        pipe.set(self._record_key(record.request_id), record.to_json(), px=self.ttl_ms)
        if writer.finished or (num_deltas and now >= writer.renew_expiry_at):
            # XADD keeps a stream's expiry, so this is needed only now and then
            pipe.pexpire(tokens_key, self.ttl_ms)
            writer.renew_expiry_at = now + self.ttl_ms / 2000
        # What changes from now on waits for its own turn.
        writer.due, writer.dirty_seen_at = False, 0.0
        writer.num_writing = writer.num_buffered_tokens
        return _Written(num_deltas, writer.num_buffered_tokens, writer.version, writer.finished)

    def _landed(self, writer: _Writer, what: _Written) -> None:
        del writer.ids[: what.num_deltas]
        del writer.texts[: what.num_deltas]
        writer.seq += what.num_deltas
        writer.offset += what.num_tokens
        writer.num_buffered_tokens -= what.num_tokens
        writer.written_version = what.version
        writer.num_writing = 0
        if what.finished:
            del self._writers[writer.record.request_id]

    def _drop_oldest(self, writer: _Writer) -> None:
        """Keep at most max_buffered_deltas; readers see the dropped range as lost."""
        excess = len(writer.ids) - self.max_buffered_deltas
        if excess <= 0:
            return
        num_tokens = sum(len(ids) for ids in writer.ids[:excess])
        first, end = writer.offset, writer.offset + num_tokens
        log.warning(
            "request %s: Redis still unreachable, dropped tokens %d to %d",
            writer.record.request_id,
            first,
            end,
        )
        del writer.ids[:excess]
        del writer.texts[:excess]
        writer.seq += excess
        writer.offset += num_tokens
        writer.num_buffered_tokens -= num_tokens

    async def _drain(self) -> None:
        deadline = time.monotonic() + CLOSE_FLUSH_TIMEOUT_S
        while any(w.is_dirty for w in self._writers.values()) and time.monotonic() < deadline:
            await self._write_cycle()
            if not self._reachable:
                await asyncio.sleep(RETRY_INTERVAL_S)
        unwritten = sum(w.is_dirty for w in self._writers.values())
        if unwritten:
            log.warning("request store closed with the state of %d requests unwritten", unwritten)

    # -- the readers' side: any router -------------------------------------------------------

    async def get(self, request_id: str) -> RequestRecord | None:
        """The record as Redis has it, or None. Raises StateUnavailableError."""
        with _redis_errors():
            data = await self._redis.get(self._record_key(request_id))
        return None if data is None else RequestRecord.from_json(data)

    async def read_tokens(self, request_id: str, offset: int) -> tuple[list[int], str]:
        """Every checkpointed token from `offset` on, and its text (see "Resume" above).

        Raises UnknownRequestError, ValueError for an offset past the end of a finished
        request, CheckpointsLostError, StateUnavailableError.
        """
        _check_offset(offset)
        _, entries = await self._snapshot(request_id)
        ids, texts, _ = _Cursor(offset).take([entry for _, entry in entries])
        return ids, "".join(texts)

    async def follow(
        self, request_id: str, offset: int
    ) -> AsyncIterator[tuple[list[int], str, RequestRecord | None]]:
        """Yield (token ids, text, None) from `offset` on as checkpoints land; the last item
        carries the terminal record instead of None.

        An offset past what is checkpointed waits for the tokens to land (the running router
        streams ahead of its checkpoints); past the end of a finished request it raises
        ValueError("resume_from beyond the stream"). Raises like `read_tokens`.
        """
        _check_offset(offset)
        cursor = _Cursor(offset)
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

    async def _snapshot(self, request_id: str) -> tuple[RequestRecord, list[tuple[bytes, _Entry]]]:
        """The record and the whole stream, read in one transaction."""
        with _redis_errors():
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.get(self._record_key(request_id))
                pipe.xrange(self._tokens_key(request_id))
                data, raw = await pipe.execute()
        if data is None:
            raise UnknownRequestError(request_id)
        return RequestRecord.from_json(data), [(id_, _Entry.parse(f)) for id_, f in raw]

    async def _read_after(self, request_id: str, last_id: bytes) -> list[tuple[bytes, _Entry]]:
        with _redis_errors():
            reply = await self._follow_redis.xread(
                {self._tokens_key(request_id): last_id}, block=int(FOLLOW_BLOCK_S * 1000)
            )
        return [(id_, _Entry.parse(fields)) for id_, fields in _stream_entries(reply)]

    async def _check_alive(self, request_id: str) -> None:
        """Between tokens: the request may have expired, or its stream been lost."""
        record = await self.get(request_id)
        if record is None:
            raise UnknownRequestError(request_id)
        if record.is_terminal:
            # The end entry lands in the transaction that made the record terminal, so a
            # read after this one must see it.
            entries = await self._read_after(request_id, b"0-0")
            if not any(entry.end for _, entry in entries):
                raise CheckpointsLostError(f"the stream of finished request {request_id} is gone")


def _assign(record: RequestRecord, fields: dict) -> None:
    unknown = fields.keys() - _UPDATABLE
    if unknown:
        raise ValueError(f"cannot set record fields {sorted(unknown)}")
    for name, value in fields.items():
        setattr(record, name, RequestPhase(value) if name == "status" else value)
