"""The version of pdserve's internal protocol (router <-> workers, prefill <-> decode).

A rolling upgrade (`helm upgrade`) runs routers and workers of two releases side by
side: a release changes what it sends in ways the previous one still understands, and
the version says which releases those are. Peers whose versions differ by at most one
work together; any other pair is refused with a clear error (the KV handshake's
FAILED_PRECONDITION, the router not routing to the worker) instead of a corrupt
transfer. Raise `PROTOCOL_VERSION` with a change an older peer would misread, and keep
reading the previous version's messages for one release.
"""

from __future__ import annotations

from pdserve.core.errors import PreconditionError

PROTOCOL_VERSION = 1
# a peer this many versions away still works with us (a rolling upgrade's two releases)
COMPATIBLE_SPAN = 1
UNVERSIONED = 0  # what a peer from before the version existed sends (proto3's default)


class IncompatiblePeerError(PreconditionError):
    """A peer speaks a protocol version this one cannot work with."""


def compatible(peer_version: int) -> bool:
    """Whether a peer speaking `peer_version` works with this process."""
    return peer_version != UNVERSIONED and abs(peer_version - PROTOCOL_VERSION) <= COMPATIBLE_SPAN


def check_peer(peer_version: int, peer: str) -> None:
    """Raise IncompatiblePeerError naming both versions unless `peer` is compatible."""
    if not compatible(peer_version):
        theirs = "no version" if peer_version == UNVERSIONED else f"version {peer_version}"
        raise IncompatiblePeerError(
            f"{peer} speaks pdserve protocol {theirs}; this process speaks version "
            f"{PROTOCOL_VERSION} and works with versions {PROTOCOL_VERSION - COMPATIBLE_SPAN}"
            f" to {PROTOCOL_VERSION + COMPATIBLE_SPAN}: upgrade one of them"
        )
