"""Cancel across routers: a Cancel may reach a router other than the one running it.

One Redis pub/sub channel; every router subscribes and cancels the requests it runs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

log = logging.getLogger(__name__)
RESUBSCRIBE_DELAY_S = 1.0


class CancelBus:
    def __init__(self, redis_url: str, channel: str = "pdserve:cancel"):
        self._redis = aioredis.Redis.from_url(redis_url, socket_connect_timeout=0.5)
        self._channel = channel
        self._task: asyncio.Task | None = None

    async def start(self, on_cancel: Callable[[str], Awaitable[None]]) -> None:
        """Call on_cancel(request_id) for every cancel any router publishes."""
        self._task = asyncio.create_task(self._listen(on_cancel))

    async def publish(self, request_id: str) -> None:
        await self._redis.publish(self._channel, request_id)

    async def _listen(self, on_cancel: Callable[[str], Awaitable[None]]) -> None:
        while True:  # Redis may come and go; keep listening
            try:
                async with self._redis.pubsub() as pubsub:
                    await pubsub.subscribe(self._channel)
                    async for message in pubsub.listen():
                        if message["type"] == "message":
                            await on_cancel(message["data"].decode())
            except RedisError as exc:
                log.warning("cancel bus: %s; resubscribing", exc)
                await asyncio.sleep(RESUBSCRIBE_DELAY_S)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self._redis.aclose()
