"""`pdserve serve ROLE`: one worker process (prefill, decode or both on one engine).

Its flags are `WorkerConfig`'s fields, the engine's included (`core/flags.py`).
"""

from __future__ import annotations

import argparse

from pdserve.commands import EXIT_USAGE, fail
from pdserve.core.flags import ConfigError, add_flags, config_from_args
from pdserve.worker.config import WorkerConfig


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    cmd = subcommands.add_parser(
        "serve",
        help="run one worker: prefill, decode or both",
        description="Run one worker. Every flag can also be set by its environment variable.",
    )
    add_flags(cmd, WorkerConfig)
    cmd.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(WorkerConfig, args)
    except ConfigError as exc:
        return fail("serve", exc, code=EXIT_USAGE)
    from pdserve.worker.server import main  # torch loads here, not for `--help`

    return main(config)
