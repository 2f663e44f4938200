"""Writes the values tables of the chart's README.md from values.yaml and its schema.

Each key's description is its `# --` comment in values.yaml (helm-docs' convention), else
the description values.schema.json gives it; its default is the value values.yaml holds.
A section (a top-level key) opens with the comment block above it. The tables go between
the README's `<!-- values:begin -->` and `<!-- values:end -->` markers.

    python scripts/chart_values_table.py          # rewrite README.md
    python scripts/chart_values_table.py --check  # exit 1 if README.md is stale
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

CHART = Path(__file__).resolve().parents[1] / "charts" / "pdserve"
BEGIN, END = "<!-- values:begin -->", "<!-- values:end -->"
_KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_.-]+):(?P<rest>.*)$")
_DOC = "# -- "
GENERAL = "general"  # the section of top-level keys holding a value themselves


@dataclass
class Section:
    """A top-level key: its comment and the rows of the keys under it."""

    key: str
    comment: str
    # (dotted path, its `# --` comment, those of the keys above it, nearest first)
    rows: list[tuple[str, str, list[str]]] = field(default_factory=list)


def _comment_text(lines: list[str]) -> str:
    return " ".join(line.strip().removeprefix("#").removeprefix(" --").strip() for line in lines)


def parse(values_text: str) -> list[Section]:
    """The sections of values.yaml with the leaf keys of each (a list or a `{}` counts as a
    leaf; lists are not descended into)."""
    general = Section(GENERAL, "")
    sections: list[Section] = [general]
    stack: list[tuple[int, str, str]] = []  # (indent, key, its `# --` comment)
    comment: list[str] = []
    lines = values_text.splitlines()
    skip_below: int | None = None  # indent of a list-valued key whose items are skipped
    for number, line in enumerate(lines):
        stripped = line.strip()
        if skip_below is not None:
            if not stripped or len(line) - len(line.lstrip()) > skip_below or stripped[0] == "-":
                continue
            skip_below = None
        if not stripped:
            comment = []
            continue
        if stripped.startswith("#"):
            comment = [line] if stripped.startswith(_DOC.strip()) else [*comment, line]
            continue
        match = _KEY.match(line)
        if match is None:
            comment = []
            continue
        indent, key, rest = len(match["indent"]), match["key"], match["rest"].strip()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([k for _, k, _ in stack] + [key])
        doc = [c for c in comment if c.strip().startswith(_DOC.strip())]
        doc_lines = comment[comment.index(doc[0]) :] if doc else []
        rest = rest.split(" #")[0].strip()
        is_list = not rest and _next_is_item(lines, number)
        is_leaf = bool(rest) or is_list
        if indent == 0 and not is_leaf:
            sections.append(Section(key, _comment_text(comment)))
        if is_leaf:
            section = general if indent == 0 else sections[-1]
            parents = [d for _, _, d in reversed(stack)]
            section.rows.append((path, _comment_text(doc_lines), parents))
            if is_list:
                skip_below = indent
        else:
            stack.append((indent, key, _comment_text(doc_lines)))
        comment = []
    return sections


def _next_is_item(lines: list[str], number: int) -> bool:
    for line in lines[number + 1 :]:
        if line.strip() and not line.strip().startswith("#"):
            return line.strip().startswith("- ")
    return False


def schema_description(schema: dict, path: str) -> str:
    """The schema's description of the key at dotted `path` (following $refs)."""
    node = schema
    for part in path.split("."):
        node = _resolve(schema, node)
        node = node.get("properties", {}).get(part)
        if node is None:
            return ""
    return node.get("description", "") or _resolve(schema, node).get("description", "")


def describe(schema: dict, path: str, parent_docs: list[str]) -> str:
    """A key without a comment of its own: the schema's words for it, else the nearest
    key above it that has some (its comment, else its schema description)."""
    parts = path.split(".")
    for depth, parent_doc in zip(range(len(parts), 0, -1), ["", *parent_docs], strict=True):
        text = parent_doc or schema_description(schema, ".".join(parts[:depth]))
        if text:
            return text
    return ""


def _resolve(schema: dict, node: dict) -> dict:
    while "$ref" in node:
        node = schema["definitions"][node["$ref"].rsplit("/", 1)[1]]
    return node


def default_of(values: dict, path: str) -> str:
    node = values
    for part in path.split("."):
        node = node[part]
    return json.dumps(node)


def tables(values_text: str, schema: dict) -> str:
    values = yaml.safe_load(values_text)
    out = []
    for section in parse(values_text):
        title = "General" if section.key == GENERAL else f"`{section.key}`"
        out.append(f"### {title}\n")
        if section.comment:
            out.append(f"{section.comment}\n")
        out.append("| key | default | description |\n| --- | --- | --- |")
        for path, doc, parent_docs in section.rows:
            text = doc or describe(schema, path, parent_docs)
            default, text = (s.replace("|", "\\|") for s in (default_of(values, path), text))
            out.append(f"| `{path}` | `{default}` | {text} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if README.md is stale")
    args = parser.parse_args(argv)
    readme_path = CHART / "README.md"
    readme = readme_path.read_text()
    schema = json.loads((CHART / "values.schema.json").read_text())
    generated = tables((CHART / "values.yaml").read_text(), schema)
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    updated = f"{head}{BEGIN}\n{generated}\n{END}{tail}"
    if args.check:
        if updated != readme:
            print(f"{readme_path} is stale: run {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    readme_path.write_text(updated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
