"""Keeps a local cluster's children running: one that dies is started again, same ports.

`pdserve up` is for people trying pdserve on one machine; a worker killed by the OOM
killer, or a Redis someone stopped, should come back by itself as a pod would, with a
line saying what happened. A child restarts after a delay that doubles with each death
in a row (from `first_delay_s` to `max_delay_s`) and goes back to the first once it has
stayed up for `stable_after_s`, so a child that cannot start does not spin.

Each child is restarted on the ports it had (its ready line said which), so the router's
address stays what clients were told, and a worker's address what the registry lists.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from pdserve.cluster.processes import ChildProcess, exit_description, wait_ready
from pdserve.state.redis_server import find_redis_server

POLL_INTERVAL_S = 0.2
REDIS_READY_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delays between restarts of one child: exponential, capped, reset once stable."""

    first_delay_s: float = 0.5
    max_delay_s: float = 10.0
    stable_after_s: float = 30.0

    def delay(self, num_deaths_in_a_row: int) -> float:
        return min(self.first_delay_s * 2 ** max(num_deaths_in_a_row - 1, 0), self.max_delay_s)


class RedisChild:
    """A private redis-server on a fixed loopback port, with nothing persisted: killed
    and started again, it comes back empty on the same address (as a Redis pod would)."""

    def __init__(self, port: int, host: str = "127.0.0.1"):
        self.host, self.port = host, port
        self.name = "redis"
        self.binary = find_redis_server()
        self.proc: subprocess.Popen | None = None
        self._dir = tempfile.mkdtemp(prefix="pdserve-redis-")

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> RedisChild:
        """Start it and wait until it answers PING; RuntimeError if it does not. Whatever
        ends the wait (Ctrl-C included) stops it first: the caller never gets it."""
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> RedisChild:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", self.host, "--save", ""]
            + ["--appendonly", "no", "--dir", self._dir, "--loglevel", "warning"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(host=self.host, port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + REDIS_READY_TIMEOUT_S
        try:
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    if client.ping():
                        return self
                except redis.ConnectionError:
                    time.sleep(0.05)
        finally:
            client.close()
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def remove(self) -> None:
        """Stop it for good and remove its directory."""
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)


@dataclass
class _Watched:
    """One child under watch: how to start it again, and its record of deaths."""

    child: ChildProcess | RedisChild
    restart: Callable[[], None]  # starts it again and waits until it serves
    started_at: float = field(default_factory=time.monotonic)
    num_deaths_in_a_row: int = 0
    restarting: bool = False


class Supervisor:
    """A thread that restarts dead children; `say` gets one line per death and return."""

    def __init__(self, say: Callable[[str], None], backoff: Backoff | None = None):
        self.say, self.backoff = say, backoff or Backoff()
        self._watched: list[_Watched] = []
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def watch_process(self, child: ChildProcess, args_for_restart: Callable[[], list[str]]):
        """Watch a pdserve child; it restarts with `args_for_restart()` (its same ports)."""

        def restart() -> None:
            wait_ready(child.respawn(args_for_restart()))

        self._watched.append(_Watched(child, restart))

    def watch_redis(self, server: RedisChild) -> None:
        self._watched.append(_Watched(server, server.start))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="pdserve-supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """No restart from now on (a restart under way is left to the children's stop)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stopping.wait(POLL_INTERVAL_S):
            for watched in self._watched:
                proc = watched.child.proc
                if not watched.restarting and proc is not None and proc.poll() is not None:
                    self._on_death(watched, proc.returncode)

    def _on_death(self, watched: _Watched, returncode: int) -> None:
        now = time.monotonic()
        if now - watched.started_at >= self.backoff.stable_after_s:
            watched.num_deaths_in_a_row = 0
        watched.num_deaths_in_a_row += 1
        delay = self.backoff.delay(watched.num_deaths_in_a_row)
        watched.restarting = True
        self.say(
            f"{watched.child.name} died ({exit_description(returncode)}); "
            f"restarting it in {delay:g} s on {_address(watched.child)}"
        )
        threading.Thread(
            target=self._restart,
            args=(watched, now, delay),
            name=f"restart-{watched.child.name}",
            daemon=True,
        ).start()

    def _restart(self, watched: _Watched, died_at: float, delay: float) -> None:
        if self._stopping.wait(delay):
            return
        try:
            watched.restart()
        except (RuntimeError, OSError) as exc:
            if not self._stopping.is_set():
                self.say(f"{watched.child.name} did not come back: {str(exc).splitlines()[0]}")
        else:
            watched.started_at = time.monotonic()
            self.say(
                f"{watched.child.name} is back on {_address(watched.child)} "
                f"({watched.started_at - died_at:.1f} s after it died)"
            )
        finally:
            watched.restarting = False


def _address(child: ChildProcess | RedisChild) -> str:
    if isinstance(child, RedisChild):
        return child.address
    return child.fields.get("address", "its ports") if child.fields else "its ports"
