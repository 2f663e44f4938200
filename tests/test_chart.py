"""The Helm chart (charts/pdserve), rendered offline by Helm v4's own code (helm-python-sdk),
for its default values and each scenario of its `ci/` folder.

Every assertion is on the rendered objects, read as Kubernetes reads them (tests/
chart_objects.py), never on the template text: what the API server would accept (Kubernetes'
own schemas, strict; our field lists for the custom resources), what each pod runs and may
reach, and that every `PDSERVE_*` variable is one the program reads (the config
dataclasses say). The golden renders under tests/golden/chart show every change to the
output in review: `make chart-golden` rewrites them. No cluster is needed.
"""

from __future__ import annotations

import base64
import difflib
import json
import re
import subprocess
import sys
import tomllib
import urllib.parse

import chart_render
import chart_schemas
import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from chart_objects import (
    Peer,
    Pod,
    Role,
    admits,
    command_line,
    disruptable,
    probe_peers,
    scaled,
)
from chart_render import CHART_DIR, NAMESPACE, ROOT, rendered
from chart_settings import args_problems, env_problems
from test_prometheus import ALERTS, DASHBOARD
from test_prometheus import _binary as prometheus_tool

pytestmark = pytest.mark.cluster

KUBE_VERSION = kubernetes_validate.latest_version()  # the newest Kubernetes it knows
SCENARIOS = [s.name for s in chart_render.scenarios()]
# the scenarios the issue asks for: ci file name -> what its values must turn on
REQUIRED_SCENARIOS = {
    "cpu-small": lambda v: v["prefill"]["gpus"] == v["decode"]["gpus"] == 0,
    "gpu-external-redis": lambda v: v["decode"]["gpus"] > 0 and not v["redis"]["enabled"],
    "k8s-discovery-netpol": lambda v: (
        v["discovery"]["mode"] == "kubernetes" and v["networkPolicy"]["enabled"]
    ),
    "autoscaling-monitoring": lambda v: (
        all(v[pool]["autoscaling"]["enabled"] for pool in ("router", "prefill", "decode"))
        and v["metrics"]["serviceMonitor"]["enabled"]
        and v["metrics"]["prometheusRule"]["enabled"]
    ),
    "secure": lambda v: (
        v["networkPolicy"]["enabled"]
        and v["redis"]["auth"]["existingSecret"]
        and v["tls"]["enabled"]
        and v["apiKeys"]["enabled"]
    ),
}
POOLS = {"router": Role.ROUTER, "prefill": Role.PREFILL, "decode": Role.DECODE, "both": Role.BOTH}
GRPC_PORT, HTTP_PORT, METRICS_PORT, REDIS_PORT = "grpc", "http", "metrics", 6379
HEALTH_PORT, KV_PORT = "health", "kv"
MODEL_MOUNT = "/model"  # the image's PDSERVE_MODEL
ENDPOINTSLICE_READ = {"get", "list", "watch"}
SCALE_VERBS = {"get", "patch", "update"}  # the most the planner's Role may allow
PLANNED_POOLS = (Role.PREFILL, Role.DECODE)
PLANNER = {
    "enabled": True,
    "record": {"configMap": "bench-record"},
    "prometheusUrl": "http://prometheus.monitoring:9090",
}


def per_scenario(test):
    return pytest.mark.parametrize("name", SCENARIOS)(test)


def with_feature(predicate) -> list[str]:
    """The scenarios whose values turn a feature on (at least one must)."""
    names = [n for n in SCENARIOS if predicate(rendered(n).values)]
    assert names, "no scenario of charts/pdserve/ci turns this feature on"
    return names


# -- the chart as a whole -------------------------------------------------------------------


@pytest.mark.parametrize("name", REQUIRED_SCENARIOS)
def test_the_ci_folder_holds_each_scenario_the_chart_is_tested_with(name):
    assert name in SCENARIOS, f"no charts/pdserve/ci/{name}-values.yaml"
    assert REQUIRED_SCENARIOS[name](rendered(name).values), f"{name} lacks its feature"


def test_the_chart_version_and_app_version_are_the_package_version():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    metadata = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    version = pyproject["project"]["version"]
    assert (metadata["version"], str(metadata["appVersion"])) == (version, version)


