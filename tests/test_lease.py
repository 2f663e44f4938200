"""LeaseTable on a fake clock: what may write into a lease, and until when."""

from __future__ import annotations

import pytest

from pdserve.core.errors import (
    LeaseError,
    LeaseExpiredError,
    LeaseIncompleteError,
    LeaseNotFoundError,
    LeaseRangeError,
)
from pdserve.kv.lease import LeaseState, LeaseTable, LeaseTerms


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def terms(ttl_s: float) -> LeaseTerms:
    return LeaseTerms(ttl_s=ttl_s, max_lifetime_s=60.0)  # longer than any test here


@pytest.fixture
def table(clock) -> LeaseTable:
    return LeaseTable(num_layers=2, clock=clock)


def test_ids_are_unguessable_and_chunks_stay_inside_their_lease(table):
    a, b = table.issue("ra", 3, terms(1)), table.issue("rb", 3, terms(1))
    assert a.lease_id != b.lease_id and len(a.lease_id) >= 32
    assert table.check_chunk(a.lease_id, layer=1, first_block=1, num_blocks=2) is a
    for layer, first, count in [(2, 0, 1), (0, 2, 2), (0, -1, 1), (0, 0, 0)]:
        with pytest.raises(LeaseRangeError):
            table.check_chunk(a.lease_id, layer, first, count)
    with pytest.raises(LeaseNotFoundError):
        table.check_chunk("guess", 0, 0, 1)


def test_commit_needs_every_block_of_every_layer(table):
    lease = table.issue("r", num_blocks=2, terms=terms(1))
    table.mark_received(lease, 0, 0, 2, num_bytes=10)
    with pytest.raises(LeaseIncompleteError) as raised:
        table.commit(lease.lease_id)
    assert "2 layer-blocks" in str(raised.value)
    table.mark_received(lease, 1, 0, 2, num_bytes=10)
    assert table.commit(lease.lease_id).state is LeaseState.COMMITTED
    with pytest.raises(LeaseError):  # committed: no more chunks, no renewals
        table.renew(lease.lease_id)


def test_renewal_moves_the_deadline_to_now_plus_the_ttl(table, clock):
    lease = table.issue("r", num_blocks=1, terms=terms(2.0))
    clock.now += 1.5
    table.renew(lease.lease_id)
    assert lease.deadline == pytest.approx(clock.now + 2.0)
    clock.now += 1.9  # past the first deadline, within the renewed one
    assert table.expired() == []
    assert table.check_chunk(lease.lease_id, 0, 0, 1) is lease
    clock.now += 0.2
    assert table.expired() == [lease]
    with pytest.raises(LeaseExpiredError):  # too late: renewing cannot revive it
        table.renew(lease.lease_id)
