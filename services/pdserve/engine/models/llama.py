"""The Llama-family decoder (Llama 2/3, Qwen2, Mistral) over a paged KV cache.

Projections are fused (q/k/v into one matmul, gate/up into another) at load
time; see `loader.py` for the mapping from Hugging Face names. On CPU the loader
then swaps each `nn.Linear` for a prepacked one (`cpu_linear.py`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.core.model_config import ModelConfig
from pdserve.engine.attention import AttentionMetadata, paged_attention, write_kv
from pdserve.engine.models.rope import RotaryEmbedding, apply_rotary

# Called with the layer index once that layer's K/V for this step are in the cache.
LayerDoneCallback = Callable[[int], None]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op, the weight included (the CPU kernel accumulates in float32). In
        # float32 it is HF's weight * normed bit for bit; in half precision it rounds once,
        # after the weight, where HF rounds before it too: at most one ulp apart. A
        # decode step runs 61 of them; the float round trip took 3-6 us more each.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, layer_cache, meta: AttentionMetadata):
        # x: [T, hidden]; cos, sin: [T, 1, head_dim]
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(self.input_layernorm(x))
        # q and k lie side by side in each row, so one rotation covers both heads.
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim)
        qk = apply_rotary(qk, cos, sin)  # [T, heads + kv_heads, head_dim]
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        write_kv(layer_cache, k, v, meta.slot_mapping)
        attn = paged_attention(q, k, v, layer_cache, meta, self.scale)
        x = x + self.o_proj(attn.reshape(num_tokens, self.q_size))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class LlamaFamilyModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, dtype: torch.dtype):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [layers, 2, num_slots, kv_heads, head_dim]
        meta: AttentionMetadata,
        on_layer_done: LayerDoneCallback | None = None,
    ) -> torch.Tensor:  # [T, hidden], after the final norm
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope(positions)
        for index, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache[index], meta)
            if on_layer_done is not None:
                on_layer_done(index)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
