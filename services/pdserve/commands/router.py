"""`pdserve router`: one router process, the public gRPC API over the worker pools.

Its flags are `RouterConfig`'s fields (`core/flags.py`).
"""

from __future__ import annotations

import argparse

from pdserve.commands import add_process_command
from pdserve.router.config import RouterConfig


def _main():
    from pdserve.router_server import main

    return main


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    add_process_command(
        subcommands,
        "router",
        RouterConfig,
        _main,
        help="run a router: the public gRPC API",
        description="Run one router. Every flag can also be set by its environment variable.",
    )
