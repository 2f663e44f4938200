"""Redis discovery: the workers heartbeating their load into the `WorkerRegistry`."""

from __future__ import annotations

import logging

from redis.exceptions import RedisError

from pdserve.core.workers import WorkerInfo
from pdserve.router.discovery.pool import Refresher, WorkerPool
from pdserve.state.registry import WorkerRegistry

log = logging.getLogger(__name__)


class RedisDiscovery:
    """The workers heartbeating into the registry, listed every `refresh_interval_s`.

    Each info is the worker's own (its block size and cached block hashes included).
    When Redis cannot be reached the last snapshot stays in use (logged once per outage):
    routing on slightly stale load beats routing nowhere, and `mark_unhealthy` still
    removes the workers that fail. A suspect comes back with its next heartbeat. The
    registry belongs to the caller, who closes it.
    """

    def __init__(self, registry: WorkerRegistry, refresh_interval_s: float = 0.5):
        if refresh_interval_s <= 0:
            raise ValueError(f"refresh_interval_s must be > 0, got {refresh_interval_s}")
        self.registry = registry
        self._pool = WorkerPool()
        self._failing = False
        self._refresher = Refresher(self.refresh, refresh_interval_s)

    @property
    def refresh_interval_s(self) -> float:
        return self._refresher.interval_s

    async def start(self) -> None:
        await self._refresher.start()

    async def stop(self) -> None:
        await self._refresher.stop()

    async def refresh(self) -> None:
        """List the registry now (the background task also does, every interval)."""
        try:
            workers = await self.registry.list()
        except (RedisError, OSError) as exc:
            if not self._failing:
                log.warning("cannot list workers, keeping the last snapshot: %r", exc)
            self._failing = True
            return
        if self._failing:
            log.info("listing workers works again")
        self._failing = False
        self._pool.replace(workers)

    def workers(self, role: str) -> list[WorkerInfo]:
        return self._pool.workers(role)

    def mark_unhealthy(self, address: str) -> None:
        # the worker's own heartbeat time, so no clock is compared across machines
        known = self._pool.get(address)
        self._pool.mark_unhealthy(address, known.updated_at if known is not None else 0.0)
