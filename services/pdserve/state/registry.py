"""The worker registry in Redis: each worker heartbeats its load; routers list the live ones.

Keys (prefix `pdserve` by default):

    {prefix}:worker:{worker_id}   string, the WorkerInfo as JSON, expiring after ttl_s
    {prefix}:workers              set of worker ids that may have a live key

Redis' own key expiry is the liveness clock, so a dead worker drops out within ttl_s with
no clock shared between machines. `list` costs two round trips for any number of workers
(SMEMBERS, then one MGET) and removes the ids whose key has expired, so the set stays as
small as the live pool. A worker that heartbeats again between that MGET and SREM is
missing from the set until its next heartbeat re-adds it: one heartbeat interval at most.
Expiry needs Redis to answer, so routers also age what they last listed: a worker whose
heartbeat a router has not seen move for ttl_s is unhealthy there, Redis or not
(`router.discovery.registry.HeartbeatAges`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from pdserve.core.workers import MAX_CACHED_BLOCK_HASHES, WorkerInfo

log = logging.getLogger(__name__)


class WorkerRegistry:
    """Publish and list workers in Redis (layout in the module docstring)."""

    def __init__(self, redis_url: str, *, key_prefix: str = "pdserve", ttl_s: float = 3.0):
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self.key_prefix = key_prefix
        self._index_key = f"{key_prefix}:workers"
        # a call slower than the TTL is useless to a heartbeat, so none waits longer
        self._redis = aioredis.Redis.from_url(
            redis_url, socket_timeout=ttl_s, socket_connect_timeout=ttl_s
        )

    def _worker_key(self, worker_id: str) -> str:
        return f"{self.key_prefix}:worker:{worker_id}"

    async def publish(self, info: WorkerInfo) -> None:
        """Write the worker's info, live for ttl_s from now (one heartbeat).

        `updated_at` is stamped here, so every heartbeat carries a newer one than the last.
        """
        info = dataclasses.replace(
            info,
            cached_block_hashes=info.cached_block_hashes[-MAX_CACHED_BLOCK_HASHES:],
            updated_at=time.time(),
        )
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(self._worker_key(info.worker_id), info.to_json(), px=self._ttl_ms)
            pipe.sadd(self._index_key, info.worker_id)
            await pipe.execute()

    async def remove(self, worker_id: str) -> None:
        """Drop the worker at once (graceful shutdown) instead of waiting for its TTL."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._worker_key(worker_id))
            pipe.srem(self._index_key, worker_id)
            await pipe.execute()

    async def list(self, role: str | None = None) -> list[WorkerInfo]:
        """The live workers, ordered by worker id; with `role`, only those serving it."""
        members = await self._redis.smembers(self._index_key)
        worker_ids = sorted(member.decode() for member in members)
        if not worker_ids:
            return []
        values = await self._redis.mget([self._worker_key(w) for w in worker_ids])
        expired = [w for w, value in zip(worker_ids, values, strict=True) if value is None]
        if expired:
            await self._redis.srem(self._index_key, *expired)
        workers = [WorkerInfo.from_json(value) for value in values if value is not None]
        return [w for w in workers if role is None or w.serves(role)]

    async def close(self) -> None:
        await self._redis.aclose()

    @property
    def _ttl_ms(self) -> int:
        return max(1, round(self.ttl_s * 1000))


async def heartbeat(
    registry: WorkerRegistry,
    info_fn: Callable[[], WorkerInfo],
    interval_s: float = 1.0,
    *,
    stop: asyncio.Event,
) -> None:
    """Publish `info_fn()` every `interval_s` until `stop` is set, then remove the worker.

    A Redis error never ends the loop: it is logged (once per outage) and the next tick
    tries again, so the worker reappears as soon as Redis does.
    """
    if not 0 < interval_s < registry.ttl_s:
        raise ValueError(
            f"interval_s must be in (0, ttl_s={registry.ttl_s}), got {interval_s}: "
            "a worker would expire between its heartbeats"
        )
    worker_id = None
    failing = False
    while not stop.is_set():
        info = info_fn()
        worker_id = info.worker_id
        try:
            await registry.publish(info)
        except (RedisError, OSError) as exc:
            if not failing:
                log.warning("heartbeat of worker %s failed, retrying: %r", worker_id, exc)
            failing = True
        else:
            if failing:
                log.info("heartbeat of worker %s recovered", worker_id)
            failing = False
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
        except TimeoutError:
            pass
    if worker_id is None:
        return
    try:
        await registry.remove(worker_id)
    except (RedisError, OSError) as exc:
        log.warning(
            "could not remove worker %s (it expires in %ss): %r", worker_id, registry.ttl_s, exc
        )
