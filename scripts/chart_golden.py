"""Write the golden renders of the Helm chart: tests/golden/chart/<scenario>.yaml for the
default values and for each charts/pdserve/ci/*-values.yaml (`make chart-golden`).

tests/test_chart.py renders the chart again and fails where a template change left a
golden file behind, so a change to what the chart renders is always seen in review. Run
this after changing the templates, values or ci files, read the diff, commit it.
The render is the tests' own (tests/chart_render.py): release and namespace `pdserve`,
Helm v4's code through helm-python-sdk, a fixed Redis password where the chart would
generate one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import chart_render  # noqa: E402  (a test helper, found on the path set just above)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 when a golden file differs from a fresh render",
    )
    args = parser.parse_args(argv)
    wanted = {s.golden_file: chart_render.golden_text(s) for s in chart_render.scenarios()}
    stale = sorted(set(chart_render.GOLDEN_DIR.glob("*.yaml")) - set(wanted))
    changed = [path for path, text in wanted.items() if _read(path) != text]
    if args.check:
        for path in [*changed, *stale]:
            print(f"{path.relative_to(chart_render.ROOT)} is out of date", file=sys.stderr)
        return 1 if changed or stale else 0
    chart_render.GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    for path in changed:
        path.write_text(wanted[path])
        print(f"wrote {path.relative_to(chart_render.ROOT)}")
    for path in stale:  # a ci file removed or renamed
        path.unlink()
        print(f"removed {path.relative_to(chart_render.ROOT)}")
    print(f"{len(wanted)} golden renders, {len(changed)} rewritten, {len(stale)} removed")
    return 0


def _read(path: Path) -> str | None:
    return path.read_text() if path.exists() else None


if __name__ == "__main__":
    sys.exit(main())
