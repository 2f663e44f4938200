"""Loading checkpoints: sharded files, and errors that name the file and the field."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import write_hf_checkpoint

from pdserve.core.errors import ModelLoadError
from pdserve.core.model_config import ModelConfig
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, demo_model_dir):
    return write_hf_checkpoint(tmp_path_factory.mktemp("llama"), "llama", demo_model_dir)


def test_sharded_checkpoint_gives_the_same_tokens(llama_dir, tmp_path):
    import transformers

    sharded = tmp_path / "sharded"
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    model.save_pretrained(sharded, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama_dir / name, sharded / name)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    prompt = [[5, 17, 99, 300]]
    whole = LLMEngine.from_pretrained(llama_dir).generate(prompt, GREEDY)[0].token_ids
    assert LLMEngine.from_pretrained(sharded).generate(prompt, GREEDY)[0].token_ids == whole


def edited_config(src, tmp_path, **changes):
    out = tmp_path / "model"
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
        ({"num_attention_heads": 0}, "num_attention_heads"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type"),
    ],
)
def test_unsupported_or_malformed_config_names_file_and_field(llama_dir, tmp_path, changes, named):
    with pytest.raises(ModelLoadError) as err:
        ModelConfig.from_dir(edited_config(llama_dir, tmp_path, **changes))
    assert "config.json" in str(err.value) and named in str(err.value)


def test_missing_files_and_tensors_are_named(llama_dir, tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        LLMEngine.from_pretrained(tmp_path)
    no_weights = tmp_path / "no-weights"
    shutil.copytree(llama_dir, no_weights)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        LLMEngine.from_pretrained(no_weights)
    wrong_shape = edited_config(llama_dir, tmp_path, intermediate_size=96)
    with pytest.raises(ModelLoadError, match="gate_up_proj"):
        LLMEngine.from_pretrained(wrong_shape)
