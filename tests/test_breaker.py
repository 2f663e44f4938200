"""A worker's circuit breaker: exact transitions on a clock the test steps by hand.

closed -> open after `failures` within `window_s`; open -> half-open after `cooldown_s`;
half-open -> closed only by a probe that passed, else open for another cool-down.
"""

from __future__ import annotations

import asyncio

import pytest
from manual_clock import Clock

from pdserve.core.workers import WorkerInfo
from pdserve.router.breaker import (
    Breakers,
    BreakerSettings,
    BreakerState,
    CircuitBreaker,
    WorkerFailureConfig,
)
from pdserve.router.config import RouterConfig
from pdserve.router.discovery.guarded import GuardedDiscovery
from pdserve.router.handoff import Attempt, AttemptHistory, WorkerTimeout, error_text

SETTINGS = BreakerSettings(failures=3, window_s=10.0, cooldown_s=5.0)


@pytest.fixture
def clock() -> Clock:
    return Clock()


def opened(clock: Clock) -> CircuitBreaker:
    breaker = CircuitBreaker(SETTINGS, clock)
    for _ in range(3):
        breaker.record_failure("UNAVAILABLE")
    assert breaker.state is BreakerState.OPEN
    return breaker


def test_a_breaker_opens_on_the_nth_failure_in_a_row_not_before(clock):
    breaker = CircuitBreaker(SETTINGS, clock)
    assert breaker.state is BreakerState.CLOSED and breaker.routable
    assert breaker.record_failure("a") is False
    assert breaker.record_failure("b") is False
    assert breaker.routable and breaker.num_failures == 2
    assert breaker.record_failure("c") is True
    assert breaker.state is BreakerState.OPEN and not breaker.routable
    assert breaker.last_failure == "c"


def test_a_success_clears_the_failures_counted(clock):
    breaker = CircuitBreaker(SETTINGS, clock)
    breaker.record_failure()
    breaker.record_failure()
    breaker.record_success()
    assert breaker.num_failures == 0
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED


def test_failures_older_than_the_window_do_not_count(clock):
    breaker = CircuitBreaker(SETTINGS, clock)
    breaker.record_failure()
    clock.now += 6.0
    breaker.record_failure()
    clock.now += 4.5  # the first is now 10.5 s old: out of the window
    assert breaker.record_failure() is False
    assert breaker.num_failures == 2
    clock.now += 1.0
    assert breaker.record_failure() is True  # three within 10 s


def test_open_turns_half_open_exactly_at_the_end_of_the_cooldown(clock):
    breaker = opened(clock)
    clock.now += 4.999
    assert breaker.state is BreakerState.OPEN
    assert breaker.begin_probe() is False
    clock.now += 0.001
    assert breaker.state is BreakerState.HALF_OPEN
    assert not breaker.routable  # half-open is not routed to: the probe decides


def test_only_one_probe_runs_and_a_pass_closes_the_breaker(clock):
    breaker = opened(clock)
    clock.now += 5.0
    assert breaker.begin_probe() is True
    assert breaker.begin_probe() is False  # one in flight
    breaker.end_probe(passed=True)
    assert breaker.state is BreakerState.CLOSED and breaker.routable
    assert breaker.num_failures == 0
    # counting starts afresh: two failures do not reopen it
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.routable


def test_a_failed_probe_opens_it_for_another_full_cooldown(clock):
    breaker = opened(clock)
    clock.now += 7.0
    assert breaker.begin_probe()
    clock.now += 1.0  # the probe took its timeout
    breaker.end_probe(passed=False)
    assert breaker.state is BreakerState.OPEN
    clock.now += 4.9
    assert breaker.state is BreakerState.OPEN
    clock.now += 0.1
    assert breaker.state is BreakerState.HALF_OPEN


def test_late_results_of_calls_begun_before_it_opened_change_nothing(clock):
    breaker = opened(clock)
    breaker.record_success()  # a call that started before the failures ended well
    assert breaker.state is BreakerState.OPEN
    clock.now += 5.0
    breaker.record_failure("late")
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.begin_probe()


def test_failures_zero_means_a_breaker_never_opens(clock):
    breaker = CircuitBreaker(BreakerSettings(failures=0), clock)
    for _ in range(100):
        assert breaker.record_failure() is False
    assert breaker.routable


def test_breakers_keep_one_per_address_and_forget_closed_ones(clock):
    breakers = Breakers(SETTINGS, clock)
    for _ in range(3):
        breakers.record_failure("a:1", "UNAVAILABLE: gone")
    breakers.record_failure("b:1", "UNAVAILABLE: once")
    assert not breakers.routable("a:1") and breakers.routable("b:1")
    assert breakers.routable("never-seen:1")
    breakers.record_success("b:1")
    assert breakers.get("b:1") is None  # nothing left to remember
    assert breakers.probes_due(["a:1", "b:1"]) == []  # still cooling down
    clock.now += 5.0
    assert breakers.probes_due(["a:1", "b:1"]) == ["a:1"]
    assert breakers.probes_due(["a:1"]) == []  # already probing
    breakers.end_probe("a:1", passed=True)
    assert breakers.routable("a:1") and breakers.get("a:1") is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("admit_timeout_s", 0),
        ("prefill_timeout_s", -1),
        ("breaker_window_s", 0),
        ("breaker_cooldown_s", 0),
        ("probe_timeout_s", 0),
        ("breaker_failures", -1),
    ],
)
def test_bad_settings_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        WorkerFailureConfig(**{field: value})


