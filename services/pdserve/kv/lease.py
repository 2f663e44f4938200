"""KV leases: which blocks a decode worker reserved for whom, until when.

A lease is a capability: its id is unguessable and only chunks naming it are
written, only into its own blocks, only while it is open. Pure Python; the
decode worker's event loop owns the table.
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


class LeaseTable:
    def __init__(self, num_layers: int, clock=time.monotonic):
        self.num_layers = num_layers
        self._clock = clock
        self._leases: dict[str, Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def issue(self, request_id: str, num_blocks: int, ttl_s: float) -> Lease:
        lease = Lease(
            lease_id=secrets.token_urlsafe(24),
            request_id=request_id,
            num_blocks=num_blocks,
            num_layers=self.num_layers,
            deadline=self._clock() + ttl_s,
            deadline_unix_ms=int((time.time() + ttl_s) * 1000),
            ttl_s=ttl_s,
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
        """Move an open lease's deadline to now + its TTL (never earlier); LeaseError if
        it is not open or already past its deadline."""
        lease = self.open_lease(lease_id)
        deadline = self._clock() + lease.ttl_s
        if deadline > lease.deadline:
            lease.deadline = deadline
            lease.deadline_unix_ms = int((time.time() + lease.ttl_s) * 1000)
        return lease

    def check_chunk(self, lease_id: str, layer: int, first_block: int, num_blocks: int) -> Lease:
        """The open lease a chunk may be written into, or LeaseError saying why not."""
        lease = self.open_lease(lease_id)
        if not 0 <= layer < lease.num_layers:
            raise LeaseRangeError(f"layer {layer} outside [0, {lease.num_layers})")
        if num_blocks < 1 or first_block < 0 or first_block + num_blocks > lease.num_blocks:
            raise LeaseRangeError(
                f"blocks [{first_block}, {first_block + num_blocks}) outside the lease's "
                f"{lease.num_blocks}",
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
