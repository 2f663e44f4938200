"""Who is calling: the API key a call presented, as the router's parts see it.

The gRPC interceptor binds the caller to the call (`bind_caller`, a context variable: each
gRPC call runs in a task of its own, so the binding is the call's alone) and handlers read
it with `current_caller()`; the HTTP gateway passes its caller explicitly. With no key file
configured every call is `ANONYMOUS`: no limits, and request ids shared by all.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import ClassVar

# Between a key's id and the client's request id in the id the router stores: key ids
# are hex, so the first separator ends the key's part whatever the client's id holds.
SCOPE_SEPARATOR = "/"


@dataclass(frozen=True, slots=True)
class KeyLimits:
    """A key's budget; 0 means no limit of that kind."""

    requests_per_minute: int = 0  # generations started in any 60 s
    concurrent_requests: int = 0  # generations running at once, across every router
    tokens_per_minute: int = 0  # prompt + output tokens of the generations of any 60 s

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "concurrent_requests", "tokens_per_minute"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")

    @property
    def any(self) -> bool:
        """Whether admission has anything to check (else it needs no Redis round trip)."""
        return bool(self.requests_per_minute or self.concurrent_requests or self.tokens_per_minute)


@dataclass(frozen=True, slots=True)
class Caller:
    """The authenticated client of one call: its key's id and name, and its limits."""

    key_id: str  # "": anonymous (no keys configured)
    name: str
    limits: KeyLimits = KeyLimits()
    ANONYMOUS: ClassVar[Caller]

    @property
    def is_anonymous(self) -> bool:
        return not self.key_id

    def scoped_id(self, request_id: str) -> str:
        """The id under which this caller's request `request_id` is stored and run: the
        key's own namespace, so another key's same id is another request. Anonymous
        callers' ids are global, as they were before keys."""
        if self.is_anonymous:
            return request_id
        return f"{self.key_id}{SCOPE_SEPARATOR}{request_id}"

    def client_id(self, scoped_id: str) -> str:
        """`scoped_id`'s inverse: the id as this caller knows it."""
        if self.is_anonymous:
            return scoped_id
        return scoped_id.removeprefix(f"{self.key_id}{SCOPE_SEPARATOR}")


ANONYMOUS = Caller(key_id="", name="anonymous")
Caller.ANONYMOUS = ANONYMOUS

_current: contextvars.ContextVar[Caller] = contextvars.ContextVar("pdserve_caller")


def current_caller() -> Caller:
    """The caller the interceptor authenticated for the running call; ANONYMOUS outside one
    (or when no keys are configured)."""
    return _current.get(ANONYMOUS)


def bind_caller(caller: Caller) -> contextvars.Token:
    """Make `caller` the current one in this task's context (the interceptor's job)."""
    return _current.set(caller)


def unbind_caller(token: contextvars.Token) -> None:
    _current.reset(token)
