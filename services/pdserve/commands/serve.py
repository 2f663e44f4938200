"""`pdserve serve ROLE`: one worker process (prefill, decode or both on one engine).

Its flags are `WorkerConfig`'s fields, the engine's included (`core/flags.py`).
"""

from __future__ import annotations

import argparse

from pdserve.commands import add_process_command
from pdserve.worker.config import WorkerConfig


def _main():
    from pdserve.worker.server import main  # torch loads here, not for `--help`

    return main


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    add_process_command(
        subcommands,
        "serve",
        WorkerConfig,
        _main,
        help="run one worker: prefill, decode or both",
        description="Run one worker. Every flag can also be set by its environment variable.",
    )
