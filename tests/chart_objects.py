"""The rendered chart's objects, read the way Kubernetes reads them: which pods a selector
picks, what a pod runs, which service account it gets, what a NetworkPolicy admits.

Every assertion of tests/test_chart.py goes through these, on the rendered objects, never
on the template text.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

# a workload kind -> the path from the object to its pod template's spec and metadata
_POD_TEMPLATES: dict[str, tuple[str, ...]] = {
    "Deployment": ("spec", "template"),
    "StatefulSet": ("spec", "template"),
    "DaemonSet": ("spec", "template"),
    "ReplicaSet": ("spec", "template"),
    "Job": ("spec", "template"),
    "CronJob": ("spec", "jobTemplate", "spec", "template"),
}
HOOK_ANNOTATION = "helm.sh/hook"
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


class Role(enum.Enum):
    """What a pod of the release is, from the command its first container runs."""

    ROUTER = "router"
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"
    PLANNER = "planner"  # `pdserve planner`: no server, it scales the pools
    OTHER = "other"  # Redis, the helm test pod, anything not `pdserve router|serve|planner`

    @property
    def is_worker(self) -> bool:
        return self in (Role.PREFILL, Role.DECODE, Role.BOTH)

    @property
    def is_pdserve(self) -> bool:
        """A pdserve server: the router or a worker pool."""
        return self not in (Role.OTHER, Role.PLANNER)


def command_line(container: Mapping) -> list[str]:
    """The container's command then args, as the kubelet joins them."""
    return [*container.get("command", []), *container.get("args", [])]


def role_of(container: Mapping) -> Role:
    """`pdserve router ...` is the router, `pdserve serve ROLE ...` a worker (the image's
    entrypoint is `pdserve`, so the args alone may say it)."""
    words = command_line(container)
    if words and words[0].endswith("pdserve"):
        words = words[1:]
    if words[:1] == ["router"]:
        return Role.ROUTER
    if words[:1] == ["planner"]:
        return Role.PLANNER
    if words[:1] == ["serve"] and len(words) > 1:
        return Role(words[1])
    return Role.OTHER


@dataclass(frozen=True)
class Pod:
    """One pod template (or a bare Pod) of the rendered release."""

    owner: dict  # the workload object (or the Pod itself)
    labels: dict[str, str]
    spec: dict

    @property
    def name(self) -> str:
        return f"{self.owner['kind']}/{self.owner['metadata']['name']}"

    @property
    def containers(self) -> list[dict]:
        return self.spec.get("containers", [])

    @property
    def all_containers(self) -> list[dict]:
        return [*self.spec.get("initContainers", []), *self.containers]

    @property
    def main(self) -> dict:
        return self.containers[0]

    @property
    def env(self) -> dict[str, str | None]:
        """The main container's variables: name -> value (None: from a Secret or field)."""
        return {e["name"]: e.get("value") for e in self.main.get("env", [])}

    def env_entry(self, *names: str) -> dict | None:
        """The main container's env entry of one of `names` (AssertionError if several)."""
        found = [e for e in self.main.get("env", []) if e["name"] in names]
        assert len(found) <= 1, (self.name, found)
        return found[0] if found else None

    @property
    def role(self) -> Role:
        return role_of(self.main)

    @property
    def is_test_hook(self) -> bool:
        hooks = self.owner["metadata"].get("annotations", {}).get(HOOK_ANNOTATION, "")
        return "test" in [h.strip() for h in hooks.split(",")]

    def exposes(self, number: int) -> bool:
        """Whether one of the pod's containers declares this container port."""
        return any(
            p["containerPort"] == number for c in self.containers for p in c.get("ports", [])
        )

    def container_port(self, port: int | str) -> int | None:
        """A port number, or a named container port's number (None: no such name)."""
        if isinstance(port, int):
            return port
        for container in self.containers:
            for p in container.get("ports", []):
                if p.get("name") == port:
                    return p["containerPort"]
        return None


