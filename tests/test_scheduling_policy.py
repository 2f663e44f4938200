"""The scheduling policy: which prompts get a step's token budget, with exact step plans.

Pure Python on CPU, no model: the scheduler plans, the test pretends the model sampled.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler import RandomWorkload, make_request, make_scheduler, plan, step

from pdserve.engine.config import EngineConfig
from pdserve.engine.scheduler import SchedulerConfig
from pdserve.engine.scheduling import Ordering, Pace, SchedulingPolicy

FCFS, PRIORITY, LEAST_WORK = (
    SchedulingPolicy.FCFS,
    SchedulingPolicy.PRIORITY,
    SchedulingPolicy.LEAST_WORK,
)


def scheduler_with(policy: SchedulingPolicy, **config):
    config.setdefault("num_blocks", 64)
    config.setdefault("block_size", 4)
    config.setdefault("max_model_len", 128)
    return make_scheduler(policy=policy, **config)


def add(scheduler, request_id: str, length: int, priority: int = 0, **params):
    first = 1000 * (len(scheduler._requests) + 1)  # distinct prompts: no prefix-cache hits
    request = make_request(request_id, range(first, first + length), **params)
    request.priority = priority
    scheduler.add_request(request)
    return request


# -- configuration -------------------------------------------------------------------------


def test_engines_default_to_least_work_and_the_bare_scheduler_to_arrival_order():
    assert EngineConfig(model="/nowhere", device="cpu").scheduling_policy is LEAST_WORK
    assert SchedulerConfig(max_model_len=8).policy is FCFS
    assert SchedulerConfig(max_model_len=8, policy="priority").policy is PRIORITY


@pytest.mark.parametrize("aging", [0.0, -1.0])
def test_aging_must_be_positive(aging):
    with pytest.raises(ValueError, match="aging"):
        SchedulerConfig(max_model_len=8, aging=aging)
    with pytest.raises(ValueError, match="scheduling_aging"):
        EngineConfig(model="/nowhere", device="cpu", scheduling_aging=aging)


# -- the orders ----------------------------------------------------------------------------


def test_fcfs_lets_a_long_prompt_in_chunks_keep_the_budget_before_a_later_short_one():
    scheduler = scheduler_with(FCFS, max_num_batched_tokens=8)
    add(scheduler, "long", 20)
    assert plan(step(scheduler)[0]) == [("long", 0, 8)]
    add(scheduler, "short", 4)

    assert plan(step(scheduler)[0]) == [("long", 8, 8)]
    assert plan(step(scheduler)[0]) == [("long", 16, 4), ("short", 0, 4)]


def test_least_work_pauses_a_long_prompt_in_chunks_for_a_short_one_that_arrives():
    scheduler = scheduler_with(LEAST_WORK, max_num_batched_tokens=8)
    add(scheduler, "long", 20)
    assert plan(step(scheduler)[0]) == [("long", 0, 8)]
    add(scheduler, "short", 4)  # key 4 + 0.25 * 8 = 6 against the long one's 12 left

    assert plan(step(scheduler)[0]) == [("short", 0, 4), ("long", 8, 4)]
    assert plan(step(scheduler)[0]) == [("short", 4, 1), ("long", 12, 7)]
    # one token left is a decode's work: served first, in admission order
    assert plan(step(scheduler)[0]) == [("long", 19, 1), ("short", 5, 1)]


def test_least_work_admits_waiting_prompts_shortest_first():
    scheduler = scheduler_with(LEAST_WORK, max_num_batched_tokens=64)
    for request_id, length in (("a", 30), ("b", 5), ("c", 12), ("d", 5)):
        add(scheduler, request_id, length)

    assert plan(step(scheduler)[0]) == [("b", 0, 5), ("d", 0, 5), ("c", 0, 12), ("a", 0, 30)]


def test_decoding_requests_are_served_before_any_prefill_work():
    scheduler = scheduler_with(LEAST_WORK, max_num_batched_tokens=6)
    add(scheduler, "old", 3)
    step(scheduler)  # old decodes from now on
    add(scheduler, "new", 2)

    assert plan(step(scheduler)[0]) == [("old", 3, 1), ("new", 0, 2)]


@pytest.mark.parametrize("policy", [PRIORITY, LEAST_WORK])
def test_a_lower_priority_value_runs_first_whatever_its_length(policy):
    scheduler = scheduler_with(policy, max_num_batched_tokens=10)
    add(scheduler, "short", 4, priority=1)
    add(scheduler, "long", 16, priority=0)

    assert plan(step(scheduler)[0]) == [("long", 0, 10)]
    assert plan(step(scheduler)[0]) == [("long", 10, 6), ("short", 0, 4)]


def test_priority_breaks_ties_by_arrival_and_fcfs_ignores_it():
    requests = (("a", 8, 2), ("b", 4, 1), ("c", 2, 1))
    by_priority = scheduler_with(PRIORITY, max_num_batched_tokens=64)
    arrival = scheduler_with(FCFS, max_num_batched_tokens=64)
    for request_id, length, priority in requests:
        add(by_priority, request_id, length, priority)
        add(arrival, request_id, length, priority)

    assert plan(step(by_priority)[0]) == [("b", 0, 4), ("c", 0, 2), ("a", 0, 8)]
    assert plan(step(arrival)[0]) == [("a", 0, 8), ("b", 0, 4), ("c", 0, 2)]


# -- aging: the bound ----------------------------------------------------------------------


def test_a_long_prompt_behind_a_stream_of_short_ones_finishes_within_the_aging_bound():
    """Two 4-token prompts arrive every step and fill the 8-token budget. A 32-token prompt
    that arrived first is overtaken only by arrivals before the engine has computed
    32 / aging = 64 tokens since: from the 8th step (64 tokens done) it goes first, and its
    prefill ends by the 11th, 96 tokens of work, the bound's R / aging + R."""
    scheduler = scheduler_with(LEAST_WORK, max_num_batched_tokens=8, aging=0.5)
    long = add(scheduler, "long", 32)
    plans = []
    for k in range(11):
        add(scheduler, f"s{k}a", 4, max_tokens=1)
        add(scheduler, f"s{k}b", 4, max_tokens=1)
        plans.append(plan(step(scheduler)[0]))

    assert plans[0] == [("s0a", 0, 4), ("s0b", 0, 4)]
    assert plans[6] == [("s6a", 0, 4), ("s6b", 0, 4)]  # keys 4 + 0.5 * 48 = 28 < 32
    assert plans[7] == [("long", 0, 8)]  # the shorts' keys reach 32: the tie is its
    assert plans[8] == [("long", 8, 8)]
    assert plans[10] == [("long", 24, 8)]
    assert long.output_token_ids != []  # its first token is out
    assert scheduler.num_scheduled_tokens == 88 <= 32 / 0.5 + 32


