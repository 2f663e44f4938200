import json
import random

import pytest
import tokenizers
from tokenizers import decoders, models, normalizers, processors, trainers

from pdserve.core.errors import InvalidRequestError, ModelLoadError
from pdserve.engine.demo_model import BOS_TOKEN_ID, EOS_TOKEN_ID, demo_corpus, write_demo_model
from pdserve.engine.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer

MULTIBYTE_TEXT = "Prefill then decode: héllo 世界 🙂, naïve café ∑ 𝔘 — done."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("demo"), size="tiny")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_dir(model_dir)


def detokenize(tokenizer, prompt_ids, output_ids, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    deltas = [detok.push(token_id) for token_id in output_ids]
    return deltas, detok.flush()


def sentencepiece_style_tokenizer() -> Tokenizer:
    """A Llama 2 style BPE: "▁" marks spaces, byte fallback, first-token space stripped."""
    backend = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace(prepend_scheme="never")
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    backend.train_from_iterator(demo_corpus().splitlines(), trainer=trainer)
    # rebuild the model with the 256 byte tokens and byte fallback, as Llama 2 ships it
    trained = json.loads(backend.to_str())["model"]
    vocab = dict(trained["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) for m in trained["merges"]]
    backend.model = models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True)
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return Tokenizer(backend, eos_token_ids=frozenset({2}), bos_token_id=1)


# --- Tokenizer ---------------------------------------------------------------------------


def test_encode_prepends_bos_and_decode_round_trips(tokenizer):
    ids = tokenizer.encode(MULTIBYTE_TEXT)
    assert ids[0] == BOS_TOKEN_ID == tokenizer.bos_token_id
    assert tokenizer.decode(ids) == MULTIBYTE_TEXT
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<s>" + MULTIBYTE_TEXT


def test_demo_tokenizer_properties(tokenizer):
    assert 900 <= tokenizer.vocab_size <= 1000
    assert tokenizer.eos_token_ids == frozenset({EOS_TOKEN_ID})


def test_decode_ignores_ids_beyond_the_tokenizer_vocab(tokenizer):
    ids = tokenizer.encode("hello")[1:]
    assert tokenizer.decode([*ids, tokenizer.vocab_size + 7]) == "hello"


def test_eos_ids_union_generation_config_list_and_tokenizer_eos(model_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == frozenset({5, 7, EOS_TOKEN_ID})


def test_eos_falls_back_to_config_json(model_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 9, "bos_token_id": 4}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token_ids == frozenset({9})
    assert tok.bos_token_id == 4


def test_missing_tokenizer_json_names_the_file(tmp_path):
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_malformed_tokenizer_json_names_the_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_bad_eos_field_names_file_and_field(model_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(ModelLoadError, match=r"generation_config\.json.*eos_token_id"):
        Tokenizer.from_dir(tmp_path)


# --- IncrementalDetokenizer ----------------------------------------------------------------


def test_detokenizer_matches_full_decode_on_multibyte_text(tokenizer):
    prompt = tokenizer.encode("Say it:")
    output = tokenizer.encode(MULTIBYTE_TEXT)[1:]
    deltas, rest = detokenize(tokenizer, prompt, output)
    assert rest == ""
    assert "".join(deltas) == tokenizer.decode(output) == MULTIBYTE_TEXT
    assert all("\ufffd" not in delta for delta in deltas)  # no split character ever emitted
    assert sum(1 for delta in deltas if delta == "") > 0  # multi-token characters were held


def random_prompt(tokenizer, rng):
    """A prompt from text, so it never ends inside a UTF-8 character as random ids can."""
    corpus = demo_corpus()
    start = rng.randrange(len(corpus) - 40)
    return tokenizer.encode(corpus[start : start + rng.randrange(40)])


def test_detokenizer_matches_full_decode_on_random_sequences(tokenizer):
    # random ids include lone UTF-8 lead and continuation bytes: invalid text, which must
    # still come out exactly as a full decode renders it
    rng = random.Random(0)
    for _ in range(300):
        prompt = random_prompt(tokenizer, rng)
        output = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))]
        deltas, rest = detokenize(tokenizer, prompt, output)
        assert "".join(deltas) + rest == tokenizer.decode(output), (prompt, output)


def test_detokenizer_keeps_special_tokens_when_asked(tokenizer):
    output = tokenizer.encode("hi")[1:] + [EOS_TOKEN_ID]
    deltas, rest = detokenize(tokenizer, [], output, skip_special_tokens=False)
    assert "".join(deltas) + rest == "hi</s>"


class DecodeSpy(Tokenizer):
    """Records the longest id sequence decoded: the detokenizer's cost per token."""

    max_decoded = 0

    def decode(self, ids, skip_special_tokens=True):
        self.max_decoded = max(self.max_decoded, len(ids))
        return super().decode(ids, skip_special_tokens)


def test_detokenizer_cost_per_token_does_not_grow_with_output(tokenizer, model_dir):
    spy = DecodeSpy.from_dir(model_dir)
    output = tokenizer.encode(MULTIBYTE_TEXT * 30)[1:]
    deltas, _ = detokenize(spy, tokenizer.encode("x" * 100), output)
    assert "".join(deltas) == MULTIBYTE_TEXT * 30
    assert spy.max_decoded <= 12


def test_detokenizer_emits_long_runs_of_invalid_bytes_and_special_tokens(tokenizer, model_dir):
    # held text is released after a few tokens so the window stays bounded
    lone_byte = next(i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]) == "\ufffd")
    spy = DecodeSpy.from_dir(model_dir)
    output = [lone_byte] * 50 + [EOS_TOKEN_ID] * 50 + tokenizer.encode("ok")[1:]
    deltas, rest = detokenize(spy, [], output)
    assert "".join(deltas) + rest == "\ufffd" * 50 + "ok"
    assert spy.max_decoded <= 12


