"""A GGUF checkpoint (llama.cpp's one-file format), read through the `gguf` package.

What pdserve needs of one, in the Hugging Face terms the rest of the tree speaks: the
config (`hf_config`, the keys of a `config.json`), the tensors under Hugging Face names,
dequantized to float32 (`tensors`), the tokenizer's metadata (`vocab`) and a fingerprint.
No torch: the router reads the config and the tokenizer from here too.

llama.cpp's converter permutes the rows of a Llama-layout model's Q and K projections so
that its rope rotates adjacent pairs; `tensors` permutes them back (Qwen2's are not
permuted). A file of another architecture, or holding a tensor type this module does not
dequantize, is refused when opened, with one line naming what.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.core.errors import ModelLoadError

# llama.cpp's `general.architecture` -> the Hugging Face architecture pdserve serves it as.
# llama.cpp writes Mistral checkpoints as `llama`.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# The architectures whose Q/K rows llama.cpp's converter permutes.
_PERMUTED_QK = frozenset({"llama"})
# The tensor types dequantized here (all through `gguf.quants`).
TENSOR_TYPES = frozenset(
    ("F32", "F16", "BF16")
    + ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")  # llama.cpp's block quantizations
    + ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")  # its k-quants
)
# As in `checkpoint.model_fingerprint`: the header, and sampled bytes of the data.
_SAMPLE_BYTES = 1 << 20

# GGUF's per-layer tensor names -> Hugging Face's, under `model.layers.N.`.
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensors a file may carry that pdserve derives itself (rope tables).
_IGNORED_TENSORS = frozenset({"rope_freqs.weight"})
_QK_PROJECTIONS = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")


@dataclass(frozen=True, slots=True)
class GGUFVocab:
    """The tokenizer a GGUF describes, as llama.cpp's `tokenizer.ggml.*` keys give it."""

    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE), "llama" (SentencePiece BPE)
    pre: str | None  # tokenizer.ggml.pre: how text is split before BPE
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]  # llama.cpp's: 1 normal, 2 unknown, 3 control, 4 user, 6 byte
    merges: tuple[str, ...]  # "left right"; empty when the file has none
    scores: tuple[float, ...]  # SentencePiece's; empty when the file has none
    bos_token_id: int | None
    eos_token_id: int | None
    eot_token_id: int | None  # an end of turn that is not the EOS (`<|eot_id|>`)
    unk_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    add_space_prefix: bool
    chat_template: str | None


