"""Health and load by asking each worker (`GetLoad`): the static and Kubernetes modes."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Collection

import grpc

from pdserve.api.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2_grpc
from pdserve.core.workers import WorkerInfo
from pdserve.router.discovery.pool import Refresher, WorkerPool
from pdserve.rpc.tls import ChannelTls
from pdserve.rpc.wire.router import worker_info_from_load

log = logging.getLogger(__name__)

# (address, role) -> the worker's load, or None when it cannot be reached
LoadFn = Callable[[str, str], Awaitable[WorkerInfo | None]]


class GrpcLoadProbe:
    """The default `LoadFn`: `GetLoad` over one cached grpc.aio channel per address (mTLS
    with `tls`; once its files change, each address gets a channel with the new ones)."""

    def __init__(self, timeout_s: float = 1.0, tls: ChannelTls | None = None):
        self.timeout_s = timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._tls = tls or ChannelTls()
        self._generation = self._tls.generation

    async def __call__(self, address: str, role: str) -> WorkerInfo | None:
        if self._tls.generation != self._generation:  # polls are short: close at once
            self._generation = self._tls.generation
            await self.close()
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self._tls.aio_channel(address)
        if role == "prefill":
            stub = prefill_pb2_grpc.PrefillStub(channel)
        else:
            stub = decode_pb2_grpc.DecodeStub(channel)
        try:
            load = await stub.GetLoad(decode_pb2.GetLoadRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            log.debug("GetLoad on %s failed: %s %s", address, exc.code(), exc.details())
            return None
        return worker_info_from_load(load, address=address, role=role, updated_at=time.time())

    async def retain(self, addresses: Collection[str]) -> None:
        """Close the channels of addresses no longer polled."""
        for address in [a for a in self._channels if a not in addresses]:
            await self._channels.pop(address).close()

    async def close(self) -> None:
        await self.retain(())


class LoadPoller:
    """Polls every target's load into a `WorkerPool`, every interval or at once on change.

    The poller stamps each info's `updated_at` with the poll's start, so a suspect is
    cleared only by a poll that began after the router saw it fail.
    """

    def __init__(self, load_fn: LoadFn | None, interval_s: float, probe_timeout_s: float):
        if interval_s <= 0:
            raise ValueError(f"poll interval must be > 0, got {interval_s}")
        # a GrpcLoadProbe given (one with TLS) is the poller's to retain and close, as its own
        if isinstance(load_fn, GrpcLoadProbe):
            self._probe: GrpcLoadProbe | None = load_fn
        else:
            self._probe = GrpcLoadProbe(probe_timeout_s) if load_fn is None else None
        self.load_fn: LoadFn = load_fn or self._probe
        self.probe_timeout_s = probe_timeout_s
        self.pool = WorkerPool()
        self._targets: dict[str, str] = {}  # address -> role
        self._refresher = Refresher(self.poll_once, interval_s)

    @property
    def interval_s(self) -> float:
        return self._refresher.interval_s

    def set_targets(self, targets: dict[str, str]) -> None:
        """Poll these (address -> role) from now on; departed ones leave the pool at once."""
        self._targets = dict(targets)
        self.pool.replace(w for w in self.pool.all() if w.address in self._targets)
        self._refresher.wake()

    def mark_unhealthy(self, address: str) -> None:
        self.pool.mark_unhealthy(address, time.time())

    async def start(self) -> None:
        await self._refresher.start()

    async def stop(self) -> None:
        await self._refresher.stop()
        if self._probe is not None:
            await self._probe.close()

    async def poll_once(self) -> None:
        targets = self._targets
        if self._probe is not None:
            await self._probe.retain(targets)
        started = time.time()
        polled = await asyncio.gather(
            *(self._load(address, role, started) for address, role in targets.items())
        )
        for info in polled:
            before = self.pool.get(info.address)
            if before is not None and before.healthy != info.healthy:
                log.info("worker %s is %s", info.address, "up" if info.healthy else "unreachable")
        # targets may have changed while we polled: keep only the current ones
        self.pool.replace(info for info in polled if info.address in self._targets)

    async def _load(self, address: str, role: str, started: float) -> WorkerInfo:
        try:
            info = await asyncio.wait_for(self.load_fn(address, role), self.probe_timeout_s)
        except TimeoutError:
            info = None
        except Exception:  # a broken load_fn must not stop the polling of everyone else
            log.exception("load_fn failed for %s", address)
            info = None
        if info is None:
            return WorkerInfo(
                worker_id=address, role=role, address=address, healthy=False, updated_at=started
            )
        return dataclasses.replace(info, updated_at=started)
