"""`pdserve bench --workload sharegpt`: the packaged ShareGPT parsed item by item, its
pairs filtered as vLLM's benchmark filters them, sampled by the seed, and sent to
generate exactly their replies' lengths."""

from __future__ import annotations

import argparse
import itertools
import json

import pytest

from pdserve.bench import sharegpt
from pdserve.bench.sharegpt import (
    dataset_path,
    iter_conversations,
    load_conversations,
    sharegpt_pairs,
    sharegpt_workload,
)
from pdserve.bench.targets import sampling_params
from pdserve.bench.workload import plan
from pdserve.commands.bench import BenchConfig, add_parser
from pdserve.engine.tokenizer import Tokenizer

PREFIX_ITEMS = 300  # of the packaged file: real conversations, tokenized in well under 1 s


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
def prefix_file(tmp_path_factory):
    """The packaged file's first PREFIX_ITEMS conversations, whole, as a JSON array."""
    turns = itertools.islice(iter_conversations(dataset_path()), PREFIX_ITEMS)
    path = tmp_path_factory.mktemp("sharegpt") / "prefix.json"
    path.write_text(json.dumps([{"conversations": t} for t in turns]))
    return path


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir):
    return Tokenizer.load(demo_model_dir)


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdserve")
    add_parser(parser.add_subparsers())
    return parser.parse_args(["bench", "--router", "127.0.0.1:1", *argv])  # never called


def test_the_packaged_file_parses_to_its_last_whole_conversation():
    with dataset_path().open("rb") as f:
        f.seek(-64, 2)
        assert not f.read().rstrip().endswith(b"]")  # cut off: json.load fails on it
    conversations = load_conversations()
    assert len(conversations) == 17_671
    assert sum(1 for turns in conversations if len(turns) >= 2) == 17_400


@pytest.mark.parametrize("chunk_chars", [7, 1 << 22])
def test_a_file_cut_off_inside_an_item_yields_the_items_before_it(
    truncated_file, monkeypatch, chunk_chars
):
    monkeypatch.setattr(sharegpt, "_CHUNK_CHARS", chunk_chars)  # items across chunk borders
    assert list(iter_conversations(truncated_file)) == [item["conversations"] for item in ITEMS]


def test_pairs_are_first_human_turns_and_their_replies_that_fit(truncated_file, tokenizer):
    pairs = sharegpt_pairs(tokenizer, 512, truncated_file)
    prompt, reply = tokenizer.encode(LONG), tokenizer.encode(LONG, add_special_tokens=False)
    longer = tokenizer.encode(LONG + "and then some", add_special_tokens=False)
    assert [(list(p.prompt_token_ids), p.output_len) for p in pairs] == [
        (prompt, len(longer)),
        (prompt, len(reply)),
    ]
    assert len(sharegpt_pairs(tokenizer, 100_000, truncated_file)) == 3  # the long one too
    # prompt + output may fill the context exactly, not one token more
    assert len(sharegpt_pairs(tokenizer, len(prompt) + len(longer), truncated_file)) == 2
    assert len(sharegpt_pairs(tokenizer, len(prompt) + len(longer) - 1, truncated_file)) == 1


def test_requests_carry_their_pairs_prompt_and_generate_exactly_its_reply(
    demo_model_dir, prefix_file
):
    workload = sharegpt_workload(str(demo_model_dir), 1024, prefix_file)
    [kind] = workload.kinds
    pairs = {(p.prompt_token_ids, p.output_len) for p in kind.pairs}
    assert 100 < len(kind.pairs) < PREFIX_ITEMS  # some skipped: past 1024 tokens
    planned = plan(workload, rate=50.0, duration_s=2.0, num_warmup=2, seed=7)
    assert len(planned) > 50
    for request in planned:
        params = sampling_params(request)
        assert params.ignore_eos
        assert (tuple(request.prompt_token_ids), params.max_tokens) in pairs
        assert len(request.prompt_token_ids) + request.max_tokens <= 1024


def test_the_seed_decides_the_sample_and_each_rate_and_repeat_draws_its_own(
    demo_model_dir, prefix_file
):
    workload = sharegpt_workload(str(demo_model_dir), 1024, prefix_file)
    planned = plan(workload, 50.0, 2.0, 2, seed=7)
    assert plan(workload, 50.0, 2.0, 2, seed=7) == planned
    for other in (  # their own prompts: no prefix-cache hits on the run before
        plan(workload, 50.0, 2.0, 2, seed=8),
        plan(workload, 25.0, 4.0, 2, seed=7),
        plan(workload, 50.0, 2.0, 2, seed=7, repeat=1),
    ):
        prompts = [r.prompt_token_ids for r in planned[:20]]
        assert [r.prompt_token_ids for r in other[:20]] != prompts


def test_bench_flags_pick_the_file_and_the_context(demo_model_dir, prefix_file):
    files = ["--model", str(demo_model_dir), "--sharegpt-path", str(prefix_file)]
    args = bench_args("--workload", "sharegpt", *files, "--max-model-len", "256")
    [kind] = BenchConfig.from_args(args).workload.kinds
    assert kind.pairs
    assert max(len(p.prompt_token_ids) + p.output_len for p in kind.pairs) <= 256


def test_bad_sharegpt_flags_fail_before_anything_starts(
    demo_model_dir, prefix_file, tmp_path, capsys
):
    not_an_array = tmp_path / "object.json"
    not_an_array.write_text('{"conversations": []}')
    sharegpt_run = ["--workload", "sharegpt", "--model", str(demo_model_dir)]
    for argv, says in (
        (["--max-model-len", "512"], "go with --workload sharegpt"),
        (["--sharegpt-path", str(not_an_array)], "go with --workload sharegpt"),
        ([*sharegpt_run, "--sharegpt-path", str(tmp_path / "none.json")], "none.json"),
        ([*sharegpt_run, "--sharegpt-path", str(not_an_array)], "not ShareGPT's format"),
        ([*sharegpt_run, "--sharegpt-path", str(prefix_file), "--max-model-len", "7"], "fits"),
    ):
        args = bench_args(*argv)
        assert args.run(args) == 1, argv
        assert says in capsys.readouterr().err, argv
