"""`pdserve router`: one router process, the public gRPC API over the worker pools.

Its flags are `RouterConfig`'s fields (`core/flags.py`).
"""

from __future__ import annotations

import argparse

from pdserve.commands import EXIT_USAGE, fail
from pdserve.core.flags import ConfigError, add_flags, config_from_args
from pdserve.router.config import RouterConfig


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    cmd = subcommands.add_parser(
        "router",
        help="run a router: the public gRPC API",
        description="Run one router. Every flag can also be set by its environment variable.",
    )
    add_flags(cmd, RouterConfig)
    cmd.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(RouterConfig, args)
    except ConfigError as exc:
        return fail("router", exc, code=EXIT_USAGE)
    from pdserve.router.server import main

    return main(config)
