"""Scheduler: step plans with exact token counts and block ids, on CPU, no model."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

EOS = 2
SAMPLED = 7  # a token that stops nothing, sampled unless a test says otherwise


def make_scheduler(
    num_blocks: int = 8, block_size: int = 4, enable_prefix_caching: bool = True, **config
) -> Scheduler:
    config.setdefault("max_model_len", 32)
    manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
    return Scheduler(SchedulerConfig(**config), manager)


def make_request(request_id: str, token_ids, **params) -> Request:
    return Request(request_id, list(token_ids), SamplingParams(**params), frozenset({EOS}))


def step(scheduler: Scheduler, token_id: int = SAMPLED) -> tuple[SchedulerOutput, list[Request]]:
    """Schedule, pretend the model sampled `token_id` everywhere, update."""
    output = scheduler.schedule()
    sampled = {s.request.request_id: token_id for s in output.scheduled if s.produces_token}
    return output, scheduler.update_from_output(output, sampled)


def plan(output: SchedulerOutput) -> list[tuple[str, int, int]]:
    """(request id, start, num_new_tokens) per scheduled request, in order."""
    return [(s.request.request_id, s.start, s.num_new_tokens) for s in output.scheduled]


def run_to_completion(scheduler: Scheduler, request: Request, token_ids: list[int]) -> Request:
    scheduler.add_request(request)
    for token_id in token_ids:
        step(scheduler, token_id)
        if request.is_finished:
            break
    return request


# -- configuration and admission checks ---------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        {"max_model_len": 0},
        {"max_model_len": 32, "max_num_seqs": 0},
        {"max_model_len": 32, "max_num_batched_tokens": 0},
        {"max_model_len": 32, "max_num_batched_tokens": 16, "enable_chunked_prefill": False},
    ],
)
def test_invalid_config_raises_value_error(config):
    with pytest.raises(ValueError):
        SchedulerConfig(**config)


def test_can_ever_fit_is_the_whole_pool():
    scheduler = make_scheduler(num_blocks=8, block_size=4)

    assert scheduler.max_blocks_per_request == 8
    assert scheduler.can_ever_fit(32)
    assert not scheduler.can_ever_fit(33)


@pytest.mark.parametrize(
    ("prompt", "max_tokens"),
    [([], 4), (range(33), 1), (range(30), 8)],
    ids=["empty prompt", "prompt over max_model_len", "can never fit the pool"],
)
def test_add_request_rejects_what_the_engine_should_have(prompt, max_tokens):
    scheduler = make_scheduler(num_blocks=7, block_size=4, max_model_len=32)

    with pytest.raises(ValueError):
        scheduler.add_request(make_request("a", prompt, max_tokens=max_tokens))


def test_add_request_rejects_a_duplicate_id():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", range(4)))

    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("a", range(4)))


# -- prefill, decode, chunking --------------------------------------------------------------


def test_a_prompt_is_prefilled_in_one_step_then_decoded_one_token_at_a_time():
    scheduler = make_scheduler(num_blocks=8, block_size=4)
    request = make_request("a", range(10))
    scheduler.add_request(request)

    prefill, updated = step(scheduler)
    assert plan(prefill) == [("a", 0, 10)]
    assert prefill.scheduled[0].is_prefill and prefill.scheduled[0].produces_token
    assert prefill.num_batched_tokens == 10
    assert request.block_ids == [0, 1, 2]
    assert updated == [request] and request.output_token_ids == [SAMPLED]
    assert request.num_computed_tokens == 10

    decode, _ = step(scheduler)
    assert plan(decode) == [("a", 10, 1)]
    assert decode.scheduled[0].is_decode and decode.scheduled[0].produces_token


def test_the_plan_reads_the_same_after_update():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", range(5)))
    output, _ = step(scheduler)
    (scheduled,) = output.scheduled

    assert (scheduled.start, scheduled.end, scheduled.num_tokens) == (0, 5, 5)
    assert scheduled.is_prefill and scheduled.produces_token


def test_chunked_prefill_splits_a_long_prompt_and_samples_only_after_the_last_chunk():
    scheduler = make_scheduler(
        num_blocks=16, block_size=4, max_num_batched_tokens=16, max_model_len=64
    )
    request = make_request("a", range(50))
    scheduler.add_request(request)

    outputs = [step(scheduler) for _ in range(4)]

    assert [plan(output) for output, _ in outputs] == [
        [("a", 0, 16)],
        [("a", 16, 16)],
        [("a", 32, 16)],
        [("a", 48, 2)],
    ]
    assert [output.scheduled[0].produces_token for output, _ in outputs] == [
        False,
        False,
        False,
        True,
    ]
    assert [updated for _, updated in outputs] == [[], [], [], [request]]
    assert request.block_ids == list(range(13))
    assert request.output_token_ids == [SAMPLED]


def test_running_requests_go_first_and_new_ones_take_the_leftover_budget():
    scheduler = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=16)
    scheduler.add_request(make_request("a", range(20)))
    scheduler.add_request(make_request("b", range(100, 110)))

    assert plan(step(scheduler)[0]) == [("a", 0, 16)]
    assert plan(step(scheduler)[0]) == [("a", 16, 4), ("b", 0, 10)]
    assert plan(step(scheduler)[0]) == [("a", 20, 1), ("b", 10, 1)]


def test_without_chunking_a_prompt_over_the_budget_waits_and_so_do_those_behind_it():
    scheduler = make_scheduler(
        max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False
    )
    for request_id, first, length in (("a", 0, 10), ("b", 100, 10), ("c", 200, 2)):
        scheduler.add_request(make_request(request_id, range(first, first + length)))

    assert plan(step(scheduler)[0]) == [("a", 0, 10)]
    assert plan(step(scheduler)[0]) == [("a", 10, 1), ("b", 0, 10), ("c", 0, 2)]


def test_max_num_seqs_caps_the_running_requests():
    scheduler = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=2)
    scheduler.add_request(make_request("a", range(4), max_tokens=1))
    scheduler.add_request(make_request("b", range(10, 14)))
    scheduler.add_request(make_request("c", range(20, 24)))

    assert plan(step(scheduler)[0]) == [("a", 0, 4), ("b", 0, 4)]
    assert (scheduler.num_running, scheduler.num_waiting) == (1, 1)  # a finished
    assert plan(step(scheduler)[0]) == [("b", 4, 1), ("c", 0, 4)]


def test_a_prefix_hit_skips_the_cached_tokens_and_is_recorded():
    scheduler = make_scheduler(num_blocks=8, block_size=4)
    scheduler.add_request(make_request("a", range(10)))
    step(scheduler)
    sharer = make_request("b", [*range(8), 50, 51, 52])
    scheduler.add_request(sharer)

    assert sharer.num_cached_tokens is None
    assert plan(step(scheduler)[0]) == [("a", 10, 1), ("b", 8, 3)]
    assert sharer.num_cached_tokens == 8
    assert sharer.block_ids == [0, 1, 3]


def test_a_prefix_hit_that_cannot_be_allocated_leaves_the_request_untouched():
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    scheduler.add_request(make_request("a", range(9), max_tokens=4))
    step(scheduler)  # a holds [0, 1, 2]; 0 and 1 are cached
    sharer = make_request("b", [*range(8), *range(100, 105)], max_tokens=3)
    scheduler.add_request(sharer)  # hits 8 tokens, needs 2 more blocks, 1 is free

    assert plan(step(scheduler)[0]) == [("a", 9, 1)]
    assert (sharer.status, sharer.num_computed_tokens, sharer.block_ids) == (
        RequestStatus.WAITING,
        0,
        [],
    )
    assert sharer.num_cached_tokens is None
    assert [block.ref_count for block in scheduler.block_manager.blocks] == [1, 1, 1, 0]


# -- preemption ----------------------------------------------------------------------------


def test_when_blocks_run_out_the_newest_request_is_preempted_and_later_recomputed():
    scheduler = make_scheduler(num_blocks=4, block_size=4, enable_prefix_caching=False)
    older = make_request("a", range(7), max_tokens=4)
    newer = make_request("b", range(100, 107), max_tokens=4)
    scheduler.add_request(older)
    scheduler.add_request(newer)
    assert plan(step(scheduler)[0]) == [("a", 0, 7), ("b", 0, 7)]
    assert plan(step(scheduler)[0]) == [("a", 7, 1), ("b", 7, 1)]

    # a's 9th token needs a third block; none is free, so b gives up its two
    third, _ = step(scheduler)
    assert plan(third) == [("a", 8, 1)]
    assert third.preempted_request_ids == ["b"]
    assert older.block_ids == [0, 1, 3]
    assert (newer.status, newer.num_computed_tokens, newer.block_ids) == (
        RequestStatus.PREEMPTED,
        0,
        [],
    )
    assert newer.num_preemptions == scheduler.num_preemptions == 1
    assert list(scheduler.waiting) == [newer]

    # b needs three blocks and one is free: it waits until a finishes with its 4th token
    assert plan(step(scheduler)[0]) == [("a", 9, 1)]
    assert older.status == RequestStatus.FINISHED_LENGTH

    # b recomputes its 7 prompt and 2 output tokens, then samples its 3rd
    fifth, updated = step(scheduler)
    assert plan(fifth) == [("b", 0, 9)]
    assert updated == [newer] and newer.output_token_ids == [SAMPLED] * 3
    assert newer.block_ids == [2, 3, 1]

    assert plan(step(scheduler)[0]) == [("b", 9, 1)]
    assert newer.status == RequestStatus.FINISHED_LENGTH
    assert scheduler.block_manager.num_free_blocks == 4


def test_a_preempted_request_resumes_from_its_own_cached_prefix():
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    scheduler.add_request(make_request("a", range(7), max_tokens=3))
    newer = make_request("b", range(100, 107), max_tokens=4)
    scheduler.add_request(newer)
    for _ in range(3):  # b is preempted in the third step; a finishes in it
        step(scheduler)

    # b's first block (block 2) is still cached; its second went to a
    fourth, _ = step(scheduler)
    assert plan(fourth) == [("b", 4, 5)]
    assert newer.block_ids == [2, 3, 1]
    assert newer.num_cached_tokens == 0  # recorded at first scheduling, not overwritten


def test_the_newest_request_preempts_itself_when_it_cannot_grow():
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    older = make_request("a", range(7), max_tokens=4)
    newer = make_request("b", range(100, 108), max_tokens=4)
    scheduler.add_request(older)
    scheduler.add_request(newer)
    step(scheduler)
    latecomer = make_request("c", range(200, 204), max_tokens=4)
    scheduler.add_request(latecomer)  # no block is free: it waits

    # a still fits in its two blocks; b's 9th token needs a third block
    output, _ = step(scheduler)
    assert plan(output) == [("a", 7, 1)]
    assert output.preempted_request_ids == ["b"]
    assert older.block_ids == [0, 1]
    assert list(scheduler.waiting) == [newer, latecomer]  # the preempted go first


def test_nothing_is_admitted_in_a_step_that_preempted():
    scheduler = make_scheduler(
        num_blocks=4, block_size=4, max_num_batched_tokens=5, enable_prefix_caching=False
    )
    scheduler.add_request(make_request("a", range(4), max_tokens=8))
    newer = make_request("b", range(100, 102), max_tokens=8)
    scheduler.add_request(newer)
    for _ in range(5):  # a and b grow until a holds [0, 2] and b [1, 3]
        step(scheduler)

    # a's 9th token takes one of b's blocks; b's first 4-token chunk would fit the other,
    # but the step that preempted admits nothing
    output, _ = step(scheduler)
    assert plan(output) == [("a", 8, 1)]
    assert output.preempted_request_ids == ["b"]
    assert scheduler.block_manager.num_free_blocks == 1
    assert plan(step(scheduler)[0]) == [("a", 9, 1), ("b", 0, 4)]


# -- abort and finish ----------------------------------------------------------------------


def test_abort_frees_a_running_request_at_once():
    scheduler = make_scheduler(num_blocks=8, block_size=4)
    scheduler.add_request(make_request("a", range(10)))
    step(scheduler)

    aborted = scheduler.abort_request("a")

    assert aborted.status == RequestStatus.FINISHED_ABORTED
    assert aborted.block_ids == []
    assert scheduler.block_manager.num_free_blocks == 8
    assert not scheduler.has_unfinished_requests()
    assert scheduler.get_request("a") is None
    assert scheduler.schedule().finished_request_ids == ["a"]


def test_abort_removes_a_waiting_request():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", range(10)))

    assert scheduler.abort_request("a").status == RequestStatus.FINISHED_ABORTED
    assert scheduler.num_waiting == 0
    assert scheduler.schedule().is_empty


def test_abort_of_an_unknown_request_returns_none():
    assert make_scheduler().abort_request("nobody") is None


def test_a_request_aborted_during_the_step_is_skipped_by_update():
    scheduler = make_scheduler(num_blocks=8, block_size=4)
    scheduler.add_request(make_request("a", range(10)))
    output = scheduler.schedule()
    aborted = scheduler.abort_request("a")

    assert scheduler.update_from_output(output, {"a": SAMPLED}) == []
    assert aborted.output_token_ids == [] and aborted.num_computed_tokens == 0


def test_finish_request_frees_blocks_with_the_given_status():
    scheduler = make_scheduler(num_blocks=8, block_size=4)
    scheduler.add_request(make_request("a", range(10)))
    step(scheduler)

    finished = scheduler.finish_request("a", RequestStatus.FINISHED_STOPPED)

    assert finished.status == RequestStatus.FINISHED_STOPPED
    assert scheduler.block_manager.num_free_blocks == 8
    assert scheduler.num_running == 0


def test_finish_request_needs_a_finished_status():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", range(4)))

    with pytest.raises(ValueError):
        scheduler.finish_request("a", RequestStatus.RUNNING)


def test_finished_ids_are_reported_once():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", range(4), max_tokens=1))
    step(scheduler)

    assert scheduler.schedule().finished_request_ids == ["a"]
    assert scheduler.schedule().finished_request_ids == []


# -- stop conditions -----------------------------------------------------------------------


def test_eos_stops():
    request = run_to_completion(make_scheduler(), make_request("a", range(4)), [5, EOS, 5])

    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.output_token_ids == [5, EOS]


def test_ignore_eos_runs_to_max_tokens():
    request = make_request("a", range(4), ignore_eos=True, max_tokens=3)
    run_to_completion(make_scheduler(), request, [EOS, EOS, EOS, EOS])

    assert request.status == RequestStatus.FINISHED_LENGTH
    assert request.output_token_ids == [EOS] * 3


def test_eos_is_ignored_until_min_tokens_are_out():
    request = make_request("a", range(4), min_tokens=3)
    run_to_completion(make_scheduler(), request, [EOS] * 5)

    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.output_token_ids == [EOS] * 3


def test_a_stop_token_id_stops():
    request = make_request("a", range(4), stop_token_ids=[9])
    run_to_completion(make_scheduler(), request, [5, 9, 5])

    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.output_token_ids == [5, 9]


def test_a_stop_token_id_is_ignored_until_min_tokens_are_out():
    request = make_request("a", range(4), stop_token_ids=[9], min_tokens=2)
    run_to_completion(make_scheduler(), request, [9, 9, 9])

    assert request.output_token_ids == [9, 9]


def test_max_tokens_stops_with_length():
    request = make_request("a", range(4), max_tokens=2)
    run_to_completion(make_scheduler(), request, [5, 5, 5])

    assert request.status == RequestStatus.FINISHED_LENGTH
    assert request.output_token_ids == [5, 5]


def test_eos_on_the_last_allowed_token_is_a_stop_not_a_length():
    request = make_request("a", range(4), max_tokens=2)
    run_to_completion(make_scheduler(), request, [5, EOS])

    assert request.status == RequestStatus.FINISHED_STOPPED


def test_the_context_window_stops_with_length():
    request = make_request("a", range(10), max_tokens=16)
    run_to_completion(make_scheduler(max_model_len=12), request, [5] * 5)

    assert request.status == RequestStatus.FINISHED_LENGTH
    assert request.num_tokens == 12


# -- random workloads ----------------------------------------------------------------------

POOL_BLOCKS, POOL_BLOCK_SIZE, MAX_MODEL_LEN, MAX_NUM_SEQS, TOKEN_BUDGET = 6, 4, 24, 3, 10
VOCAB = st.integers(0, 3)  # tiny, so prompts share prefixes and EOS comes often
DRAIN_STEP_LIMIT = 2000


class RandomWorkload(RuleBasedStateMachine):
    """Adds, steps, aborts and finishes at random under a pool that forces preemption."""

    def __init__(self):
        super().__init__()
        self.scheduler = make_scheduler(
            num_blocks=POOL_BLOCKS,
            block_size=POOL_BLOCK_SIZE,
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=TOKEN_BUDGET,
        )
        self.request_ids: list[str] = []

    @rule(
        prompt=st.lists(VOCAB, min_size=1, max_size=14),
        max_tokens=st.integers(1, 10),
        min_tokens=st.integers(0, 2),
        ignore_eos=st.booleans(),
    )
    def add(self, prompt, max_tokens, min_tokens, ignore_eos):
        request_id = f"r{len(self.request_ids)}"
        params = {"max_tokens": max_tokens, "min_tokens": min_tokens, "ignore_eos": ignore_eos}
        self.scheduler.add_request(make_request(request_id, prompt, **params))
        self.request_ids.append(request_id)

    @rule(data=st.data(), abort_during_step=st.booleans())
    def step(self, data, abort_during_step):
        output = self.scheduler.schedule()
        self._check_plan(output)
        if abort_during_step and output.scheduled:
            self.scheduler.abort_request(output.scheduled[-1].request.request_id)
        sampled = {
            s.request.request_id: data.draw(VOCAB) for s in output.scheduled if s.produces_token
        }
        self.scheduler.update_from_output(output, sampled)

    @precondition(lambda self: self.request_ids)
    @rule(data=st.data())
    def abort(self, data):
        self.scheduler.abort_request(data.draw(st.sampled_from(self.request_ids)))

    @precondition(lambda self: self.request_ids)
    @rule(data=st.data())
    def finish(self, data):
        request_id = data.draw(st.sampled_from(self.request_ids))
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)

    @invariant()
    def every_block_is_held_by_exactly_its_ref_count(self):
        holders = [0] * POOL_BLOCKS
        for request in self.scheduler.running:
            assert len(request.block_ids) * POOL_BLOCK_SIZE >= request.num_computed_tokens
            for block_id in request.block_ids:
                holders[block_id] += 1
        for request in self.scheduler.waiting:
            assert request.block_ids == [] and request.num_computed_tokens == 0
        manager = self.scheduler.block_manager
        assert [block.ref_count for block in manager.blocks] == holders
        assert manager.num_free_blocks == holders.count(0)

    def teardown(self):
        for _ in range(DRAIN_STEP_LIMIT):
            if not self.scheduler.has_unfinished_requests():
                break
            output = self.scheduler.schedule()
            self._check_plan(output)
            assert not output.is_empty, "unfinished requests but nothing scheduled: deadlock"
            sampled = {s.request.request_id: 1 for s in output.scheduled if s.produces_token}
            self.scheduler.update_from_output(output, sampled)
        assert not self.scheduler.has_unfinished_requests()
        assert self.scheduler.block_manager.num_free_blocks == POOL_BLOCKS

    def _check_plan(self, output: SchedulerOutput) -> None:
        assert output.num_batched_tokens <= TOKEN_BUDGET
        assert len(output.scheduled) <= MAX_NUM_SEQS
        assert all(s.num_new_tokens >= 1 for s in output.scheduled)
        assert self.scheduler.num_running <= MAX_NUM_SEQS


TestRandomWorkload = RandomWorkload.TestCase
TestRandomWorkload.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
