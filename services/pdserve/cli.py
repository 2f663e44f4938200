"""The `pdserve` command line: assembles the subcommands, which live in `pdserve.commands`."""

from __future__ import annotations

import argparse
import sys

from pdserve import __version__
from pdserve.commands import (
    bench,
    certs,
    demo_model,
    generate,
    keys,
    plan,
    planner,
    router,
    serve,
    status,
    up,
)

# In the order `pdserve --help` lists them.
COMMANDS = (demo_model, serve, router, up, generate, status, bench, plan, planner, keys, certs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="Disaggregated prefill/decode LLM serving over gRPC.",
    )
    parser.add_argument("--version", action="version", version=f"pdserve {__version__}")
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(subcommands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help()
        return 0
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
