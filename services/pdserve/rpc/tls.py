"""mTLS for every pdserve server and channel: credentials from the PEM files of a
`TlsConfig`, re-read when they change, and the role a peer's certificate carries.

Rotation (cert-manager rewrites the files in place, through a symlink swap):
- Servers take `grpc.dynamic_ssl_server_credentials`: gRPC asks `TlsFiles` before every
  TLS handshake, which compares the files' inode, mtime and size with the last read
  and hands gRPC the new pair once they changed. Connections already open keep theirs.
- A channel's credentials are fixed when it is made, so channel pools ask
  `ChannelTls.generation` (files checked at most once a second) and open a new channel
  for new calls once it moved; the old one keeps its calls (a Relay call lives for
  hours) and is closed with its pool. TLS checks a certificate only at the handshake,
  so a connection made with the old files works on after they rotate.
- A certificate and key are used only once they match each other: a rotation written
  one file at a time keeps the old pair until the second file lands.

A peer's role is its certificate's Subject OU (`Role`). Servers read the client's
certificate from the call's auth context (`peer_role`); a client reads a server's in a
TLS handshake of its own (`server_role`), since gRPC's Python channels do not show the
certificate they verified: the prefill worker checks that a KV target is a decode
worker, the router that a registered worker holds the role it registered with.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import ssl
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import grpc
from cryptography import x509
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from cryptography.x509.oid import NameOID

from pdserve.core.errors import PreconditionError
from pdserve.core.tls_config import TLS_FLAGS, Role, TlsConfig

__all__ = [
    "ChannelTls",
    "PeerRoleError",
    "Role",
    "TlsFileError",
    "TlsFiles",
    "channel_credentials",
    "check_server_role",
    "peer_role",
    "role_of_certificate",
    "server_credentials",
    "server_role",
    "server_tls",
]
log = logging.getLogger(__name__)
CHANNEL_CHECK_INTERVAL_S = 1.0  # how often channel pools look at the files
ROLE_PROBE_TIMEOUT_S = 5.0
PEM_CERT_PROPERTY = "x509_pem_cert"  # the auth context's property holding the peer's PEM
_ROLE_NAMES = frozenset(role.value for role in Role)


class TlsFileError(ValueError):
    """A TLS file cannot be used; the message names its flag and path."""


@dataclass(frozen=True, slots=True)
class TlsMaterial:
    """The three files' contents, as gRPC takes them."""

    cert_chain: bytes
    key: bytes
    ca: bytes


def load_material(tls: TlsConfig) -> TlsMaterial:
    """Read `tls`'s files; TlsFileError naming the flag when one is unreadable, not PEM,
    or the key is not the certificate's."""
    flag_cert, flag_key, flag_ca = TLS_FLAGS
    cert = _read(flag_cert, tls.tls_cert)
    key = _read(flag_key, tls.tls_key)
    ca = _read(flag_ca, tls.tls_ca)
    try:
        leaf = x509.load_pem_x509_certificate(cert)
    except ValueError as exc:
        raise TlsFileError(f"{flag_cert} {tls.tls_cert!r}: not a PEM certificate") from exc
    try:
        private_key = load_pem_private_key(key, password=None)
    except (ValueError, TypeError) as exc:
        raise TlsFileError(f"{flag_key} {tls.tls_key!r}: not an unencrypted PEM key") from exc
    if private_key.public_key() != leaf.public_key():
        raise TlsFileError(f"{flag_key} {tls.tls_key!r} is not the key of {flag_cert}")
    try:
        x509.load_pem_x509_certificates(ca)
    except ValueError as exc:
        raise TlsFileError(f"{flag_ca} {tls.tls_ca!r}: not a PEM certificate bundle") from exc
    return TlsMaterial(cert, key, ca)


def _read(flag: str, path: str | None) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise TlsFileError(f"{flag} {path!r}: {exc.strerror or exc}") from exc


