"""GGUF checkpoints: pdserve reads llama.cpp's one-file format as it reads a Hugging Face
directory. Oracles: the same model's safetensors (for an unquantized GGUF, which must be
token-identical) and transformers' own GGUF loading (for quantized ones)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf_support import write_gguf, write_sentencepiece_gguf

from pdserve.core.checkpoint import find_gguf, model_fingerprint, served_name
from pdserve.core.errors import ModelLoadError
from pdserve.core.model_config import ModelConfig
from pdserve.engine import LLMEngine, SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateways.chat_template import ChatTemplate

pytestmark = pytest.mark.cluster

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 5, 9, 300, 42, 7], list(range(3, 40)), [1, 17]]
TEXTS = [
    "Hello there, the year 2024 had 12,345 days!\n\n1. a list",
    "def f(x):\n    return x ** 2  # émoji 🤖 and 世界",
    "   leading spaces and trailing   ",
    "<s> specials </s> inside text",
]


def assert_same_config(ours: ModelConfig, theirs: ModelConfig) -> None:
    """Equal, but for the floats GGUF stores in float32 (the norm's epsilon, rope's base)."""
    approx = {"rms_norm_eps": theirs.rms_norm_eps, "rope": theirs.rope}
    assert replace(ours, **approx) == theirs
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps, rel=1e-6)
    assert ours.rope.theta == pytest.approx(theirs.rope.theta, rel=1e-6)


def generate(model, prompts=PROMPTS) -> list[list[int]]:
    engine = LLMEngine.from_pretrained(model, dtype="float32", num_kv_blocks=64)
    return [out.token_ids for out in engine.generate(prompts, GREEDY)]


def transformers_generate(path, prompts=PROMPTS) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    outs = []
    for prompt in prompts:
        ids = model.generate(
            torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False
        )
        outs.append(ids[0, len(prompt) :].tolist())
    return outs


@pytest.fixture(scope="module")
def f32_gguf(demo_model_dir, tmp_path_factory):
    return write_gguf(demo_model_dir, tmp_path_factory.mktemp("gguf") / "demo-tiny.F32.gguf")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_an_unquantized_gguf_generates_what_its_safetensors_generate(
    arch, demo_model_dir, tmp_path
):
    """Holds the Q/K rows llama.cpp permutes (Llama, Mistral) and those it leaves (Qwen2,
    with biases and tied embeddings) to the checkpoint they were converted from."""
    from conftest import write_hf_checkpoint

    hf_dir = write_hf_checkpoint(tmp_path / arch, arch, demo_model_dir)
    path = write_gguf(hf_dir, tmp_path / f"{arch}.gguf")
    expected = ModelConfig.load(hf_dir)
    if arch == "mistral":  # llama.cpp writes Mistral as Llama (its window spans the context)
        expected = replace(expected, architecture="LlamaForCausalLM", sliding_window=None)
    assert_same_config(ModelConfig.load(path), expected)
    assert generate(path) == generate(hf_dir)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16", "BF16"])
def test_a_quantized_gguf_generates_what_transformers_generates_from_it(
    qtype, demo_model_dir, tmp_path
):
    path = write_gguf(demo_model_dir, tmp_path / f"demo.{qtype}.gguf", qtype)
    assert generate(path) == transformers_generate(path)


def test_the_config_comes_from_the_metadata(f32_gguf, demo_model_dir):
    ours = ModelConfig.load(f32_gguf)
    theirs = transformers.AutoConfig.from_pretrained(f32_gguf.parent, gguf_file=f32_gguf.name)
    assert_same_config(ours, ModelConfig.load(demo_model_dir))
    assert (ours.num_layers, ours.num_heads, ours.num_kv_heads, ours.head_dim) == (
        theirs.num_hidden_layers,
        theirs.num_attention_heads,
        theirs.num_key_value_heads,
        theirs.head_dim,
    )
    assert ours.rope.theta == theirs.rope_parameters["rope_theta"]


def test_the_tokenizer_comes_from_the_metadata(f32_gguf, demo_model_dir):
    ours, original = Tokenizer.load(f32_gguf), Tokenizer.load(demo_model_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(f32_gguf.parent, gguf_file=f32_gguf.name)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == original.encode(text) == theirs(text).input_ids
        assert ours.decode(ids) == original.decode(ids)
    assert ours.eos_token_ids == original.eos_token_ids
    assert ours.bos_token_id == original.bos_token_id


def test_the_chat_template_comes_from_the_metadata(f32_gguf, demo_model_dir):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    ours, original = ChatTemplate.load(f32_gguf), ChatTemplate.load(demo_model_dir)
    assert ours.render(messages) == original.render(messages)
    assert ours.prompt_ids(messages) == original.prompt_ids(messages)


def test_a_directory_holding_one_gguf_names_it(f32_gguf):
    assert find_gguf(f32_gguf.parent) == f32_gguf
    assert find_gguf(f32_gguf) == f32_gguf
    (f32_gguf.parent / "other.gguf").write_bytes(f32_gguf.read_bytes())
    try:
        with pytest.raises(ModelLoadError, match="several GGUF files"):
            find_gguf(f32_gguf.parent)
    finally:
        (f32_gguf.parent / "other.gguf").unlink()


def test_the_served_name_drops_the_quantization():
    assert served_name("/m/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct"
    assert served_name("/m/model.gguf") == "model"
    assert served_name("/m/Llama-3.2-1B") == "Llama-3.2-1B"


def test_the_fingerprint_tells_quantizations_apart_and_agrees_on_one(demo_model_dir, tmp_path):
    q8 = write_gguf(demo_model_dir, tmp_path / "a.Q8_0.gguf", "Q8_0")
    q8_again = write_gguf(demo_model_dir, tmp_path / "b.Q8_0.gguf", "Q8_0")
    q4 = write_gguf(demo_model_dir, tmp_path / "c.Q4_0.gguf", "Q4_0")
    assert model_fingerprint(q8) == model_fingerprint(q8_again)
    assert model_fingerprint(q8) != model_fingerprint(q4)
    assert model_fingerprint(q8) != model_fingerprint(demo_model_dir)


def write_bare_gguf(path, arch: str, tensor_type: str = "F32"):
    """A file with one tensor and nothing else: enough to be refused by."""
    writer = gguf.GGUFWriter(path, arch)
    kind = gguf.GGMLQuantizationType[tensor_type]
    block, size = gguf.GGML_QUANT_SIZES[kind]
    if kind == gguf.GGMLQuantizationType.F32:
        writer.add_tensor("token_embd.weight", np.zeros((4, 256), dtype=np.float32))
    else:
        data = np.zeros((4, 256 // block * size), dtype=np.uint8)
        writer.add_tensor("token_embd.weight", data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_architecture_not_served_is_refused_naming_it(tmp_path):
    path = write_bare_gguf(tmp_path / "gpt2.gguf", "gpt2")
    with pytest.raises(ModelLoadError, match="architecture 'gpt2' is not served"):
        ModelConfig.load(path)


def test_a_tensor_type_not_served_is_refused_naming_it(tmp_path):
    path = write_bare_gguf(tmp_path / "ternary.gguf", "llama", "TQ1_0")
    with pytest.raises(ModelLoadError, match="'token_embd.weight' has type TQ1_0"):
        ModelConfig.load(path)


def test_a_worker_given_a_gguf_it_cannot_serve_exits_with_one_line(tmp_path):
    path = write_bare_gguf(tmp_path / "gpt2.gguf", "gpt2")
    command = [sys.executable, "-m", "pdserve", "serve", "decode", "--model", str(path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert "architecture 'gpt2' is not served" in done.stderr.strip().splitlines()[-1]


def train_sentencepiece(corpus: list[str]) -> bytes:
    """A BPE SentencePiece model as Llama 2's is trained: byte fallback, digits apart, no
    normalization, a space put before the text."""
    import io

    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus),
        model_writer=model,
        vocab_size=600,
        model_type="bpe",
        byte_fallback=True,
        split_digits=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    return model.getvalue()


def test_a_sentencepiece_vocabulary_tokenizes_as_sentencepiece_does(tmp_path):
    """SentencePiece itself is the oracle here: transformers' GGUF tokenizer cuts a run of
    spaces differently from it ("   leading" -> three pieces against SentencePiece's two).
    Special tokens written in the text are left out: pdserve matches them whole, as
    transformers does, where SentencePiece reads them as text."""
    import sentencepiece

    from pdserve.engine import demo_model

    corpus = (Path(demo_model.__file__).parent / "demo_corpus.txt").read_text().splitlines()
    proto = train_sentencepiece(corpus)
    path = write_sentencepiece_gguf(tmp_path / "spm.gguf", proto)
    reference = sentencepiece.SentencePieceProcessor(model_proto=proto)
    ours = Tokenizer.load(path)
    texts = [t for t in TEXTS if "<s>" not in t]
    for text in [*texts, *corpus[:50], "a\nb\n\n  c", "x" * 40, "ünïcödé ∑ 📦"]:
        ids = ours.encode(text)
        assert ids == [reference.bos_id(), *reference.encode(text)], text
        assert ours.decode(ids) == reference.decode(ids[1:])
    assert ours.bos_token_id == reference.bos_id()
    assert ours.eos_token_ids == {reference.eos_id()}