def test_the_default_image_is_tagged_with_the_app_version():
    """The version alone, or with the image's flavour (`0.1.0-cpu`)."""
    app_version = helm.Chart.load(CHART_DIR).metadata["appVersion"]
    for pod in rendered("default").pdserve_pods():
        tag = pod.main["image"].rsplit(":", 1)[1]
        assert tag == app_version or tag.startswith(f"{app_version}-"), (pod.name, tag)


@per_scenario
def test_helm_lint_passes_strict_with_no_warnings(name):
    report = helm.lint(
        CHART_DIR,
        rendered(name).scenario.values(),
        strict=True,
        namespace=NAMESPACE,
        kube_version=f"v{KUBE_VERSION}",
    )
    findings = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error
    assert not findings and not report["errors"], findings or report["errors"]


@per_scenario
def test_every_object_validates_strictly_against_its_schema(name):
    """Built-in kinds against Kubernetes' own schemas, custom resources against their CRDs'
    fields (tests/chart_schemas.py)."""
    problems = chart_schemas.problems(rendered(name).release.objects, KUBE_VERSION)
    assert not problems, "\n".join(problems)


SCHEMA_REFUSALS = {
    "negative router replicas": ({"router": {"replicas": -1}}, "/router/replicas"),
    "negative decode replicas": ({"decode": {"replicas": -1}}, "/decode/replicas"),
    "negative gpus": ({"prefill": {"gpus": -1}}, "/prefill/gpus"),
    "unknown top-level key": ({"replicaCount": 3}, "'replicaCount'"),
    "unknown nested key": ({"prefill": {"engine": {"maxNumSeq": 8}}}, "'maxNumSeq'"),
    "no model path": ({"model": {"path": None}}, "'path'"),
    "empty model path": ({"model": {"path": ""}}, "/model/path"),
    "a claim without a name": ({"model": {"source": "existingClaim"}}, "/claimName"),
    "a host path without a path": ({"model": {"source": "hostPath"}}, "/hostPath/path"),
    "a model image without a repository": ({"model": {"source": "image"}}, "/repository"),
    "both Redis modes": (
        {"redis": {"enabled": True}, "externalRedis": {"existingSecret": "redis-url"}},
        "/externalRedis/existingSecret",
    ),
    "neither Redis mode": ({"redis": {"enabled": False}}, "/externalRedis/existingSecret"),
    "a both pool with Kubernetes discovery": (
        {"discovery": {"mode": "kubernetes"}, "both": {"enabled": True}},
        "/both/enabled",
    ),
    "the planner and an HPA on the prefill pool": (
        {"planner": PLANNER, "prefill": {"autoscaling": {"enabled": True}}},
        "/prefill/autoscaling/enabled",
    ),
    "the planner and an HPA on the decode pool": (
        {"planner": PLANNER, "decode": {"autoscaling": {"enabled": True}}},
        "/decode/autoscaling/enabled",
    ),
    "the planner without its bench record": (
        {"planner": {**PLANNER, "record": {"configMap": ""}}},
        "/planner/record/configMap",
    ),
    "the planner without Prometheus": (
        {"planner": {**PLANNER, "prometheusUrl": ""}},
        "/planner/prometheusUrl",
    ),
    "planner bounds of zero": (
        {"planner": {**PLANNER, "decode": {"minReplicas": 0, "maxReplicas": 2}}},
        "/planner/decode/minReplicas",
    ),
    "cert-manager TLS without an issuer": ({"tls": {"enabled": True}}, "/issuerRef/name"),
    "TLS from Secrets without the router's": (
        {"tls": {"enabled": True, "source": "secrets"}},
        "/tls/secrets/router",
    ),
    "API keys without their Secret": ({"apiKeys": {"enabled": True}}, "/apiKeys/existingSecret"),
}


@pytest.mark.parametrize("case", SCHEMA_REFUSALS)
def test_the_schema_refuses_bad_values_naming_the_key(case):
    values, key = SCHEMA_REFUSALS[case]
    with pytest.raises(helm.HelmValuesError) as refused:
        chart_render.render(values)
    assert key in str(refused.value), str(refused.value)


# -- golden renders -------------------------------------------------------------------------


@per_scenario
def test_the_golden_render_is_up_to_date(name):
    r = rendered(name)
    want = chart_render.golden_header(r.scenario) + r.text
    path = r.scenario.golden_file
    assert path.exists(), f"{path.relative_to(ROOT)} is missing: {chart_render.REGENERATE}"
    have = path.read_text()
    if have != want:
        diff = difflib.unified_diff(
            have.splitlines(), want.splitlines(), str(path.relative_to(ROOT)), "render", lineterm=""
        )
        pytest.fail(
            f"the templates changed the render: {chart_render.REGENERATE}\n"
            + "\n".join(list(diff)[:80]),
            pytrace=False,
        )