def test_without_aging_to_speak_of_the_same_stream_starves_the_long_prompt():
    scheduler = scheduler_with(LEAST_WORK, max_num_batched_tokens=8, aging=1e-6)
    long = add(scheduler, "long", 32)
    for k in range(20):
        add(scheduler, f"s{k}a", 4, max_tokens=1)
        add(scheduler, f"s{k}b", 4, max_tokens=1)
        step(scheduler)

    assert long.num_computed_tokens == 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    long_len=st.integers(9, 60),
    aging=st.sampled_from([0.25, 0.5, 1.0]),
    arrivals=st.lists(st.lists(st.integers(1, 12), max_size=3), min_size=1, max_size=40),
)
def test_no_request_arriving_after_r_over_aging_tokens_of_work_goes_first(
    long_len, aging, arrivals
):
    scheduler = scheduler_with(
        LEAST_WORK, num_blocks=512, max_num_batched_tokens=8, aging=aging, max_num_seqs=256
    )
    long = add(scheduler, "long", long_len)
    late: set[str] = set()  # arrived once the engine had done long_len / aging tokens since
    for k, lengths in enumerate(arrivals):
        for i, length in enumerate(lengths):
            request = add(scheduler, f"r{k}.{i}", length, max_tokens=1)
            if request.work_at_arrival >= long_len / aging:
                late.add(request.request_id)
        output, _ = step(scheduler)
        if long.num_computed_tokens < long_len:
            assert not late & {s.request.request_id for s in output.scheduled}


