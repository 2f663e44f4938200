"""Several engine steps in one TokenDelta, and a retry that regenerates part of a stream.

A decode worker coalesces the steps waiting for a slow receiver into one message, so
the grouping of a stream into messages differs from attempt to attempt. Whatever the
groupings, and wherever the first attempt broke off, the caller must get each token
exactly once with exactly the uninterrupted stream's text.
"""

from __future__ import annotations

import itertools

import pytest

from pdserve.api.v1 import common_pb2
from pdserve.core.sampling_params import TokenLogprobs
from pdserve.engine.outputs import RequestOutput
from pdserve.router.session import DeliveredTokens
from pdserve.rpc.wire import drop_first_tokens
from pdserve.rpc.wire.worker import deltas_to_proto

# One engine step each: "é" takes two tokens (the first completes no character), one
# step yields two tokens at once, and the last step has no token, only held-back text.
STEPS = [
    ([11], "Hello"),
    ([12], ","),
    ([13], ""),
    ([14], " é"),
    ([15, 16], " wor"),
    ([17], "ld"),
    ([], "!"),
]
TOKENS = [t for ids, _ in STEPS for t in ids]
TEXT = "".join(text for _, text in STEPS)


def outputs() -> list[RequestOutput]:
    last = len(STEPS) - 1
    return [
        RequestOutput(
            "r",
            [1, 2],
            list(ids),
            text,
            finished=i == last,
            finish_reason="stop" if i == last else None,
            logprobs=[TokenLogprobs(t, -0.5, []) for t in ids],
        )
        for i, (ids, text) in enumerate(STEPS)
    ]


def groupings(n: int):
    """Every way to cut n consecutive steps into messages, as lists of group sizes."""
    for cuts in itertools.product([False, True], repeat=n - 1):
        sizes, size = [], 1
        for cut in cuts:
            if cut:
                sizes.append(size)
                size = 0
            size += 1
        yield [*sizes, size]


def messages(sizes: list[int]):
    steps, start, num_tokens = outputs(), 0, 0
    for size in sizes:
        group = steps[start : start + size]
        start += size
        num_tokens += sum(len(step.token_ids) for step in group)
        yield deltas_to_proto(group, num_tokens)


def test_one_message_for_several_steps_keeps_tokens_text_and_the_final_usage():
    [merged] = messages([len(STEPS)])
    assert list(merged.token_ids) == TOKENS and merged.text == TEXT
    assert [lp.sampled.token_id for lp in merged.logprobs] == TOKENS
    assert merged.finish_reason == common_pb2.FINISH_REASON_STOP
    assert merged.usage.completion_tokens == len(TOKENS)
    # token i's text ends there; " é" completes 14 (13 completes nothing), " wor" 16
    assert list(merged.text_ends) == [5, 6, 6, 8, 8, 12, 14]


def test_a_generations_first_message_brings_its_cached_tokens_a_decode_after_a_prefill_not():
    # a colocated prompt's cached tokens come with its first token, as a prefill's do
    prompt = list(range(40))
    steps = [RequestOutput("r", prompt, [11 + i], "x", num_cached_tokens=32) for i in range(3)]
    first, second = deltas_to_proto(steps[:1], 1), deltas_to_proto(steps[1:2], 2)
    assert (first.usage.prompt_tokens, first.usage.cached_prompt_tokens) == (40, 32)
    assert not second.HasField("usage")
    # a decode worker's stream after a prefill worker's first token starts at output 1
    assert not deltas_to_proto(steps[1:3], 3).HasField("usage")


def test_one_step_per_message_needs_no_text_ends():
    assert all(not m.text_ends for m in messages([1] * len(STEPS)))


@pytest.mark.parametrize("count", range(1, len(TOKENS) + 1))
def test_dropping_leading_tokens_drops_exactly_their_text(count):
    [merged] = messages([len(STEPS)])
    drop_first_tokens(merged, count)
    assert list(merged.token_ids) == TOKENS[count:]
    assert [lp.sampled.token_id for lp in merged.logprobs] == TOKENS[count:]
    ends = [5, 6, 6, 8, 8, 12, 14]
    assert merged.text == TEXT[ends[count - 1] :]
    assert list(merged.text_ends) == [end - ends[count - 1] for end in ends[count:]]


def test_a_retry_delivers_each_token_once_with_exact_text_whatever_the_groupings():
    """Attempt 1 breaks off after any of its messages; attempt 2 groups steps its own way."""
    all_groupings = list(groupings(len(STEPS)))
    for first in all_groupings:
        for num_sent in range(len(first)):  # the final message never went out
            for second in all_groupings:
                delivered, got = DeliveredTokens(), []
                for sizes, limit in ((first, num_sent), (second, None)):
                    delivered.new_attempt()
                    for message in itertools.islice(messages(sizes), limit):
                        if delivered.keep_new(message):
                            got.append(message)
                case = f"{first} broken after {num_sent}, then {second}"
                assert [t for m in got for t in m.token_ids] == TOKENS, case
                assert "".join(m.text for m in got) == TEXT, case
                assert got[-1].finish_reason == common_pb2.FINISH_REASON_STOP, case
