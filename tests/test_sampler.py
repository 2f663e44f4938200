"""The sampler, row by row: greedy, temperature, filters, penalties, seeds and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.sampler import Sampler, SamplingState, _apply_filters

NUM_DRAWS = 4000  # rows per frequency check; with fixed seeds every check is deterministic


def state(prompt=(), output=(), seed=None, **params) -> SamplingState:
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return SamplingState(SamplingParams(**params), list(prompt), list(output), generator)


def sample(logits, *states, sampler=None):
    sampler = sampler or Sampler(torch.Generator().manual_seed(0))
    return sampler(torch.as_tensor(logits, dtype=torch.float32).reshape(len(states), -1), states)


def frequencies(probs: list[float], **params) -> torch.Tensor:
    """Draw NUM_DRAWS tokens, one per row, each row seeded differently."""
    logits = torch.tensor(probs).log().expand(NUM_DRAWS, -1)
    states = [state(seed=i, **params) for i in range(NUM_DRAWS)]
    token_ids = sample(logits, *states).token_ids
    return torch.bincount(torch.tensor(token_ids), minlength=len(probs)) / NUM_DRAWS


def random_logits(num_rows: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * 3


# --- greedy and temperature -------------------------------------------------------------------


def test_temperature_zero_is_argmax():
    logits = random_logits(8, 50)
    out = sample(logits, *[state(temperature=0.0) for _ in range(8)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 8


def test_greedy_ties_go_to_the_first_token_as_in_hugging_face():
    logits = torch.zeros(3, 32000)  # a real vocabulary's width: the vectorized reduction
    logits[0, [7, 31000]] = 1.0
    logits[1, [30000, 30001]] = 1.0
    out = sample(logits, *[state(temperature=0.0) for _ in range(3)])
    assert out.token_ids == [7, 30000, 0]


def test_temperature_samples_the_tempered_distribution():
    probs = [0.5, 0.25, 0.15, 0.1]
    temperature = 0.7
    expected = torch.softmax(torch.tensor(probs).log() / temperature, dim=-1)
    observed = frequencies(probs, temperature=temperature)
    chi_square = (NUM_DRAWS * (observed - expected) ** 2 / expected).sum().item()
    assert chi_square < 25.0  # 3 degrees of freedom: p < 1e-4 for a correct sampler


def test_unseeded_rows_sample_the_distribution_too():
    probs = torch.tensor([0.6, 0.3, 0.1])
    states = [state() for _ in range(NUM_DRAWS)]
    token_ids = sample(probs.log().expand(NUM_DRAWS, -1), *states).token_ids
    observed = torch.bincount(torch.tensor(token_ids), minlength=3) / NUM_DRAWS
    assert torch.allclose(observed, probs, atol=0.03)


def test_top_k_one_is_greedy():
    logits = random_logits(64, 100)
    out = sample(logits, *[state(seed=i, top_k=1) for i in range(64)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()


# --- filters ----------------------------------------------------------------------------------


def test_small_top_p_keeps_only_the_top_token():
    logits = random_logits(64, 100)
    out = sample(logits, *[state(seed=i, top_p=0.01) for i in range(64)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_top_p_keeps_the_smallest_set_reaching_p():
    observed = frequencies([0.5, 0.3, 0.15, 0.05], top_p=0.75)
    assert observed[2:].sum() == 0
    assert torch.allclose(observed[:2], torch.tensor([0.625, 0.375]), atol=0.03)


def test_top_p_applies_to_what_top_k_left():
    # top_k=2 leaves 0.4 and 0.3, renormalized to 4/7 and 3/7: 4/7 alone reaches top_p=0.5.
    observed = frequencies([0.4, 0.3, 0.2, 0.1], top_k=2, top_p=0.5)
    assert observed.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_top_k_keeps_the_k_most_likely():
    observed = frequencies([0.1, 0.4, 0.2, 0.3], top_k=2)
    assert observed[0] == 0 and observed[2] == 0
    assert torch.allclose(observed[[1, 3]], torch.tensor([4 / 7, 3 / 7]), atol=0.03)


def test_min_p_drops_tokens_below_a_fraction_of_the_max():
    # min_p=0.5 of 0.5 keeps tokens with p >= 0.25
    observed = frequencies([0.5, 0.3, 0.15, 0.05], min_p=0.5)
    assert observed[2:].sum() == 0
    assert torch.allclose(observed[:2], torch.tensor([0.625, 0.375]), atol=0.03)


def test_filters_touch_only_their_own_rows():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    states = [state(seed=i, top_k=1) if i % 2 else state(seed=i) for i in range(NUM_DRAWS)]
    token_ids = torch.tensor(sample(probs.expand(NUM_DRAWS, -1), *states).token_ids)
    assert (token_ids[1::2] == 0).all()
    assert set(token_ids[0::2].tolist()) == {0, 1, 2, 3}


def sorted_filters(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The filters' definition, written the plain way: a stable sort of the whole
    vocabulary, then the first top-k, the first whose mass above them is under top-p of
    what top-k left, and min-p of the largest."""
    out = torch.zeros_like(probs)
    for row, q in enumerate(params):
        p, order = probs[row].sort(descending=True, stable=True)
        keep = torch.arange(len(p)) < (q.top_k or len(p))
        p = p * keep
        if q.top_p < 1.0:
            keep &= p.cumsum(0) - p < q.top_p * p.sum()
        keep &= p >= q.min_p * p[0]
        out[row, order] = p * keep
    return out