class TlsFiles:
    """One TlsConfig's files as last read, re-read once one of them changed on disk.

    Thread-safe: gRPC calls a server's fetcher from its own threads.
    """

    def __init__(self, tls: TlsConfig, *, check_interval_s: float = 0.0):
        self.tls = tls
        self.check_interval_s = check_interval_s
        self._lock = threading.Lock()
        self._stamps = self._stamp()
        self.material = load_material(tls)
        self.generation = 0  # counts the changes taken
        self._checked_at = time.monotonic()
        self._refusing = False  # the files changed into ones we cannot use (logged once)

    def _stamp(self) -> tuple:
        paths = (self.tls.tls_cert, self.tls.tls_key, self.tls.tls_ca)
        stats = [os.stat(path) for path in paths]
        return tuple((s.st_ino, s.st_mtime_ns, s.st_size) for s in stats)

    def refresh(self) -> bool:
        """Take the files' new contents if they changed; whether the material did. Files
        that cannot be used (half-written, missing) are refused: the last good ones stay."""
        with self._lock:
            now = time.monotonic()
            if now - self._checked_at < self.check_interval_s:
                return False
            self._checked_at = now
            try:
                stamps = self._stamp()
                if stamps == self._stamps:
                    return False
                material = load_material(self.tls)
            except (OSError, TlsFileError) as exc:
                if not self._refusing:
                    log.warning("TLS files changed but cannot be used; keeping the last: %s", exc)
                self._refusing = True
                return False
            self._stamps, self._refusing = stamps, False
            if material == self.material:
                return False
            self.material, self.generation = material, self.generation + 1
            log.info("TLS files reloaded (%s)", self.tls.tls_cert)
            return True


# -- servers ---------------------------------------------------------------------------


def server_credentials(
    tls: TlsConfig, *, require_client_cert: bool = True
) -> grpc.ServerCredentials | None:
    """A server's credentials from `tls` (None when TLS is off), re-read from disk when
    the files change. `require_client_cert`: refuse, at the handshake, a client without
    a certificate signed by the CA (the workers); False serves clients that have none
    (the router's public API, whose callers hold API keys)."""
    if not tls.enabled:
        return None
    files = TlsFiles(tls)

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        # gRPC calls this before every handshake; it must never raise into gRPC's core.
        try:
            return _certificate_configuration(files.material) if files.refresh() else None
        except Exception:  # noqa: BLE001 - the current certificate stays in use
            log.exception("checking the TLS files failed")
            return None

    return grpc.dynamic_ssl_server_credentials(
        _certificate_configuration(files.material),
        fetch,
        require_client_authentication=require_client_cert,
    )


def server_tls(
    tls: TlsConfig, *, require_client_cert: bool = True
) -> Callable[[], grpc.ServerCredentials] | None:
    """What `rpc.server.ServerOptions.credentials` takes: `server_credentials` made anew
    for each port (gRPC's reloading credentials serve one port each); None: TLS off.
    The files are read once now, so that bad ones stop the process at start-up."""
    if not tls.enabled:
        return None
    load_material(tls)
    return functools.partial(server_credentials, tls, require_client_cert=require_client_cert)


def _certificate_configuration(material: TlsMaterial) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration(
        [(material.key, material.cert_chain)], root_certificates=material.ca
    )


def peer_role(context: grpc.aio.ServicerContext) -> Role | None:
    """The role (Subject OU) of the client certificate on this call; None without a
    certificate, or when it names no single role."""
    pem = peer_certificate_pem(context)
    return None if pem is None else role_of_pem(pem)


def peer_certificate_pem(context: grpc.aio.ServicerContext) -> bytes | None:
    """The PEM of the certificate the caller presented (None: none, or no TLS)."""
    pems = context.auth_context().get(PEM_CERT_PROPERTY)
    return pems[0] if pems else None


@functools.lru_cache(maxsize=256)  # a cluster has a handful of certificates
def role_of_pem(pem: bytes) -> Role | None:
    return role_of_certificate(x509.load_pem_x509_certificate(pem))


def role_of_certificate(certificate: x509.Certificate) -> Role | None:
    """The one role among the Subject's OUs; None when no OU, or two, name a role."""
    units = certificate.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    roles = {Role(unit.value) for unit in units if unit.value in _ROLE_NAMES}
    return roles.pop() if len(roles) == 1 else None


# -- channels --------------------------------------------------------------------------


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials | None:
    """A channel's credentials from `tls`'s files as they are now; None when TLS is off."""
    return _channel_credentials(load_material(tls)) if tls.enabled else None


def _channel_credentials(material: TlsMaterial) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=material.ca,
        private_key=material.key,
        certificate_chain=material.cert_chain,
    )


