"""Generate the Python gRPC stubs for protos/pdserve/v1 into one package.

protoc writes imports as ``from pdserve.v1 import x_pb2`` (the proto package
path); the stubs live at ``pdserve.api.v1`` so that they work installed, so the
imports are rewritten here. The output is committed and never hand-edited;
``tests/test_protos.py`` regenerates into a temp dir and compares.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PROTO_DIR = PROTO_ROOT / "pdserve" / "v1"
# ``from pdserve.v1 import common_pb2 as ...`` -> ``from pdserve.api.v1 import ...``
_IMPORT = re.compile(r"^from pdserve\.v1 import ", re.MULTILINE)
_PACKAGE_DOC = '"""Generated gRPC stubs for pdserve.v1. Do not edit: run `make protos`."""\n'


def generate(out_dir: Path) -> list[Path]:
    """Write *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every proto into out_dir."""
    protos = sorted(PROTO_DIR.glob("*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files in {PROTO_DIR}")
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{Path(protoc.__file__).parent / '_proto'}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(str(p.relative_to(PROTO_ROOT)) for p in protos),
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        generated = Path(tmp) / "pdserve" / "v1"
        out_dir.mkdir(parents=True, exist_ok=True)
        for old in out_dir.glob("*_pb2*.py*"):
            old.unlink()
        written = []
        for src in sorted(generated.iterdir()):
            dst = out_dir / src.name
            dst.write_text(_IMPORT.sub("from pdserve.api.v1 import ", src.read_text()))
            written.append(dst)
    (out_dir / "__init__.py").write_text(_PACKAGE_DOC)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "services/pdserve/api/v1")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    for path in generate(out):
        print(path.relative_to(out.parent) if out.is_relative_to(ROOT) else path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
