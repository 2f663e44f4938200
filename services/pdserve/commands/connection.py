"""How a command reaches a router: plaintext, or TLS trusting a CA, and an API key.

`pdserve generate`, `status --router` and `bench --router` share these flags. A router with
`--tls-*` serves TLS on its gRPC port without asking for a client certificate (its callers
hold API keys), so `--tls-ca` alone turns TLS on; `--tls-cert/--tls-key` present one
anyway (a proxy that asks for it). Each flag falls back to a variable, the API key's
above all: on a command line it shows in `ps`.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import grpc

# flag -> its variable; the TLS ones are the servers' own (one CA for every process)
CONNECTION_FLAGS = {
    "--tls-ca": "PDSERVE_TLS_CA",
    "--tls-cert": "PDSERVE_TLS_CERT",
    "--tls-key": "PDSERVE_TLS_KEY",
    "--api-key": "PDSERVE_API_KEY",
}
CONNECTION_HELP = {
    "--tls-ca": "connect over TLS, trusting the router's certificate if this CA (PEM) signed it",
    "--tls-cert": "with --tls-ca: a client certificate (PEM) to present (with --tls-key)",
    "--tls-key": "the private key (PEM) of --tls-cert",
    "--api-key": "sent as `authorization: Bearer KEY` (prefer the variable: flags show in ps)",
}


class ConnectionFlagError(ValueError):
    """A connection flag that cannot be used; the message names it."""


@dataclass(frozen=True, slots=True)
class RouterConnection:
    """What `pdserve.client.Client` / `AsyncClient` take beside the address."""

    credentials: grpc.ChannelCredentials | None = None  # None: plaintext
    api_key: str | None = None

    @property
    def client_kwargs(self) -> dict:
        """`Client(address, **connection.client_kwargs)`."""
        return {"credentials": self.credentials, "api_key": self.api_key}


def add_connection_arguments(cmd: argparse.ArgumentParser) -> None:
    """--tls-ca, --tls-cert, --tls-key and --api-key, each defaulting to its variable."""
    group = cmd.add_argument_group("connecting to a secured router")
    for flag, variable in CONNECTION_FLAGS.items():
        metavar = "KEY" if flag == "--api-key" else "PATH"
        group.add_argument(
            flag, default=None, metavar=metavar, help=f"{CONNECTION_HELP[flag]} (${variable})"
        )


def connection_from_args(args: argparse.Namespace) -> RouterConnection:
    """The credentials the flags (or their variables) ask for; ConnectionFlagError naming the
    flag when a file cannot be read or the flags do not go together."""
    given = {flag: _value(args, flag) for flag in CONNECTION_FLAGS}
    ca, cert, key = given["--tls-ca"], given["--tls-cert"], given["--tls-key"]
    if bool(cert) != bool(key):
        raise ConnectionFlagError("--tls-cert and --tls-key go together")
    if cert and not ca:
        raise ConnectionFlagError("--tls-cert needs --tls-ca (the CA that signed the router's)")
    credentials = None
    if ca:
        pair = {}
        if cert:
            pair = {
                "certificate_chain": _read("--tls-cert", cert),
                "private_key": _read("--tls-key", key),
            }
        credentials = grpc.ssl_channel_credentials(_read("--tls-ca", ca), **pair)
    return RouterConnection(credentials, given["--api-key"] or None)


def _value(args: argparse.Namespace, flag: str) -> str | None:
    value = getattr(args, flag.removeprefix("--").replace("-", "_"), None)
    return value or os.environ.get(CONNECTION_FLAGS[flag]) or None


def _read(flag: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConnectionFlagError(f"{flag} {path!r}: {exc.strerror or exc}") from exc