def test_every_golden_file_belongs_to_a_scenario():
    stale = {p.stem for p in chart_render.GOLDEN_DIR.glob("*.yaml")} - set(SCENARIOS)
    assert not stale, f"golden renders of no scenario {sorted(stale)}: {chart_render.REGENERATE}"


# -- monitoring -----------------------------------------------------------------------------


def alert_groups() -> list[dict]:
    return yaml.safe_load(ALERTS.read_text())["groups"]


def prometheus_rules() -> list[dict]:
    names = with_feature(lambda v: v["metrics"]["prometheusRule"]["enabled"])
    return [o for n in names for o in rendered(n).release.of_kind("PrometheusRule")]


def test_the_prometheus_rule_holds_the_alerts_file_rules():
    rules = prometheus_rules()
    assert rules
    for rule in rules:
        assert rule["spec"]["groups"] == alert_groups()


def test_the_prometheus_rules_pass_promtool(tmp_path):
    promtool = prometheus_tool("promtool")
    for i, rule in enumerate(prometheus_rules()):
        path = tmp_path / f"rules-{i}.yaml"
        path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
        checked = subprocess.run(
            [promtool, "check", "rules", str(path)], capture_output=True, text=True
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_dashboard_configmap_holds_the_dashboard_with_the_sidecar_label():
    dashboard = json.loads(DASHBOARD.read_text())
    for name in with_feature(lambda v: v["metrics"]["grafanaDashboard"]["enabled"]):
        maps = [
            m
            for m in rendered(name).release.of_kind("ConfigMap")
            if "grafana_dashboard" in m["metadata"].get("labels", {})
        ]
        assert len(maps) == 1, (name, [m["metadata"]["name"] for m in maps])
        [(key, text)] = maps[0]["data"].items()
        assert key.endswith(".json") and json.loads(text) == dashboard
    for name in SCENARIOS:
        if not rendered(name).values["metrics"]["grafanaDashboard"]["enabled"]:
            labels = [
                m["metadata"].get("labels", {}) for m in rendered(name).release.of_kind("ConfigMap")
            ]
            assert not any("grafana_dashboard" in label for label in labels), name


@pytest.mark.parametrize("kind", ["ServiceMonitor", "PodMonitor"])
def test_the_monitor_scrapes_every_pdserve_pod_once(kind):
    key = "serviceMonitor" if kind == "ServiceMonitor" else "podMonitor"
    values = {"metrics": {key: {"enabled": True}}, "both": {"enabled": True}}  # every pool
    release = chart_render.release_of(values)
    [monitor] = release.of_kind(kind)
    want = sorted(p.name for p in release.pods if p.role.is_pdserve)
    assert sorted(release.scraped_pods(monitor, NAMESPACE)) == want


# -- what every pod runs --------------------------------------------------------------------


@per_scenario
def test_every_pod_meets_the_restricted_pod_security_standard(name):
    for pod in rendered(name).all_pods():
        pod_context = pod.spec.get("securityContext", {})
        for c in pod.all_containers:
            context = {**pod_context, **c.get("securityContext", {})}
            where = f"{pod.name} {c['name']}"
            assert context.get("runAsNonRoot") is True, where
            assert context.get("runAsUser", 10001) != 0, where
            assert c.get("securityContext", {}).get("readOnlyRootFilesystem") is True, where
            assert c.get("securityContext", {}).get("allowPrivilegeEscalation") is False, where
            assert "ALL" in context.get("capabilities", {}).get("drop", []), where
            assert not context.get("capabilities", {}).get("add"), where
            assert context.get("seccompProfile", {}).get("type") == "RuntimeDefault", where


@per_scenario
def test_gpus_are_asked_for_by_the_worker_pools_only(name):
    r = rendered(name)
    for pod in r.all_pods():
        for c in pod.all_containers:
            want = r.values[pod.role.value]["gpus"] if pod.role.is_worker and c is pod.main else 0
            assert r.gpus(c) == want, f"{pod.name} {c['name']}: {c.get('resources')}"


def test_the_cpu_scenario_asks_for_no_gpu_and_the_gpu_scenario_for_both_pools():
    cpu, gpu = rendered("cpu-small"), rendered("gpu-external-redis")
    assert not any(cpu.gpus(c) for p in cpu.all_pods() for c in p.all_containers)
    for role in (Role.PREFILL, Role.DECODE):
        assert all(gpu.gpus(p.main) > 0 for p in gpu.release.pods_of(role)), role


@per_scenario
def test_every_pdserve_container_is_probed_over_grpc(name):
    """On its gRPC port, or under TLS its plaintext health port (the kubelet has no
    certificate)."""
    r = rendered(name)
    for pod in r.pdserve_pods():
        grpc_port = pod.container_port(HEALTH_PORT if r.values["tls"]["enabled"] else GRPC_PORT)
        assert grpc_port is not None, pod.name
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = pod.main.get(kind)
            assert probe is not None, f"{pod.name} has no {kind}"
            handlers = {"grpc", "httpGet", "tcpSocket", "exec"} & set(probe)
            assert handlers == {"grpc"}, f"{pod.name} {kind}: {handlers}"
            assert probe["grpc"]["port"] == grpc_port, f"{pod.name} {kind}"


@per_scenario
def test_the_model_is_mounted_read_only_where_pdserve_reads_it(name):
    r = rendered(name)
    mount_path = r.values["model"]["path"]
    for pod in r.pdserve_pods():
        assert pod.env.get("PDSERVE_MODEL", MODEL_MOUNT) == mount_path, pod.name
        mounts = [m for m in pod.main.get("volumeMounts", []) if m["mountPath"] == mount_path]
        assert len(mounts) == 1 and mounts[0].get("readOnly") is True, (pod.name, mounts)


def test_by_default_the_model_is_mounted_at_the_images_model_path():
    for pod in rendered("default").pdserve_pods():
        paths = [m["mountPath"] for m in pod.main["volumeMounts"] if m.get("readOnly")]
        assert MODEL_MOUNT in paths, pod.name


@per_scenario
def test_every_server_serves_plaintext_beyond_loopback_only_without_tls_and_by_saying_so(name):
    r = rendered(name)
    for pod in r.pdserve_pods():
        want = None if r.values["tls"]["enabled"] else "true"
        assert pod.env.get("PDSERVE_INSECURE") == want, pod.name


def mounted_secret_file(release, pod: Pod, path: str) -> tuple[str, str]:
    """(Secret, key) of the file at `path` in the pod's main container, which must come
    from a read-only mount of a Secret volume."""
    volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
    for mount in pod.main.get("volumeMounts", []):
        prefix = mount["mountPath"].rstrip("/") + "/"
        if not path.startswith(prefix):
            continue
        assert mount.get("readOnly") is True, (pod.name, mount)
        secret = volumes[mount["name"]]["secret"]
        file = path.removeprefix(prefix)
        keys = {i["path"]: i["key"] for i in secret.get("items", [])} or {file: file}
        return secret["secretName"], keys[file]
    raise AssertionError(f"{pod.name}: nothing mounted at {path}")


def test_under_tls_every_server_reads_its_roles_certificate_with_the_role_as_its_ou():
    r = rendered("secure")
    certificates = {c["spec"]["secretName"]: c for c in r.release.of_kind("Certificate")}
    for pod in r.pdserve_pods():
        env = pod.env
        files = [
            mounted_secret_file(r.release, pod, env[f"PDSERVE_TLS_{part}"])
            for part in ("CERT", "KEY", "CA")
        ]
        assert [key for _, key in files] == ["tls.crt", "tls.key", "ca.crt"], pod.name
        [secret] = {name for name, _ in files}
        certificate = certificates[secret]["spec"]
        assert certificate["subject"]["organizationalUnits"] == [pod.role.value], pod.name
        assert {"server auth", "client auth"} <= set(certificate["usages"]), pod.name
        assert (
            certificate["issuerRef"]["name"] == r.values["tls"]["certManager"]["issuerRef"]["name"]
        )
        assert int(env["PDSERVE_HEALTH_PORT"]) == pod.container_port(HEALTH_PORT), pod.name
        assert env["PDSERVE_TLS_SERVER_NAME"] in certificate["dnsNames"], pod.name


def test_tls_from_given_secrets_makes_no_certificates():
    secrets = {"router": "r-tls", "prefill": "p-tls", "decode": "d-tls"}
    release = chart_render.release_of(
        {
            "tls": {"enabled": True, "source": "secrets", "secrets": secrets},
            "redis": {"auth": {"password": "x"}},
        }
    )
    assert not release.of_kind("Certificate")
    for pod in [p for p in release.pods if p.role.is_pdserve]:
        secret, _ = mounted_secret_file(release, pod, pod.env["PDSERVE_TLS_CERT"])
        assert secret == secrets[pod.role.value], pod.name


@per_scenario
def test_decode_workers_take_the_kv_push_on_their_own_kv_port(name):
    r = rendered(name)
    for pod in r.pdserve_pods():
        kv = r.values["ports"]["kv"] if pod.role in (Role.DECODE, Role.BOTH) else None
        assert pod.container_port(KV_PORT) == kv, pod.name
        assert pod.env.get("PDSERVE_KV_PORT") == (None if kv is None else str(kv)), pod.name


@per_scenario
def test_the_router_reads_its_api_keys_from_their_secret_when_keys_are_on(name):
    r = rendered(name)
    keys = r.values["apiKeys"]
    for pod in r.pdserve_pods():
        path = pod.env.get("PDSERVE_API_KEY_FILE")
        if pod.role is not Role.ROUTER or not keys["enabled"]:
            assert path is None, pod.name
            continue
        secret = mounted_secret_file(r.release, pod, path)
        assert secret == (keys["existingSecret"], keys["key"]), pod.name


@per_scenario
def test_every_pdserve_variable_and_flag_is_one_the_program_reads(name):
    r = rendered(name)
    problems = []
    for pod in r.pdserve_pods():
        pool = "both" if pod.role is Role.BOTH else pod.role.value
        user_names = {e["name"] for e in r.values[pool].get("extraEnv", [])}
        for problem in env_problems(pod.main, pod.role, user_names):
            problems.append(f"{pod.name}: {problem}")
        problems += [f"{pod.name}: {p}" for p in args_problems(pod.main, pod.role)]
    assert not problems, "\n".join(problems)


def test_the_routers_queue_settings_reach_it():
    values = {
        "router": {"maxQueuedRequests": 32, "queueTimeout": 2.5},
        "redis": {"auth": {"password": "x"}},
    }
    release = chart_render.release_of(values)
    [router] = release.pods_of(Role.ROUTER)
    assert (router.env["PDSERVE_MAX_QUEUED_REQUESTS"], router.env["PDSERVE_QUEUE_TIMEOUT"]) == (
        "32",
        "2.5",
    )
    problems = env_problems(router.main, router.role, set())
    assert not problems, "\n".join(problems)


def test_the_decode_pools_orphan_timeout_reaches_its_workers_only():
    values = {
        "decode": {"orphanTimeout": 5},
        "prefill": {"orphanTimeout": 5},  # a prefill worker keeps no orphans: not passed
        "redis": {"auth": {"password": "x"}},
    }
    release = chart_render.release_of(values)
    [decode] = release.pods_of(Role.DECODE)
    [prefill] = release.pods_of(Role.PREFILL)
    assert decode.env["PDSERVE_ORPHAN_TIMEOUT"] == "5"
    assert "PDSERVE_ORPHAN_TIMEOUT" not in prefill.env
    assert not env_problems(decode.main, decode.role, set())


# -- Redis, discovery, service accounts -----------------------------------------------------


def redis_url_of(pod: Pod) -> dict | None:
    return pod.env_entry("PDSERVE_REDIS_URL", "REDIS_URL")


@per_scenario
def test_redis_is_either_the_bundled_one_or_the_external_one(name):
    r = rendered(name)
    redis_pods = [p for p in r.all_pods() if p.exposes(REDIS_PORT)]
    external = r.values["externalRedis"]
    assert len(redis_pods) == (1 if r.values["redis"]["enabled"] else 0), redis_pods
    assert redis_url_of(r.release.pods_of(Role.ROUTER)[0]), (
        "the router keeps request state in Redis"
    )
    for pod in r.pdserve_pods():
        entry = redis_url_of(pod)
        if entry is None:
            continue
        if not r.values["redis"]["enabled"]:
            ref = entry.get("valueFrom", {}).get("secretKeyRef")
            assert ref == {"name": external["existingSecret"], "key": external["urlKey"]}
            continue
        url = urllib.parse.urlsplit(entry["value"])
        service_name, namespace, *_ = url.hostname.split(".")
        service = r.release.get("Service", service_name)
        assert namespace == NAMESPACE and service is not None, entry
        assert r.release.service_pods(service) == redis_pods, entry
        [port] = [p for p in service["spec"]["ports"] if p["port"] == url.port]
        assert redis_pods[0].container_port(port["targetPort"]) == REDIS_PORT


def test_the_bundled_redis_gets_a_random_password_when_given_none():
    release = chart_render.release_of({})
    [secret] = [s for s in release.of_kind("Secret") if "redis-password" in s.get("data", {})]
    password = base64.b64decode(secret["data"]["redis-password"]).decode()
    assert len(password) >= 16 and password != chart_render.FIXED_REDIS_PASSWORD


@per_scenario
def test_worker_services_name_their_grpc_port_and_discovery_watches_them(name):
    r = rendered(name)
    for pod in [p for p in r.pdserve_pods() if p.role.is_worker]:
        services = [s for s in r.release.of_kind("Service") if pod in r.release.service_pods(s)]
        assert services, f"no Service in front of {pod.name}"
        for service in services:
            [port] = [p for p in service["spec"]["ports"] if p.get("name") == GRPC_PORT]
            target = port.get("targetPort", port["port"])
            assert pod.container_port(target) == pod.container_port(GRPC_PORT), service
    if r.values["discovery"]["mode"] == "kubernetes":
        [router] = r.release.pods_of(Role.ROUTER)
        env = router.env
        assert env["PDSERVE_DISCOVERY"] == "kubernetes"
        for role in (Role.PREFILL, Role.DECODE):
            service = r.release.get("Service", env[f"PDSERVE_K8S_{role.name}_SERVICE"])
            assert service is not None, role
            assert {p.role for p in r.release.service_pods(service)} == {role}


@per_scenario
def test_only_the_router_in_kubernetes_discovery_and_the_planner_get_an_api_token(name):
    r = rendered(name)
    kubernetes = r.values["discovery"]["mode"] == "kubernetes"
    for pod in r.all_pods():
        wanted = (kubernetes and pod.role is Role.ROUTER) or pod.role is Role.PLANNER
        assert r.release.token_mounted(pod) is wanted, pod.name


@per_scenario
def test_the_router_may_only_read_endpointslices(name):
    r = rendered(name)
    accounts = {p.spec.get("serviceAccountName", "default"): p.role for p in r.all_pods()}
    for account, role in accounts.items():
        rules = r.release.rules_of_account(account)
        if role is Role.PLANNER:
            continue  # the next test's
        if role is not Role.ROUTER or r.values["discovery"]["mode"] != "kubernetes":
            assert not rules, (account, rules)
            continue
        assert rules, "Kubernetes discovery needs to watch EndpointSlices"
        for rule in rules:
            assert rule["apiGroups"] == ["discovery.k8s.io"], rule
            assert rule["resources"] == ["endpointslices"], rule
            assert set(rule["verbs"]) <= ENDPOINTSLICE_READ and "resourceNames" not in rule, rule
        assert set().union(*(rule["verbs"] for rule in rules)) == ENDPOINTSLICE_READ
    assert not r.release.of_kind("ClusterRole") and not r.release.of_kind("ClusterRoleBinding")


def test_the_planner_may_only_get_and_patch_the_scale_of_the_two_pools():
    names = with_feature(lambda v: v["planner"]["enabled"])
    for name in names:
        r = rendered(name)
        [planner] = r.release.pods_of(Role.PLANNER)
        rules = r.release.rules_of_account(planner.spec["serviceAccountName"])
        pools = sorted(r.release.workload_of(role)["metadata"]["name"] for role in PLANNED_POOLS)
        assert rules, "the planner needs to scale the pools"
        for rule in rules:
            assert rule["apiGroups"] == ["apps"], rule
            assert rule["resources"] == ["deployments/scale"], rule
            assert sorted(rule["resourceNames"]) == pools, rule
            assert set(rule["verbs"]) <= SCALE_VERBS, rule
        assert {"get", "patch"} <= set().union(*(rule["verbs"] for rule in rules))


def test_no_planner_by_default():
    assert not rendered("default").release.pods_of(Role.PLANNER)
    assert not rendered("default").values["planner"]["enabled"]


@per_scenario
def test_the_planner_scales_the_pools_deployments_within_its_bounds(name):
    r = rendered(name)
    planners = r.release.pods_of(Role.PLANNER)
    if not r.values["planner"]["enabled"]:
        assert not planners
        return
    [planner] = planners
    env = planner.env
    assert planner.owner["spec"]["replicas"] == 1  # two would each decide alone
    for role in PLANNED_POOLS:
        workload = r.release.workload_of(role)
        assert env[f"PDSERVE_{role.name}_DEPLOYMENT"] == workload["metadata"]["name"]
        assert "replicas" not in workload["spec"], "an upgrade would reset the planner's scale"
        bounds = r.values["planner"][role.value]
        assert (int(env[f"PDSERVE_MIN_{role.name}"]), int(env[f"PDSERVE_MAX_{role.name}"])) == (
            bounds["minReplicas"],
            bounds["maxReplicas"],
        )
    assert env["PDSERVE_NAMESPACE"] == NAMESPACE
    volumes = {v["name"]: v for v in planner.spec["volumes"]}
    [record] = [
        m for m in planner.main["volumeMounts"] if env["PDSERVE_RECORD"].startswith(m["mountPath"])
    ]
    assert (
        volumes[record["name"]]["configMap"]["name"] == r.values["planner"]["record"]["configMap"]
    )
    problems = env_problems(planner.main, Role.PLANNER, set()) + args_problems(
        planner.main, Role.PLANNER
    )
    assert not problems, "\n".join(problems)


def test_the_chart_refuses_planner_bounds_whose_min_is_over_their_max():
    values = {"planner": {**PLANNER, "prefill": {"minReplicas": 3, "maxReplicas": 2}}}
    with pytest.raises(helm.HelmRenderError, match="planner.prefill: minReplicas 3 is over"):
        chart_render.render(values)


# -- NetworkPolicy --------------------------------------------------------------------------


# destination role -> the peers that may open its gRPC port (a decode worker's: the prefill
# workers too when the KV push shares it, without a KV port)
GRPC_CLIENTS = {Role.PREFILL: {"router"}, Role.DECODE: {"router"}}
KV_PUSHERS = {"prefill", "both"}  # who may open a KV port


@per_scenario
def test_network_policies_admit_only_the_paths_pdserve_uses(name):
    r = rendered(name)
    policies = r.release.of_kind("NetworkPolicy")
    if not r.values["networkPolicy"]["enabled"]:
        assert not policies
        return
    who = probe_peers(r.release, NAMESPACE, r.values["networkPolicy"])
    anyone_to_router = not r.values["networkPolicy"]["routerFrom"]
    kv_port = r.values["ports"]["kv"] is not None
    denied = []
    for dst in r.pdserve_pods():
        for peer, may in _expected_access(dst.role, who, anyone_to_router, kv_port):
            for port, allowed in may.items():
                if dst.container_port(port) is None:
                    continue  # the router without its HTTP API
                if admits(policies, NAMESPACE, dst, who[peer], port) != allowed:
                    denied.append(f"{peer} -> {dst.role.value}:{port} should be {allowed}")
    redis_users = {p.role.value for p in r.pdserve_pods() if redis_url_of(p)}
    for redis in [p for p in r.release.pods if p.exposes(REDIS_PORT)]:
        for peer in who:
            allowed = peer in redis_users
            if admits(policies, NAMESPACE, redis, who[peer], REDIS_PORT) != allowed:
                denied.append(f"{peer} -> redis should be {allowed}")
    for planner in r.release.pods_of(Role.PLANNER):
        for peer in who:
            if admits(policies, NAMESPACE, planner, who[peer], 1):  # any port
                denied.append(f"{peer} -> planner should be False")
    assert not denied, "\n".join(denied)


def _expected_access(role: Role, who: dict[str, Peer], anyone_to_router: bool, kv_port: bool):
    """(peer, {port: whether it may connect}) for every peer of a pdserve pod: Prometheus
    alone scrapes; the router takes its clients (the helm test's pod among them), and the
    helm test alone its health port; a worker pool takes the pods that call it, a KV port
    the pods that push KV, and nobody its health port (the kubelet's probes are not
    subject to policies). The planner reaches nothing."""
    for peer in who:
        may = {METRICS_PORT: peer == "prometheus", KV_PORT: peer in KV_PUSHERS}
        if role is Role.ROUTER:
            client = anyone_to_router or peer == "test" or peer.startswith("client-")
            may[GRPC_PORT] = may[HTTP_PORT] = client
            may[HEALTH_PORT] = peer == "test"
        else:  # a colocated pool has the router's calls only
            clients = GRPC_CLIENTS.get(role, {"router"})
            if role is Role.DECODE and not kv_port:
                clients = clients | {"prefill"}
            may[GRPC_PORT] = peer in clients
            may[HEALTH_PORT] = False
        yield peer, may


# -- scaling and disruptions ----------------------------------------------------------------


@per_scenario
def test_autoscalers_exist_exactly_for_the_pools_that_enable_them(name):
    r = rendered(name)
    hpas = r.release.autoscalers()
    wanted = set()
    for pool, role in POOLS.items():
        if not r.release.pods_of(role):
            continue
        workload = r.release.workload_of(role)
        settings = r.values[pool]["autoscaling"]
        if settings["enabled"]:
            wanted.add(workload["metadata"]["name"])
            hpa = hpas[workload["metadata"]["name"]]
            assert hpa["spec"]["scaleTargetRef"]["kind"] == workload["kind"]
            bounds = (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"])
            assert bounds == (settings["minReplicas"], settings["maxReplicas"])
            assert "replicas" not in workload["spec"], "an upgrade would reset the HPA's scale"
    assert set(hpas) == wanted


@per_scenario
def test_no_rollout_or_disruption_budget_takes_a_whole_pool_down(name):
    r = rendered(name)
    hpas = r.release.autoscalers()
    for role in POOLS.values():
        for pod in r.release.pods_of(role):
            workload = pod.owner
            hpa = hpas.get(workload["metadata"]["name"])
            replicas = hpa["spec"]["minReplicas"] if hpa else workload["spec"].get("replicas", 1)
            if r.values["planner"]["enabled"] and role in PLANNED_POOLS:
                replicas = r.values["planner"][role.value]["minReplicas"]
            strategy = workload["spec"].get("strategy", {})
            assert strategy.get("type", "RollingUpdate") == "RollingUpdate", pod.name
            rolling = strategy.get("rollingUpdate", {})
            down = scaled(rolling.get("maxUnavailable", "25%"), replicas, round_up=False)
            assert down < replicas, f"{pod.name}: a rollout may stop {down} of {replicas}"
            for pdb in r.release.of_kind("PodDisruptionBudget"):
                if pod in r.release.selected_pods(pdb["spec"]["selector"]):
                    taken = disruptable(pdb["spec"], replicas)
                    assert taken < replicas, (
                        f"{pdb['metadata']['name']}: evictions may take {taken} of {replicas}"
                    )


# -- helm test ------------------------------------------------------------------------------


@per_scenario
def test_the_helm_test_checks_the_routers_grpc_health(name):
    r = rendered(name)
    tests = [p for p in r.release.pods if p.is_test_hook]
    assert tests, "no pod with the helm.sh/hook: test annotation"
    [router_service] = [
        s
        for s in r.release.of_kind("Service")
        if {p.role for p in r.release.service_pods(s)} == {Role.ROUTER}
    ]
    health = HEALTH_PORT if r.values["tls"]["enabled"] else GRPC_PORT  # plaintext under TLS
    [port] = [p["port"] for p in router_service["spec"]["ports"] if p.get("name") == health]
    service = router_service["metadata"]["name"]
    address = re.compile(rf"{service}(\.{NAMESPACE}(\.svc(\.cluster\.local)?)?)?:{port}")
    for pod in tests:
        words = [w for c in pod.containers for w in command_line(c)]
        text = " ".join(words)
        assert re.search(r"grpc[_-]health", text), f"{pod.name} calls no grpc.health.v1: {text}"
        assert any(address.fullmatch(w) for w in words), f"{pod.name} checks not {service}"


def test_the_secure_profile_limits_every_containers_cpu_and_memory():
    for pod in rendered("secure").all_pods():
        for c in pod.all_containers:
            limits = c.get("resources", {}).get("limits", {})
            assert {"cpu", "memory"} <= set(limits), f"{pod.name} {c['name']}: {limits}"


def test_the_chart_readmes_values_tables_are_current():
    # `make chart-readme` writes them from values.yaml's comments and the schema
    check = subprocess.run(
        [sys.executable, "scripts/chart_values_table.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr + "\nrun `make chart-readme`"
