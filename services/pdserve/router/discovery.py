"""The router's view of the worker pools: who serves prefill and decode, and how loaded.

Three backends behind one protocol:

- `RedisDiscovery`: workers heartbeat their load into the `WorkerRegistry`; the router
  lists it every refresh interval.
- `StaticDiscovery`: fixed addresses (flags); load polled from each worker's `GetLoad`.
- `KubernetesDiscovery`: the ready endpoints of the prefill and decode Services, watched
  through their EndpointSlices; load polled from each worker's `GetLoad`.

Each keeps a snapshot in memory that `workers()` reads without I/O, so routing never waits
on discovery. Snapshots hold `WorkerInfo`s that are never mutated once handed out
(policies cache per-snapshot state by identity): a refresh builds new ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from http import HTTPStatus
from typing import Protocol

import grpc
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.watch import Watch
from redis.exceptions import RedisError

from pdserve.api.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2_grpc
from pdserve.core.workers import WorkerInfo
from pdserve.state.registry import WorkerRegistry

log = logging.getLogger(__name__)

# (address, role) -> the worker's load, or None when it cannot be reached
LoadFn = Callable[[str, str], Awaitable[WorkerInfo | None]]
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
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

    def replace(self, workers: Iterable[WorkerInfo]) -> None:
        latest: dict[str, WorkerInfo] = {}
        for worker in workers:
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


def merge_roles(pools: Iterable[tuple[str, Iterable[str]]]) -> dict[str, str]:
    """address -> role from (role, addresses) pairs; an address in both phases is "both"."""
    phases: dict[str, set[str]] = {}
    for role, addresses in pools:
        for address in addresses:
            phases.setdefault(address, set()).update(PHASES if role == "both" else (role,))
    return {a: "both" if len(p) == len(PHASES) else next(iter(p)) for a, p in phases.items()}


# -- load polling (Static and Kubernetes) --------------------------------------------------


class GrpcLoadProbe:
    """The default `LoadFn`: `GetLoad` over one cached grpc.aio channel per address."""

    def __init__(self, timeout_s: float = 1.0):
        self.timeout_s = timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def __call__(self, address: str, role: str) -> WorkerInfo | None:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(address)
        if role == "prefill":
            stub = prefill_pb2_grpc.PrefillStub(channel)
        else:
            stub = decode_pb2_grpc.DecodeStub(channel)
        try:
            load = await stub.GetLoad(decode_pb2.GetLoadRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            log.debug("GetLoad on %s failed: %s %s", address, exc.code(), exc.details())
            return None
        return WorkerInfo(
            worker_id=address,
            role=role,
            address=address,
            free_blocks=load.free_blocks,
            total_blocks=load.total_blocks,
            running=load.running,
            waiting=load.waiting,
            open_leases=load.open_leases,
            updated_at=time.time(),
        )

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
        self._probe = GrpcLoadProbe(probe_timeout_s) if load_fn is None else None
        self.load_fn: LoadFn = load_fn or self._probe
        self.interval_s = interval_s
        self.probe_timeout_s = probe_timeout_s
        self.pool = WorkerPool()
        self._targets: dict[str, str] = {}  # address -> role
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def set_targets(self, targets: dict[str, str]) -> None:
        """Poll these (address -> role) from now on; departed ones leave the pool at once."""
        self._targets = dict(targets)
        self.pool.replace(w for w in self.pool.all() if w.address in self._targets)
        self._wake.set()

    def mark_unhealthy(self, address: str) -> None:
        self.pool.mark_unhealthy(address, time.time())

    async def start(self) -> None:
        await self.poll_once()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._probe is not None:
            await self._probe.close()

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            self._wake.clear()
            await self.poll_once()

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


# -- Redis -------------------------------------------------------------------------------


class RedisDiscovery:
    """The workers heartbeating into the registry, listed every `refresh_interval_s`.

    When Redis cannot be reached the last snapshot stays in use (logged once per outage):
    routing on slightly stale load beats routing nowhere, and `mark_unhealthy` still
    removes the workers that fail. A suspect comes back with its next heartbeat. The
    registry belongs to the caller, who closes it.
    """

    def __init__(self, registry: WorkerRegistry, refresh_interval_s: float = 0.5):
        if refresh_interval_s <= 0:
            raise ValueError(f"refresh_interval_s must be > 0, got {refresh_interval_s}")
        self.registry = registry
        self.refresh_interval_s = refresh_interval_s
        self._pool = WorkerPool()
        self._failing = False
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

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

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_interval_s)
            await self.refresh()

    def workers(self, role: str) -> list[WorkerInfo]:
        return self._pool.workers(role)

    def mark_unhealthy(self, address: str) -> None:
        # the worker's own heartbeat time, so no clock is compared across machines
        known = self._pool.get(address)
        self._pool.mark_unhealthy(address, known.updated_at if known is not None else 0.0)


# -- Kubernetes --------------------------------------------------------------------------


def default_api_client() -> k8s.ApiClient:
    """In a pod, its service account; elsewhere, the kubeconfig (as kubectl finds it)."""
    configuration = k8s.Configuration()
    try:
        k8s_config.load_incluster_config(client_configuration=configuration)
    except k8s_config.ConfigException:
        k8s_config.load_kube_config(client_configuration=configuration)
    return k8s.ApiClient(configuration)


def ready_addresses(endpoint_slice: k8s.V1EndpointSlice, port_name: str) -> list[str]:
    """ "ip:port" of the slice's ready endpoints on the port named `port_name`.

    A missing ready condition counts as ready, as the API defines it. The controller
    writes one address per endpoint; later ones have no defined meaning, so only the
    first is used.
    """
    ports = [p.port for p in endpoint_slice.ports or () if (p.name or "") == port_name]
    if not ports or ports[0] is None:
        return []
    addresses = []
    for endpoint in endpoint_slice.endpoints or ():
        if endpoint.conditions is not None and endpoint.conditions.ready is False:
            continue
        host = endpoint.addresses[0]
        if endpoint_slice.address_type == "IPv6":
            host = f"[{host}]"
        addresses.append(f"{host}:{ports[0]}")
    return addresses


@dataclasses.dataclass(slots=True)
class WatchTimeouts:
    watch_s: int = 300  # the server ends each watch after this; we resume from its version
    request_s: float = 10.0  # connecting, and a whole list call
    retry_backoff_s: float = 1.0  # after an error other than 410 Gone


class EndpointSliceWatch:
    """One Service's ready addresses, kept current from a thread.

    List, then watch from the list's resourceVersion; when the server has forgotten that
    version (410 Gone) list again. Every change of the address set goes to `on_change`.
    """

    def __init__(
        self,
        api: k8s.DiscoveryV1Api,
        namespace: str,
        service: str,
        port_name: str,
        timeouts: WatchTimeouts,
    ):
        self.api, self.namespace, self.service = api, namespace, service
        self.port_name, self.timeouts = port_name, timeouts
        self.stopping = threading.Event()
        self._selector = f"{SERVICE_NAME_LABEL}={service}"
        self._slices: dict[str, list[str]] = {}  # slice name -> its ready addresses
        self._published: frozenset[str] | None = None
        self._watch: Watch | None = None

    def run(self, on_change: Callable[[str, frozenset[str]], None]) -> None:
        """The thread's body: returns once `interrupt` has been called."""
        resource_version = None
        while not self.stopping.is_set():
            try:
                if resource_version is None:
                    resource_version = self._list(on_change)
                resource_version = self._watch_from(resource_version, on_change)
            except k8s.ApiException as exc:
                if exc.status == HTTPStatus.GONE:
                    log.info("EndpointSlices of %s: version expired, listing again", self.service)
                else:
                    self._back_off(exc)
                resource_version = None
            except Exception as exc:  # connection errors, or a malformed object
                self._back_off(exc)

    def interrupt(self) -> None:
        """End `run` soon: stops the current watch by shutting its socket down."""
        self.stopping.set()
        if self._watch is not None:
            self._watch.stop()

    def _back_off(self, exc: Exception) -> None:
        if self.stopping.is_set():
            return  # interrupt() broke the connection on purpose
        log.warning(
            "watching EndpointSlices of %s/%s failed, retrying in %ss: %r",
            self.namespace,
            self.service,
            self.timeouts.retry_backoff_s,
            exc,
        )
        self.stopping.wait(self.timeouts.retry_backoff_s)

    def _list(self, on_change) -> str:
        result = self.api.list_namespaced_endpoint_slice(
            self.namespace, label_selector=self._selector, _request_timeout=self.timeouts.request_s
        )
        self._slices = {s.metadata.name: ready_addresses(s, self.port_name) for s in result.items}
        self._publish(on_change)
        return result.metadata.resource_version

    def _watch_from(self, resource_version: str, on_change) -> str:
        timeouts = self.timeouts
        self._watch = watch = Watch()
        events = watch.stream(
            self.api.list_namespaced_endpoint_slice,
            self.namespace,
            label_selector=self._selector,
            resource_version=resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=timeouts.watch_s,
            # the server ends the watch by watch_s; the read timeout only catches dead peers
            _request_timeout=(timeouts.request_s, timeouts.watch_s + timeouts.request_s),
        )
        with contextlib.closing(events):
            for event in events:
                if self.stopping.is_set():
                    break
                self._apply(event)
                self._publish(on_change)
        return watch.resource_version or resource_version

    def _apply(self, event: dict) -> None:
        if event["type"] == "BOOKMARK":
            return  # only moves the resource version, which Watch tracks
        endpoint_slice = event["object"]
        if event["type"] == "DELETED":
            self._slices.pop(endpoint_slice.metadata.name, None)
        else:  # ADDED, MODIFIED
            self._slices[endpoint_slice.metadata.name] = ready_addresses(
                endpoint_slice, self.port_name
            )

    def _publish(self, on_change) -> None:
        addresses = frozenset(
            a for slice_addresses in self._slices.values() for a in slice_addresses
        )
        if addresses != self._published:
            self._published = addresses
            on_change(self.service, addresses)


