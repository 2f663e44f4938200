"""A model's shape, as read from its Hugging Face `config.json` (or a GGUF's metadata,
in the same terms). No torch: every process (router, workers, client tools) reads it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.core.checkpoint import find_gguf
from pdserve.core.errors import ModelLoadError
from pdserve.core.gguf_file import GGUFCheckpoint

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
# A config.json without `architectures` names its family by `model_type`, as transformers
# and llama.cpp's converter read it.
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
}


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The subset of a Hugging Face config.json that the Llama family needs."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def load(cls, model: str | Path) -> ModelConfig:
        """The config of what `--model` names: a GGUF file, or a Hugging Face directory."""
        gguf = find_gguf(model)
        if gguf is not None:
            return cls.from_dict(GGUFCheckpoint.open(gguf).hf_config(), source=str(gguf))
        return cls.from_dir(model)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{path}: missing (a model directory needs config.json)")
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{path}: not valid JSON ({exc})") from exc
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        architectures = raw.get("architectures") or []
        arch = architectures[0] if architectures else _MODEL_TYPES.get(raw.get("model_type", ""))
        if arch not in SUPPORTED_ARCHITECTURES:
            named = (
                f"is {architectures!r}"
                if architectures
                else f"is missing and field 'model_type' is {raw.get('model_type')!r}"
            )
            raise ModelLoadError(
                f"{source}: field 'architectures' {named}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        get = _Getter(raw, source)
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"{source}: field 'hidden_act' must be 'silu'")
        num_heads = get.int("num_attention_heads")
        hidden = get.int("hidden_size")
        if "head_dim" in raw and raw["head_dim"] is not None:
            head_dim = get.int("head_dim")
        elif hidden % num_heads == 0:
            head_dim = hidden // num_heads
        else:
            raise ModelLoadError(f"{source}: field 'hidden_size' is not divisible by heads")
        num_kv_heads = get.int("num_key_value_heads", default=num_heads)
        if num_heads % num_kv_heads:
            raise ModelLoadError(
                f"{source}: field 'num_key_value_heads' ({num_kv_heads}) must divide "
                f"num_attention_heads ({num_heads})"
            )
        is_qwen2 = arch == "Qwen2ForCausalLM"
        return cls(
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=get.int("intermediate_size"),
            num_layers=get.int("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            vocab_size=get.int("vocab_size"),
            max_position_embeddings=get.int("max_position_embeddings", default=2048),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=_rope_config(raw, source),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or bool(raw.get("attention_bias", False)),
            sliding_window=_sliding_window(raw, arch),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_as_tuple(raw.get("eos_token_id")),
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token across all layers, per byte of element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


class _Getter:
    def __init__(self, raw: dict[str, Any], source: str):
        self.raw, self.source = raw, source

    def int(self, name: str, default: int | None = None) -> int:
        value = self.raw.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ModelLoadError(f"{self.source}: field '{name}' must be a positive integer")
        return value


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


def _rope_config(raw: dict[str, Any], source: str) -> RopeConfig:
    # transformers 5 writes `rope_parameters`; checkpoints from before write
    # `rope_theta` and `rope_scaling`. Both describe the same thing.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "linear", "llama3"):
        raise ModelLoadError(
            f"{source}: field 'rope_scaling.rope_type' is {kind!r}; "
            "supported: default, linear, llama3"
        )
    if kind == "default":
        return RopeConfig(theta=theta)
    return RopeConfig(
        theta=theta,
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _sliding_window(raw: dict[str, Any], arch: str) -> int | None:
    if arch == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
        return None
    window = raw.get("sliding_window")
    return int(window) if window else None