def test_detokenizer_keeps_sentencepiece_spaces():
    tok = sentencepiece_style_tokenizer()
    prompt = tok.encode("The cache holds")
    output = tok.encode("the keys and values. " + MULTIBYTE_TEXT)[1:]  # "▁the", ...
    assert tok.decode(prompt + output).startswith("The cache holds the keys")
    assert tok.decode(output[:1]) == "the"  # decoded alone, the first token loses its space
    deltas, rest = detokenize(tok, prompt, output)
    full = tok.decode(prompt + output)
    assert "".join(deltas) + rest == full[len(tok.decode(prompt)) :]
    assert "".join(deltas).startswith(" the keys and values. Prefill")
    assert "".join(deltas).endswith(MULTIBYTE_TEXT)


def test_detokenizer_sentencepiece_random_sequences():
    # Random pieces and whole byte-encoded characters. Random lone byte tokens are left out:
    # ByteFallback renders a run of bytes as replacement characters when any byte in the run
    # is invalid, so a later byte can change text already decoded, which no stream can match.
    tok = sentencepiece_style_tokenizer()
    pieces = [[i] for i in range(3, tok.vocab_size) if "\ufffd" not in tok.decode([i])]
    pieces += [tok.encode(ch)[2:] for ch in "é世界🙂∑𝔘—"]  # [<s>, "▁", bytes...]
    rng = random.Random(1)
    for _ in range(200):
        prompt = tok.encode("Hello")
        output = [i for _ in range(rng.randrange(1, 30)) for i in rng.choice(pieces)]
        deltas, rest = detokenize(tok, prompt, output)
        assert rest == ""
        full = tok.decode(prompt + output)
        assert "".join(deltas) == full[len(tok.decode(prompt)) :], output


# --- StopStringMatcher ---------------------------------------------------------------------


def feed_all(matcher, deltas):
    emitted = []
    for delta in deltas:
        text, stopped = matcher.feed(delta)
        emitted.append(text)
        if stopped:
            return "".join(emitted), True
    return "".join(emitted), False


def test_stop_string_across_tokens_is_never_emitted():
    matcher = StopStringMatcher(["STOP here"])
    outputs = [matcher.feed(d) for d in ["abc ST", "OP", " he", "re and more"]]
    assert outputs == [("abc ", False), ("", False), ("", False), ("", True)]
    assert matcher.stopped
    assert matcher.feed("later") == ("", True)


def test_held_back_text_is_released_when_it_cannot_be_a_stop():
    matcher = StopStringMatcher(["</end>"])
    assert matcher.feed("a </e") == ("a ", False)
    assert matcher.feed("xtra") == ("</extra", False)


def test_held_back_text_is_flushed_when_output_ends_without_a_stop():
    matcher = StopStringMatcher(["\n\nUser:"])
    text, stopped = feed_all(matcher, ["Answer.", "\n", "\nUs"])
    assert (text, stopped) == ("Answer.", False)
    assert matcher.flush() == "\n\nUs"
    assert matcher.flush() == ""


def test_earliest_stop_string_wins():
    matcher = StopStringMatcher(["world", "lo"])
    assert feed_all(matcher, ["hel", "lo wor", "ld"]) == ("hel", True)


def test_stop_that_completes_first_wins_however_the_text_is_split():
    stops = ["abcd", "bc"]
    one_delta = feed_all(StopStringMatcher(stops), ["xabcd"])
    char_by_char = feed_all(StopStringMatcher(stops), list("xabcd"))
    assert one_delta == char_by_char == ("xa", True)


def test_stop_matcher_on_detokenized_stream(tokenizer):
    output = tokenizer.encode("The prefill is done. 世界 STOP ignored")[1:]
    detok = IncrementalDetokenizer(tokenizer, [])
    matcher = StopStringMatcher(["界 ST"])
    text, stopped = feed_all(matcher, [detok.push(t) for t in output])
    assert (text, stopped) == ("The prefill is done. 世", True)


def test_empty_stop_string_is_invalid():
    with pytest.raises(InvalidRequestError, match=r"stop\[1\]"):
        StopStringMatcher(["ok", ""])
