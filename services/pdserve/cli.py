"""The `pdserve` command line. Each subcommand lives beside the component it drives."""

from __future__ import annotations

import argparse
import sys

from pdserve import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="Disaggregated prefill/decode LLM serving over gRPC.",
    )
    parser.add_argument("--version", action="version", version=f"pdserve {__version__}")
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_demo_model(subcommands)
    return parser


def _add_demo_model(subcommands: argparse._SubParsersAction) -> None:
    cmd = subcommands.add_parser(
        "demo-model",
        help="write a random-weight Llama checkpoint and a locally trained tokenizer",
    )
    cmd.add_argument("--out", required=True, help="directory to write (created)")
    cmd.add_argument("--size", choices=["tiny", "small"], default="tiny")
    cmd.add_argument("--seed", type=int, default=0)
    cmd.set_defaults(run=_run_demo_model)


def _run_demo_model(args: argparse.Namespace) -> int:
    from pdserve.engine.demo_model import write_demo_model

    path = write_demo_model(args.out, size=args.size, seed=args.seed)
    print(f"wrote a {args.size} random-weight demo model to {path} (its output is meaningless)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help()
        return 0
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
