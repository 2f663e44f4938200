"""`pdserve certs`: a local CA and one certificate per role, to try mTLS on one machine.

Writes ca.crt, ca.key and ROLE.crt / ROLE.key for router, prefill, decode and both (Subject
OU = the role; SANs localhost, 127.0.0.1 and each `--san`) into `--out`, keys with mode
0600. `pdserve up --tls-dir DIR` takes such a directory (and makes one if it is empty);
each process started by hand takes its role's three files as `--tls-cert/--tls-key/--tls-ca`.
For a real cluster issue certificates from your own CA (docs/security.md).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

from pdserve.cluster.certs import LOCAL_NAMES, make_role_certs
from pdserve.commands import EXIT_USAGE, fail

DEFAULT_OUT = "pdserve-certs"
DEFAULT_DAYS = 90


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    cmd = subcommands.add_parser(
        "certs", help="make a local CA and a certificate per role (router, prefill, decode, both)"
    )
    cmd.add_argument(
        "--out", default=DEFAULT_OUT, metavar="DIR", help=f"where to write (default {DEFAULT_OUT})"
    )
    cmd.add_argument(
        "--san",
        action="append",
        default=[],
        metavar="NAME",
        help=f"another DNS name or IP every certificate names, beside {', '.join(LOCAL_NAMES)} "
        "(repeatable)",
    )
    cmd.add_argument(
        "--days", type=int, default=DEFAULT_DAYS, help=f"validity (default {DEFAULT_DAYS})"
    )
    cmd.add_argument(
        "--force", action="store_true", help="write into a directory that is not empty"
    )
    cmd.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.days < 1:
        return fail("certs", f"--days must be >= 1, got {args.days}", EXIT_USAGE)
    if out.exists() and not out.is_dir():
        return fail("certs", f"--out {out}: not a directory", EXIT_USAGE)
    if out.is_dir() and any(out.iterdir()) and not args.force:
        return fail("certs", f"--out {out} is not empty (--force writes over it)", EXIT_USAGE)
    try:
        issued = make_role_certs(out, args.san, valid_for=datetime.timedelta(days=args.days))
    except OSError as exc:
        return fail("certs", f"--out {out}: {exc.strerror or exc}")
    except ValueError as exc:  # a --san that cannot be a name
        return fail("certs", f"--san: {exc}", EXIT_USAGE)
    names = ", ".join([*LOCAL_NAMES, *args.san])
    print(
        f"wrote a CA and {len(issued)} certificates to {out} (valid for {names})", file=sys.stderr
    )
    for role, files in issued.items():
        print(f"{role.value}: {' '.join(files.args())}")
    print(f"try: pdserve up --tls-dir {out}", file=sys.stderr)
    return 0
