"""LLMEngine's public behaviour on the tiny demo model: what it rejects, how it stops, streams,
aborts and preempts, and that it always gives every KV block back.

Outputs are compared with the engine's own greedy runs; test_engine_vs_hf.py checks those
against transformers.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.core.errors import InvalidRequestError, UnknownRequestError
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_runner import decode_groups

PROMPT = "The quick brown fox"
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
TINY_VOCAB_SIZE = 1024  # the tiny demo model's (padded) vocabulary
EOS = 2  # the demo tokenizer's </s>
MAX_MODEL_LEN = 64  # the context window of `strict_engine`
ROOMY_KV_BLOCKS = 256  # of 16 tokens: far more than any test here needs


def greedy(**overrides) -> SamplingParams:
    return replace(GREEDY, **overrides)


def random_prompts(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in lengths]


def assert_idle(engine: LLMEngine) -> None:
    """No request left, and every KV block back in the free pool (cached ones count)."""
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def assert_serves_a_request(engine: LLMEngine) -> None:
    [out] = engine.generate(["a normal request"], greedy(max_tokens=4))
    assert (out.finish_reason, len(out.token_ids)) == ("length", 4)
    assert_idle(engine)


def run_to_completion(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, list]:
    """Step until idle; every delta, by request id."""
    deltas: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return deltas
        for delta in engine.step():
            deltas.setdefault(delta.request_id, []).append(delta)
    raise AssertionError(f"still busy after {max_steps} steps")


@pytest.fixture(scope="module")
def shared_engine(demo_model_dir):
    return LLMEngine.from_pretrained(demo_model_dir, num_kv_blocks=ROOMY_KV_BLOCKS)


@pytest.fixture
def engine(shared_engine):
    """The module's roomy engine; each test must leave it idle, and this checks it did."""
    assert_idle(shared_engine)
    yield shared_engine
    assert_idle(shared_engine)


@pytest.fixture
def fresh_engine(demo_model_dir):
    """For tests that leave state behind (cheap: the weights are in the page cache)."""
    return LLMEngine.from_pretrained(demo_model_dir, num_kv_blocks=ROOMY_KV_BLOCKS)


@pytest.fixture(scope="module")
def strict_engine(demo_model_dir):
    """A 64-token context window, with a pool that holds all of it."""
    return LLMEngine.from_pretrained(demo_model_dir, max_model_len=MAX_MODEL_LEN, num_kv_blocks=8)


@pytest.fixture(scope="module")
def reference(shared_engine):
    """The greedy 24-token output of PROMPT."""
    [out] = shared_engine.generate([PROMPT], GREEDY)
    return out


# -- validation --------------------------------------------------------------------------

INVALID_REQUESTS = {
    # name: (prompt, params, the field the error names)
    "empty text prompt": ("", SamplingParams(), "prompt"),
    "empty token list": ([], SamplingParams(), "prompt_token_ids"),
    "token id past the vocabulary": (
        [5, 6, TINY_VOCAB_SIZE],
        SamplingParams(),
        "prompt_token_ids[2]",
    ),
    "negative token id": ([5, -1], SamplingParams(), "prompt_token_ids[1]"),
    "prompt fills the context": ([5] * MAX_MODEL_LEN, SamplingParams(max_tokens=1), "prompt"),
    "max_tokens 0": (PROMPT, SamplingParams(max_tokens=0), "sampling_params.max_tokens"),
    "max_tokens past the context": (
        [5] * 10,
        SamplingParams(max_tokens=MAX_MODEL_LEN - 9),
        "sampling_params.max_tokens",
    ),
    "negative temperature": (
        PROMPT,
        SamplingParams(temperature=-0.5),
        "sampling_params.temperature",
    ),
    "NaN temperature": (
        PROMPT,
        SamplingParams(temperature=math.nan),
        "sampling_params.temperature",
    ),
    "top_p 0": (PROMPT, SamplingParams(top_p=0.0), "sampling_params.top_p"),
    "top_p 1.5": (PROMPT, SamplingParams(top_p=1.5), "sampling_params.top_p"),
    "top_k -1": (PROMPT, SamplingParams(top_k=-1), "sampling_params.top_k"),
    "min_p 2": (PROMPT, SamplingParams(min_p=2.0), "sampling_params.min_p"),
    "logprobs 21": (PROMPT, SamplingParams(logprobs=21), "sampling_params.logprobs"),
    "stop token id past the vocabulary": (
        PROMPT,
        SamplingParams(stop_token_ids=[TINY_VOCAB_SIZE]),
        "sampling_params.stop_token_ids[0]",
    ),
    "negative stop token id": (
        PROMPT,
        SamplingParams(stop_token_ids=[7, -1]),
        "sampling_params.stop_token_ids[1]",
    ),
    "empty stop string": (PROMPT, SamplingParams(stop=["ok", ""]), "sampling_params.stop[1]"),
    "min_tokens over max_tokens": (
        PROMPT,
        SamplingParams(min_tokens=5, max_tokens=4),
        "sampling_params.min_tokens",
    ),
}