class KubernetesDiscovery:
    """The ready endpoints of the prefill and decode Services; load polled via `GetLoad`.

    Each Service's EndpointSlices (discovery.k8s.io/v1, label kubernetes.io/service-name)
    are listed and watched in a thread with the `kubernetes` client, which is synchronous;
    address changes hop onto the event loop, where the poller picks them up at once. One
    Service given for both roles (or a pod behind both Services) serves both phases.
    """

    def __init__(
        self,
        namespace: str,
        prefill_service: str,
        decode_service: str,
        port_name: str = "grpc",
        api_client: k8s.ApiClient | None = None,
        *,
        poll_interval_s: float = 0.5,
        load_fn: LoadFn | None = None,
        probe_timeout_s: float = 1.0,
        timeouts: WatchTimeouts | None = None,
    ):
        self._owns_api_client = api_client is None
        self._api_client = api_client or default_api_client()
        api = k8s.DiscoveryV1Api(self._api_client)
        self.timeouts = timeouts or WatchTimeouts()
        self._roles = {prefill_service: "prefill"}
        self._roles[decode_service] = "both" if decode_service == prefill_service else "decode"
        self._watches = [
            EndpointSliceWatch(api, namespace, service, port_name, self.timeouts)
            for service in self._roles
        ]
        self._addresses: dict[str, frozenset[str]] = {}  # service -> ready addresses
        self._synced = asyncio.Event()  # every Service has been listed once
        self._threads: list[asyncio.Future] = []
        self._poller = LoadPoller(load_fn, poll_interval_s, probe_timeout_s)

    async def start(self) -> None:
        """Start watching; waits (at most the request timeout) for the first lists."""
        loop = asyncio.get_running_loop()

        def on_change(service: str, addresses: frozenset[str]) -> None:
            loop.call_soon_threadsafe(self._set_addresses, service, addresses)

        self._threads = [
            asyncio.ensure_future(asyncio.to_thread(w.run, on_change)) for w in self._watches
        ]
        try:
            await asyncio.wait_for(self._synced.wait(), self.timeouts.request_s)
        except TimeoutError:
            log.warning("EndpointSlices not listed yet; starting with the services found")
        await self._poller.start()

    async def stop(self) -> None:
        pending = set(self._threads)
        while pending:
            # again and again: a watch that opens just after one interrupt needs another
            for watch in self._watches:
                watch.interrupt()
            _, pending = await asyncio.wait(pending, timeout=0.05)
        for thread in self._threads:
            thread.result()
        self._threads = []
        await self._poller.stop()
        if self._owns_api_client:
            self._api_client.close()

    async def refresh(self) -> None:
        """Poll every known worker now (the background task also does, every interval)."""
        await self._poller.poll_once()

    def _set_addresses(self, service: str, addresses: frozenset[str]) -> None:
        self._addresses[service] = addresses
        self._poller.set_targets(
            merge_roles((self._roles[s], a) for s, a in self._addresses.items())
        )
        if len(self._addresses) == len(self._roles):
            self._synced.set()

    def workers(self, role: str) -> list[WorkerInfo]:
        return self._poller.pool.workers(role)

    def mark_unhealthy(self, address: str) -> None:
        self._poller.mark_unhealthy(address)
