"""Redis discovery: the workers heartbeating their load into the `WorkerRegistry`."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable

from redis.exceptions import RedisError

from pdserve.core.workers import WorkerInfo
from pdserve.router.discovery.pool import Refresher, WorkerPool
from pdserve.state.registry import WorkerRegistry

log = logging.getLogger(__name__)


class HeartbeatAges:
    """When this router last saw each worker's heartbeat move, by its own clock.

    A worker whose heartbeat has not moved for `stale_after_s` is shown unhealthy. Redis'
    key expiry says the same while Redis answers; this says it when Redis cannot be asked,
    so a snapshot that outlives the workers in it (Redis gone with them) does not route
    to them for ever. Only heartbeat times of one worker are compared with each other,
    so no clock is compared across machines.
    """

    def __init__(self, stale_after_s: float):
        self.stale_after_s = stale_after_s
        self._seen: dict[str, tuple[float, float]] = {}  # worker id -> (updated_at, seen at)
        self._stale: set[str] = set()  # worker ids judged stale last time (logged once)

    def judge(self, workers: Iterable[WorkerInfo], now: float) -> list[WorkerInfo]:
        """`workers` as listed, the stale ones replaced by unhealthy copies."""
        seen, stale, judged = {}, set(), []
        for worker in workers:
            updated_at, seen_at = self._seen.get(worker.worker_id, (None, now))
            if updated_at != worker.updated_at:  # a new heartbeat (or the first one seen)
                seen_at = now
            seen[worker.worker_id] = (worker.updated_at, seen_at)
            if now - seen_at < self.stale_after_s:
                judged.append(worker)
                continue
            stale.add(worker.worker_id)
            if worker.worker_id not in self._stale:
                log.warning("worker %s: no heartbeat for %.1fs", worker.address, now - seen_at)
            judged.append(dataclasses.replace(worker, healthy=False))
        self._seen, self._stale = seen, stale
        return judged


class RedisDiscovery:
    """The workers heartbeating into the registry, listed every `refresh_interval_s`.

    Each info is the worker's own (its block size and cached block hashes included).
    When Redis cannot be reached the last listing stays in use (logged once per outage):
    routing on slightly stale load beats routing nowhere, and `mark_unhealthy` still
    removes the workers that fail. But only for the registry's TTL: a worker whose
    heartbeat this router has not seen move for that long is unhealthy (`HeartbeatAges`),
    as its key in Redis would have expired. A suspect comes back with its next heartbeat.
    The registry belongs to the caller, who closes it.
    """

    def __init__(self, registry: WorkerRegistry, refresh_interval_s: float = 0.5):
        if refresh_interval_s <= 0:
            raise ValueError(f"refresh_interval_s must be > 0, got {refresh_interval_s}")
        self.registry = registry
        self._pool = WorkerPool()
        self._listed: list[WorkerInfo] = []  # the last listing Redis answered
        self._ages = HeartbeatAges(stale_after_s=registry.ttl_s)
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
            self._listed = await self.registry.list()
        except (RedisError, OSError) as exc:
            if not self._failing:
                log.warning("cannot list workers, keeping the last snapshot: %r", exc)
            self._failing = True
        else:
            if self._failing:
                log.info("listing workers works again")
            self._failing = False
        self._pool.replace(self._ages.judge(self._listed, time.monotonic()))

    def workers(self, role: str) -> list[WorkerInfo]:
        return self._pool.workers(role)

    def mark_unhealthy(self, address: str) -> None:
        # the worker's own heartbeat time, so no clock is compared across machines
        known = self._pool.get(address)
        self._pool.mark_unhealthy(address, known.updated_at if known is not None else 0.0)
