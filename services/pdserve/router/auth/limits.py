"""Per-key limits in Redis, so that every router of a cluster spends one budget.

Three limits (`KeyLimits`), each checked when a generation is admitted:

- requests per minute: generations started in the last `window_s` (60 s);
- tokens per minute: prompt + output tokens of the generations that ended in the last
  `window_s`; a key at or over it is refused until enough of them age out (a request's
  tokens are known only at its end, so one long request may take a key past its budget);
- concurrent requests: a sorted set of the key's running generations, each scored by
  its expiry. The router holding a slot renews it every third of `slot_ttl_s`, and
  releases it when the generation ends; a router that dies stops renewing, and its
  slots expire within `slot_ttl_s`, so a crash leaks no slot for longer.

The windows are sliding, in one-second buckets: a hash per key and limit, field = the
second (Redis' clock, `TIME`, so the routers' clocks do not matter), value = the count.
Admission is one Lua script (atomic): it checks all three and charges the request and
its slot only if all pass, so a refused request costs nothing. Keys (prefix `pdserve`):

    {prefix}:apikey:{id}:rpm     hash, second -> requests started
    {prefix}:apikey:{id}:tpm     hash, second -> tokens counted
    {prefix}:apikey:{id}:slots   sorted set, slot id -> expiry (unix seconds)
"""

from __future__ import annotations

import asyncio
import enum
import logging
import uuid

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from pdserve.core.errors import StateUnavailableError
from pdserve.router.auth.caller import Caller

log = logging.getLogger(__name__)
WINDOW_S = 60.0
SLOT_TTL_S = 30.0
CONCURRENCY_RETRY_S = 1.0  # a running request ends when it ends: a hint, not a promise
CONNECT_TIMEOUT_S, SOCKET_TIMEOUT_S = 0.25, 0.5  # as the request store: fail within a second

_WINDOW_FUNCTIONS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local function usage(key, window)
  local total, buckets = 0, {}
  local fields = redis.call('HGETALL', key)
  for i = 1, #fields, 2 do
    local at, n = tonumber(fields[i]), tonumber(fields[i + 1])
    if at <= now - window then
      redis.call('HDEL', key, fields[i])
    else
      total = total + n
      buckets[#buckets + 1] = {at, n}
    end
  end
  table.sort(buckets, function(a, b) return a[1] < b[1] end)
  return total, buckets
end
local function wait_ms(buckets, excess, window)
  for _, bucket in ipairs(buckets) do
    excess = excess - bucket[2]
    if excess <= 0 then return math.ceil((bucket[1] + window - now) * 1000) end
  end
  return math.ceil(window * 1000)
end
local function charge(key, n, window)
  redis.call('HINCRBY', key, math.floor(now), n)
  redis.call('EXPIRE', key, math.ceil(window) + 1)
end
"""
# KEYS: rpm, tpm, slots. ARGV: rpm limit, tpm limit, concurrency limit, window s, slot ttl s,
# slot id. Returns {0} when admitted, else {limit kind (1, 2, 3), retry after ms}.
_ADMIT = (
    _WINDOW_FUNCTIONS
    + """
local rpm, tpm, concurrency = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local window, ttl = tonumber(ARGV[4]), tonumber(ARGV[5])
if rpm > 0 then
  local total, buckets = usage(KEYS[1], window)
  if total + 1 > rpm then return {1, wait_ms(buckets, total + 1 - rpm, window)} end
end
if tpm > 0 then
  local total, buckets = usage(KEYS[2], window)
  if total >= tpm then return {2, wait_ms(buckets, total - tpm + 1, window)} end
end
if concurrency > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) >= concurrency then return {3, -1} end
  redis.call('ZADD', KEYS[3], now + ttl, ARGV[6])
  redis.call('EXPIRE', KEYS[3], math.ceil(ttl) + 1)
end
if rpm > 0 then charge(KEYS[1], 1, window) end
return {0}
"""
)
# KEYS: tpm. ARGV: tokens, window s.
_COUNT_TOKENS = _WINDOW_FUNCTIONS + "charge(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]))"
# KEYS: slot sets; ARGV: ttl s, then one slot id per key. Extends only slots still there.
_RENEW = """
local t = redis.call('TIME')
local expiry = tonumber(t[1]) + tonumber(t[2]) / 1e6 + tonumber(ARGV[1])
for i, key in ipairs(KEYS) do
  redis.call('ZADD', key, 'XX', expiry, ARGV[i + 1])
  redis.call('EXPIRE', key, math.ceil(tonumber(ARGV[1])) + 1)
