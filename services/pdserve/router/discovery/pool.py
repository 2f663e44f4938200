"""What every discovery mode shares: the protocol, the pool snapshot, the refresh loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol

from pdserve.core.protocol import IncompatiblePeerError, check_peer
from pdserve.core.workers import WorkerInfo

log = logging.getLogger(__name__)

PHASES = ("prefill", "decode")


class Discovery(Protocol):
    async def start(self) -> None:
        """Take a first snapshot, then keep it current in background tasks."""
        ...

    async def stop(self) -> None:
        """Stop the background tasks; the snapshot stays readable."""
        ...

    def workers(self, role: str) -> list[WorkerInfo]:
        """Healthy workers serving `role` ("both" workers count for either), by address."""
        ...

    def mark_unhealthy(self, address: str) -> None:
        """The router saw UNAVAILABLE: exclude the worker until a refresh proves it alive."""
        ...


class WorkerPool:
    """A snapshot of workers by address, minus the ones the router saw fail.

    A failed worker is a suspect until an info newer than its threshold arrives: a later
    heartbeat (Redis) or a poll started after the failure (GetLoad).
    """

    def __init__(self) -> None:
        self._workers: dict[str, WorkerInfo] = {}
        self._suspects: dict[str, float] = {}  # address -> threshold on updated_at
        self._refused: set[str] = set()  # workers left out for their protocol version

    def replace(self, workers: Iterable[WorkerInfo]) -> None:
        latest: dict[str, WorkerInfo] = {}
        for worker in _compatible(workers, self._refused):
            # a restarted worker may briefly be listed twice (old id not yet expired)
            known = latest.get(worker.address)
            if known is None or worker.updated_at > known.updated_at:
                latest[worker.address] = worker
        self._workers = latest
        self._suspects = {
            address: threshold
            for address, threshold in self._suspects.items()
            if address in latest and latest[address].updated_at <= threshold
        }

    def get(self, address: str) -> WorkerInfo | None:
        return self._workers.get(address)

    def all(self) -> list[WorkerInfo]:
        return list(self._workers.values())

    def workers(self, role: str) -> list[WorkerInfo]:
        return [
            worker
            for address, worker in sorted(self._workers.items())
            if worker.healthy and address not in self._suspects and worker.serves(role)
        ]

    def mark_unhealthy(self, address: str, threshold: float) -> None:
        self._suspects[address] = threshold


def _compatible(workers: Iterable[WorkerInfo], refused: set[str]) -> Iterable[WorkerInfo]:
    """The workers whose protocol version this router works with; a warning, once per
    worker, for each left out (a rolling upgrade gone more than one release apart)."""
    for worker in workers:
        try:
            check_peer(worker.protocol_version, f"worker {worker.worker_id} ({worker.address})")
        except IncompatiblePeerError as exc:
            if worker.address not in refused:
                refused.add(worker.address)
                log.warning("not routing to it: %s", exc)
            continue
        refused.discard(worker.address)
        yield worker


def merge_roles(pools: Iterable[tuple[str, Iterable[str]]]) -> dict[str, str]:
    """address -> role from (role, addresses) pairs; an address in both phases is "both"."""
    phases: dict[str, set[str]] = {}
    for role, addresses in pools:
        for address in addresses:
            phases.setdefault(address, set()).update(PHASES if role == "both" else (role,))
    return {a: "both" if len(p) == len(PHASES) else next(iter(p)) for a, p in phases.items()}


class Refresher:
    """Runs `refresh` once on `start`, then in a task every `interval_s`, or at once when
    woken. `refresh` must not raise: it keeps the last snapshot when its source fails."""

    def __init__(self, refresh: Callable[[], Awaitable[None]], interval_s: float):
        self.refresh = refresh
        self.interval_s = interval_s
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._run())

    def wake(self) -> None:
        """Refresh now instead of at the end of the interval."""
        self._wake.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            self._wake.clear()
            await self.refresh()
