import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve.engine.demo_model import (
    demo_config,
    num_parameters,
    parameter_shapes,
    train_demo_tokenizer,
    write_demo_model,
)
from pdserve.engine.tokenizer import Tokenizer

pytestmark = pytest.mark.cluster

FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
]
TEXTS = ["Hello world", "The KV cache holds keys and values.", "héllo 世界 🙂", "", "  two  spaces"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("tiny"), size="tiny", seed=0)


def test_writes_every_file_of_a_hugging_face_checkpoint(model_dir):
    for name in FILES:
        assert (model_dir / name).is_file(), name
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"]) == (64, 2)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["vocab_size"] == 1024
    generation_config = json.loads((model_dir / "generation_config.json").read_text())
    assert generation_config["eos_token_id"] == config["eos_token_id"] == 2


def test_transformers_loads_it_with_our_weights_unchanged(model_dir):
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set()
    ours = load_file(model_dir / "model.safetensors")
    theirs = model.state_dict()
    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def test_weights_are_random_normal_and_norms_ones(model_dir):
    weights = load_file(model_dir / "model.safetensors")
    assert torch.equal(weights["model.norm.weight"], torch.ones(64))
    embed = weights["model.embed_tokens.weight"]
    assert abs(embed.std().item() - 0.02) < 0.002
    assert not torch.equal(embed, weights["lm_head.weight"])  # untied


def test_transformers_tokenizer_encodes_and_decodes_like_ours(model_dir):
    theirs = AutoTokenizer.from_pretrained(model_dir)
    ours = Tokenizer.from_dir(model_dir)
    for text in TEXTS:
        ids = ours.encode(text)
        assert theirs(text)["input_ids"] == ids, text
        assert theirs.decode(ids, skip_special_tokens=True) == ours.decode(ids) == text
    assert ours.eos_token_ids == {theirs.eos_token_id}
    assert ours.bos_token_id == theirs.bos_token_id


def test_same_seed_gives_identical_bytes(model_dir, tmp_path):
    again = write_demo_model(tmp_path / "again", size="tiny", seed=0)
    for name in FILES:
        assert (again / name).read_bytes() == (model_dir / name).read_bytes(), name


def test_other_seed_gives_other_weights_same_tokenizer(model_dir, tmp_path):
    other = write_demo_model(tmp_path / "other", size="tiny", seed=1)
    assert (other / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    ours = load_file(model_dir / "model.safetensors")["model.embed_tokens.weight"]
    theirs = load_file(other / "model.safetensors")["model.embed_tokens.weight"]
    assert not torch.equal(ours, theirs)


def test_small_config_is_the_55m_benchmark_model():
    tokenizer = train_demo_tokenizer(4096)
    assert 3000 <= tokenizer.get_vocab_size() <= 4096
    config = demo_config("small", tokenizer.get_vocab_size())
    assert config["vocab_size"] == 32000  # padded far beyond the tokenizer, like real vocabs
    assert (config["hidden_size"], config["intermediate_size"]) == (512, 1408)
    assert (config["num_hidden_layers"], config["num_attention_heads"]) == (8, 8)
    assert config["num_key_value_heads"] == 2 and config["head_dim"] == 64
    assert num_parameters(config) == 55_321_088


def test_parameter_count_matches_transformers(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    shapes = parameter_shapes(config)
    assert {name: tuple(p.shape) for name, p in model.named_parameters()} == shapes
    assert num_parameters(config) == sum(p.numel() for p in model.parameters())


def test_vocab_is_padded_to_a_multiple_of_64():
    assert demo_config("tiny", 1000)["vocab_size"] == 1024
    assert demo_config("tiny", 1500)["vocab_size"] == 1536


def test_cli_writes_the_same_model_in_a_fresh_process(model_dir, tmp_path):
    # also shows training does not depend on the Rust side's per-process hash seeds
    out = tmp_path / "cli"
    subprocess.run(
        [sys.executable, "-m", "pdserve", "demo-model", "--out", str(out), "--size", "tiny"],
        check=True,
        capture_output=True,
    )
    for name in FILES:
        assert (out / name).read_bytes() == (model_dir / name).read_bytes(), name
