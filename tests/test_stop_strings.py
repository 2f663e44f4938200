"""Stop strings: bounded in number and length (the request checks), and found by a matcher
whose work per character does not grow with how many there are.

The matcher is checked against a plain reference (search the whole text for every stop
string, earliest end first, then earliest start), on exact outcomes and on random texts
split at random into deltas as tokens split them.
"""

from __future__ import annotations

import itertools
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.core.errors import InvalidRequestError
from pdserve.core.sampling_params import (
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
    RequestLimits,
    SamplingParams,
)
from pdserve.engine.tokenizer import StopStringMatcher

VOCAB_SIZE = 1024


def feed_all(matcher: StopStringMatcher, deltas: list[str]) -> tuple[str, bool]:
    """What a stream of deltas emits in all, and whether it stopped (flushing otherwise)."""
    out = []
    for delta in deltas:
        text, stopped = matcher.feed(delta)
        out.append(text)
        if stopped:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


def reference(stops: list[str], text: str) -> tuple[str, bool]:
    """The whole text at once: the stop string that ends first (then starts first) cuts it."""
    found = [(i + len(s), i) for s in stops if (i := text.find(s)) != -1]
    if not found:
        return text, False
    return text[: min(found)[1]], True


# -- exact outcomes ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stops", "deltas", "expected"),
    [
        (["STOP"], ["abc ST", "OP def"], ("abc ", True)),  # spans two tokens
        (["STOP"], ["S", "T", "O", "P"], ("", True)),  # one character per token
        (["STOP"], ["ST", "OR", "Y"], ("STORY", False)),  # a prefix that did not finish
        (["abcd", "bc"], ["xab", "cd"], ("xa", True)),  # "bc" completes first
        (["bcd", "abcd"], ["xabc", "d"], ("x", True)),  # both end at "d": the longer starts first
        (["aab"], ["aaa", "ab"], ("aa", True)),  # a failure link keeps the match going
        (["he", "she", "hers"], ["ushers"], ("u", True)),  # the textbook Aho-Corasick case
        (["界 ST"], ["世界", " S", "T!"], ("世", True)),  # multi-byte characters
        (["\n\nUser:"], ["Hi.\n", "\nUse", "d"], ("Hi.\n\nUsed", False)),
    ],
)
def test_stop_matcher_exact_outcomes(stops, deltas, expected):
    assert feed_all(StopStringMatcher(stops), deltas) == expected


def test_the_held_text_is_only_what_could_still_begin_a_stop():
    matcher = StopStringMatcher(["abcX", "bcY"])
    assert matcher.feed("zab") == ("z", False)  # "ab" may begin abcX
    assert matcher.feed("c") == ("", False)  # "abc" may begin abcX, "bc" bcY
    assert matcher.feed("Q") == ("abcQ", False)  # neither: all of it goes out
    assert matcher.flush() == ""


def test_after_a_stop_every_feed_is_empty():
    matcher = StopStringMatcher(["end"])
    assert matcher.feed("the end is near") == ("the ", True)
    assert matcher.feed("more") == ("", True)
    assert matcher.stopped


def test_after_a_flush_matching_starts_afresh():
    matcher = StopStringMatcher(["abc"])
    assert matcher.feed("ab") == ("", False)
    assert matcher.flush() == "ab"
    assert matcher.feed("c") == ("c", False)  # "ab" was flushed: "c" alone is no stop


@settings(max_examples=300, deadline=None)
@given(
    stops=st.lists(st.text("abc", min_size=1, max_size=4), min_size=1, max_size=6),
    text=st.text("abcd", max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=10),
)
def test_stop_matcher_matches_the_reference_however_the_text_is_split(stops, text, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = [text[a:b] for a, b in itertools.pairwise(bounds)]
    assert feed_all(StopStringMatcher(stops), deltas) == reference(stops, text)


# -- cost -------------------------------------------------------------------------------


def _seconds_per_char(matcher: StopStringMatcher, deltas: list[str]) -> float:
    best = float("inf")
    for _ in range(3):  # the best of three: a loaded machine only slows runs down
        started = time.perf_counter()
        for delta in deltas:
            matcher.feed(delta)
        best = min(best, time.perf_counter() - started)
        matcher.flush()
    return best / sum(map(len, deltas))


def test_cost_per_character_does_not_grow_with_the_number_of_stop_strings():
    # 4,000 stop strings sharing prefixes with the text: the old matcher searched the
    # text for each of them on every delta (about 4,000 times the work of one).
    many = [f"word{i} and more" for i in range(4000)]
    deltas = [f"word{i % 97} an" for i in range(400)]  # each starts a prefix, none finishes
    one = _seconds_per_char(StopStringMatcher(["word0 and more"]), deltas)
    thousands = _seconds_per_char(StopStringMatcher(many), deltas)
    assert thousands < 10 * one, (one, thousands)


# -- the request checks -------------------------------------------------------------------


def test_the_engine_refuses_more_stop_strings_than_its_hard_cap():
    params = SamplingParams(stop=["x"] * (MAX_STOP_STRINGS + 1))
    with pytest.raises(InvalidRequestError) as caught:
        params.validate(VOCAB_SIZE)
    assert caught.value.field == "sampling_params.stop"
    assert f"the limit is {MAX_STOP_STRINGS}" in caught.value.message


def test_the_engine_refuses_a_stop_string_longer_than_its_hard_cap():
    params = SamplingParams(stop=["ok", "y" * (MAX_STOP_LENGTH + 1)])
    with pytest.raises(InvalidRequestError) as caught:
        params.validate(VOCAB_SIZE)
    assert caught.value.field == "sampling_params.stop[1]"
    assert f"the limit is {MAX_STOP_LENGTH}" in caught.value.message


def test_the_engine_takes_stop_strings_at_its_hard_caps():
    SamplingParams(stop=["z" * MAX_STOP_LENGTH] * MAX_STOP_STRINGS).validate(VOCAB_SIZE)


def test_router_limits_name_the_public_field_and_the_limit():
    limits = RequestLimits(max_prompt_bytes=100, max_model_len=64, max_stop_strings=2)
    with pytest.raises(InvalidRequestError) as caught:
        limits.check_stop(["a", "b", "c"], "sampling.stop")
    assert (caught.value.field, caught.value.message) == (
        "sampling.stop",
        "3 stop strings; the limit is 2",
    )
    limits.check_stop(["a", "b"], "sampling.stop")


def test_router_limits_cannot_exceed_the_engines_hard_caps():
    with pytest.raises(ValueError, match="max_stop_strings"):
        RequestLimits(max_prompt_bytes=1, max_model_len=1, max_stop_strings=MAX_STOP_STRINGS + 1)
    with pytest.raises(ValueError, match="max_stop_length"):
        RequestLimits(max_prompt_bytes=1, max_model_len=1, max_stop_length=MAX_STOP_LENGTH + 1)
