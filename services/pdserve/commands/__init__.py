"""Every `pdserve` subcommand: one module each, each with `add_parser(subcommands)`
(`cli.py` assembles them). What they share lives here."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from pdserve.core.flags import ConfigError, add_flags, config_from_args

DEFAULT_ROUTER = "127.0.0.1:50051"
EXIT_FAILURE = 1
EXIT_USAGE = 2  # a flag or variable that cannot be used, as argparse exits
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it


def add_router_argument(cmd: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    cmd.add_argument(
        "--router",
        default=None,
        metavar="ADDR",
        help=f"router host:port (default: $PDSERVE_ROUTER, else {DEFAULT_ROUTER})",
    )


def router_address(flag: str | None) -> str:
    """--router if given, else $PDSERVE_ROUTER, else the default port on this machine."""
    return flag or os.environ.get("PDSERVE_ROUTER") or DEFAULT_ROUTER


def fail(command: str, error: BaseException | str, code: int = EXIT_FAILURE) -> int:
    """Print `pdserve COMMAND: error` as one line on stderr; return `code` (the exit code)."""
    message = " ".join(str(error).split())  # one line, whatever the server's message holds
    print(f"pdserve {command}: {message}", file=sys.stderr)
    return code


def add_process_command(
    subcommands: argparse._SubParsersAction,
    name: str,
    config_cls: type,
    main: Callable[[], Callable[[Any], int]],
    *,
    help: str,
    description: str,
) -> None:
    """A subcommand that runs one server process: its flags are `config_cls`'s fields
    (`core/flags.py`), and `main()` gives the process's entry point, imported only once
    the config is valid (a worker's imports torch; `--help` should not)."""
    cmd = subcommands.add_parser(name, help=help, description=description)
    add_flags(cmd, config_cls)

    def run(args: argparse.Namespace) -> int:
        try:
            config = config_from_args(config_cls, args)
        except ConfigError as exc:
            return fail(name, exc, code=EXIT_USAGE)
        return main()(config)

    cmd.set_defaults(run=run)
