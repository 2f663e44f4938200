"""A random-weight Llama checkpoint in Hugging Face layout, for tests and benchmarks.

Its output is meaningless, but everything else is real: `transformers` loads it, so it serves
as the oracle for the engine's forward pass, and the tokenizer is a byte-level BPE trained
here, deterministically, on a corpus shipped with the package. transformers is not needed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

UNK_TOKEN, BOS_TOKEN, EOS_TOKEN = "<unk>", "<s>", "</s>"
SPECIAL_TOKENS = [UNK_TOKEN, BOS_TOKEN, EOS_TOKEN]  # ids 0, 1, 2, as in Llama 2
BOS_TOKEN_ID, EOS_TOKEN_ID = SPECIAL_TOKENS.index(BOS_TOKEN), SPECIAL_TOKENS.index(EOS_TOKEN)

LOGIT_STD = 4.0
WEIGHT_STD = 0.02  # the usual initializer_range of Llama configs
MAX_POSITION_EMBEDDINGS = 4096
# Model vocabularies are padded to a multiple of this, as real checkpoints pad theirs.
VOCAB_PAD_MULTIPLE = 64


@dataclass(frozen=True, slots=True)
class DemoSize:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    # the BPE trainer's target; it stops early when the corpus runs out of pairs to merge
    tokenizer_vocab_size: int
    # the smallest model vocabulary; larger when the tokenizer's (padded) is larger
    min_vocab_size: int


SIZES = {
    "tiny": DemoSize(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tokenizer_vocab_size=1000,
        min_vocab_size=1024,
    ),
    # about 55M parameters: the benchmark model. The corpus supports ~3.2k merged tokens.
    "small": DemoSize(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        tokenizer_vocab_size=4096,
        min_vocab_size=32000,
    ),
}


def write_demo_model(out_dir: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """Write config, weights, generation config and tokenizer files to `out_dir` (created).

    The same size and seed always give byte-identical files. Returns `out_dir` as a Path.
    """
    spec = _size(size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_demo_tokenizer(spec.tokenizer_vocab_size)
    config = demo_config(size, tokenizer.get_vocab_size(with_added_tokens=True))

    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config())
    _write_json(out / "special_tokens_map.json", _special_tokens_map())
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID},
    )
    save_file(random_weights(config, seed), str(out / "model.safetensors"), {"format": "pt"})
    return out


def demo_config(size: str, tokenizer_vocab_size: int) -> dict:
    """The Hugging Face config.json of a demo model, as a dict."""
    spec = _size(size)
    padded = math.ceil(tokenizer_vocab_size / VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.hidden_size // spec.num_attention_heads,
        "vocab_size": max(padded, spec.min_vocab_size),
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": WEIGHT_STD,
    }


def parameter_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Hugging Face parameter names of a LlamaForCausalLM and their shapes, in a fixed order."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim, vocab = config["head_dim"], config["vocab_size"]
    q_size = config["num_attention_heads"] * head_dim
    kv_size = config["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.input_layernorm.weight": (hidden,),
            f"{layer}.self_attn.q_proj.weight": (q_size, hidden),
            f"{layer}.self_attn.k_proj.weight": (kv_size, hidden),
            f"{layer}.self_attn.v_proj.weight": (kv_size, hidden),
            f"{layer}.self_attn.o_proj.weight": (hidden, q_size),
            f"{layer}.post_attention_layernorm.weight": (hidden,),
            f"{layer}.mlp.gate_proj.weight": (inter, hidden),
            f"{layer}.mlp.up_proj.weight": (inter, hidden),
            f"{layer}.mlp.down_proj.weight": (hidden, inter),
        }
    shapes |= {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    return shapes


def num_parameters(config: dict) -> int:
    return sum(math.prod(shape) for shape in parameter_shapes(config).values())


def random_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Normal(0, WEIGHT_STD) matrices and all-ones norms, drawn in parameter_shapes order.

    The output head is drawn wider (logits of standard deviation about LOGIT_STD): with
    WEIGHT_STD there, the next-token distribution is nearly flat, near-ties between the
    top two tokens are common, and the last-bit differences between a batched and a
    single-request matmul flip greedy picks. Real models are peaked; so is this one.
    """
    generator = torch.Generator().manual_seed(seed)
    head_std = LOGIT_STD / config["hidden_size"] ** 0.5
    weights = {}
    for name, shape in parameter_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape)
        else:
            std = head_std if name == "lm_head.weight" else WEIGHT_STD
            weights[name] = torch.empty(shape).normal_(0.0, std, generator=generator)
    return weights


def train_demo_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE with <unk>, <s>, </s> at ids 0..2 whose encode prepends <s>.

    Training is deterministic: the same corpus gives the same tokenizer.json bytes.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        # all 256 bytes, so that any text encodes without <unk>
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(demo_corpus().splitlines(), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, BOS_TOKEN_ID)],
    )
    return tokenizer


def demo_corpus() -> str:
    return resources.files("pdserve.engine").joinpath("demo_corpus.txt").read_text("utf-8")


def _size(size: str) -> DemoSize:
    if size not in SIZES:
        raise ValueError(f"unknown demo model size {size!r}; expected one of {sorted(SIZES)}")
    return SIZES[size]


# A chat template in the Zephyr style, so that the demo model serves chat completions:
# `<s><|role|>\ncontent</s>\n` per message, then `<|assistant|>\n` for the reply.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}{{ message['content'] }}{{ eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def _tokenizer_config() -> dict:
    # PreTrainedTokenizerFast makes transformers use tokenizer.json exactly as written
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": UNK_TOKEN,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def _special_tokens_map() -> dict:
    return {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "unk_token": UNK_TOKEN}


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