@pytest.mark.parametrize(
    ("prompt", "params", "field"), INVALID_REQUESTS.values(), ids=INVALID_REQUESTS.keys()
)
def test_an_invalid_request_is_rejected_naming_its_field(strict_engine, prompt, params, field):
    assert strict_engine.model_config.vocab_size == TINY_VOCAB_SIZE
    with pytest.raises(InvalidRequestError) as excinfo:
        strict_engine.add_request(prompt, params)
    assert excinfo.value.field == field
    assert_idle(strict_engine)
    assert_serves_a_request(strict_engine)


VALID_EDGES = {
    "prompt one short of the context": ([5] * (MAX_MODEL_LEN - 1), greedy(max_tokens=1)),
    "prompt and output fill the context": ([5] * 10, greedy(max_tokens=MAX_MODEL_LEN - 10)),
    "one-token prompt": ([5], greedy(max_tokens=2)),
    "last token id of the vocabulary": ([TINY_VOCAB_SIZE - 1], greedy(max_tokens=2)),
    "top_p 1, min_p 1, top_k 0": (PROMPT, SamplingParams(top_p=1.0, min_p=1.0, top_k=0)),
    "logprobs 20": (PROMPT, greedy(max_tokens=2, logprobs=20)),
    "min_tokens equal to max_tokens": (PROMPT, greedy(min_tokens=4, max_tokens=4)),
}


@pytest.mark.parametrize(("prompt", "params"), VALID_EDGES.values(), ids=VALID_EDGES.keys())
def test_a_request_at_the_edge_of_validity_runs(strict_engine, prompt, params):
    [out] = strict_engine.generate([prompt], params)
    assert out.finished
    assert_idle(strict_engine)


def test_a_request_larger_than_the_kv_pool_is_rejected(demo_model_dir):
    engine = LLMEngine.from_pretrained(demo_model_dir, num_kv_blocks=2)  # 32 tokens of 16
    engine.add_request([5] * 10, greedy(max_tokens=22))  # exactly the pool: accepted
    with pytest.raises(InvalidRequestError) as excinfo:
        engine.add_request([5] * 10, greedy(max_tokens=23))
    assert excinfo.value.field == "sampling_params.max_tokens"
    run_to_completion(engine)
    assert_serves_a_request(engine)


def test_a_duplicate_request_id_is_rejected_while_the_first_runs(engine):
    engine.add_request(PROMPT, GREEDY, request_id="dup")
    with pytest.raises(InvalidRequestError) as excinfo:
        engine.add_request("another prompt", GREEDY, request_id="dup")
    assert excinfo.value.field == "request_id"
    deltas = run_to_completion(engine)
    assert len(deltas["dup"]) == GREEDY.max_tokens
    assert_serves_a_request(engine)


def test_generate_rejects_a_bare_prompt_and_mismatched_params(engine):
    with pytest.raises(InvalidRequestError) as excinfo:
        engine.generate(PROMPT, GREEDY)
    assert excinfo.value.field == "prompts"
    with pytest.raises(InvalidRequestError) as excinfo:
        engine.generate([PROMPT, "hello"], [GREEDY])
    assert excinfo.value.field == "params"


