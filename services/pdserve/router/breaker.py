"""A circuit breaker per worker: one that keeps failing is left alone until it answers again.

Discovery drops a worker whose heartbeat (or GetLoad poll) stops; that does not catch a
worker that still heartbeats but whose calls fail or hang, and it brings a thawed worker
back on its first heartbeat. The breaker does both. Each worker's breaker is

- **closed** (routed to): every call the router sees fail on it (UNAVAILABLE, or past
  the router's own deadline) is counted; a call that succeeds clears the count. When
  `failures` have been counted within `window_s`, it **opens**.
- **open** (not routed to) for `cooldown_s`, then
- **half-open**: still not routed to; one probe (the worker's `GetLoad`, with its own
  short deadline) runs. Passed: closed, the count cleared. Failed: open again, for
  another cool-down.

Only the probe closes a breaker: the late result of a call that began before it opened
says nothing about the worker now. `CircuitBreaker` is the state machine alone (no I/O;
its clock is a parameter, so its tests step time exactly); `Breakers` keeps one per
address; `pdserve.router.discovery.guarded` runs the probes and hides open workers.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

DEFAULT_BREAKER_FAILURES = 3
DEFAULT_BREAKER_WINDOW_S = 30.0
# a restarted or thawed worker is usually back within seconds; a probe every 5 s costs
# one GetLoad per open worker
DEFAULT_BREAKER_COOLDOWN_S = 5.0
DEFAULT_PROBE_TIMEOUT_S = 1.0  # GetLoad does no model work: a second is very slow already
# Admit only reserves blocks (no model work): seconds mean the worker is hung or gone.
DEFAULT_ADMIT_TIMEOUT_S = 5.0
# Prefill answers once the prompt is computed, after the worker's queue: its deadline
# bounds the whole call, generously; a hung worker is left sooner, once discovery stops
# listing it (its heartbeat stopped) or its breaker opens.
DEFAULT_PREFILL_TIMEOUT_S = 120.0


class BreakerState(enum.Enum):
    CLOSED = "closed"  # routed to; failures counted
    OPEN = "open"  # not routed to until the cool-down ends
    HALF_OPEN = "half_open"  # not routed to; its probe decides


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    """When a worker's breaker opens and how it closes again (`RouterConfig.breaker`)."""

    failures: int = DEFAULT_BREAKER_FAILURES  # in a row within the window; 0: never opens
    window_s: float = DEFAULT_BREAKER_WINDOW_S
    cooldown_s: float = DEFAULT_BREAKER_COOLDOWN_S
    probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.failures < 0:
            raise ValueError(f"breaker failures must be >= 0, got {self.failures}")
        for name in ("window_s", "cooldown_s", "probe_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"breaker {name} must be > 0, got {getattr(self, name)}")

    @property
    def enabled(self) -> bool:
        return self.failures > 0


@dataclass(slots=True)
class WorkerFailureConfig:
    """The router's settings for workers that fail or hang (held by `RouterConfig`)."""

    admit_timeout_s: float = field(
        default=DEFAULT_ADMIT_TIMEOUT_S,
        metadata={
            "help": "seconds a decode worker has to answer Admit; then it counts as failed "
            "and the next one is tried",
            "flag": "admit-timeout",
        },
    )
    prefill_timeout_s: float = field(
        default=DEFAULT_PREFILL_TIMEOUT_S,
        metadata={
            "help": "seconds a prefill worker has to return a first token, its queue "
            "included (one whose heartbeat stops is left sooner); then the request is "
            "retried elsewhere",
            "flag": "prefill-timeout",
        },
    )
    breaker_failures: int = field(
        default=DEFAULT_BREAKER_FAILURES,
        metadata={
            "help": "failures in a row (unreachable, or past a deadline) within "
            "--breaker-window that take a worker out of routing until it passes a "
            "health probe (0: never)"
        },
    )
    breaker_window_s: float = field(
        default=DEFAULT_BREAKER_WINDOW_S,
        metadata={
            "help": "seconds within which --breaker-failures count",
            "flag": "breaker-window",
        },
    )
    breaker_cooldown_s: float = field(
        default=DEFAULT_BREAKER_COOLDOWN_S,
        metadata={
            "help": "seconds a worker taken out stays out before its health probe",
            "flag": "breaker-cooldown",
        },
    )
    probe_timeout_s: float = field(
        default=DEFAULT_PROBE_TIMEOUT_S,
        metadata={
            "help": "seconds a worker taken out has to answer its health probe (GetLoad)",
            "flag": "probe-timeout",
        },
    )

    def __post_init__(self) -> None:
        for name in (
            "admit_timeout_s",
            "prefill_timeout_s",
            "breaker_window_s",
            "breaker_cooldown_s",
            "probe_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.breaker_failures < 0:
            raise ValueError(f"breaker_failures must be >= 0, got {self.breaker_failures}")

    @property
    def breaker(self) -> BreakerSettings:
        return BreakerSettings(
            failures=self.breaker_failures,
            window_s=self.breaker_window_s,
            cooldown_s=self.breaker_cooldown_s,
            probe_timeout_s=self.probe_timeout_s,
        )


class CircuitBreaker:
    """One worker's breaker (the module docstring); `clock` gives seconds, monotonic."""

    def __init__(self, settings: BreakerSettings, clock: Callable[[], float] = time.monotonic):
        self.settings, self._clock = settings, clock
        self._failures: deque[float] = deque()  # times of the failures counted, oldest first
        self._opened_at: float | None = None  # None: closed
        self._probing = False
        self.last_failure = ""  # the failure that opened it, for the log and for errors

    @property
    def state(self) -> BreakerState:
        if self._opened_at is None:
            return BreakerState.CLOSED
        if self._probing or self._clock() - self._opened_at >= self.settings.cooldown_s:
            return BreakerState.HALF_OPEN
        return BreakerState.OPEN

    @property
    def routable(self) -> bool:
        return self._opened_at is None

    @property
    def num_failures(self) -> int:
        """Failures counted now (within the window), while closed."""
        self._forget_old(self._clock())
        return len(self._failures)

    def record_success(self) -> None:
        """A call on the worker succeeded: the failures counted so far no longer count."""
        if self._opened_at is None:
            self._failures.clear()

    def record_failure(self, why: str = "") -> bool:
        """A call failed (or passed its deadline); True when this one opened the breaker.
        Ignored unless closed: what calls that began before it opened report is old news."""
        if self._opened_at is not None or not self.settings.enabled:
            return False
        now = self._clock()
        self._failures.append(now)
        self._forget_old(now)
        if len(self._failures) < self.settings.failures:
            return False
        self._opened_at, self.last_failure = now, why
        self._failures.clear()
        return True

    def begin_probe(self) -> bool:
        """True when a probe is due now (half-open, none running): the caller runs it and
        reports with `end_probe`."""
        if self.state is not BreakerState.HALF_OPEN or self._probing:
            return False
        self._probing = True
        return True

    def end_probe(self, passed: bool) -> None:
        """The probe's result: closed when it passed, else open for another cool-down."""
        self._probing = False
        if self._opened_at is None:
            return
        if passed:
            self._opened_at, self.last_failure = None, ""
            self._failures.clear()
        else:
            self._opened_at = self._clock()

    def _forget_old(self, now: float) -> None:
        while self._failures and now - self._failures[0] > self.settings.window_s:
            self._failures.popleft()


class Breakers:
    """A breaker per worker address, made on its first failure; closed ones with nothing
    counted are forgotten, so workers that come and go (pods) leave nothing behind."""

    def __init__(self, settings: BreakerSettings, clock: Callable[[], float] = time.monotonic):
        self.settings, self._clock = settings, clock
        self._breakers: dict[str, CircuitBreaker] = {}

    def routable(self, address: str) -> bool:
        breaker = self._breakers.get(address)
        return breaker is None or breaker.routable

    def state(self, address: str) -> BreakerState:
        breaker = self._breakers.get(address)
        return BreakerState.CLOSED if breaker is None else breaker.state

    def get(self, address: str) -> CircuitBreaker | None:
        return self._breakers.get(address)

    def record_failure(self, address: str, why: str) -> None:
        if not self.settings.enabled:
            return
        breaker = self._breakers.get(address)
        if breaker is None:
            breaker = self._breakers[address] = CircuitBreaker(self.settings, self._clock)
        if breaker.record_failure(why):
            log.warning(
                "worker %s: circuit open after %d failure(s) within %gs (last: %s); "
                "not routed to until it passes a health probe",
                address,
                self.settings.failures,
                self.settings.window_s,
                why,
            )

    def record_success(self, address: str) -> None:
        breaker = self._breakers.get(address)
        if breaker is not None and breaker.routable:
            breaker.record_success()
            del self._breakers[address]  # closed with nothing counted: nothing to keep

    def probes_due(self, addresses: list[str]) -> list[str]:
        """Of `addresses`, those whose probe should start now (each marked as probing)."""
        return [a for a in addresses if (b := self._breakers.get(a)) and b.begin_probe()]

    def end_probe(self, address: str, passed: bool) -> None:
        breaker = self._breakers.get(address)
        if breaker is None:
            return
        breaker.end_probe(passed)
        if passed:
            log.info("worker %s passed its health probe: circuit closed", address)
            del self._breakers[address]

    def forget(self, keep: set[str]) -> None:
        """Drop the breakers of addresses not in `keep` (workers gone for good)."""
        for address in [a for a in self._breakers if a not in keep]:
            del self._breakers[address]