class GGUFCheckpoint:
    """An open GGUF file: its metadata parsed, its tensors memory-mapped."""

    def __init__(self, path: Path):
        import gguf  # numpy only; kept off the import path of a process that reads no GGUF

        self.path = path
        try:
            self._reader = gguf.GGUFReader(path, "r")
        except (OSError, ValueError, KeyError, IndexError) as exc:
            raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from exc
        self._vocab: GGUFVocab | None = None
        self.gguf_architecture = str(self.get("general.architecture", ""))
        if self.gguf_architecture not in ARCHITECTURES:
            raise ModelLoadError(
                f"{path}: architecture {self.gguf_architecture!r} is not served; "
                f"supported: {', '.join(ARCHITECTURES)}"
            )
        self._tensors = {}
        for tensor in self._reader.tensors:
            if tensor.tensor_type.name not in TENSOR_TYPES:
                raise ModelLoadError(
                    f"{path}: tensor '{tensor.name}' has type {tensor.tensor_type.name}; "
                    f"supported: {', '.join(sorted(TENSOR_TYPES))}"
                )
            name = hf_tensor_name(tensor.name)
            if name is not None:
                self._tensors[name] = tensor
            elif tensor.name not in _IGNORED_TENSORS:
                raise ModelLoadError(f"{path}: tensor '{tensor.name}' is not served")

    @staticmethod
    def open(path: str | Path) -> GGUFCheckpoint:
        """One parse per file and process: the config, tokenizer and fingerprint share it."""
        path = Path(path).resolve()
        stat = path.stat()
        return _open_cached(path, stat.st_mtime_ns, stat.st_size)

    def get(self, key: str, default: Any = None) -> Any:
        field = self._reader.fields.get(key)
        return default if field is None else field.contents()

    def hf_config(self) -> dict[str, Any]:
        """The config.json a Hugging Face checkpoint of this model would carry."""
        arch = self.gguf_architecture
        key = functools.partial(_prefixed, self, arch)
        heads = _required(self, f"{arch}.attention.head_count")
        hidden = _required(self, f"{arch}.embedding_length")
        tensor_names = {t.name for t in self._reader.tensors}  # GGUF's names
        raw: dict[str, Any] = {
            "architectures": [ARCHITECTURES[arch]],
            "hidden_size": hidden,
            "intermediate_size": _required(self, f"{arch}.feed_forward_length"),
            "num_hidden_layers": _required(self, f"{arch}.block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": key("attention.head_count_kv", heads),
            "head_dim": key("attention.key_length", key("rope.dimension_count", hidden // heads)),
            "vocab_size": key("vocab_size", len(self._reader.fields["tokenizer.ggml.tokens"].data)),
            "max_position_embeddings": key("context_length", 2048),
            "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
            "rope_theta": key("rope.freq_base", 10000.0),
            "tie_word_embeddings": "output.weight" not in tensor_names,
            "attention_bias": "blk.0.attn_q.bias" in tensor_names,
            "sliding_window": key("attention.sliding_window"),
            "bos_token_id": self.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.get("tokenizer.ggml.eos_token_id"),
        }
        if key("rope.scaling.type", "none") == "linear":
            raw["rope_scaling"] = {"rope_type": "linear", "factor": key("rope.scaling.factor")}
        elif key("rope.scaling.type", "none") != "none" or "rope_freqs.weight" in tensor_names:
            raise ModelLoadError(
                f"{self.path}: rope scaling {key('rope.scaling.type', 'rope_freqs')!r} "
                "is not served from GGUF; supported: none, linear"
            )
        return raw

    def vocab(self) -> GGUFVocab:
        """The tokenizer's metadata, read once (the tokenizer and the chat template share it)."""
        if self._vocab is None:
            self._vocab = self._read_vocab()
        return self._vocab

    def _read_vocab(self) -> GGUFVocab:
        get = self.get
        if "tokenizer.ggml.tokens" not in self._reader.fields:
            raise ModelLoadError(f"{self.path}: no tokenizer (tokenizer.ggml.tokens missing)")
        model = str(get("tokenizer.ggml.model", ""))
        return GGUFVocab(
            model=model,
            pre=get("tokenizer.ggml.pre"),
            tokens=tuple(get("tokenizer.ggml.tokens")),
            token_types=tuple(get("tokenizer.ggml.token_type", ())),
            merges=tuple(get("tokenizer.ggml.merges", ())),
            scores=tuple(get("tokenizer.ggml.scores", ())),
            bos_token_id=get("tokenizer.ggml.bos_token_id"),
            eos_token_id=get("tokenizer.ggml.eos_token_id"),
            eot_token_id=get("tokenizer.ggml.eot_token_id"),
            unk_token_id=get("tokenizer.ggml.unknown_token_id"),
            pad_token_id=get("tokenizer.ggml.padding_token_id"),
            # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
            add_bos_token=bool(get("tokenizer.ggml.add_bos_token", model == "llama")),
            add_eos_token=bool(get("tokenizer.ggml.add_eos_token", False)),
            add_space_prefix=bool(get("tokenizer.ggml.add_space_prefix", model == "llama")),
            chat_template=get("tokenizer.chat_template"),
        )

    def tensor_names(self) -> frozenset[str]:
        """The Hugging Face names of the weights the file holds."""
        return frozenset(self._tensors)

    def tensor(self, name: str) -> np.ndarray:
        """The weight named `name` (Hugging Face's name), dequantized to float32."""
        from gguf.quants import dequantize

        tensor = self._tensors[name]
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims inner first
        array = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        if self.gguf_architecture in _PERMUTED_QK and name.endswith(_QK_PROJECTIONS):
            key = "head_count" if "q_proj" in name else "head_count_kv"
            heads = self.get(f"{self.gguf_architecture}.attention.{key}") or self.get(
                f"{self.gguf_architecture}.attention.head_count"
            )
            array = _unpermute(array, heads)
        # F32 data is a view of the read-only map; the model's weights must own theirs.
        return array if array.flags.writeable else array.copy()

    def fingerprint(self) -> str:
        """The header (metadata, tensor names, types, shapes) and sampled data bytes: two
        quantizations of one model differ in their header."""
        digest = hashlib.sha256()
        size = self.path.stat().st_size
        data_offset = self._reader.data_offset
        with self.path.open("rb") as f:
            digest.update(f.read(data_offset))
            digest.update(f.read(_SAMPLE_BYTES))
            f.seek(max(data_offset, size - _SAMPLE_BYTES))
            digest.update(f.read(_SAMPLE_BYTES))
        digest.update(str(size).encode())
        return digest.hexdigest()


@functools.lru_cache(maxsize=4)
def _open_cached(path: Path, mtime_ns: int, size: int) -> GGUFCheckpoint:
    del mtime_ns, size  # part of the key: a rewritten file is parsed anew
    return GGUFCheckpoint(path)


def hf_tensor_name(name: str) -> str | None:
    """GGUF's name of a tensor -> Hugging Face's; None for one pdserve has no place for."""
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    blk, _, rest = name.partition(".")
    layer, _, suffix = rest.partition(".")
    if blk != "blk" or not layer.isdigit() or suffix not in _LAYER_TENSORS:
        return None
    return f"model.layers.{layer}.{_LAYER_TENSORS[suffix]}"


def _unpermute(array: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute`: per head, rows (pairs, 2) back to (2, pairs)."""
    rows = array.shape[0]
    return (
        array.reshape(heads, rows // heads // 2, 2, *array.shape[1:])
        .swapaxes(1, 2)
        .reshape(array.shape)
    )


def _prefixed(checkpoint: GGUFCheckpoint, arch: str, key: str, default: Any = None) -> Any:
    return checkpoint.get(f"{arch}.{key}", default)


def _required(checkpoint: GGUFCheckpoint, key: str) -> Any:
    value = checkpoint.get(key)
    if value is None:
        raise ModelLoadError(f"{checkpoint.path}: metadata '{key}' is missing")
    return value
