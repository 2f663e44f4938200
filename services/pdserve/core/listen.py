"""Where a server may listen: the checks every process's config makes of its address.

Without TLS a pdserve server speaks plaintext gRPC, so it binds loopback only unless its
operator says `--insecure` (`PDSERVE_INSECURE=true`, what the Helm chart sets for pods,
whose traffic must reach them from other nodes). With TLS (`--tls-cert/--tls-key/--tls-ca`)
it may bind any address: its peers are authenticated, and `--insecure` is not needed.
"""

from __future__ import annotations

import ipaddress

LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost"})


def check_port(name: str, port: int) -> None:
    """A TCP port, or 0 for a free one."""
    if not 0 <= port <= 65535:
        raise ValueError(f"{name} must be in [0, 65535], got {port}")


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, IPv6 with or without brackets) is loopback."""
    host = host.strip("[]")
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, *, insecure: bool, tls: bool = False) -> None:
    """Refuses a plaintext server beyond loopback unless `insecure` says it is meant; a
    server with TLS (`tls`) may bind anywhere."""
    if not insecure and not tls and not is_loopback(host):
        raise ValueError(
            f"host {host!r} is beyond loopback and this server has no TLS: "
            "pass --insecure (PDSERVE_INSECURE=true) to serve plaintext there"
        )
