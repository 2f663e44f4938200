"""API keys: the key file, stored hashed, and the ring the router checks keys against.

A key is `pdk_<id>_<secret>`: `id` (12 hex digits) names it in the file, in logs and in
Redis; `secret` is 32 random bytes (url-safe base64). The file keeps only the sha256 of
the whole key, so a copy of the file lets nobody in. `pdserve keys` writes it; the router
reads it (`--api-key-file`) and reloads it when it changes (a Kubernetes Secret mount
swaps the file under a symlink: a new inode, a new mtime), without a restart.

The file is JSON:

    {"format": "pdserve-api-keys/v1",
     "keys": [{"id": "3f9a0c1b2d4e", "name": "team-a", "sha256": "<64 hex digits>",
               "created_at": 1767225600.0, "revoked": false,
               "limits": {"requests_per_minute": 60, "concurrent_requests": 4,
                          "tokens_per_minute": 100000}}]}

A limit of 0 (or one left out) is no limit.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from pdserve.router.auth.caller import Caller, KeyLimits

log = logging.getLogger(__name__)
KEY_PREFIX = "pdk_"
FILE_FORMAT = "pdserve-api-keys/v1"
FILE_MODE = 0o600  # the hashes are no secret, but the names and limits are nobody's business
RELOAD_CHECK_INTERVAL_S = 1.0  # how often the router looks whether the file changed
_ID_HEX_DIGITS = 12
_SECRET_BYTES = 32
_SHA256_HEX_DIGITS = 64
# What an unknown key id is compared against, so that an unknown key and a wrong secret
# cost the same time (a hash no key has: sha256 hex digits are never all "x").
_NO_HASH = "x" * _SHA256_HEX_DIGITS


class KeyFileError(ValueError):
    """The key file cannot be used; the message names the file and the field at fault."""


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One key as the file stores it: never the key itself, only its sha256."""

    id: str
    name: str
    sha256: str  # hex digest of the whole key (`pdk_<id>_<secret>`)
    created_at: float  # unix seconds
    limits: KeyLimits = field(default_factory=KeyLimits)
    revoked: bool = False

    @property
    def caller(self) -> Caller:
        return Caller(key_id=self.id, name=self.name, limits=self.limits)


def hash_key(key: str) -> str:
    """The sha256 (hex) the file stores for `key`."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def key_id_of(key: str) -> str | None:
    """The id part of a key in pdserve's form, None for anything else."""
    if not key.startswith(KEY_PREFIX):
        return None
    key_id, separator, secret = key[len(KEY_PREFIX) :].partition("_")
    return key_id if separator and secret else None


def new_key(name: str, limits: KeyLimits, *, taken: set[str] = frozenset()) -> tuple[str, ApiKey]:
    """A fresh key (shown to its owner once) and the entry the file keeps for it."""
    if not name.strip():
        raise KeyFileError("name: must not be empty")
    key_id = secrets.token_hex(_ID_HEX_DIGITS // 2)
    while key_id in taken:
        key_id = secrets.token_hex(_ID_HEX_DIGITS // 2)
    key = f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(_SECRET_BYTES)}"
    return key, ApiKey(key_id, name, hash_key(key), time.time(), limits)


def revoked(entry: ApiKey) -> ApiKey:
    return replace(entry, revoked=True)


# -- the file ---------------------------------------------------------------------------------


def parse_key_file(text: str, source: str = "the key file") -> list[ApiKey]:
    """The keys in a key file's text; KeyFileError naming the field at fault."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise KeyFileError(f"{source}: not valid JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FILE_FORMAT:
        raise KeyFileError(f"{source}: format: must be {FILE_FORMAT!r}")
    entries = data.get("keys")
    if not isinstance(entries, list):
        raise KeyFileError(f"{source}: keys: must be a list")
    keys = [_parse_entry(entry, f"{source}: keys[{i}]") for i, entry in enumerate(entries)]
    ids = [key.id for key in keys]
    if len(set(ids)) != len(ids):
        raise KeyFileError(f"{source}: keys: an id appears twice")
    return keys


def _parse_entry(entry: object, where: str) -> ApiKey:
    if not isinstance(entry, dict):
        raise KeyFileError(f"{where}: must be an object")
    checks = {
        "id": lambda v: isinstance(v, str) and len(v) == _ID_HEX_DIGITS and _is_hex(v),
        "name": lambda v: isinstance(v, str) and bool(v),
        "sha256": lambda v: isinstance(v, str) and len(v) == _SHA256_HEX_DIGITS and _is_hex(v),
        "created_at": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    }
    for name, check in checks.items():
        if not check(entry.get(name)):
            raise KeyFileError(f"{where}.{name}: missing or malformed")
    revoked_flag = entry.get("revoked", False)
    if not isinstance(revoked_flag, bool):
        raise KeyFileError(f"{where}.revoked: must be true or false")
    limits = entry.get("limits", {})
    if not isinstance(limits, dict):
        raise KeyFileError(f"{where}.limits: must be an object")
    try:
        key_limits = KeyLimits(**limits)
    except (TypeError, ValueError) as exc:
        raise KeyFileError(f"{where}.limits: {exc}") from None
    created_at = float(entry["created_at"])
    return ApiKey(entry["id"], entry["name"], entry["sha256"], created_at, key_limits, revoked_flag)


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


def read_key_file(path: str | Path, *, missing_ok: bool = False) -> list[ApiKey]:
    """The keys in the file at `path` ([] if it does not exist and `missing_ok`)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        if missing_ok:
            return []
        raise KeyFileError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"{path}: cannot be read ({exc})") from None
    return parse_key_file(text, str(path))