def test_generate_with_one_invalid_prompt_leaves_nothing_queued(fresh_engine):
    with pytest.raises(InvalidRequestError):
        fresh_engine.generate([PROMPT, ""], GREEDY)
    assert not fresh_engine.has_unfinished_requests()


# -- abort -------------------------------------------------------------------------------


def test_abort_mid_generation_frees_all_blocks_at_once(engine):
    request_id = engine.add_request(PROMPT, greedy(max_tokens=40))
    for _ in range(5):
        engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    engine.abort(request_id)
    assert_idle(engine)
    assert engine.step() == []


def test_an_aborted_request_gets_no_more_output_and_the_others_run_on(engine):
    [alone] = engine.generate(["hello"], GREEDY)
    doomed = engine.add_request(PROMPT, GREEDY)
    survivor = engine.add_request("hello", GREEDY)
    for _ in range(3):
        engine.step()
    engine.abort(doomed)
    deltas = run_to_completion(engine)
    assert doomed not in deltas
    assert [t for d in deltas[survivor] for t in d.token_ids] == alone.token_ids[3:]


def test_abort_of_an_unknown_or_finished_id_raises(engine):
    with pytest.raises(UnknownRequestError):
        engine.abort("no-such-request")
    request_id = engine.add_request(PROMPT, greedy(max_tokens=2))
    run_to_completion(engine)
    with pytest.raises(UnknownRequestError):
        engine.abort(request_id)


# -- preemption --------------------------------------------------------------------------


def test_preempted_requests_finish_with_the_same_output_as_without_preemption(
    engine, demo_model_dir
):
    prompts = random_prompts([5, 12, 9, 15, 3, 11], seed=10)
    params = greedy(max_tokens=40)  # each request grows to 4 blocks of 16
    roomy = engine.generate(prompts, params)
    tight = LLMEngine.from_pretrained(demo_model_dir, num_kv_blocks=9)  # about 2 at a time
    request_ids = [tight.add_request(p, params) for p in prompts]
    requests = [tight.scheduler.get_request(rid) for rid in request_ids]
    deltas = run_to_completion(tight)
    outputs = [[t for d in deltas[rid] for t in d.token_ids] for rid in request_ids]
    assert outputs == [o.token_ids for o in roomy]
    assert [d[-1].finish_reason for d in deltas.values()] == ["length"] * len(prompts)
    assert sum(r.num_preemptions for r in requests) > 0
    assert_idle(tight)


# -- stopping ----------------------------------------------------------------------------


@pytest.mark.parametrize("max_tokens", [1, 7, 24])
def test_max_tokens_ends_with_length_after_exactly_that_many_tokens(engine, max_tokens):
    [out] = engine.generate([PROMPT], greedy(max_tokens=max_tokens))
    assert out.finish_reason == "length"
    assert len(out.token_ids) == max_tokens


def test_text_is_the_decoded_token_ids(engine, reference):
    assert reference.text == engine.tokenizer.decode(reference.token_ids)


def test_text_is_the_decoded_token_ids_when_output_ends_mid_character(engine, reference):
    decode = engine.tokenizer.decode
    ends_mid_char = [n for n in range(1, 25) if decode(reference.token_ids[:n]).endswith("\ufffd")]
    assert ends_mid_char, "precondition: some prefix of the output ends mid-character"
    [out] = engine.generate([PROMPT], greedy(max_tokens=ends_mid_char[0]))
    assert out.text == decode(out.token_ids)


def test_a_stop_string_ends_the_text_right_before_it(engine, reference):
    middle = len(reference.text) // 2
    stop = reference.text[middle : middle + 4]
    start = reference.text.find(stop)
    assert start > 0, "precondition: the stop string is not at the very start"
    [out] = engine.generate([PROMPT], greedy(stop=[stop]))
    assert out.finish_reason == "stop"
    assert out.text == reference.text[:start]
    assert stop not in out.text
    assert out.token_ids == reference.token_ids[: len(out.token_ids)]
    assert len(out.token_ids) < len(reference.token_ids)


def test_a_stop_token_id_ends_the_output_and_is_included(engine):
    [free_run] = engine.generate(["hello"], GREEDY)
    stop_token = free_run.token_ids[4]
    stop_at = free_run.token_ids.index(stop_token)  # the 5th token, unless it came earlier
    [out] = engine.generate(["hello"], greedy(stop_token_ids=[stop_token]))
    assert out.finish_reason == "stop"
    assert out.token_ids == free_run.token_ids[: stop_at + 1]