end
return #KEYS
"""


class LimitKind(enum.IntEnum):
    """Which limit refused a request (the admission script's code)."""

    REQUESTS_PER_MINUTE = 1
    TOKENS_PER_MINUTE = 2
    CONCURRENT_REQUESTS = 3

    def describe(self, caller: Caller) -> str:
        limits = caller.limits
        return {
            LimitKind.REQUESTS_PER_MINUTE: f"{limits.requests_per_minute} requests per minute",
            LimitKind.TOKENS_PER_MINUTE: f"{limits.tokens_per_minute} tokens per minute",
            LimitKind.CONCURRENT_REQUESTS: f"{limits.concurrent_requests} concurrent requests",
        }[self]


class RateLimitedError(Exception):
    """The caller's key is over one of its limits; it may try again after `retry_after_s`."""

    def __init__(self, caller: Caller, kind: LimitKind, retry_after_s: float):
        self.key_id, self.kind, self.retry_after_s = caller.key_id, kind, retry_after_s
        super().__init__(
            f"API key {caller.key_id} is over its limit of {kind.describe(caller)}: "
            f"retry in {retry_after_s:.1f} s"
        )


class Slot:
    """One admitted generation of a key with a concurrency limit; `release` at its end."""

    __slots__ = ("limiter", "key", "member")

    def __init__(self, limiter: KeyLimiter | None, key: str = "", member: str = ""):
        self.limiter, self.key, self.member = limiter, key, member

    def release(self) -> None:
        """Give the slot back (in the background: safe in a `finally` of a cancelled task)."""
        limiter, self.limiter = self.limiter, None
        if limiter is not None:
            limiter.release(self)


NO_SLOT = Slot(None)  # what a key without a concurrency limit is admitted with


class KeyLimiter:
    """Admits generations under their caller's `KeyLimits`, one budget for all routers."""

    def __init__(
        self,
        redis_url: str,
        *,
        key_prefix: str = "pdserve",
        window_s: float = WINDOW_S,
        slot_ttl_s: float = SLOT_TTL_S,
    ):
        self.prefix, self.window_s, self.slot_ttl_s = key_prefix, window_s, slot_ttl_s
        self._redis = aioredis.Redis.from_url(
            redis_url,
            socket_timeout=SOCKET_TIMEOUT_S,
            socket_connect_timeout=CONNECT_TIMEOUT_S,
            retry=Retry(NoBackoff(), 0),
        )
        self._admit = self._redis.register_script(_ADMIT)
        self._count = self._redis.register_script(_COUNT_TOKENS)
        self._renew = self._redis.register_script(_RENEW)
        self._held: dict[str, Slot] = {}  # slot id -> the slot, renewed while held
        self._background: set[asyncio.Task] = set()
        self._renewer: asyncio.Task | None = None

    def key(self, key_id: str, limit: str) -> str:
        return f"{self.prefix}:apikey:{key_id}:{limit}"

    async def admit(self, caller: Caller) -> Slot:
        """Admit one generation of `caller` (charging its requests per minute), or raise
        RateLimitedError; StateUnavailableError when Redis does not answer."""
        limits = caller.limits
        if not limits.any:
            return NO_SLOT
        member = uuid.uuid4().hex
        keys = [self.key(caller.key_id, name) for name in ("rpm", "tpm", "slots")]
        args = [
            limits.requests_per_minute,
            limits.tokens_per_minute,
            limits.concurrent_requests,
            self.window_s,
            self.slot_ttl_s,
            member,
        ]
        try:
            reply = await self._admit(keys=keys, args=args)
        except (RedisError, OSError) as exc:
            raise StateUnavailableError(f"the API key's limits cannot be checked: {exc}") from exc
        if reply[0] != 0:
            kind, wait_ms = LimitKind(int(reply[0])), int(reply[1])
            retry_after_s = CONCURRENCY_RETRY_S if wait_ms < 0 else wait_ms / 1000
            raise RateLimitedError(caller, kind, retry_after_s)
        if not limits.concurrent_requests:
            return NO_SLOT
        slot = Slot(self, keys[2], member)
        self._held[member] = slot
        self._ensure_renewer()
        return slot

    def count_tokens(self, caller: Caller, num_tokens: int) -> None:
        """Add a finished generation's tokens to its key's minute (in the background)."""
        if caller.limits.tokens_per_minute and num_tokens > 0:
            key = self.key(caller.key_id, "tpm")
            self._in_background(self._count(keys=[key], args=[num_tokens, self.window_s]))

    def release(self, slot: Slot) -> None:
        if self._held.pop(slot.member, None) is not None:
            self._in_background(self._redis.zrem(slot.key, slot.member))

    @property
    def num_held(self) -> int:
        return len(self._held)

    async def wait_written(self) -> None:
        """Until every background write so far (token counts, releases) has landed."""
        await asyncio.gather(*self._background, return_exceptions=True)

    async def close(self) -> None:
        """Give back every held slot, then close the connection."""
        if self._renewer is not None:
            self._renewer.cancel()
        for slot in list(self._held.values()):
            slot.release()
        await self.wait_written()
        await self._redis.aclose()

    def _in_background(self, write) -> None:
        task = asyncio.ensure_future(self._quietly(write))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @staticmethod
    async def _quietly(write) -> None:
        try:
            await write
        except (RedisError, OSError) as exc:  # a slot then expires by its TTL
            log.warning("API key limits: a write to Redis failed: %s", exc)

    def _ensure_renewer(self) -> None:
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.create_task(self._renew_held(), name="api-key-slots")

    async def _renew_held(self) -> None:
        """Every third of the TTL, push the expiry of every held slot up (one round trip)."""
        while self._held:
            await asyncio.sleep(self.slot_ttl_s / 3)
            held = list(self._held.values())
            if not held:
                break
            args = [self.slot_ttl_s, *(slot.member for slot in held)]
            await self._quietly(self._renew(keys=[slot.key for slot in held], args=args))
