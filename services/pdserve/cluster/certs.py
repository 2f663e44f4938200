"""A private CA and one certificate per role, for a cluster on this machine.

`pdserve certs` writes them for people trying mTLS by hand, `pdserve up --tls-dir` for its
children, and the tests issue theirs here too. Each certificate carries its role in the
Subject OU (`router`, `prefill`, `decode`, `both`: what `rpc/roles.py` checks), serves as
both server and client (a worker is one and the other), and names this machine (DNS
`localhost`, IP 127.0.0.1) plus any extra names given, the way `docs/security.md` tells an
operator to issue them with openssl or cert-manager. Keys are written with mode 0600.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pdserve.core.tls_config import Role, TlsConfig

LOCAL_NAMES = ("localhost", "127.0.0.1")  # what every local certificate names
CA_CERT, CA_KEY = "ca.crt", "ca.key"
DEFAULT_VALID_FOR = datetime.timedelta(days=90)
CLOCK_SKEW = datetime.timedelta(minutes=5)  # valid from a little before now
KEY_MODE = 0o600


@dataclass(frozen=True, slots=True)
class Issued:
    """One certificate's files, and the TlsConfig that names them."""

    cert: Path
    key: Path
    ca: Path

    @property
    def config(self) -> TlsConfig:
        return TlsConfig(tls_cert=str(self.cert), tls_key=str(self.key), tls_ca=str(self.ca))

    def args(self) -> list[str]:
        """The flags that give a pdserve process these files."""
        return ["--tls-cert", str(self.cert), "--tls-key", str(self.key), "--tls-ca", str(self.ca)]


def subject_alt_names(names: Sequence[str]) -> list[x509.GeneralName]:
    """Each name as an IP address SAN if it reads as one, else as a DNS name."""
    alt_names: list[x509.GeneralName] = []
    for name in names:
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alt_names.append(x509.DNSName(name))
    return alt_names


def _name(organization: str, common_name: str, unit: str | None = None) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization)]
    if unit is not None:
        attributes.append(x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, unit))
    attributes.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attributes)


def write_private_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    """The key as unencrypted PKCS#8 PEM, readable by its owner alone from the start
    (created 0600, never widened then narrowed)."""
    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, KEY_MODE)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, KEY_MODE)  # an existing file keeps its mode through O_CREAT


class ClusterCA:
    """A self-signed CA in `directory` (`ca.crt`; `ca.key` too with `keep_key`) that
    issues role certificates for this machine."""

    def __init__(
        self,
        directory: Path,
        name: str = "pdserve test CA",
        *,
        organization: str = "pdserve tests",
        valid_for: datetime.timedelta = datetime.timedelta(days=1),
        keep_key: bool = False,
    ):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.organization = organization
        self.valid_for = valid_for
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self.name = _name(organization, name)
        self.certificate = (
            x509.CertificateBuilder()
            .subject_name(self.name)
            .issuer_name(self.name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + valid_for)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_key_usage(ca=True), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.ca_path = self.directory / CA_CERT
        self.ca_path.write_bytes(self.certificate.public_bytes(serialization.Encoding.PEM))
        if keep_key:  # to issue more later with openssl (docs/security.md)
            write_private_key(self.key, self.directory / CA_KEY)

    def issue(
        self,
        name: str,
        role: str | None,
        *,
        into: Path | None = None,
        dns_names: tuple[str, ...] | None = None,
        extra_names: Sequence[str] = (),
    ) -> Issued:
        """A certificate (and key) for `name` whose Subject OU is `role` (None: no OU),
        valid for localhost and 127.0.0.1 and `extra_names` (or for `dns_names` alone);
        written as NAME.crt and NAME.key (in `into`)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        if dns_names is not None:
            san: list[x509.GeneralName] = [x509.DNSName(dns_name) for dns_name in dns_names]
        else:
            san = subject_alt_names([*LOCAL_NAMES, *extra_names])
        usage = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        certificate = (
            x509.CertificateBuilder()
            .subject_name(_name(self.organization, name, role))
            .issuer_name(self.name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + self.valid_for)
            .add_extension(x509.SubjectAlternativeName(san), critical=False)
            .add_extension(_key_usage(ca=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        directory = into or self.directory
        directory.mkdir(parents=True, exist_ok=True)
        cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
        cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        write_private_key(key, key_path)
        return Issued(cert_path, key_path, self.ca_path)


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    """A CA signs certificates; a leaf signs its handshakes (ECDSA: digital signature)."""
    return x509.KeyUsage(
        digital_signature=not ca,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


# -- a cluster's set: one certificate per role ----------------------------------------


class CertDirError(ValueError):
    """A certificate directory that is neither empty nor a whole set; names what is off."""


def role_files(directory: Path, role: Role) -> Issued:
    """Where `role`'s files are in a set's directory: ROLE.crt, ROLE.key, ca.crt."""
    return Issued(directory / f"{role}.crt", directory / f"{role}.key", directory / CA_CERT)


def _set_files(directory: Path) -> list[Path]:
    files = [directory / CA_CERT]
    for role in Role:
        issued = role_files(directory, role)
        files += [issued.cert, issued.key]
    return files


def make_role_certs(
    directory: Path,
    extra_names: Sequence[str] = (),
    *,
    valid_for: datetime.timedelta = DEFAULT_VALID_FOR,
    organization: str = "pdserve",
) -> dict[Role, Issued]:
    """A new CA (ca.crt, ca.key) and a certificate per role in `directory` (made 0700 if
    new), each named ROLE.crt / ROLE.key, valid for this machine and `extra_names`."""
    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    ca = ClusterCA(
        directory,
        "pdserve local CA",
        organization=organization,
        valid_for=valid_for,
        keep_key=True,
    )
    return {role: ca.issue(role.value, role.value, extra_names=extra_names) for role in Role}


def load_role_certs(directory: Path) -> dict[Role, Issued]:
    """The set in `directory` as `make_role_certs` wrote it; CertDirError naming the
    files missing if it is not whole."""
    missing = [path.name for path in _set_files(Path(directory)) if not path.is_file()]
    if missing:
        raise CertDirError(
            f"{directory}: not a whole certificate set; missing {', '.join(missing)}"
        )
    return {role: role_files(Path(directory), role) for role in Role}


def ensure_role_certs(directory: Path) -> tuple[dict[Role, Issued], bool]:
    """The set in `directory`, made first when the directory is missing or empty; and
    whether it was made now. A directory holding anything else is refused (CertDirError),
    so that nothing of someone's is overwritten."""
    directory = Path(directory)
    if not directory.exists() or not any(directory.iterdir()):
        return make_role_certs(directory), True
    return load_role_certs(directory), False