FILTER_CASES = [
    dict(top_k=k, top_p=tp, min_p=mp)
    for k in (0, 1, 3, 255, 256, 257, 2000)
    for tp in (1.0, 0.999, 0.9, 0.3, 1e-6)
    for mp in (0.0, 0.02, 0.5)
    if k or tp < 1.0 or mp
]


@pytest.mark.parametrize("vocab_size,spread", [(7, 3.0), (300, 3.0), (32000, 1.0), (32000, 8.0)])
def test_filters_keep_what_a_stable_sort_of_the_vocabulary_keeps(vocab_size, spread):
    # Flat rows (a top-p set of thousands: the sort after the first candidates) and peaked
    # ones; logits rounded to a few levels, so ties straddle the cuts, kept in index order.
    params = [SamplingParams(**case) for case in FILTER_CASES]
    gen = torch.Generator().manual_seed(vocab_size)
    logits = (torch.randn(len(params), vocab_size, generator=gen) * spread).round(decimals=1)
    probs = torch.softmax(logits, dim=-1)
    filtered = _apply_filters(probs, params)
    assert torch.equal(filtered, sorted_filters(probs, params))
    mixed = [params[0], SamplingParams(), params[-1]]  # a row without filters in between
    assert torch.equal(_apply_filters(probs[:3], mixed)[1], probs[1])


# --- penalties (crafted logits, read through greedy picks) -------------------------------------
# --- penalties (crafted logits, read through greedy picks) -------------------------------------


def greedy_pick(logits, **kwargs) -> int:
    return sample(logits, state(temperature=0.0, **kwargs)).token_ids[0]


def test_logit_bias_is_added_to_its_tokens_logits_before_the_pick():
    logits = [3.0, 2.0, 1.0]
    assert greedy_pick(logits, logit_bias={2: 2.5}) == 2  # 1 + 2.5 beats 3
    assert greedy_pick(logits, logit_bias={0: -1.5}) == 1  # 3 - 1.5 loses to 2
    assert greedy_pick(logits, logit_bias={2: 1.0}) == 0  # 1 + 1 still loses


def test_logit_bias_touches_only_its_own_row_and_shifts_sampling():
    logits = torch.zeros(2, 4)
    out = sample(logits, state(temperature=0.0, logit_bias={3: 5.0}), state(temperature=0.0))
    assert out.token_ids == [3, 0]
    # -100 on three of four tokens: the fourth is (all but) always drawn
    assert frequencies([0.25] * 4, logit_bias={0: -100, 1: -100, 2: -100})[3] == 1.0


@pytest.mark.parametrize(
    ("bias", "field"),
    [
        ({7: 1.0}, "sampling_params.logit_bias[7]"),  # outside a vocabulary of 5
        ({1: 100.5}, "sampling_params.logit_bias[1]"),
        ({1: float("nan")}, "sampling_params.logit_bias[1]"),
        ({i: 1.0 for i in range(1025)}, "sampling_params.logit_bias"),
    ],
)
def test_a_bad_logit_bias_names_its_field(bias, field):
    from pdserve.core.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(logit_bias=bias).validate(vocab_size=5 if len(bias) < 1025 else 2048)
    assert caught.value.field == field


