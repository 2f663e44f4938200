"""The Helm chart rendered offline by Helm v4's own code (helm-python-sdk), as the tests and
`make chart-golden` both see it.

A scenario is the chart's default values, or those plus one file of the chart's `ci/`
folder (the files `helm lint` and chart CI tools pick up by convention). Each renders as
`helm template pdserve charts/pdserve -n pdserve -f ci/FILE` would, into one text that the
golden files under tests/golden/chart/ hold: one `# Source:` document per object, templates
in path order, so that a change to the templates shows as a readable diff.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import helm_python as helm
import yaml
from chart_objects import Pod, Release, Role

ROOT = Path(__file__).resolve().parents[1]
CHART_DIR = ROOT / "charts" / "pdserve"
CI_DIR = CHART_DIR / "ci"
GOLDEN_DIR = ROOT / "tests" / "golden" / "chart"
RELEASE = "pdserve"
NAMESPACE = "pdserve"
DEFAULT_SCENARIO = "default"
CI_SUFFIX = "-values.yaml"
REGENERATE = "run `make chart-golden` and commit tests/golden/chart"
# The chart makes a random Redis password when given none: a different render each time.
# The tests and the golden files give this one instead (`redis.auth.password`).
FIXED_REDIS_PASSWORD = "fixed-password-of-the-golden-renders"
_DOCUMENT_SEPARATOR = re.compile(r"^---[ \t]*$", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class Scenario:
    """One set of values the chart is rendered with: the defaults, or a `ci/` file on top."""

    name: str  # "default", or the ci file's name without "-values.yaml"
    values_file: Path | None  # None: the chart's defaults alone

    @property
    def golden_file(self) -> Path:
        return GOLDEN_DIR / f"{self.name}.yaml"

    def file_values(self) -> dict:
        """The file's values as Helm parses a `-f` file (empty for the defaults)."""
        if self.values_file is None:
            return {}
        return helm.values_from_yaml(self.values_file.read_text())

    def generates_password(self) -> bool:
        """Whether the chart would make a random Redis password for these values."""
        redis = _chart().merge_values(self.file_values())["redis"]
        auth = redis["auth"]
        return bool(redis["enabled"] and not auth["existingSecret"] and not auth["password"])

    def values(self) -> dict:
        """What the tests and the golden files render the scenario with: its file's values,
        and a fixed Redis password where the chart would generate a random one."""
        if not self.generates_password():
            return self.file_values()
        fixed = {"redis": {"auth": {"password": FIXED_REDIS_PASSWORD}}}
        return merged(self.file_values(), fixed)

    def command(self) -> str:
        """The `helm template` command line that gives the same output."""
        line = f"helm template {RELEASE} charts/pdserve --namespace {NAMESPACE}"
        if self.values_file is not None:
            line += f" --values {self.values_file.relative_to(ROOT)}"
        if self.generates_password():
            line += f" --set redis.auth.password={FIXED_REDIS_PASSWORD}"
        return line


def scenarios() -> list[Scenario]:
    """The defaults, then every `ci/*-values.yaml` in name order."""
    files = sorted(CI_DIR.glob(f"*{CI_SUFFIX}")) if CI_DIR.is_dir() else []
    ci = [Scenario(path.name.removesuffix(CI_SUFFIX), path) for path in files]
    return [Scenario(DEFAULT_SCENARIO, None), *ci]


def scenario(name: str) -> Scenario:
    """The scenario called `name`; KeyError listing those there are."""
    by_name = {s.name: s for s in scenarios()}
    if name not in by_name:
        raise KeyError(f"no scenario {name!r} (ci/{name}{CI_SUFFIX}); there are {sorted(by_name)}")
    return by_name[name]


@cache
def _chart() -> helm.Chart:
    return helm.Chart.load(CHART_DIR)


def render(values: dict | None = None) -> dict[str, str]:
    """Template path -> rendered text, as an install of release `pdserve` in namespace
    `pdserve` renders it (the chart's defaults under `values`; its schema enforced).

    Raises helm.HelmValuesError when the schema refuses the values, helm.HelmRenderError
    when a template fails (its `fail` messages included).
    """
    return _chart().render(values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)


def manifest_text(rendered: dict[str, str]) -> str:
    """`helm template`'s shape: each non-empty document under `# Source: TEMPLATE`, in
    template path order (NOTES.txt is not a manifest and is left out)."""
    parts = []
    for path in sorted(rendered):
        if not path.endswith((".yaml", ".yml")):
            continue
        for document in _DOCUMENT_SEPARATOR.split(rendered[path]):
            body = document.strip()  # a block scalar's inner blank lines stay
            if _is_empty(body):
                continue
            parts.append(f"---\n# Source: {path}\n{body}\n")
    return "".join(parts)


def _is_empty(document: str) -> bool:
    """A document of comments and blank lines only (a template switched off)."""
    return all(line.lstrip().startswith("#") for line in document.splitlines())


def golden_header(s: Scenario) -> str:
    """The first line of a golden file: how it was made."""
    return f"# Rendered by `make chart-golden`: {s.command()}\n"


def golden_text(s: Scenario) -> str:
    """What `make chart-golden` writes for `s`: the header, then the manifests."""
    return golden_header(s) + manifest_text(render(s.values()))


def merged(base: dict, overrides: dict) -> dict:
    """`base` with `overrides` on top, maps merged key by key (as Helm merges -f files)."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def objects_of(text: str) -> list[dict]:
    """The Kubernetes objects of a manifest text, in order."""
    return [doc for doc in yaml.safe_load_all(text) if doc]


def release_of(values: dict) -> Release:
    """The release that `values` alone render (for tests of values of their own)."""
    return Release(objects_of(manifest_text(render(values))))


@dataclass(frozen=True)
class Rendered:
    """One scenario's render: its golden-file text, its objects, its merged values."""

    scenario: Scenario
    text: str
    release: Release
    values: dict

    def pdserve_pods(self) -> list[Pod]:
        """The router's and the worker pools' pods: one pod template per role the values
        turn on (AssertionError otherwise, so that no test passes over an empty render)."""
        pods = [p for p in self.release.pods if p.role.is_pdserve]
        roles = [p.role for p in pods]
        wanted = [Role.ROUTER] + [
            role
            for role in (Role.PREFILL, Role.DECODE, Role.BOTH)
            if self.values[role.value]["enabled"]
        ]
        assert sorted(roles, key=str) == sorted(wanted, key=str), f"pods of {roles}, want {wanted}"
        return pods

    def all_pods(self) -> list[Pod]:
        """Every pod template and Pod of the release (the pdserve ones checked there)."""
        self.pdserve_pods()
        return self.release.pods

    def gpus(self, container: dict) -> int:
        """The GPUs a container asks for (`gpu.resourceName`, or any other GPU resource);
        extended resources are asked for in limits, which requests then default to."""
        resources = container.get("resources", {})
        asked = {**resources.get("requests", {}), **resources.get("limits", {})}
        names = [n for n in asked if n == self.values["gpu"]["resourceName"] or "gpu" in n]
        return sum(int(asked[n]) for n in names)


@cache
def rendered(name: str) -> Rendered:
    """A scenario rendered, once per process: the tests share it."""
    s = scenario(name)
    text = manifest_text(render(s.values()))
    return Rendered(s, text, Release(objects_of(text)), _chart().merge_values(s.values()))