def write_key_file(path: str | Path, keys: list[ApiKey]) -> None:
    """Replace the file at `path` with `keys`, atomically (a temporary file in the same
    directory, mode 0600, renamed over it): a router reading it sees the old or the new."""
    path = Path(path)
    data = {"format": FILE_FORMAT, "keys": [asdict(key) for key in keys]}
    text = json.dumps(data, indent=2) + "\n"
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


# -- the router's side --------------------------------------------------------------------------


class KeyRing:
    """The keys of one key file, checked against what callers present.

    It looks at the file (a stat) at most every `check_interval_s`, and reloads it when its
    inode, size or mtime changed. A file that cannot be read or parsed any more leaves the
    keys as they were (with a warning), so a half-written edit locks nobody out; at start
    (`open`) it is an error.
    """

    def __init__(self, path: str | Path, keys: list[ApiKey], *, check_interval_s: float):
        self.path, self.check_interval_s = Path(path), check_interval_s
        self._by_id = {key.id: key for key in keys}
        self._signature = self._stat()
        self._checked_at = time.monotonic()
        self._failed_signature: tuple | None = None  # warned about once

    @classmethod
    def open(cls, path: str | Path, *, check_interval_s: float = RELOAD_CHECK_INTERVAL_S):
        """Read the file now; KeyFileError if it is missing or malformed."""
        ring = cls(path, [], check_interval_s=check_interval_s)
        ring._by_id = {key.id: key for key in read_key_file(path)}
        return ring

    @property
    def keys(self) -> list[ApiKey]:
        return list(self._by_id.values())

    def authenticate(self, presented: str | None) -> Caller | None:
        """The caller whose key `presented` is, or None (missing, malformed, unknown, wrong
        or revoked: one answer for all). The secret part is compared in constant time."""
        self._reload_if_changed()
        if not presented:
            return None
        entry = self._by_id.get(key_id_of(presented) or "")
        expected = entry.sha256 if entry is not None else _NO_HASH
        matches = hmac.compare_digest(expected.encode(), hash_key(presented).encode())
        if not matches or entry is None or entry.revoked:
            return None
        return entry.caller

    def _stat(self) -> tuple | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def _reload_if_changed(self) -> None:
        now = time.monotonic()
        if now - self._checked_at < self.check_interval_s:
            return
        self._checked_at = now
        signature = self._stat()
        if signature == self._signature or signature == self._failed_signature:
            return
        try:
            keys = read_key_file(self.path)
        except KeyFileError as exc:
            self._failed_signature = signature
            log.warning("API keys: kept the %d loaded keys: %s", len(self._by_id), exc)
            return
        self._by_id = {key.id: key for key in keys}
        self._signature, self._failed_signature = signature, None
        log.info("API keys: reloaded %s (%d keys)", self.path, len(keys))
