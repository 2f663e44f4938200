"""The one check every front door of the router runs: who is calling, and may it start a
generation now.

`Gate.authenticate` turns an `authorization: Bearer KEY` value (gRPC metadata or HTTP
header) into a `Caller`; `Gate.admit` admits one generation under the caller's limits.
Without a key file the gate is open: every caller is ANONYMOUS and nothing is limited.
"""

from __future__ import annotations

from pdserve.router.auth.caller import ANONYMOUS, Caller
from pdserve.router.auth.keys import KeyRing
from pdserve.router.auth.limits import NO_SLOT, KeyLimiter, Slot

BEARER = "bearer"
# One text for a missing, malformed, unknown, wrong and revoked key: which of them it was
# would tell an attacker how far a guess got.
INVALID_KEY_MESSAGE = "missing or invalid API key: send `authorization: Bearer KEY`"


class AuthenticationError(Exception):
    """The call presented no valid API key (UNAUTHENTICATED, HTTP 401)."""

    def __init__(self) -> None:
        super().__init__(INVALID_KEY_MESSAGE)


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `authorization` value `Bearer TOKEN`; None for any other form."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == BEARER and token else None


class Gate:
    """Authentication and admission; `keys` None: no keys configured (the gate is open)."""

    def __init__(self, keys: KeyRing | None, limiter: KeyLimiter | None):
        self.keys, self.limiter = keys, limiter

    @property
    def enabled(self) -> bool:
        return self.keys is not None

    def authenticate(self, authorization: str | None) -> Caller:
        """The caller an `authorization` value proves; AuthenticationError if none."""
        if self.keys is None:
            return ANONYMOUS
        caller = self.keys.authenticate(bearer_token(authorization))
        if caller is None:
            raise AuthenticationError()
        return caller

    async def admit(self, caller: Caller) -> Slot:
        """Admit one generation of `caller`: a slot to release at its end. Raises
        RateLimitedError over a limit, StateUnavailableError when Redis does not answer."""
        if self.limiter is None or not caller.limits.any:
            return NO_SLOT
        return await self.limiter.admit(caller)


def open_gate(api_key_file: str | None, redis_url: str) -> Gate:
    """The router's gate: open without a key file; else its keys, limited through Redis."""
    if api_key_file is None:
        return Gate(None, None)
    return Gate(KeyRing.open(api_key_file), KeyLimiter(redis_url))