# -- deadlines: late prompts after those still on time -----------------------------------------


def test_a_prompt_is_late_once_its_wait_and_remaining_work_pass_its_deadline():
    """Deadline: 2 x max(prompt, budget 8) tokens of work. On the engine's clock of work, a
    prompt alone is never late: its wait is 0 and its remaining work its own length."""
    ordering = Ordering(deadline_scale=2.0, min_deadline_tokens=8, work_now=100)
    long, short = make_request("long", range(16)), make_request("short", range(3))
    long.work_at_arrival, short.work_at_arrival = 84, 87
    assert not ordering.is_late(long)  # waited 16 + 16 left = 32 <= 2 x 16
    assert not ordering.is_late(short)  # 13 + 3 <= 2 x 8: the budget is the floor
    long.work_at_arrival, short.work_at_arrival = 83, 86
    assert ordering.is_late(long)  # 17 + 16 > 32
    assert ordering.is_late(short)  # 14 + 3 > 16
    assert not dataclasses.replace(ordering, deadline_scale=0.0).is_late(long)  # off
    long.num_computed_tokens = 8  # started: never late, whatever it waited
    assert not dataclasses.replace(ordering, work_now=1000).is_late(long)
    short.append_output_token(7)  # a token out (preempted, it recomputes from 0): never late
    assert not ordering.is_late(short)


@pytest.mark.parametrize(("scale", "first", "second"), [(2.0, "b", "a"), (0.0, "a", "b")])
def test_a_prompt_past_its_deadline_yields_to_one_still_on_time(scale, first, second):
    """`a` (16 tokens: deadline 32 tokens of work) waits behind 40 tokens of a lower
    priority value, so it is late by then; `b` (16) arrives after 32 of them and has waited
    8 when the engine is free: on time. Without deadlines `a`, aged longer, goes first."""
    scheduler = scheduler_with(LEAST_WORK, max_num_batched_tokens=8, deadline_scale=scale)
    add(scheduler, "hog", 40, priority=-1, max_tokens=1)
    add(scheduler, "a", 16, max_tokens=1)
    for _ in range(4):
        step(scheduler)
    add(scheduler, "b", 16, max_tokens=1)

    assert plan(step(scheduler)[0]) == [("hog", 32, 8)]
    assert plan(step(scheduler)[0]) == [(first, 0, 8)]
    assert plan(step(scheduler)[0]) == [(first, 8, 8)]
    assert plan(step(scheduler)[0]) == [(second, 0, 8)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    long_len=st.integers(9, 40),
    penalty=st.integers(0, 48),
    arrivals=st.lists(st.lists(st.integers(1, 12), max_size=3), min_size=1, max_size=40),
)
def test_with_deadlines_no_request_arriving_after_r_plus_penalty_over_aging_goes_first(
    long_len, penalty, arrivals
):
    aging = 0.5
    scheduler = scheduler_with(
        LEAST_WORK,
        num_blocks=512,
        max_num_batched_tokens=8,
        aging=aging,
        max_num_seqs=256,
        deadline_scale=1.0,
        deadline_penalty=penalty,
    )
    long = add(scheduler, "long", long_len)
    bound = (long_len + penalty) / aging
    late: set[str] = set()  # arrived once the engine had done `bound` tokens since
    for k, lengths in enumerate(arrivals):
        for i, length in enumerate(lengths):
            request = add(scheduler, f"r{k}.{i}", length, max_tokens=1)
            if request.work_at_arrival >= bound:
                late.add(request.request_id)
        output, _ = step(scheduler)
        if long.num_computed_tokens < long_len:
            assert not late & {s.request.request_id for s in output.scheduled}


# -- clients' TTFT targets: deadlines on the wall clock ----------------------------------------


