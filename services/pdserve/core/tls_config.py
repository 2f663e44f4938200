"""TLS settings every pdserve process shares, and the roles its certificates carry.

With `--tls-cert`, `--tls-key` and `--tls-ca` a process speaks mTLS: its servers present
the certificate and (on the workers) require a client certificate signed by the CA; its
channels present the certificate and trust only servers the CA signed. A certificate's
role is its Subject OU (`Role`): what it may call is `rpc/roles.py`'s table. The files
are re-read when they change (`rpc/tls.py`), as cert-manager rotates them in place.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field

TLS_FLAGS = ("--tls-cert", "--tls-key", "--tls-ca")


class Role(enum.StrEnum):
    """What a certificate's holder is: the Subject OU it was issued with."""

    ROUTER = "router"
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"  # a colocated worker: prefill and decode on one engine


@dataclass(slots=True)
class TlsConfig:
    """The PEM files of one process's certificate, its key and the cluster's CA: all
    three or none (plaintext)."""

    tls_cert: str | None = field(
        default=None,
        metadata={"help": "PEM certificate (chain) this process presents; turns on mTLS"},
    )
    tls_key: str | None = field(default=None, metadata={"help": "PEM private key of --tls-cert"})
    tls_ca: str | None = field(
        default=None,
        metadata={"help": "PEM CA bundle: peers' certificates must be signed by it"},
    )
    tls_server_name: str | None = field(
        default=None,
        metadata={
            "help": "the DNS name checked in a server's certificate in place of the host "
            "dialled (for pod IPs, which certificates rarely name)",
            "default_help": "the host dialled",
        },
    )

    def __post_init__(self) -> None:
        paths = dict(zip(TLS_FLAGS, (self.tls_cert, self.tls_key, self.tls_ca), strict=True))
        given = [flag for flag, path in paths.items() if path]
        if given and len(given) < len(TLS_FLAGS):
            missing = [f"{flag} (${_variable(flag)})" for flag in TLS_FLAGS if flag not in given]
            raise ValueError(
                f"{', '.join(TLS_FLAGS)} go together: {' and '.join(missing)} not given "
                f"(only {', '.join(given)})"
            )
        for flag, path in paths.items():
            if path and not os.path.isfile(path):
                raise ValueError(f"{flag}: no file at {path!r}")
        if self.tls_server_name is not None and not given:
            raise ValueError("--tls-server-name needs --tls-cert, --tls-key and --tls-ca")

    @property
    def enabled(self) -> bool:
        """Whether this process speaks mTLS (all three files given)."""
        return bool(self.tls_cert)


def _variable(flag: str) -> str:
    return "PDSERVE_" + flag.removeprefix("--").upper().replace("-", "_")