def test_repetition_penalty_divides_positive_logits_of_prompt_tokens():
    logits = [3.0, 2.0, 1.0]
    assert greedy_pick(logits, prompt=[0], repetition_penalty=2.0) == 1  # 3 -> 1.5
    assert greedy_pick(logits, prompt=[2], repetition_penalty=2.0) == 0  # unseen 0 untouched


def test_repetition_penalty_multiplies_negative_logits_of_output_tokens():
    logits = [-1.0, -1.5, -3.0]
    assert greedy_pick(logits, output=[0], repetition_penalty=2.0) == 1  # -1 -> -2
    assert greedy_pick(logits, output=[0], repetition_penalty=1.2) == 0  # -1 -> -1.2


def test_frequency_penalty_scales_with_the_count_in_the_output():
    logits = [2.0, 1.5, 1.0]
    assert greedy_pick(logits, output=[0], frequency_penalty=0.3) == 0  # 2 - 0.3
    assert greedy_pick(logits, output=[0, 0], frequency_penalty=0.3) == 1  # 2 - 0.6
    assert greedy_pick(logits, prompt=[0, 0, 0], frequency_penalty=2.0) == 0  # prompt is free


def test_presence_penalty_counts_once_and_only_the_output():
    logits = [2.0, 1.5]
    assert greedy_pick(logits, output=[0, 0, 0], presence_penalty=0.4) == 0  # 2 - 0.4
    assert greedy_pick(logits, output=[0], presence_penalty=0.6) == 1  # 2 - 0.6
    assert greedy_pick(logits, prompt=[0], presence_penalty=2.0) == 0


def test_negative_penalties_encourage_repeats():
    logits = [2.0, 1.5]
    assert greedy_pick(logits, output=[1], frequency_penalty=-1.0) == 1
    assert greedy_pick(logits, output=[1], presence_penalty=-1.0) == 1


def test_penalties_touch_only_their_own_rows():
    logits = [[2.0, 1.5]] * 3
    states = [
        state(temperature=0.0, output=[0], presence_penalty=1.0),
        state(temperature=0.0, output=[0]),
        state(temperature=0.0, output=[1], frequency_penalty=-1.0),
    ]
    assert sample(logits, *states).token_ids == [1, 0, 1]


def test_penalties_apply_before_temperature():
    # Penalized then tempered: [1.0, 1.5] / 0.05 puts token 1 ahead by 10 (p(0) ~ 5e-5).
    # Tempered then penalized would be [40, 30] - [1, 0]: token 0 every time.
    logits = [2.0, 1.5]
    states = [state(seed=i, temperature=0.05, output=[0], presence_penalty=1.0) for i in range(50)]
    assert set(sample([logits] * 50, *states).token_ids) == {1}


# --- seeds ------------------------------------------------------------------------------------


def mixed_batch(vocab_size: int) -> list[SamplingState]:
    """15 rows exercising every path: greedy, filters, penalties, seeds, no seed, logprobs."""
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.8, top_k=5),
        dict(temperature=1.2, top_p=0.5),
        dict(min_p=0.1),
        dict(repetition_penalty=1.3, frequency_penalty=0.5),
        dict(temperature=0.0, presence_penalty=1.0, logprobs=3),
        dict(logprobs=0),
    ]
    batch = []
    for i in range(15):
        seed = 100 + i if i % 3 else None
        kind = kinds[i % len(kinds)]
        batch.append(state(prompt=[1, 2, 3], output=[i % vocab_size], seed=seed, **kind))
    return batch