def test_router_config_carries_the_settings():
    config = RouterConfig(
        model="m",
        redis_url="redis://x",
        worker_failures=WorkerFailureConfig(admit_timeout_s=2, breaker_failures=4),
    )
    assert config.deadlines.admit_s == 2
    assert config.breaker.failures == 4
    assert config.breaker.cooldown_s == WorkerFailureConfig().breaker_cooldown_s


class FakeDiscovery:
    """A fixed listing (the guard's inner discovery; no I/O in these tests)."""

    def __init__(self, workers: list[WorkerInfo]):
        self.listed = workers

    def workers(self, role: str) -> list[WorkerInfo]:
        return [w for w in self.listed if w.serves(role)]

    def mark_unhealthy(self, address: str) -> None:
        pass


def worker(address: str) -> WorkerInfo:
    return WorkerInfo(worker_id=address, role="prefill", address=address, healthy=True)


async def test_an_open_worker_is_not_listed_until_its_probe_passes(clock):
    probes: list[str] = []
    answers = {"a:1": False}

    async def probe(address: str, role: str) -> bool:
        probes.append(address)
        return answers[address]

    guarded = GuardedDiscovery(
        FakeDiscovery([worker("a:1"), worker("b:1")]), Breakers(SETTINGS, clock), probe, clock
    )
    for _ in range(3):
        guarded.record_failure("a:1", "UNAVAILABLE")
    assert [w.address for w in guarded.workers("prefill")] == ["b:1"]
    await asyncio.sleep(0)
    assert probes == []  # cooling down: no probe yet
    clock.now += 5.0
    assert [w.address for w in guarded.workers("prefill")] == ["b:1"]
    await asyncio.sleep(0)
    assert probes == ["a:1"]  # failed: open for another cool-down
    clock.now += 5.0
    answers["a:1"] = True
    guarded.workers("prefill")
    await asyncio.sleep(0)
    assert probes == ["a:1", "a:1"]
    assert [w.address for w in guarded.workers("prefill")] == ["a:1", "b:1"]


async def test_with_every_worker_open_all_are_routed_to_until_one_passes_its_probe(clock, caplog):
    probes: list[str] = []
    answers = {"a:1": False, "b:1": False}

    async def probe(address: str, role: str) -> bool:
        probes.append(address)
        return answers[address]

    guarded = GuardedDiscovery(
        FakeDiscovery([worker("a:1"), worker("b:1")]), Breakers(SETTINGS, clock), probe, clock
    )
    for address in ("a:1", "b:1"):
        for _ in range(3):
            guarded.record_failure(address, "UNAVAILABLE")
    with caplog.at_level("WARNING", logger="pdserve.router.discovery.guarded"):
        assert [w.address for w in guarded.workers("prefill")] == ["a:1", "b:1"]
        guarded.workers("prefill")
    assert [r.getMessage() for r in caplog.records if r.name.endswith("guarded")] == [
        "every prefill worker's circuit is open (2 listed): routing to all of them "
        "until one passes its probe"
    ]  # once, not per listing
    assert guarded.workers("decode") == []  # none listed: nothing to route to
    clock.now += 5.0
    answers["b:1"] = True
    guarded.workers("prefill")  # half-open: both probed
    await asyncio.sleep(0)
    assert sorted(probes) == ["a:1", "b:1"]
    assert [w.address for w in guarded.workers("prefill")] == ["b:1"]  # breakers apply again
    clock.now += 5.0
    answers["a:1"] = True
    guarded.workers("prefill")
    await asyncio.sleep(0)
    assert [w.address for w in guarded.workers("prefill")] == ["a:1", "b:1"]


def test_a_request_that_gives_up_names_each_worker_and_error():
    history = AttemptHistory()
    attempt = Attempt("r", [1, 2], sampling=None, history=history)
    retry = attempt.for_block_size(16)
    assert retry.history is history  # every attempt of a request shares it
    history.num_attempts = 1
    history.failed("prefill", "p:1", WorkerTimeout("p:1", "Prefill", "stopped heartbeating"))
    history.num_attempts = 2
    history.failed("decode", "d:1", RuntimeError("x" * 500))
    summary = history.summary()
    assert summary.startswith(
        "#1 prefill p:1: UNAVAILABLE: worker p:1 stopped heartbeating during Prefill; "
        "#2 decode d:1: RuntimeError: xxx"
    )
    assert len(error_text(RuntimeError("x" * 500))) == 160