@pytest.fixture(scope="module")
def eos_run(shared_engine):
    """(prompt, greedy output) of a random prompt whose free-running output holds EOS."""
    prompts = random_prompts([3 + i % 17 for i in range(128)], seed=11)
    outputs = shared_engine.generate(prompts, greedy(max_tokens=32))
    runs = zip(prompts, outputs, strict=True)
    found = [(p, o.token_ids) for p, o in runs if EOS in o.token_ids[2:]]
    assert found, "precondition: the demo model samples EOS for one of 128 random prompts"
    return found[0]


def test_eos_ends_the_output_unless_ignored(engine, eos_run):
    prompt, free_run = eos_run
    [out] = engine.generate([prompt], greedy(max_tokens=32, ignore_eos=False))
    assert out.finish_reason == "stop"
    assert out.token_ids == free_run[: free_run.index(EOS) + 1]
    assert out.text == engine.tokenizer.decode(out.token_ids)  # EOS itself adds no text


def test_min_tokens_keeps_eos_from_ending_the_output_early(engine, eos_run):
    prompt, free_run = eos_run
    min_tokens = free_run.index(EOS) + 3
    [out] = engine.generate(
        [prompt], greedy(max_tokens=32, ignore_eos=False, min_tokens=min_tokens)
    )
    assert len(out.token_ids) >= min_tokens
    assert EOS not in out.token_ids[: min_tokens - 1]


# -- outputs -----------------------------------------------------------------------------


def test_logprobs_give_the_sampled_token_and_the_top_n_best_first(engine):
    [out] = engine.generate([PROMPT], greedy(max_tokens=8, logprobs=3))
    assert len(out.logprobs) == len(out.token_ids) == 8
    for token_id, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == token_id
        assert lp.logprob <= 0.0
        assert len(lp.top) == 3
        top_logprobs = [logprob for _, logprob in lp.top]
        assert top_logprobs == sorted(top_logprobs, reverse=True)
        assert lp.top[0][0] == token_id  # greedy takes the best
        assert lp.logprob == pytest.approx(lp.top[0][1])


def test_step_deltas_add_up_to_the_generate_result(engine, reference):
    request_id = engine.add_request(PROMPT, GREEDY)
    deltas = run_to_completion(engine)[request_id]
    assert [len(d.token_ids) for d in deltas] == [1] * GREEDY.max_tokens
    assert [d.finished for d in deltas] == [False] * (GREEDY.max_tokens - 1) + [True]
    assert [t for d in deltas for t in d.token_ids] == reference.token_ids
    assert "".join(d.text for d in deltas) == reference.text


def test_a_text_prompt_and_its_token_ids_give_the_same_output(engine, reference):
    [out] = engine.generate([engine.tokenizer.encode(PROMPT)], GREEDY)
    assert (out.token_ids, out.text) == (reference.token_ids, reference.text)


def test_generate_takes_one_sampling_params_per_prompt_in_order(engine):
    outs = engine.generate([PROMPT, "hello", PROMPT], [greedy(max_tokens=n) for n in (3, 9, 5)])
    assert [len(o.token_ids) for o in outs] == [3, 9, 5]
    assert outs[0].token_ids == outs[2].token_ids[:3]


# -- sampling ----------------------------------------------------------------------------


def test_the_same_seed_gives_the_same_tokens(engine):
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)
    first, second = (engine.generate([PROMPT], seeded)[0] for _ in range(2))
    assert first.token_ids == second.token_ids
    unseeded = replace(seeded, seed=None)
    first, second = (engine.generate([PROMPT], unseeded)[0] for _ in range(2))
    assert first.token_ids != second.token_ids  # the draw is random: the seed matters