@pytest.mark.parametrize(
    "params",
    [dict(), dict(temperature=0.7, top_k=50, top_p=0.9, min_p=0.01)],
    ids=["plain", "filtered"],
)
def test_a_seeded_row_draws_the_same_tokens_in_any_batch(params):
    vocab_size, num_steps = 1000, 5
    row = random_logits(1, vocab_size, seed=1)
    others = random_logits(15, vocab_size, seed=2)

    def draws(position: int | None) -> list[int]:
        target = state(seed=1234, **params)
        tokens = []
        for _ in range(num_steps):
            if position is None:
                logits, states = row, [target]
            else:
                logits = torch.cat([others[:position], row, others[position:]])
                batch = mixed_batch(vocab_size)
                states = batch[:position] + [target] + batch[position:]
            tokens.append(sample(logits, *states).token_ids[position or 0])
            if position is not None:
                position = len(states) - 1 - position  # the row moves between steps
        return tokens

    alone = draws(None)
    assert draws(5) == alone
    assert draws(11) == alone
    assert draws(0) == alone


def test_different_seeds_draw_different_tokens():
    logits = random_logits(1, 1000, seed=3) / 3  # flat enough that draws vary

    def draws(seed: int) -> list[int]:
        target = state(seed=seed)
        return [sample(logits, target).token_ids[0] for _ in range(20)]

    assert draws(1) != draws(2)
    assert len(set(draws(1))) > 1  # the generator advances between steps


# --- logprobs ---------------------------------------------------------------------------------


def test_logprobs_are_of_the_raw_logits():
    logits = random_logits(3, 40)
    states = [
        state(seed=1, temperature=0.5, top_k=3, repetition_penalty=1.5, output=[7], logprobs=5),
        state(temperature=0.0, frequency_penalty=2.0, output=[1, 1], logprobs=2),
        state(seed=2, top_p=0.3, logprobs=1),
    ]
    out = sample(logits, *states)
    expected = torch.log_softmax(logits, dim=-1)
    for row, (token_id, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        n = states[row].params.logprobs
        assert lp.token_id == token_id
        assert lp.logprob == pytest.approx(expected[row, token_id].item(), abs=1e-6)
        top_values, top_ids = expected[row].topk(n)
        assert [t for t, _ in lp.top] == top_ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top_values.tolist(), abs=1e-6)
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


def test_zero_logprobs_returns_the_sampled_token_only():
    out = sample(random_logits(2, 10), state(logprobs=0), state(logprobs=4))
    assert out.logprobs[0].top == []
    assert len(out.logprobs[1].top) == 4
    assert math.isfinite(out.logprobs[0].logprob)


def test_rows_without_logprobs_get_none():
    out = sample(random_logits(3, 10), state(), state(logprobs=2), state(temperature=0.0))
    assert out.logprobs[0] is None and out.logprobs[2] is None
    assert out.logprobs[1].token_id == out.token_ids[1]


# --- robustness -------------------------------------------------------------------------------


def test_masked_logits_are_never_sampled_and_give_no_nan():
    vocab_size = 32
    logits = random_logits(1, vocab_size).expand(NUM_DRAWS, -1).clone()
    logits[:, ::2] = -math.inf  # even tokens are impossible
    kinds = [
        dict(),
        dict(temperature=0.0),
        dict(top_k=3),
        dict(top_p=0.8),
        dict(min_p=0.2),
        dict(repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=-1.0),
    ]
    states = [
        state(seed=i, prompt=[0, 1], output=[2, 3], logprobs=20, **kinds[i % len(kinds)])
        for i in range(NUM_DRAWS)
    ]
    out = sample(logits, *states)
    assert all(t % 2 == 1 for t in out.token_ids)
    for lp in out.logprobs:
        assert math.isfinite(lp.logprob)
        assert not any(math.isnan(v) for _, v in lp.top)
        assert lp.top[-1][1] == -math.inf  # 20 > 16 possible tokens


def test_sampling_mutates_nothing():
    logits = random_logits(2, 20)
    before = logits.clone()
    states = [
        state(seed=1, prompt=[1, 2], output=[3], repetition_penalty=2.0, top_p=0.5, logprobs=2),
        state(temperature=0.0, output=[4, 4], frequency_penalty=1.0),
    ]
    params_before = [
        SamplingParams(**{f: getattr(s.params, f) for f in s.params.__slots__}) for s in states
    ]
    sample(logits, *states)
    assert torch.equal(logits, before)
    assert [s.params for s in states] == params_before
    assert (states[0].prompt_token_ids, states[0].output_token_ids) == ([1, 2], [3])
    assert states[1].output_token_ids == [4, 4]
