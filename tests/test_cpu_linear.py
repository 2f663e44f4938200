"""Prepacked CPU linears compute what `nn.Linear` computes, and apply only where they can."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pdserve.core.model_config import ModelConfig
from pdserve.engine.loader import load_model
from pdserve.engine.models.cpu_linear import PrepackedLinear, can_prepack, prepack_linears

pytestmark = pytest.mark.skipif(
    not can_prepack(torch.device("cpu"), torch.float32), reason="this torch has no oneDNN"
)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_matches_nn_linear(rows, bias):
    torch.manual_seed(0)
    dense = nn.Linear(96, 40, bias=bias)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        torch.testing.assert_close(PrepackedLinear(dense)(x), dense(x), atol=1e-5, rtol=1e-5)


def test_prepack_replaces_every_linear_and_keeps_the_embedding_dense():
    model = nn.ModuleDict(
        {
            "embed": nn.Embedding(10, 8),
            "block": nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)),
            "head": nn.Linear(8, 10, bias=False),
        }
    )
    model["head"].weight = model["embed"].weight  # tied, as in Qwen2
    prepack_linears(model)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert sum(isinstance(m, PrepackedLinear) for m in model.modules()) == 3
    assert model["embed"].weight.layout == torch.strided


def test_only_cpu_float32_and_bfloat16_are_packed():
    assert can_prepack("cpu", torch.float32)
    assert not can_prepack("cpu", torch.float16)
    assert not can_prepack(torch.device("cuda"), torch.float32)
    assert not can_prepack("meta", torch.float32)


def test_the_loader_packs_cpu_float32_models(demo_model_dir):
    config = ModelConfig.from_dir(demo_model_dir)
    model = load_model(demo_model_dir, config, 64, torch.device("cpu"), torch.float32)
    assert isinstance(model.lm_head, PrepackedLinear)
    assert isinstance(model.layers[0].qkv_proj, PrepackedLinear)
