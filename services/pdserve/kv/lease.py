"""KV leases: which blocks a decode worker reserved for whom, until when.

A lease is a capability: its id is unguessable and only chunks naming it are
written, only into its own blocks, only while it is open. Pure Python; the
decode worker's event loop owns the table.

A lease is also a claim on scarce memory that anyone who can call Admit makes, so it is
bounded twice (`LeaseLimits`): its TTL is capped whatever the caller asked (Admit's TTL
is a uint32 of milliseconds: up to 49.7 days), and renewals keep it open at most its
`max_lifetime_s` after its issue, so a renewer cannot hold blocks for ever.
"""

from __future__ import annotations

import enum
import secrets
import time
from dataclasses import dataclass, field

from pdserve.core.errors import (
    LeaseExpiredError,
    LeaseIncompleteError,
    LeaseNotFoundError,
    LeaseRangeError,
)


@dataclass(frozen=True, slots=True)
class LeaseTerms:
    """What one lease gets: its TTL (at issue, and again at each renewal), and how long
    after its issue renewals may keep it open."""

    ttl_s: float
    max_lifetime_s: float


@dataclass(frozen=True, slots=True)
class LeaseLimits:
    """What a caller may ask of a lease: the worker's --lease-ttl, --max-lease-ttl and
    --max-lease-lifetime (`WorkerConfig` holds their defaults and checks them)."""

    default_ttl_s: float  # what a lease gets when its caller asks for none
    max_ttl_s: float  # the most it gets, whatever the caller asked
    max_lifetime_s: float

    def terms(self, requested_ttl_s: float | None) -> LeaseTerms:
        """The terms of a lease whose caller asked for `requested_ttl_s` (None or 0: the
        default TTL), capped."""
        ttl_s = min(requested_ttl_s or self.default_ttl_s, self.max_ttl_s)
        return LeaseTerms(ttl_s=ttl_s, max_lifetime_s=self.max_lifetime_s)


class LeaseState(enum.Enum):
    OPEN = "open"  # waiting for KV chunks
    COMMITTED = "committed"  # KV complete, the request runs on the engine
    EXPIRED = "expired"
    RELEASED = "released"
    FAILED = "failed"


@dataclass
class Lease:
    lease_id: str
    request_id: str
    num_blocks: int
    num_layers: int
    deadline: float  # time.monotonic()
    deadline_unix_ms: int
    ttl_s: float  # what issue and each renewal give it
    end_of_life: float  # time.monotonic(): no renewal moves the deadline past it
    max_lifetime_s: float  # end_of_life - its issue, for the renewal's error
    state: LeaseState = LeaseState.OPEN
    # received[layer][block] is True once that block of that layer arrived
    received: list[bytearray] = field(default_factory=list)
    bytes_received: int = 0

    def __post_init__(self) -> None:
        if not self.received:
            self.received = [bytearray(self.num_blocks) for _ in range(self.num_layers)]

    @property
    def is_complete(self) -> bool:
        return all(all(layer) for layer in self.received)


def _unix_ms(seconds_from_now: float) -> int:
    """A deadline as callers see it: unix milliseconds."""
    return int((time.time() + seconds_from_now) * 1000)


class LeaseTable:
    def __init__(self, num_layers: int, clock=time.monotonic):
        self.num_layers = num_layers
        self._clock = clock
        self._leases: dict[str, Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def issue(self, request_id: str, num_blocks: int, terms: LeaseTerms) -> Lease:
        """A new open lease on `terms` (see `LeaseLimits.terms`)."""
        ttl_s, lifetime_s = terms.ttl_s, terms.max_lifetime_s
        now, first_s = self._clock(), min(ttl_s, lifetime_s)
        lease = Lease(
            lease_id=secrets.token_urlsafe(24),
            request_id=request_id,
            num_blocks=num_blocks,
            num_layers=self.num_layers,
            deadline=now + first_s,
            deadline_unix_ms=_unix_ms(first_s),
            ttl_s=ttl_s,
            end_of_life=now + lifetime_s,
            max_lifetime_s=lifetime_s,
        )
        self._leases[lease.lease_id] = lease
        return lease

    def get(self, lease_id: str) -> Lease:
        lease = self._leases.get(lease_id)
        if lease is None:
            raise LeaseNotFoundError("unknown lease (never issued, or already closed)")
        return lease

    def open_lease(self, lease_id: str) -> Lease:
        """The lease if chunks may still go into it, else LeaseError."""
        lease = self.get(lease_id)
        if lease.state is not LeaseState.OPEN:
            raise LeaseNotFoundError(f"lease is {lease.state.value}, not open")
        if self._clock() > lease.deadline:
            raise LeaseExpiredError("lease deadline passed before its KV arrived")
        return lease

    def renew(self, lease_id: str) -> Lease:
        """Move an open lease's deadline to now + its TTL (never earlier, never past its
        end of life); LeaseError if it is not open, already past its deadline, or its
        deadline is its end of life already (LeaseExpiredError naming the limit)."""
        lease = self.open_lease(lease_id)
        if lease.deadline >= lease.end_of_life:
            raise LeaseExpiredError(
                f"lease reached its lifetime of {lease.max_lifetime_s:g} s "
                "(--max-lease-lifetime): it cannot be renewed again"
            )
        now = self._clock()
        deadline = min(now + lease.ttl_s, lease.end_of_life)
        if deadline > lease.deadline:
            lease.deadline, lease.deadline_unix_ms = deadline, _unix_ms(deadline - now)
        return lease

    def check_chunk(self, lease_id: str, layer: int, first_block: int, num_blocks: int) -> Lease:
        """The open lease a chunk may be written into, or LeaseError saying why not."""
        lease = self.open_lease(lease_id)
        # Each message starts with the chunk's field at fault, as a bad field's does.
        if not 0 <= layer < lease.num_layers:
            raise LeaseRangeError(f"kv_chunk.layer: {layer} outside [0, {lease.num_layers})")
        if num_blocks < 1 or first_block < 0 or first_block + num_blocks > lease.num_blocks:
            raise LeaseRangeError(
                f"kv_chunk.first_block: blocks [{first_block}, {first_block + num_blocks}) "
                f"outside the lease's {lease.num_blocks}",
            )
        return lease

    @staticmethod
    def mark_received(
        lease: Lease, layer: int, first_block: int, num_blocks: int, num_bytes: int
    ) -> None:
        """Record a chunk written into the lease's blocks (after `check_chunk` and the write)."""
        lease.received[layer][first_block : first_block + num_blocks] = b"\x01" * num_blocks
        lease.bytes_received += num_bytes

    def commit(self, lease_id: str) -> Lease:
        lease = self.open_lease(lease_id)
        if not lease.is_complete:
            missing = sum(layer.count(0) for layer in lease.received)
            raise LeaseIncompleteError(f"{missing} layer-blocks of KV not received")
        lease.state = LeaseState.COMMITTED
        return lease

    def close(self, lease_id: str, state: LeaseState) -> Lease | None:
        """Forget a lease, recording why; None if it was already gone."""
        lease = self._leases.pop(lease_id, None)
        if lease is not None and lease.state is LeaseState.OPEN:
            lease.state = state
        return lease

    def expired(self) -> list[Lease]:
        """Open leases whose deadline has passed (still in the table)."""
        now = self._clock()
        return [
            lease
            for lease in self._leases.values()
            if lease.state is LeaseState.OPEN and now > lease.deadline
        ]
