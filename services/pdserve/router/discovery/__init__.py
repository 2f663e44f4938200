"""The router's view of the worker pools: who serves prefill and decode, and how loaded.

Three modes behind one protocol (`Discovery`, in `pool`):

- `RedisDiscovery` (`registry`): workers heartbeat their load into the `WorkerRegistry`;
  the router lists it every refresh interval.
- `StaticDiscovery` (`static`): fixed addresses (flags); load polled from each worker's
  `GetLoad` (`polling`).
- `KubernetesDiscovery` (`endpoint_slices`): the ready endpoints of the prefill and
  decode Services, watched through their EndpointSlices; load polled as in static mode.

Each keeps a snapshot in memory that `workers()` reads without I/O, so routing never waits
on discovery. Snapshots hold `WorkerInfo`s as the workers report them (block size
included) that are never mutated once handed out (policies cache per-snapshot state by
identity): a refresh builds new ones.

The Kubernetes names load on first use, so that a router in the other modes does not
import the `kubernetes` client.
"""

from __future__ import annotations

import importlib

from pdserve.router.discovery.polling import GrpcLoadProbe, LoadFn, LoadPoller
from pdserve.router.discovery.pool import PHASES, Discovery, Refresher, WorkerPool, merge_roles
from pdserve.router.discovery.registry import RedisDiscovery
from pdserve.router.discovery.static import StaticDiscovery

_KUBERNETES = "pdserve.router.discovery.endpoint_slices"
_LAZY = {
    "SERVICE_NAME_LABEL": _KUBERNETES,
    "EndpointSliceWatch": _KUBERNETES,
    "KubernetesDiscovery": _KUBERNETES,
    "WatchTimeouts": _KUBERNETES,
    "default_api_client": _KUBERNETES,
    "ready_addresses": _KUBERNETES,
}
__all__ = [  # noqa: F822 (the Kubernetes names load in __getattr__)
    "PHASES",
    "SERVICE_NAME_LABEL",
    "Discovery",
    "EndpointSliceWatch",
    "GrpcLoadProbe",
    "KubernetesDiscovery",
    "LoadFn",
    "LoadPoller",
    "RedisDiscovery",
    "Refresher",
    "StaticDiscovery",
    "WatchTimeouts",
    "WorkerPool",
    "default_api_client",
    "merge_roles",
    "ready_addresses",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
