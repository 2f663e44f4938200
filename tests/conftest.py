"""Shared fixtures: a real Redis (REDIS_URL or a private server), never a fake."""

from __future__ import annotations

import os

import pytest
import redis

from pdserve.state.redis_server import redis_url as _redis_url

# The suite's routers send every prompt to the prefill pool (plain disaggregation), so that
# its short test prompts take the KV path they test; by default a router prefills a short
# prompt on its decode worker when that is faster. The live decision's own tests ask for it
# (`--prefill-placement live`: tests/test_disaggregation_policy.py). Children inherit it.
os.environ.setdefault("PDSERVE_PREFILL_PLACEMENT", "remote")

# The suite's workers keep 4 KiB pages. Huge pages (a worker's default: engine/huge_pages.py)
# made each worker start 1-2 s later on the 2-core VMs, its 1 GiB KV cache zeroed in 2 MiB
# faults, and the suite starts many workers. Their own tests ask for the default
# (tests/test_huge_pages.py). Children inherit it.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "0")

# The suite's engines compute in float32 on every machine: its token-identity tests hold
# them to transformers' fp32 output. `--dtype auto`, the default, is bfloat16 on a CPU
# with AMX or AVX512-BF16; its own tests ask for it (tests/test_dtype.py). Children
# inherit the variable; engines in this process get `float32_engines` below.
os.environ.setdefault("PDSERVE_DTYPE", "float32")


@pytest.fixture(scope="session", autouse=True)
def float32_engines():
    """`auto` means float32 for the engines the tests build in process."""
    from pdserve.engine import config

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(config, "native_dtype", lambda device: "float32")
        yield


@pytest.fixture(scope="session")
def redis_url():
    with _redis_url() as url:
        yield url


@pytest.fixture
def redis_client(redis_url):
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


# -- tiny random-weight checkpoints, written by transformers (the reference) ---------------

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
ARCHITECTURES = {
    # name: (transformers classes, config overrides)
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "num_key_value_heads": 2,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
        },
    ),
    "llama_mha_headdim": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "num_key_value_heads": 4,
            "head_dim": 24,
        },
    ),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {
            "num_key_value_heads": 1,
            "tie_word_embeddings": True,
        },
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        {
            "num_key_value_heads": 2,
            "sliding_window": 4096,
            "head_dim": 16,
        },
    ),
}


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory):
    """The tiny demo model (Llama), as `pdserve demo-model --size tiny` writes it."""
    from pdserve.engine.demo_model import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("demo") / "tiny", size="tiny", seed=0)


def write_hf_checkpoint(out_dir, arch: str, tokenizer_dir, seed: int = 0, **overrides):
    """Save a random-weight model of `arch` with transformers, plus the demo tokenizer."""
    import shutil

    import torch
    import transformers

    config_cls, model_cls, arch_overrides = ARCHITECTURES[arch]
    settings = {
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 1024,
        "max_position_embeddings": 4096,
        "bos_token_id": 1,
        "eos_token_id": 2,
        **arch_overrides,
        **overrides,
    }
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**settings)
    model = getattr(transformers, model_cls)(config).eval()
    model.save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


@pytest.fixture(scope="session", params=sorted(ARCHITECTURES))
def hf_checkpoint(request, tmp_path_factory, demo_model_dir):
    """(architecture name, checkpoint dir) for each supported architecture."""
    out = tmp_path_factory.mktemp(request.param)
    return request.param, write_hf_checkpoint(out, request.param, demo_model_dir)
