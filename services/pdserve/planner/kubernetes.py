"""The pools' replica counts through the Kubernetes API: the apps/v1 `scale` subresource of
the prefill and decode Deployments, the only thing the planner's Role lets it touch
(get and patch on `deployments/scale`, limited to those two names).

The `kubernetes` client is synchronous; the planner's loop calls it from a thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kubernetes import client as k8s

from pdserve.planner.capacity import Pool

MERGE_PATCH = "application/merge-patch+json"


class ScaleError(RuntimeError):
    """The API server refused a read or a change of a Deployment's scale."""


@dataclass(slots=True)
class DeploymentScaler:
    api_client: k8s.ApiClient
    namespace: str
    deployments: Mapping[Pool, str]  # pool -> its Deployment's name
    _apps: k8s.AppsV1Api = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._apps = k8s.AppsV1Api(self.api_client)

    def replicas(self, pool: Pool) -> int:
        """The replicas the pool's Deployment asks for (spec, not the ready count: a pod
        still loading its model counts, so the planner does not add another for it)."""
        name = self.deployments[pool]
        try:
            scale = self._apps.read_namespaced_deployment_scale(name, self.namespace)
        except k8s.ApiException as exc:
            raise ScaleError(self._refused("read", name, exc)) from exc
        return int(scale.spec.replicas or 0)

    def scale(self, pool: Pool, replicas: int) -> None:
        name = self.deployments[pool]
        body = {"spec": {"replicas": replicas}}
        try:
            self._apps.patch_namespaced_deployment_scale(
                name, self.namespace, body, _content_type=MERGE_PATCH
            )
        except k8s.ApiException as exc:
            raise ScaleError(self._refused(f"scale to {replicas}", name, exc)) from exc

    def _refused(self, what: str, name: str, exc: k8s.ApiException) -> str:
        return (
            f"cannot {what} deployments/{name} in namespace {self.namespace}: "
            f"{exc.status} {exc.reason}"
        )
