"""Generate the Python gRPC stubs for every proto package under protos/, one stub package each.

- ``protos/pdserve/v1`` -> ``pdserve.api.v1`` (pdserve's own API),
- ``protos/inference`` -> ``pdserve.api.inference`` (the KServe v2 protocol the router
  also serves).

protoc writes imports as the proto package path (``from pdserve.v1 import x_pb2``,
``from inference import x_pb2``); the stubs live under ``pdserve.api`` so that they
work installed, so the imports are rewritten here. The ``inference`` stubs also get a
descriptor pool of their own instead of protobuf's default one: tritonclient registers
the same message names there, and one process (a test, a tool) may load both. The
output is committed and never hand-edited; ``tests/test_protos.py`` regenerates into a
temp dir and compares.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
API_ROOT = ROOT / "services" / "pdserve" / "api"
_DEFAULT_POOL = "_descriptor_pool.Default()"
_IMPORTS_END = "# @@protoc_insertion_point(imports)\n"


@dataclass(frozen=True, slots=True)
class StubPackage:
    """One proto package and the stub package generated from it."""

    proto_package: str  # as the .proto files declare it: "pdserve.v1"
    stubs: str  # the stub package's folder under pdserve/api: "v1"
    doc: str  # the stub package's docstring
    own_pool: bool = False  # register in POOL (its __init__) instead of the default pool
    grpc: bool = True  # *_pb2_grpc.py too (stubs and servicer bases)

    @property
    def proto_dir(self) -> Path:
        return PROTO_ROOT.joinpath(*self.proto_package.split("."))

    @property
    def module(self) -> str:
        return f"pdserve.api.{self.stubs}"

    def init_source(self) -> str:
        if not self.own_pool:
            return f'"""{self.doc}"""\n'
        return (
            f'"""{self.doc}\n\nIts descriptors live in POOL, not in protobuf\'s default pool '
            '(where tritonclient\nregisters the same names).\n"""\n\n'
            "from google.protobuf import descriptor_pool\n\n"
            "POOL = descriptor_pool.DescriptorPool()\n"
        )

    def rewrite(self, source: str) -> str:
        """protoc's output for this package, importing from its installed home."""
        imports = re.compile(rf"^from {re.escape(self.proto_package)} import ", re.MULTILINE)
        source = imports.sub(f"from {self.module} import ", source)
        if self.own_pool and _DEFAULT_POOL in source:
            source = source.replace(_DEFAULT_POOL, "POOL")
            source = source.replace(_IMPORTS_END, f"from {self.module} import POOL\n{_IMPORTS_END}")
        return source


PACKAGES = (
    StubPackage(
        "pdserve.v1", "v1", "Generated gRPC stubs for pdserve.v1. Do not edit: run `make protos`."
    ),
    StubPackage(
        "inference",
        "inference",
        "Generated gRPC stubs for the KServe v2 protocol. Do not edit: run `make protos`.",
        own_pool=True,
        grpc=False,  # the router registers its servicer by descriptor; clients use tritonclient
    ),
)


def generate(api_root: Path) -> list[Path]:
    """Write *_pb2.py, *_pb2.pyi (and *_pb2_grpc.py) of every package under api_root."""
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        for package in PACKAGES:
            _protoc(package, Path(tmp))
            generated = Path(tmp).joinpath(*package.proto_package.split("."))
            out_dir = api_root / package.stubs
            out_dir.mkdir(parents=True, exist_ok=True)
            for old in out_dir.glob("*_pb2*.py*"):
                old.unlink()
            for src in sorted(generated.iterdir()):
                dst = out_dir / src.name
                dst.write_text(package.rewrite(src.read_text()))
                written.append(dst)
            (out_dir / "__init__.py").write_text(package.init_source())
    return written


def _protoc(package: StubPackage, out: Path) -> None:
    protos = sorted(package.proto_dir.glob("*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files in {package.proto_dir}")
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{Path(protoc.__file__).parent / '_proto'}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        *([f"--grpc_python_out={out}"] if package.grpc else []),
        *(str(p.relative_to(PROTO_ROOT)) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {package.proto_dir}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--out",
        type=Path,
        default=API_ROOT,
        help="the folder that holds the stub packages (v1/, inference/)",
    )
    args = parser.parse_args(argv)
    out = args.out.resolve()
    for path in generate(out):
        print(path.relative_to(out.parent) if out.is_relative_to(ROOT) else path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
