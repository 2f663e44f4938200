"""Write a Hugging Face checkpoint as a GGUF, laid out as llama.cpp's converter lays one
out (its tensor names, Q/K rows permuted for Llama, the tokenizer as metadata), with the
`gguf` package's own writer and quantizers: the files pdserve must read back."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}


def gguf_name(name: str) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    _, _, layer, rest = name.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}"


def permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's permutation of Q/K rows (per head, halves interleaved)."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_gguf(
    hf_dir: Path, out: Path, qtype: str = "F32", *, pre: str = "default", tied: bool | None = None
) -> Path:
    """`hf_dir` (config.json, model.safetensors, tokenizer.json) as a GGUF at `out`: 2-D
    weights in `qtype` (F32 where the rows are not whole blocks), norms and biases in F32,
    as llama.cpp quantizes them."""
    config = json.loads((hf_dir / "config.json").read_text())
    arch = _GGUF_ARCH[config["architectures"][0]]
    writer = gguf.GGUFWriter(out, arch)
    _write_config(writer, config)
    _write_tokenizer(writer, hf_dir, config["vocab_size"], pre)
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads")
    weights = load_file(hf_dir / "model.safetensors")
    tied = config.get("tie_word_embeddings", False) if tied is None else tied
    for name, array in weights.items():
        if name == "lm_head.weight" and tied:
            continue
        array = array.astype(np.float32)
        if arch == "llama" and name.endswith("q_proj.weight"):
            array = permute(array, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            array = permute(array, kv_heads or heads)
        kind = gguf.GGMLQuantizationType[qtype if array.ndim == 2 else "F32"]
        if array.shape[-1] % gguf.GGML_QUANT_SIZES[kind][0]:
            kind = gguf.GGMLQuantizationType.F32  # rows the blocks do not divide, as llama.cpp
        data = gguf.quants.quantize(array, kind)
        writer.add_tensor(gguf_name(name), data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _write_config(writer: gguf.GGUFWriter, config: dict) -> None:
    heads = config["num_attention_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(config["vocab_size"])
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)


def _write_tokenizer(writer: gguf.GGUFWriter, hf_dir: Path, vocab_size: int, pre: str) -> None:
    """A byte-level BPE tokenizer.json as `tokenizer.ggml.*`; the model's vocabulary past the
    tokenizer's padded with unused tokens, as llama.cpp's converter pads it."""
    spec = json.loads((hf_dir / "tokenizer.json").read_text())
    tokens = {i: t for t, i in spec["model"]["vocab"].items()}
    types = dict.fromkeys(tokens, int(gguf.TokenType.NORMAL))
    for added in spec["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = int(
            gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED
        )
    for i in range(vocab_size):
        if i not in tokens:
            tokens[i], types[i] = f"[PAD{i}]", int(gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list([tokens[i] for i in range(vocab_size)])
    writer.add_token_types([types[i] for i in range(vocab_size)])
    writer.add_token_merges(merges)
    by_name = {t: i for i, t in tokens.items()}
    writer.add_bos_token_id(by_name[config["bos_token"]])
    writer.add_eos_token_id(by_name[config["eos_token"]])
    writer.add_add_bos_token("<s>" in json.dumps(spec["post_processor"]))
    if config.get("chat_template"):
        writer.add_chat_template(config["chat_template"])


def write_sentencepiece_gguf(out: Path, model_proto: bytes) -> Path:
    """A GGUF holding only a SentencePiece tokenizer, as llama.cpp's converter writes a
    Llama 2 one: pieces, scores and types, no merges, BOS added."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_proto=model_proto)
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    kinds = [
        gguf.TokenType.UNKNOWN
        if sp.is_unknown(i)
        else gguf.TokenType.CONTROL
        if sp.is_control(i)
        else gguf.TokenType.BYTE
        if sp.is_byte(i)
        else gguf.TokenType.NORMAL
        for i in range(len(pieces))
    ]
    writer = gguf.GGUFWriter(out, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores([sp.get_score(i) for i in range(len(pieces))])
    writer.add_token_types([int(kind) for kind in kinds])
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
