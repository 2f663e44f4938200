"""Structured outputs in the engine, on the tiny random-weight demo model: a token the
constraint rejects is never sampled (greedy or drawn), constrained and free rows share a
batch without touching each other, a constraint that completes ends its request, and a
decode engine rebuilds the matcher from the first token a prefill engine sampled.

A random model writes garbage unconstrained, so every valid output here is the mask's."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
import torch
from test_kv_export_import import prefill_and_export

from pdserve.core.errors import InvalidRequestError
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.structured_output import MAX_CONSTRAINT_BYTES, Constraint, ConstraintKind
from pdserve.engine.grammar import COMPILE_THREADS, GrammarCompiler
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampler import Sampler, SamplingState

REGEX = "[a-z]{3,8}( [a-z]{2,5}){2}"
WORDS = Constraint(ConstraintKind.REGEX, REGEX)
YES_NO = Constraint(ConstraintKind.CHOICE, choices=("yes", "no way"))
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["n"],
    "additionalProperties": False,
}
NUMBER = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA))
PROMPT = "The quick brown fox"
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def engine(demo_model_dir):
    return LLMEngine.from_pretrained(demo_model_dir, num_kv_blocks=NUM_BLOCKS)


def params(constraint=None, temperature=0.0, seed=None, max_tokens=40) -> SamplingParams:
    return SamplingParams(
        temperature=temperature, seed=seed, max_tokens=max_tokens, constraint=constraint
    )


def allowed_tokens(compiler: GrammarCompiler, constraint: Constraint) -> set[int]:
    """The tokens the grammar allows first, read from llguidance's own bitmask."""
    native = compiler.matcher(constraint, "c").native
    mask = torch.frombuffer(bytearray(native.compute_bitmask()), dtype=torch.uint8)
    bits = (mask.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
    return set(torch.nonzero(bits.flatten()).flatten().tolist())


def test_the_sampler_never_picks_a_token_the_grammar_rejects(engine):
    compiler, vocab_size = engine.grammars, engine.model_config.vocab_size
    allowed = allowed_tokens(compiler, WORDS)
    assert 0 < len(allowed) < vocab_size // 2
    logits = torch.randn(64, vocab_size, generator=torch.Generator().manual_seed(0)) * 4
    sampler = Sampler(torch.Generator().manual_seed(0))
    for temperature in (0.0, 1.0, 2.0):
        free = [SamplingState(params(temperature=temperature), [1], []) for _ in range(64)]
        unconstrained = sampler(logits, free).token_ids
        assert sum(t not in allowed for t in unconstrained) > 32  # the logits prefer others
        states = [
            SamplingState(
                params(WORDS, temperature), [1], [], None, (), compiler.matcher(WORDS, "c")
            )
            for _ in range(64)
        ]
        assert set(sampler(logits, states).token_ids) <= allowed


def test_constrained_outputs_match_greedy_and_sampled(engine):
    for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2), (1.5, 3)):
        [words, choice, number] = engine.generate(
            [PROMPT] * 3, [params(c, temperature, seed) for c in (WORDS, YES_NO, NUMBER)]
        )
        assert re.fullmatch(REGEX, words.text), words.text
        assert choice.text in ("yes", "no way")
        value = json.loads(number.text)
        assert value.keys() == {"n"} and 0 <= value["n"] <= 99
        for out in (words, choice, number):
            assert out.finish_reason == "stop"  # the constraint completed: nothing may follow
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS


def test_without_the_constraint_the_model_writes_no_json(engine):
    outs = engine.generate([PROMPT] * 4, [params(None, 1.0, seed) for seed in range(4)])
    for out in outs:
        with pytest.raises(ValueError):
            json.loads(out.text)


def test_free_rows_beside_constrained_ones_sample_what_they_sample_alone(engine):
    alone = engine.generate([PROMPT, "jumps over"], [params(None), params(None, 1.0, 5)])
    mixed = engine.generate(
        [PROMPT, PROMPT, "jumps over", PROMPT],
        [params(NUMBER), params(None), params(None, 1.0, 5), params(WORDS, 1.0, 9)],
    )
    assert [m.token_ids for m in (mixed[1], mixed[2])] == [a.token_ids for a in alone]
    assert json.loads(mixed[0].text)["n"] >= 0 and re.fullmatch(REGEX, mixed[3].text)


def test_a_decode_engine_rebuilds_the_matcher_from_the_first_token(demo_model_dir, engine):
    sampled = params(NUMBER, 1.0, seed=11)
    prompt = engine.tokenizer.encode(PROMPT)
    [expected] = engine.generate([prompt], sampled)
    prefill = LLMEngine.from_pretrained(demo_model_dir)
    first, chunks = prefill_and_export(prefill, prompt, sampled)
    decode = LLMEngine.from_pretrained(demo_model_dir, num_kv_blocks=NUM_BLOCKS)
    decode.reserve_kv(prompt, sampled, "r")
    for chunk in chunks:
        decode.import_kv("r", chunk)
    decode.commit_kv("r", first)
    tokens = [first]
    while decode.has_unfinished_requests():
        tokens += [t for d in decode.step() for t in d.token_ids]
    assert tokens == expected.token_ids
    json.loads(decode.tokenizer.decode(tokens))


