"""Whether the environment and arguments the chart gives a pdserve container are ones the
program reads, checked against the config dataclasses themselves (`core/flags.py` makes
every flag and `PDSERVE_*` variable from them), so that a renamed or removed setting fails
the chart's tests instead of being ignored by the pod.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping

import opentelemetry.environment_variables as otel_api_variables
import opentelemetry.sdk.environment_variables as otel_sdk_variables
from chart_objects import Role, command_line

from pdserve.core import flags
from pdserve.planner.config import PlannerConfig
from pdserve.router.config import RouterConfig
from pdserve.worker.config import WorkerConfig

CONFIGS: dict[Role, type] = {
    Role.ROUTER: RouterConfig,
    Role.PREFILL: WorkerConfig,
    Role.DECODE: WorkerConfig,
    Role.BOTH: WorkerConfig,
    Role.PLANNER: PlannerConfig,
}
# the words after `pdserve` that start each role's process
SUBCOMMANDS: dict[Role, tuple[str, ...]] = {
    Role.ROUTER: ("router",),
    Role.PREFILL: ("serve", "prefill"),
    Role.DECODE: ("serve", "decode"),
    Role.BOTH: ("serve", "both"),
    Role.PLANNER: ("planner",),
}
# the OpenTelemetry SDK's own variables (what its exporters and resource detector read)
OTEL_VARIABLES = frozenset(
    value
    for module in (otel_api_variables, otel_sdk_variables)
    for name, value in vars(module).items()
    if name.startswith("OTEL_") and isinstance(value, str)
)
# Kubernetes' dependent environment variables: $(NAME) is NAME's value, $$(NAME) a literal
REFERENCE = re.compile(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def program(role: Role) -> str:
    """The command a `role` container runs."""
    return " ".join(("pdserve", *SUBCOMMANDS[role]))


def readable(config_cls: type) -> dict[str, flags.Setting]:
    """Every variable the process reads -> its setting (positional ones have none)."""
    return {name: s for s in flags.settings(config_cls) if not s.positional for name in s.env_names}


def expand(text: str, known: Mapping[str, str | None]) -> str | None:
    """`text` with its $(NAME) references replaced as the kubelet does; None when one
    names a variable whose value only the cluster knows (a Secret's, a field's)."""
    unknown = False

    def replace(match: re.Match) -> str:
        nonlocal unknown
        name = match.group(1)
        if name not in known:
            return match.group(0)  # the kubelet leaves an undefined reference as it is
        if known[name] is None:
            unknown = True
            return ""
        return known[name]

    expanded = REFERENCE.sub(replace, text).replace("$$(", "$(")
    return None if unknown else expanded


def env_problems(container: Mapping, role: Role, user_names: set[str]) -> list[str]:
    """What is wrong with the variables the chart sets on a `role` container: a
    `PDSERVE_*` that `role` does not read or whose value does not parse, an `OTEL_*` that
    OpenTelemetry does not define, any other variable that no other one refers to.
    `user_names` are the values' extraEnv names: the user's, not the chart's."""
    settings = readable(CONFIGS[role])
    env = container.get("env", [])
    referenced = {name for e in env for name in REFERENCE.findall(e.get("value", ""))}
    referenced |= {name for arg in command_line(container) for name in REFERENCE.findall(arg)}
    known: dict[str, str | None] = {}
    problems = []
    for entry in env:
        name = entry["name"]
        value = expand(entry["value"], known) if "value" in entry else None
        known[name] = value
        if name in user_names:
            continue
        if name.startswith(flags.ENV_PREFIX):
            if name not in settings:
                problems.append(f"{name}: `{program(role)}` reads no such variable")
            elif value:  # an empty variable counts as unset
                problems += _parse_problem(settings[name], name, value)
        elif name.startswith("OTEL_"):
            if name not in OTEL_VARIABLES:
                problems.append(f"{name}: not an OpenTelemetry SDK variable")
        elif name not in referenced:
            problems.append(f"{name}: neither a setting nor referenced by another variable")
    return problems


def _parse_problem(setting: flags.Setting, name: str, value: str) -> list[str]:
    try:
        setting.parse(value)
    except ValueError as exc:
        return [f"{name}={value!r}: {exc}"]
    return []


class _Refusal(Exception):
    pass


class _StrictParser(argparse.ArgumentParser):
    """An ArgumentParser that raises instead of printing and exiting."""

    def error(self, message: str):
        raise _Refusal(message)


def args_problems(container: Mapping, role: Role) -> list[str]:
    """What the process's own parser refuses in the container's arguments (after
    `router`, `serve` or `planner`): an unknown flag, a value that does not parse."""
    words = command_line(container)
    words = words[words.index(SUBCOMMANDS[role][0]) + 1 :]
    known = {e["name"]: e.get("value") for e in container.get("env", [])}
    words = [expand(w, known) or w for w in words]
    parser = _StrictParser(prog=program(role), add_help=False)
    flags.add_flags(parser, CONFIGS[role])
    try:
        parser.parse_args(words)
    except _Refusal as exc:
        return [f"{' '.join(words)}: {exc}"]
    return []
