"""Static discovery: worker addresses fixed by flags, load polled from each worker."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.core.workers import WorkerInfo
from pdserve.router.discovery.polling import LoadFn, LoadPoller
from pdserve.router.discovery.pool import merge_roles


class StaticDiscovery:
    """Fixed worker addresses (from flags); load polled from each worker's `GetLoad`.

    An address listed for both prefill and decode (or in `both`) serves both phases.
    `load_fn` replaces the gRPC probe (None from it means unreachable).
    """

    def __init__(
        self,
        prefill: Sequence[str],
        decode: Sequence[str],
        both: Sequence[str] = (),
        poll_interval_s: float = 0.5,
        load_fn: LoadFn | None = None,
        probe_timeout_s: float = 1.0,
    ):
        self._poller = LoadPoller(load_fn, poll_interval_s, probe_timeout_s)
        pools = (("prefill", prefill), ("decode", decode), ("both", both))
        self._poller.set_targets(merge_roles(pools))

    async def start(self) -> None:
        await self._poller.start()

    async def stop(self) -> None:
        await self._poller.stop()

    async def refresh(self) -> None:
        """Poll every worker now (the background task also does, every interval)."""
        await self._poller.poll_once()

    def workers(self, role: str) -> list[WorkerInfo]:
        return self._poller.pool.workers(role)

    def mark_unhealthy(self, address: str) -> None:
        self._poller.mark_unhealthy(address)
