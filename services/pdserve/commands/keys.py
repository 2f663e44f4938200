"""`pdserve keys`: create, list and revoke the router's API keys (`--api-key-file`).

`create` prints the new key once, on stdout alone (the file keeps only its sha256); the
other lines go to stderr, so `KEY=$(pdserve keys create ...)` captures the key. Every
change rewrites the file atomically with mode 0600; running routers reload it within a
second. The file is `--file`, else $PDSERVE_API_KEY_FILE (the router's own setting).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from pdserve.commands import EXIT_USAGE, fail
from pdserve.commands.status import format_table
from pdserve.router.auth.caller import KeyLimits
from pdserve.router.auth.keys import (
    ApiKey,
    KeyFileError,
    new_key,
    read_key_file,
    revoked,
    write_key_file,
)

FILE_ENV = "PDSERVE_API_KEY_FILE"
COLUMNS = ("ID", "NAME", "CREATED", "RPM", "CONCURRENCY", "TPM", "STATUS")


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    cmd = subcommands.add_parser("keys", help="create, list and revoke API keys")
    actions = cmd.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    create = actions.add_parser("create", help="add a key and print it (once)")
    create.add_argument("--name", required=True, help="whose key it is (in lists and logs)")
    limits = (("--rpm", "requests per minute"), ("--concurrency", "concurrent requests"))
    for flag, what in (*limits, ("--tpm", "prompt + output tokens per minute")):
        create.add_argument(flag, type=int, default=0, metavar="N", help=f"{what} (0: no limit)")
    create.set_defaults(run=_create)
    listing = actions.add_parser("list", help="list the keys (never the keys themselves)")
    listing.add_argument("--json", action="store_true", help="print a JSON list")
    listing.set_defaults(run=_list)
    revoke = actions.add_parser("revoke", help="revoke a key: routers refuse it from then on")
    revoke.add_argument("key_id", metavar="ID", help="the key's id (`pdserve keys list`)")
    revoke.set_defaults(run=_revoke)
    for action in (create, listing, revoke):
        action.add_argument(
            "--file",
            default=os.environ.get(FILE_ENV),
            metavar="PATH",
            help=f"the key file (default: ${FILE_ENV})",
        )


def _path(args: argparse.Namespace) -> str | None:
    return args.file or None


def _create(args: argparse.Namespace) -> int:
    if _path(args) is None:
        return fail("keys", f"--file (or ${FILE_ENV}) is required", EXIT_USAGE)
    try:
        limits = KeyLimits(args.rpm, args.concurrency, args.tpm)
        keys = read_key_file(args.file, missing_ok=True)
        key, entry = new_key(args.name, limits, taken={k.id for k in keys})
        write_key_file(args.file, [*keys, entry])
    except (KeyFileError, ValueError) as exc:
        return fail("keys", exc, EXIT_USAGE)
    except OSError as exc:
        return fail("keys", f"{args.file}: {exc}")
    print(
        f"created key {entry.id} ({entry.name}) in {args.file}; it is shown once:", file=sys.stderr
    )
    print(key)
    return 0


def _list(args: argparse.Namespace) -> int:
    if _path(args) is None:
        return fail("keys", f"--file (or ${FILE_ENV}) is required", EXIT_USAGE)
    try:
        keys = read_key_file(args.file, missing_ok=True)
    except KeyFileError as exc:
        return fail("keys", exc)
    if args.json:
        print(json.dumps([_json(key) for key in keys]))
    elif not keys:
        print("no keys")
    else:
        print(format_table(COLUMNS, [_row(key) for key in keys]))
    return 0


def _revoke(args: argparse.Namespace) -> int:
    if _path(args) is None:
        return fail("keys", f"--file (or ${FILE_ENV}) is required", EXIT_USAGE)
    try:
        keys = read_key_file(args.file)
        if args.key_id not in {key.id for key in keys}:
            return fail("keys", f"no key {args.key_id!r} in {args.file}")
        write_key_file(args.file, [revoked(k) if k.id == args.key_id else k for k in keys])
    except KeyFileError as exc:
        return fail("keys", exc)
    except OSError as exc:
        return fail("keys", f"{args.file}: {exc}")
    print(f"revoked key {args.key_id}", file=sys.stderr)
    return 0


def _row(key: ApiKey) -> tuple[str, ...]:
    limits = key.limits
    created = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(key.created_at))
    counts = (limits.requests_per_minute, limits.concurrent_requests, limits.tokens_per_minute)
    status = "revoked" if key.revoked else "active"
    return (key.id, key.name, created, *(str(n) if n else "-" for n in counts), status)


def _json(key: ApiKey) -> dict:
    limits = key.limits
    return {
        "id": key.id,
        "name": key.name,
        "created_at": key.created_at,
        "revoked": key.revoked,
        "limits": {
            "requests_per_minute": limits.requests_per_minute,
            "concurrent_requests": limits.concurrent_requests,
            "tokens_per_minute": limits.tokens_per_minute,
        },
    }
