"""The router's request state in Redis: one record per request, and token checkpoints.

Several routers share one Redis. The router that runs a request is its only writer
(`create`, `update`, `append_tokens`, `finish`); any router reads it (`get`,
`read_tokens`, `follow`), so a client can re-attach through another router from a
token offset, even while the request still runs. A request that stopped running
(its router died, or it failed asking to try again) passes to the router that
`adopt`s it: its writer from then on.

Keys (prefix `pdserve` by default), both expiring ttl_s after a request's last write
(while it runs, the stream's expiry is renewed every ttl_s / 2, not on every write):

    {prefix}:req:{id}      string, the RequestRecord as JSON; created with SET NX
    {prefix}:tokens:{id}   stream of checkpoint entries, oldest first

With API keys, `id` is the one the router stores a keyed caller's request under,
`KEYID/ID` (`router.auth.caller.Caller.scoped_id`): each key's ids are its own.

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

from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from pdserve.core.phase import RequestPhase
from pdserve.state.checkpoint_reader import FOLLOW_BLOCK_S, CheckpointReader
from pdserve.state.checkpoint_writer import (
    CLOSE_FLUSH_TIMEOUT_S,
    FLUSH_WAIT_S,
    RETRY_INTERVAL_S,
    CheckpointWriter,
    WriterConfig,
)
from pdserve.state.checkpoints import Keys
from pdserve.state.record import RequestRecord

__all__ = [
    "CHECKPOINT_INTERVAL_S",
    "CLOSE_FLUSH_TIMEOUT_S",
    "FLUSH_WAIT_S",
    "FOLLOW_BLOCK_S",
    "MAX_BUFFERED_DELTAS",
    "RETRY_INTERVAL_S",
    "RequestRecord",
    "RequestStore",
]

# A new request should hear UNAVAILABLE within a second, so no retries and short
# timeouts (the writer's side retries by itself, in the background).
# (A connect takes microseconds; the timeout is for a loaded router whose event loop
# runs late: 0.25 s refused requests on a busy two-core machine with Redis up.)
CONNECT_TIMEOUT_S = 1.0
SOCKET_TIMEOUT_S = 0.5
# How long a running request's new tokens may wait for their checkpoint (about; up to
# twice this). Readers following a running request lag by as much.
CHECKPOINT_INTERVAL_S = 0.25
MAX_BUFFERED_DELTAS = 65_536


class RequestStore:
    """Request records and token checkpoints in Redis (layout in the module docstring).

    The writer's side (`create` to `flush`) goes to a `CheckpointWriter`, the readers'
    side (`get`, `read_tokens`, `follow`) to a `CheckpointReader`; this class holds
    their connections and their life.
    """

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
        self.config = WriterConfig(
            ttl_s=ttl_s,
            checkpoint_tokens=checkpoint_tokens,
            checkpoint_interval_s=checkpoint_interval_s,
            max_buffered_deltas=max_buffered_deltas,
        )
        self.key_prefix = key_prefix
        keys = Keys(key_prefix)
        fail_fast = dict(socket_connect_timeout=CONNECT_TIMEOUT_S, retry=Retry(NoBackoff(), 0))
        self._redis = aioredis.Redis.from_url(
            redis_url, socket_timeout=SOCKET_TIMEOUT_S, **fail_fast
        )
        # XREAD BLOCK holds its connection for FOLLOW_BLOCK_S before the reply
        self._follow_redis = aioredis.Redis.from_url(
            redis_url, socket_timeout=FOLLOW_BLOCK_S + SOCKET_TIMEOUT_S, **fail_fast
        )
        self._writer = CheckpointWriter(self._redis, keys, self.config)
        self._reader = CheckpointReader(self._redis, self._follow_redis, keys)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the background writer (the writer's side needs it)."""
        await self._writer.start()

    async def close(self) -> None:
        """Stop the background writer, then try for CLOSE_FLUSH_TIMEOUT_S to write the rest."""
        await self._writer.stop()
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
        return await self._writer.create(record)

    async def adopt(self, record: RequestRecord, seen_updated_at: float) -> int | None:
        """Run here a request another router stopped running: one whose router died (its
        record stopped moving) or one that failed asking its client to try again
        (`RequestRecord.may_run_again`). `record` names this router and replaces the one
        Redis holds if that is unchanged since the caller read it (`seen_updated_at`).

        Returns how many tokens its checkpoints hold (this run goes on from there); None
        if another router wrote it since (follow that one). Raises StateUnavailableError.
        """
        return await self._writer.adopt(record, seen_updated_at)

    async def update(self, request_id: str, **fields) -> bool:
        """Set record fields of a request running here (a terminal status: use `finish`).

        Returns once the write landed, or at once, the write queued, while Redis does not
        answer. False, with nothing written, if the request is not running here.
        """
        return await self._writer.update(request_id, fields)

    def update_later(self, request_id: str, *, soon: bool = False, **fields) -> bool:
        """Like `update`, but without waiting: the fields land with the request's next
        checkpoint, or with the next write cycle (started now) if `soon`.

        For progress reports on the hot path: most cost no Redis write of their own.
        """
        return self._writer.update_later(request_id, fields, soon)

    def append_tokens(self, request_id: str, token_ids: list[int], text: str) -> None:
        """Buffer one delta (no Redis call); the background writer checkpoints it.

        Call from the event loop's thread. `text` is the text this delta completed.
        """
        self._writer.append_tokens(request_id, token_ids, text)

    async def finish(
        self, request_id: str, status: RequestPhase, finish_reason: str, error: str = "", **fields
    ) -> bool:
        """End a request running here: its buffered deltas, then the end entry and record.

        Both go out in one transaction, in that order. Waits like `update`. False if the
        request is not running here (never created here, or finished already).
        """
        terminal = {"status": status, "finish_reason": finish_reason, "error": error}
        return await self._writer.finish(request_id, {**fields, **terminal})

    async def flush(self) -> bool:
        """Write everything buffered now. True if it landed; False if Redis did not take it
        (it stays buffered) or the wait ran past FLUSH_WAIT_S."""
        return await self._writer.flush()

    # -- the readers' side: any router -------------------------------------------------------

    async def get(self, request_id: str) -> RequestRecord | None:
        """The record as Redis has it, or None. Raises StateUnavailableError."""
        return await self._reader.get(request_id)

    async def read_tokens(self, request_id: str, offset: int) -> tuple[list[int], str]:
        """Every checkpointed token from `offset` on, and its text (see "Resume" above).

        Raises UnknownRequestError, ValueError for an offset past the end of a request
        that ended other than failed, CheckpointsLostError, StateUnavailableError.
        """
        return await self._reader.read_tokens(request_id, offset)

    def follow(
        self, request_id: str, offset: int
    ) -> AsyncIterator[tuple[list[int], str, RequestRecord | None]]:
        """Yield (token ids, text, None) from `offset` on as checkpoints land; the last item
        carries the terminal record instead of None.

        An offset past what is checkpointed waits for the tokens to land (the running router
        streams ahead of its checkpoints); past the end of a request that ended other
        than failed it raises ValueError("resume_from beyond the stream"). Past a failed
        end it yields that end, so the caller may run the request again from the offset
        (`RequestRecord.may_run_again`) or give its failure. Raises like `read_tokens`.
        """
        return self._reader.follow(request_id, offset)