@dataclass
class Release:
    """The objects one render gave, with the lookups the tests need."""

    objects: list[dict]
    pods: list[Pod] = field(init=False)

    def __post_init__(self) -> None:
        self.pods = list(_pods(self.objects))

    def of_kind(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict | None:
        return next((o for o in self.of_kind(kind) if o["metadata"]["name"] == name), None)

    def pods_of(self, role: Role) -> list[Pod]:
        return [p for p in self.pods if p.role is role]

    def workload_of(self, role: Role) -> dict:
        [pod] = self.pods_of(role)
        return pod.owner

    def selected_pods(self, selector: Mapping | None) -> list[Pod]:
        """The pods a label selector (matchLabels/matchExpressions) picks."""
        return [p for p in self.pods if selector is not None and matches(selector, p.labels)]

    def service_pods(self, service: Mapping) -> list[Pod]:
        """A Service's pods: its `selector` is a plain label map."""
        selector = service["spec"].get("selector")
        return self.selected_pods({"matchLabels": selector} if selector else None)

    def service_account(self, pod: Pod) -> dict | None:
        return self.get("ServiceAccount", pod.spec.get("serviceAccountName", "default"))

    def token_mounted(self, pod: Pod) -> bool:
        """Whether Kubernetes mounts an API token into `pod`: the pod's say, else its
        service account's, else yes."""
        if "automountServiceAccountToken" in pod.spec:
            return pod.spec["automountServiceAccountToken"]
        account = self.service_account(pod) or {}
        return account.get("automountServiceAccountToken", True)

    def autoscalers(self) -> dict[str, dict]:
        """Workload name -> the HorizontalPodAutoscaler scaling it."""
        hpas = self.of_kind("HorizontalPodAutoscaler")
        return {h["spec"]["scaleTargetRef"]["name"]: h for h in hpas}

    def scraped_pods(self, monitor: dict, namespace: str) -> list[str]:
        """The pods a ServiceMonitor or PodMonitor scrapes, once per scrape (so twice where it
        would double-count one)."""
        spec = monitor["spec"]
        names = spec.get("namespaceSelector", {}).get("matchNames", [namespace])
        assert namespace in names or spec["namespaceSelector"].get("any"), spec
        if monitor["kind"] == "PodMonitor":
            pods = self.selected_pods(spec["selector"])
            ports = [e["port"] for e in spec["podMetricsEndpoints"]]
            return [p.name for p in pods for port in ports if p.container_port(port)]
        scraped = []
        for service in self.of_kind("Service"):
            if not matches(spec["selector"], service["metadata"].get("labels", {})):
                continue
            names = {p.get("name") for p in service["spec"]["ports"]}
            for endpoint in spec["endpoints"]:
                if endpoint["port"] in names:
                    scraped += [p.name for p in self.service_pods(service)]
        return scraped

    def rules_of_account(self, account_name: str) -> list[dict]:
        """Every RBAC rule bound to the service account `account_name` of the release's
        namespace (Roles and ClusterRoles, through RoleBindings and ClusterRoleBindings)."""
        rules = []
        for binding in [*self.of_kind("RoleBinding"), *self.of_kind("ClusterRoleBinding")]:
            subjects = binding.get("subjects", [])
            if not any(
                s["kind"] == "ServiceAccount" and s["name"] == account_name for s in subjects
            ):
                continue
            ref = binding["roleRef"]
            role = self.get(ref["kind"], ref["name"])
            assert role is not None, f"{binding['metadata']['name']} binds a missing {ref}"
            rules += role.get("rules", [])
        return rules


def _pods(objects: list[dict]) -> Iterator[Pod]:
    for obj in objects:
        if obj["kind"] == "Pod":
            yield Pod(obj, obj["metadata"].get("labels", {}), obj["spec"])
        elif obj["kind"] in _POD_TEMPLATES:
            template = obj
            for key in _POD_TEMPLATES[obj["kind"]]:
                template = template[key]
            yield Pod(obj, template.get("metadata", {}).get("labels", {}), template["spec"])


def matches(selector: Mapping, labels: Mapping[str, str]) -> bool:
    """Kubernetes' label selector semantics; an empty selector picks everything."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    return all(_expression_holds(e, labels) for e in selector.get("matchExpressions") or [])


def _expression_holds(expression: Mapping, labels: Mapping[str, str]) -> bool:
    key, operator = expression["key"], expression["operator"]
    if operator == "In":
        return labels.get(key) in expression["values"]
    if operator == "NotIn":
        return labels.get(key) not in expression["values"]
    if operator == "Exists":
        return key in labels
    if operator == "DoesNotExist":
        return key not in labels
    raise ValueError(f"unknown label selector operator {operator!r}")


def scaled(value: int | str, replicas: int, *, round_up: bool) -> int:
    """An IntOrString count against `replicas` ("25%" of 4 is 1), rounded as Kubernetes
    rounds it for that field."""
    if isinstance(value, int):
        return value
    fraction = float(value.rstrip("%")) / 100 * replicas
    return math.ceil(fraction) if round_up else math.floor(fraction)


def disruptable(spec: dict, replicas: int) -> int:
    """How many of `replicas` pods a PodDisruptionBudget lets an eviction take at once."""
    if "maxUnavailable" in spec:
        return scaled(spec["maxUnavailable"], replicas, round_up=True)
    return replicas - scaled(spec["minAvailable"], replicas, round_up=True)


# -- NetworkPolicy ------------------------------------------------------------------------


@dataclass(frozen=True)
class Peer:
    """A would-be client of a pod: its pod labels and its namespace's labels."""

    name: str
    pod_labels: Mapping[str, str]
    namespace_labels: Mapping[str, str]


def namespace_labels(namespace: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """A namespace's labels as the API server sets them (its name under
    kubernetes.io/metadata.name), plus `extra`."""
    return {NAMESPACE_NAME_LABEL: namespace, **(extra or {})}


def probe_peers(release: Release, namespace: str, network: Mapping) -> dict[str, Peer]:
    """Would-be clients: the release's own pdserve pods (by role, the planner's too) and its
    helm test pod, a
    stranger beside them, Prometheus, the router's clients (`client-N`, one per peer of
    the values' networkPolicy.routerFrom), and an impostor: a pod elsewhere wearing the
    router's labels. `network` is the values' `networkPolicy`."""
    home = namespace_labels(namespace)
    pdserve = [p for p in release.pods if p.role.is_pdserve]
    found = {p.role.value: Peer(p.role.value, p.labels, home) for p in pdserve}
    for planner in release.pods_of(Role.PLANNER):
        found["planner"] = Peer("planner", planner.labels, home)
    found["test"] = next(Peer("test", p.labels, home) for p in release.pods if p.is_test_hook)
    found["stranger"] = Peer("stranger", {"app": "stranger"}, home)
    found["prometheus"] = _peer_like("prometheus", network["prometheus"], home)
    for i, selector in enumerate(network["routerFrom"]):
        found[f"client-{i}"] = _peer_like(f"client-{i}", selector, home)
    found["impostor"] = Peer("impostor", found["router"].pod_labels, namespace_labels("elsewhere"))
    return found


def _peer_like(name: str, peer: Mapping, home: Mapping[str, str]) -> Peer:
    """A pod that a NetworkPolicy peer of matchLabels selectors describes."""
    pod_labels = (peer.get("podSelector") or {}).get("matchLabels") or {}
    if "namespaceSelector" not in peer:
        return Peer(name, pod_labels, home)
    return Peer(name, pod_labels, peer["namespaceSelector"].get("matchLabels") or {})


def admits(
    policies: list[dict], policy_namespace: str, dst: Pod, src: Peer, port: int | str
) -> bool:
    """Whether the NetworkPolicies let `src` open a connection to `dst` on `port` (a
    number or a port name): allowed when no policy isolates `dst` for ingress, else when
    one rule of a policy selecting it matches both the peer and the port."""
    selecting = [
        p
        for p in policies
        if matches(p["spec"]["podSelector"], dst.labels) and _isolates_ingress(p["spec"])
    ]
    if not selecting:
        return True
    number = dst.container_port(port)
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            peers = rule.get("from")
            if peers and not any(_peer_matches(p, policy_namespace, src) for p in peers):
                continue
            ports = rule.get("ports")
            if not ports or any(_port_matches(p, dst, number) for p in ports):
                return True
    return False


def _port_matches(rule_port: Mapping, dst: Pod, number: int | None) -> bool:
    """A rule's port: all ports when it names none, else one port or a range."""
    if rule_port.get("port") is None:
        return True
    first = dst.container_port(rule_port["port"])
    last = rule_port.get("endPort", first)
    return number is not None and first is not None and first <= number <= last


def _isolates_ingress(spec: Mapping) -> bool:
    types = spec.get("policyTypes")
    return "Ingress" in types if types is not None else True


def _peer_matches(peer: Mapping, policy_namespace: str, src: Peer) -> bool:
    if "ipBlock" in peer:
        return False  # the peers here are pods, addressed by labels
    if "namespaceSelector" in peer:
        if not matches(peer["namespaceSelector"], src.namespace_labels):
            return False
    elif src.namespace_labels.get(NAMESPACE_NAME_LABEL) != policy_namespace:
        return False  # a podSelector alone means pods of the policy's namespace
    return matches(peer.get("podSelector", {}), src.pod_labels)