class ChannelTls:
    """How this process opens channels: mTLS from the files (their newest contents for
    each new channel), or plaintext when TLS is off."""

    def __init__(
        self, tls: TlsConfig | None = None, *, check_interval_s: float = CHANNEL_CHECK_INTERVAL_S
    ):
        self.tls = tls or TlsConfig()
        self._files = (
            TlsFiles(self.tls, check_interval_s=check_interval_s) if self.tls.enabled else None
        )
        self._credentials = (
            None if self._files is None else _channel_credentials(self._files.material)
        )

    @property
    def enabled(self) -> bool:
        return self._files is not None

    @property
    def generation(self) -> int:
        """Moves when the files changed: channels made before are of the old files."""
        return self._refresh()

    def _refresh(self) -> int:
        """Take changed files (looked at once per check interval); their generation."""
        if self._files is None:
            return 0
        if self._files.refresh():
            self._credentials = _channel_credentials(self._files.material)
        return self._files.generation

    def options(self) -> list[tuple[str, str]]:
        if self.tls.tls_server_name:
            return [("grpc.ssl_target_name_override", self.tls.tls_server_name)]
        return []

    def aio_channel(self, address: str, options: Sequence[tuple] = ()) -> grpc.aio.Channel:
        """A grpc.aio channel to `address`: secure with the newest files, else plaintext."""
        self._refresh()
        if self._credentials is None:
            return grpc.aio.insecure_channel(address, options=list(options))
        return grpc.aio.secure_channel(
            address, self._credentials, options=[*options, *self.options()]
        )

    def channel(self, address: str, options: Sequence[tuple] = ()) -> grpc.Channel:
        """The same as a blocking grpc channel (tools, tests)."""
        self._refresh()
        if self._credentials is None:
            return grpc.insecure_channel(address, options=list(options))
        return grpc.secure_channel(address, self._credentials, options=[*options, *self.options()])

    def ssl_context(self) -> ssl.SSLContext:
        """The client side of a TLS handshake as our channels make it (for `server_role`)."""
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.tls.tls_ca)
        context.load_cert_chain(self.tls.tls_cert, self.tls.tls_key)
        context.set_alpn_protocols(["h2"])
        return context


def split_address(address: str) -> tuple[str, int]:
    """("host", port) of "host:port" or "[v6]:port"; ValueError naming the address."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{address!r} is not host:port")
    return host.strip("[]"), int(port)


async def server_role(
    address: str, tls: ChannelTls, timeout_s: float = ROLE_PROBE_TIMEOUT_S
) -> Role | None:
    """The role in the certificate the server at `address` presents, read in a TLS
    handshake of our own that checks it as our channels do (signed by the CA, naming the
    host dialled or --tls-server-name). Raises OSError / ssl.SSLError / TimeoutError when
    no such handshake can be made."""
    host, port = split_address(address)
    server_name = tls.tls.tls_server_name or host
    _, writer = await asyncio.wait_for(
        asyncio.open_connection(host, port, ssl=tls.ssl_context(), server_hostname=server_name),
        timeout_s,
    )
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    finally:
        writer.close()
    return role_of_certificate(x509.load_der_x509_certificate(der))


class PeerRoleError(PreconditionError):
    """A server's certificate does not hold a role this call may go to."""

    def __init__(self, field: str, address: str, role: Role | None, allowed: Collection[Role]):
        names = " or ".join(sorted(r.value for r in allowed))
        super().__init__(
            f"{field} {address!r}: its certificate's role (Subject OU) is "
            f"{role.value if role else 'none'}, not {names}"
        )
        self.field, self.address, self.role = field, address, role


async def check_server_role(
    address: str, allowed: Collection[Role], tls: ChannelTls, *, field: str
) -> Role:
    """The server's role if it is one of `allowed`; PeerRoleError naming `field` and the
    address otherwise, or when no mTLS handshake with it succeeds."""
    try:
        role = await server_role(address, tls)
    except (OSError, TimeoutError, ValueError) as exc:  # ssl.SSLError is an OSError
        raise PreconditionError(
            f"{field} {address!r}: no mTLS handshake with it succeeded ({exc})"
        ) from exc
    if role not in allowed:
        raise PeerRoleError(field, address, role, allowed)
    return role
