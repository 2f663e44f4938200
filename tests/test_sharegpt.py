"""`pdserve bench --workload sharegpt`: the packaged ShareGPT parsed item by item, its
pairs filtered as vLLM's benchmark filters them, and sampled by the seed."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.sharegpt import (
    iter_conversations,
    load_conversations,
    sharegpt_pairs,
    sharegpt_workload,
)
from pdserve.bench.workload import plan
from pdserve.engine.tokenizer import Tokenizer


def conversation(*turns: tuple[str, str]) -> dict:
    return {"id": "x", "conversations": [{"from": who, "value": text} for who, text in turns]}


LONG = "the quick brown fox jumps over the lazy dog " * 3
ITEMS = [
    conversation(("human", LONG), ("gpt", LONG + "and then some")),  # kept
    conversation(("human", "hi"), ("gpt", LONG)),  # prompt under 4 tokens
    conversation(("human", LONG), ("gpt", "ok")),  # reply under 4 tokens
    conversation(("gpt", "welcome"), ("human", LONG), ("gpt", LONG)),  # the human turn's pair
    conversation(("human", LONG)),  # no reply
    conversation(("human", LONG * 40), ("gpt", LONG * 40)),  # past the context
]


@pytest.fixture
def truncated_file(tmp_path):
    """ITEMS as the packaged file is: a JSON array cut off inside its last item."""
    text = json.dumps([*ITEMS, conversation(("human", LONG), ("gpt", LONG))], indent=1)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[: len(text) - 40])
    return path


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir):
    return Tokenizer.load(demo_model_dir)


def test_the_packaged_file_parses_to_its_last_whole_conversation():
    conversations = load_conversations()
    assert len(conversations) == 17_671
    assert sum(1 for turns in conversations if len(turns) >= 2) == 17_400


def test_a_file_cut_off_inside_an_item_yields_the_items_before_it(truncated_file):
    assert len(list(iter_conversations(truncated_file))) == len(ITEMS)


def test_pairs_are_first_human_turns_and_their_replies_that_fit(truncated_file, tokenizer):
    pairs = sharegpt_pairs(tokenizer, 512, truncated_file)
    prompt, reply = tokenizer.encode(LONG), tokenizer.encode(LONG, add_special_tokens=False)
    longer = tokenizer.encode(LONG + "and then some", add_special_tokens=False)
    assert [(list(p.prompt_token_ids), p.output_len) for p in pairs] == [
        (prompt, len(longer)),
        (prompt, len(reply)),
    ]
    assert len(sharegpt_pairs(tokenizer, 100_000, truncated_file)) == 3  # the long one too


def test_requests_carry_their_pairs_prompt_and_exact_output_length(demo_model_dir):
    workload = sharegpt_workload(str(demo_model_dir), 1024, None)
    [kind] = workload.kinds
    pairs = {(p.prompt_token_ids, p.output_len) for p in kind.pairs}
    planned = plan(workload, rate=50.0, duration_s=2.0, num_warmup=2, seed=7)
    assert len(planned) > 50
    for request in planned:
        assert (tuple(request.prompt_token_ids), request.max_tokens) in pairs
        assert len(request.prompt_token_ids) + request.max_tokens <= 1024
    assert plan(workload, 50.0, 2.0, 2, seed=7) == planned  # the seed decides
    other_seed = plan(workload, 50.0, 2.0, 2, seed=8)
    other_rate = plan(workload, 25.0, 4.0, 2, seed=7)
    for other in (other_seed, other_rate):  # their own prompts: no prefix-cache hits
        assert [r.prompt_token_ids for r in other[:20]] != [
            r.prompt_token_ids for r in planned[:20]
        ]