def test_a_first_token_outside_the_constraint_is_refused_and_frees_its_blocks(demo_model_dir):
    decode = LLMEngine.from_pretrained(demo_model_dir, num_kv_blocks=NUM_BLOCKS)
    prompt = decode.tokenizer.encode(PROMPT)
    not_json = decode.tokenizer.encode("x", add_special_tokens=False)[0]
    decode.reserve_kv(prompt, params(NUMBER), "r")
    with pytest.raises(InvalidRequestError) as exc:
        decode.commit_kv("r", not_json)
    assert exc.value.field == "first_token_id"
    assert decode.block_manager.num_free_blocks == NUM_BLOCKS
    assert not decode.has_unfinished_requests()


@pytest.mark.parametrize(
    ("constraint", "field"),
    [
        (Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "nope"}'), "json_schema"),
        (Constraint(ConstraintKind.JSON_SCHEMA, "{not json"), "json_schema"),
        (Constraint(ConstraintKind.JSON_SCHEMA, "[1, 2]"), "json_schema"),
        (Constraint(ConstraintKind.REGEX, "[a-"), "regex"),
        (Constraint(ConstraintKind.REGEX, ""), "regex"),
        (Constraint(ConstraintKind.GRAMMAR, "start: undefined_rule"), "grammar"),
        (Constraint(ConstraintKind.GRAMMAR, 'a ::= "b"'), "grammar"),  # GBNF with no root
        (Constraint(ConstraintKind.CHOICE), "choice"),
        (Constraint(ConstraintKind.CHOICE, choices=("a", "")), "choice[1]"),
        (Constraint(ConstraintKind.REGEX, "a" * (MAX_CONSTRAINT_BYTES + 1)), "regex"),
    ],
)
def test_a_bad_constraint_is_an_error_naming_its_field_and_reserves_nothing(
    engine, constraint, field
):
    for call in (
        lambda: engine.add_request(PROMPT, params(constraint)),
        lambda: engine.reserve_kv([5, 6, 7], params(constraint), "bad"),
    ):
        with pytest.raises(InvalidRequestError) as exc:
            call()
        assert exc.value.field == f"sampling_params.{field}"
        assert "Traceback" not in exc.value.message and "\n" not in exc.value.message
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS


def test_a_grammar_in_gbnf_or_lark_constrains_alike(engine):
    for text in ('root ::= "ab" [0-9]+ "."', 'start: "ab" /[0-9]+/ "."'):
        grammar = Constraint(ConstraintKind.GRAMMAR, text)
        [out] = engine.generate([PROMPT], params(grammar, 1.0, seed=4, max_tokens=12))
        assert re.fullmatch(r"ab[0-9]+\.?", out.text), out.text


def test_a_constraint_slower_to_compile_than_the_bound_is_refused(engine):
    """The compile threads held busy (as by a pathological schema): a new constraint is
    refused once the bound passes, instead of holding its caller."""
    compiler = GrammarCompiler(
        engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids, timeout_s=0.2
    )
    compiler.tokenizer  # noqa: B018  (built once, apart from any compile's bound)
    held = threading.Event()
    blockers = [compiler._pool.submit(held.wait) for _ in range(COMPILE_THREADS)]
    try:
        started = time.monotonic()
        with pytest.raises(InvalidRequestError, match="longer than 200 ms") as exc:
            compiler.check(NUMBER, "response_format")
        assert exc.value.field == "response_format"
        assert time.monotonic() - started < 2.0
    finally:
        held.set()
    for blocker in blockers:
        blocker.result()
    compiler.check(NUMBER, "response_format")  # free again: it compiles


def test_each_constraint_compiles_once_and_the_cache_is_bounded(engine):
    compiler = GrammarCompiler(
        engine.tokenizer,
        engine.model_config.vocab_size,
        engine.eos_token_ids,
        cache_size=2,
    )
    first = compiler._compiled(WORDS, "c")
    assert compiler._compiled(WORDS, "c") is first
    compiler.check(YES_NO, "c")
    compiler.check(NUMBER, "c")
    assert len(compiler._cache) == 2 and compiler._compiled(WORDS, "c") is not first


def test_a_preempted_constrained_request_resumes_its_grammar_where_it_was(demo_model_dir):
    """Recomputed after preemption, a request samples on from the matcher's state: its
    output is what it is alone, and still matches."""
    long_words = Constraint(ConstraintKind.REGEX, "[a-z]{40,60}")
    prompts = [[(11 * i + 7 * j) % 900 + 3 for j in range(30)] for i in range(6)]
    asked = params(long_words, max_tokens=60)
    roomy = LLMEngine.from_pretrained(demo_model_dir, num_kv_blocks=NUM_BLOCKS)
    alone = [roomy.generate([p], asked)[0].text for p in prompts]
    tight = LLMEngine.from_pretrained(demo_model_dir, num_kv_blocks=12)
    together = [out.text for out in tight.generate(prompts, asked)]
    assert tight.scheduler.num_preemptions > 0
    assert together == alone
    assert all(re.fullmatch("[a-z]{40,60}", text) for text in together)