def test_a_prompt_with_a_ttft_target_is_late_once_its_remaining_work_cannot_make_it():
    """At 125 ms a token, 16 tokens take 2 s: from 8.0 they end at 10.0. The target is
    the client's whatever the deadline scale (0 here), and a started prompt can be late."""
    ordering = Ordering(now=8.0, seconds_per_token=0.125)
    request = make_request("r", range(16))
    request.ttft_deadline = 10.0
    assert not ordering.is_late(request)  # just in time
    request.ttft_deadline = 9.875
    assert ordering.is_late(request)
    request.num_computed_tokens = 8  # started, 8 left: 9.0
    assert not ordering.is_late(request)
    assert dataclasses.replace(ordering, now=9.0).is_late(request)  # 10.0 > 9.875
    request.append_output_token(7)  # a token out (back from a preemption): never late
    assert not dataclasses.replace(ordering, now=100.0).is_late(request)


def test_before_any_step_a_ttft_target_counts_the_wait_alone():
    ordering = Ordering(now=5.0)  # no pace yet: 0 s a token
    request = make_request("r", range(2048))
    request.ttft_deadline = 5.0
    assert not ordering.is_late(request)
    assert dataclasses.replace(ordering, now=5.5).is_late(request)


def test_the_pace_is_a_decayed_ratio_of_step_time_to_tokens():
    pace = Pace(decay=0.5)
    assert pace.seconds_per_token == 0.0
    pace.record(100, 1.0)  # 10 ms a token
    assert pace.seconds_per_token == pytest.approx(0.01)
    pace.record(10, 1.0)  # a small, slow step weighs its tokens: (0.5 + 1) / (50 + 10)
    assert pace.seconds_per_token == pytest.approx(1.5 / 60)


LATE_A = [("b", 0, 8), ("b", 8, 8), ("a", 8, 8)]
A_GOES_ON = [("a", 8, 8), ("b", 0, 8), ("b", 8, 8)]


@pytest.mark.parametrize(("target", "plans"), [(2.0, LATE_A), (0.0, A_GOES_ON)])
def test_a_started_prompt_that_cannot_make_its_target_pauses_for_one_that_can(target, plans):
    """`a` (16 tokens, 125 ms each) starts with a target it just makes; the step then
    takes 1.5 s instead of 1, so its 8 tokens left end at 2.5 s: late. `b` arrives with a
    far target and goes first. Without a target `a`, aged longer and shorter, goes on."""
    scheduler = scheduler_with(LEAST_WORK, max_num_batched_tokens=8)
    now = 0.0
    scheduler.clock = lambda: now
    scheduler.pace.record(8, 1.0)
    a = add(scheduler, "a", 16, max_tokens=1)
    a.ttft_deadline = target
    assert plan(step(scheduler)[0]) == [("a", 0, 8)]
    now = 1.5
    b = add(scheduler, "b", 16, max_tokens=1)
    b.ttft_deadline = 100.0

    assert [plan(step(scheduler)[0]) for _ in plans] == [[p] for p in plans]


def test_engines_have_deadlines_on_and_the_scale_must_not_be_negative():
    assert EngineConfig(model="/nowhere", device="cpu").scheduling_deadline_scale == 2.0
    assert SchedulerConfig(max_model_len=8).deadline_scale == 0.0
    with pytest.raises(ValueError, match="deadline_scale"):
        SchedulerConfig(max_model_len=8, deadline_scale=-1.0)
    with pytest.raises(ValueError, match="scheduling_deadline_scale"):
        EngineConfig(model="/nowhere", device="cpu", scheduling_deadline_scale=-1.0)


# -- random workloads under the new policies -------------------------------------------------


class LeastWorkRandomWorkload(RandomWorkload):
    """The scheduler's random workload (preemption, aborts, EOS) under LEAST_WORK: no
    block leaks, no deadlock, every plan within its bounds."""

    def __init__(self):
        super().__init__()
        self.scheduler.config.policy = LEAST_WORK


TestLeastWorkRandomWorkload = LeastWorkRandomWorkload.TestCase
TestLeastWorkRandomWorkload.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