@pytest.mark.parametrize(
    "penalty",
    [{"repetition_penalty": 1.5}, {"frequency_penalty": 1.0}, {"presence_penalty": 1.0}],
    ids=lambda p: next(iter(p)),
)
def test_a_penalty_changes_the_greedy_output(engine, reference, penalty):
    assert len(set(reference.token_ids)) < len(reference.token_ids), "precondition: repeats"
    [out] = engine.generate([PROMPT], greedy(**penalty))
    assert out.token_ids != reference.token_ids


def test_a_high_repetition_penalty_repeats_fewer_tokens(engine, reference):
    [out] = engine.generate([PROMPT], greedy(repetition_penalty=2.0))
    num_repeats = len(out.token_ids) - len(set(out.token_ids))
    assert num_repeats < len(reference.token_ids) - len(set(reference.token_ids))


# -- a random mix of add, step and abort ---------------------------------------------------

add_op = st.tuples(
    st.just("add"), st.lists(st.integers(3, 999), min_size=1, max_size=12), st.integers(1, 16)
)
step_op = st.tuples(st.just("step"))
abort_op = st.tuples(st.just("abort"), st.integers(0, 31))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.one_of(add_op, step_op, step_op, abort_op), max_size=40))
def test_any_mix_of_add_step_and_abort_drains_and_frees_every_block(demo_model_dir, ops):
    # 8 blocks of 4 tokens: the largest request (12 + 16 tokens) fits alone, few fit together
    engine = LLMEngine.from_pretrained(
        demo_model_dir, block_size=4, num_kv_blocks=8, max_num_batched_tokens=16
    )
    max_tokens: dict[str, int] = {}
    tokens: dict[str, list[int]] = {}
    finished: set[str] = set()
    aborted: set[str] = set()

    def record(deltas):
        for delta in deltas:
            assert delta.request_id not in aborted | finished
            tokens[delta.request_id].extend(delta.token_ids)
            if delta.finished:
                finished.add(delta.request_id)

    for op in ops:
        if op[0] == "add":
            request_id = engine.add_request(op[1], greedy(max_tokens=op[2]))
            max_tokens[request_id], tokens[request_id] = op[2], []
        elif op[0] == "step":
            record(engine.step())
        elif max_tokens:
            request_id = list(max_tokens)[op[1] % len(max_tokens)]
            if request_id in finished | aborted:
                with pytest.raises(UnknownRequestError):
                    engine.abort(request_id)
            else:
                engine.abort(request_id)
                aborted.add(request_id)
    for deltas in run_to_completion(engine, max_steps=2_000).values():
        record(deltas)
    assert_idle(engine)
    assert finished == set(max_tokens) - aborted
    assert all(len(tokens[rid]) == max_tokens[rid] for rid in finished)


def test_decodes_are_grouped_where_a_context_is_far_longer_than_its_groups_shortest():
    # a new group: over twice the group's shortest and at least 256 tokens longer
    assert decode_groups([]) == []
    assert decode_groups([5, 9, 200, 260]) == [range(0, 4)]  # short ones stay together
    assert decode_groups([5, 9, 200, 261]) == [range(0, 3), range(3, 4)]
    assert decode_groups([9, 12, 300, 700, 1300]) == [range(0, 2), range(2, 3), range(3, 5)]
    assert decode_groups([600, 1200, 1201]) == [range(0, 2), range(2, 3)]


def test_a_lone_decode_attends_over_its_consecutive_blocks_in_place(demo_model_dir, monkeypatch):
    engine = LLMEngine.from_pretrained(demo_model_dir, num_kv_blocks=ROOMY_KV_BLOCKS)
    prepared, prepare = [], engine.runner.prepare

    def spy(plan):
        prepared.append(prepare(plan))
        return prepared[-1]

    monkeypatch.setattr(engine.runner, "prepare", spy)
    [alone] = engine.generate(random_prompts([40]), greedy(max_tokens=8))
    lone = [inputs.meta.decodes for inputs in prepared if inputs.meta.decodes]
    assert len(lone) == 7  # the first token came with the prompt
    assert all(batch.first_slot == 0 and batch.block_table is None for [batch] in lone)
    prepared.clear()
    together = engine.generate(random_prompts([40, 33]), greedy(max_tokens=8))
    assert together[0].token_ids == alone.token_ids  # the gathered path agrees
    assert all(b.first_slot is None for i in prepared for b in i.meta.decodes)
