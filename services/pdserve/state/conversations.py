"""Stored responses of the OpenAI door's Responses API, in Redis beside the request records.

A response made with `store` (OpenAI's default) is kept with the conversation it ended,
so that a later request naming it (`previous_response_id`) through any router continues
that conversation without the client sending it again. Keys (prefix `pdserve` by
default), each expiring ttl_s after it was written:

    {prefix}:resp:{id}   string: {"response": {...}, "conversation": [...]} as JSON

`response` is the response object as the client got it (what GET returns); the
`conversation` its chat messages up to and including its output (what a follow-up
renders before its own input). `id` is the response's id in its caller's key's namespace
(`router.auth.caller.Caller.scoped_id`, given by the caller of this store), so another
key's GET, DELETE or follow-up finds nothing.

A record's size is bounded (`max_record_bytes`): a conversation passes through the
prompt limit when it is rendered, so only a record near the context window reaches the
bound, and it is refused (InvalidRequestError naming `store`) rather than written. Every
call raises StateUnavailableError within about a second when Redis does not answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from pdserve.core.errors import InvalidRequestError
from pdserve.state.checkpoints import redis_errors
from pdserve.state.requests import CONNECT_TIMEOUT_S, SOCKET_TIMEOUT_S

DEFAULT_MAX_RECORD_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A response as the client got it, and the conversation it ended."""

    response: dict
    conversation: list[dict]

    def to_json(self) -> bytes:
        record = {"response": self.response, "conversation": self.conversation}
        return json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> StoredResponse:
        record = json.loads(data)
        return cls(record["response"], record["conversation"])


class ResponseStore:
    """Stored responses in Redis (layout in the module docstring)."""

    def __init__(
        self,
        redis_url: str,
        *,
        ttl_s: float,
        key_prefix: str = "pdserve",
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
    ):
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.ttl_s, self.key_prefix = ttl_s, key_prefix
        self.max_record_bytes = max_record_bytes
        # as the request store's readers: no retries, an answer within about a second
        self._redis = aioredis.Redis.from_url(
            redis_url,
            socket_timeout=SOCKET_TIMEOUT_S,
            socket_connect_timeout=CONNECT_TIMEOUT_S,
            retry=Retry(NoBackoff(), 0),
        )

    def _key(self, response_id: str) -> str:
        return f"{self.key_prefix}:resp:{response_id}"

    async def put(self, response_id: str, stored: StoredResponse) -> None:
        """Keep `stored` for ttl_s under `response_id` (a scoped id)."""
        data = stored.to_json()
        if len(data) > self.max_record_bytes:
            raise InvalidRequestError(
                "store",
                f"the conversation is {len(data)} bytes, over the {self.max_record_bytes} "
                "a stored response may hold: send store: false",
            )
        with redis_errors():
            await self._redis.set(self._key(response_id), data, px=int(self.ttl_s * 1000))

    async def get(self, response_id: str) -> StoredResponse | None:
        with redis_errors():
            data = await self._redis.get(self._key(response_id))
        return None if data is None else StoredResponse.from_json(data)

    async def delete(self, response_id: str) -> bool:
        """Forget the response; False if there was none."""
        with redis_errors():
            return bool(await self._redis.delete(self._key(response_id)))

    async def close(self) -> None:
        await self._redis.aclose()
