"""Kubernetes discovery: the ready endpoints of the prefill and decode Services.

Each Service's EndpointSlices are listed, then watched, in a thread (the `kubernetes`
client is synchronous); load is polled from each endpoint's `GetLoad`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable
from http import HTTPStatus

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.watch import Watch

from pdserve.core.workers import WorkerInfo
from pdserve.router.discovery.polling import LoadFn, LoadPoller
from pdserve.router.discovery.pool import merge_roles

log = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"


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
