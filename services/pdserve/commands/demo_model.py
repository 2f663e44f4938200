"""`pdserve demo-model`: write the random-weight demo checkpoint and its tokenizer."""

from __future__ import annotations

import argparse


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    cmd = subcommands.add_parser(
        "demo-model",
        help="write a random-weight Llama checkpoint and a locally trained tokenizer",
    )
    cmd.add_argument("--out", required=True, help="directory to write (created)")
    cmd.add_argument("--size", choices=["tiny", "small"], default="tiny", help="model size")
    cmd.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    cmd.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pdserve.engine.demo_model import write_demo_model

    path = write_demo_model(args.out, size=args.size, seed=args.seed)
    print(f"wrote a {args.size} random-weight demo model to {path} (its output is meaningless)")
    return 0
