"""Load a checkpoint's weights into `LlamaFamilyModel`.

Reads `model.safetensors`, or the shards listed by `model.safetensors.index.json`, or a
GGUF file (its tensors dequantized under Hugging Face names by `core.gguf_file`).
Hugging Face names map onto ours one to one except for the fused projections:
q/k/v_proj -> qkv_proj (concatenated in that order) and gate/up_proj -> gate_up_proj.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from pdserve.core.checkpoint import find_gguf, weight_files
from pdserve.core.errors import ModelLoadError
from pdserve.core.gguf_file import GGUFCheckpoint
from pdserve.core.model_config import ModelConfig
from pdserve.engine.models import LlamaFamilyModel
from pdserve.engine.models.cpu_linear import can_prepack, prepack_linears

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
# Our per-layer parameter -> the Hugging Face tensors it is built from
# (concatenated along dim 0 when there are several).
_LAYER_SOURCES = {
    "qkv_proj.weight": (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ),
    "qkv_proj.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "o_proj.weight": ("self_attn.o_proj.weight",),
    "gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down_proj.weight": ("mlp.down_proj.weight",),
    "input_layernorm.weight": ("input_layernorm.weight",),
    "post_attention_layernorm.weight": ("post_attention_layernorm.weight",),
}


class _Checkpoint:
    """Lazy name -> tensor access across all shards."""

    def __init__(self, files: list[Path]):
        self.files = ", ".join(p.name for p in files)
        self.handles, self.where = [], {}
        for path in files:
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except (SafetensorError, OSError) as exc:
                raise ModelLoadError(f"{path}: not a readable safetensors file ({exc})") from exc
            self.handles.append(handle)
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                self.where[name] = (path, handle)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise ModelLoadError(f"{self.files}: tensor '{name}' is missing")
        return self.where[name][1].get_tensor(name)

    def __contains__(self, name: str) -> bool:
        return name in self.where


class _GGUFTensors:
    """A GGUF's tensors, each dequantized as the model asks for it."""

    def __init__(self, path: Path):
        self.files = path.name
        self.gguf = GGUFCheckpoint.open(path)
        self.names = self.gguf.tensor_names()

    def get(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise ModelLoadError(f"{self.files}: tensor '{name}' is missing")
        return torch.from_numpy(self.gguf.tensor(name))

    def __contains__(self, name: str) -> bool:
        return name in self.names


def _open(model: Path) -> _Checkpoint | _GGUFTensors:
    gguf = find_gguf(model)
    return _Checkpoint(weight_files(model)) if gguf is None else _GGUFTensors(gguf)


def _source_tensor(ckpt: _Checkpoint | _GGUFTensors, name: str) -> torch.Tensor:
    """Our parameter `name` built from the checkpoint's tensors."""
    match = _LAYER.match(name)
    if match is None:
        return ckpt.get(name if name == "lm_head.weight" else "model." + name)
    prefix = f"model.layers.{match.group(1)}."
    parts = [ckpt.get(prefix + part) for part in _LAYER_SOURCES[match.group(2)]]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def load_model(
    model_dir: str | Path,
    config: ModelConfig,
    max_positions: int,
    device: torch.device,
    dtype: torch.dtype,
) -> LlamaFamilyModel:
    model_dir = Path(model_dir)
    ckpt = _open(model_dir)
    with torch.device("meta"):
        model = LlamaFamilyModel(config, max_positions, dtype)
    tied = config.tie_word_embeddings or "lm_head.weight" not in ckpt
    params = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if name == "lm_head.weight" and tied:
            continue
        tensor = _source_tensor(ckpt, name)
        if tuple(tensor.shape) != tuple(param.shape):
            raise ModelLoadError(
                f"{model_dir}: tensor for '{name}' has shape {tuple(tensor.shape)}, "
                f"its config implies {tuple(param.shape)}"
            )
        params[name] = tensor.to(device=device, dtype=dtype)
    if tied:
        params["lm_head.weight"] = params["embed_tokens.weight"]
    model.load_state_dict(params, strict=False, assign=True)
    # Buffers (rope tables) were built on meta; rebuild them for real.
    model.rope = type(model.rope)(config.rope, config.head_dim, max_positions, dtype).to(device)
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    model.eval().requires_grad_(False)
    if can_prepack(device, dtype):
        prepack_linears(model)
    return model
