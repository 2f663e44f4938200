"""A `tokenizers.Tokenizer` built from a GGUF's tokenizer metadata (`GGUFVocab`).

A GGUF carries no `tokenizer.json`: it lists the vocabulary, the merges, each token's
type and the special ids under llama.cpp's keys, and names the text splitting by
`tokenizer.ggml.pre`. Two models are built here, as llama.cpp reads them:
- `gpt2`: byte-level BPE. Tokens are spelled in GPT-2's byte alphabet; the split before
  BPE is the one `pre` names (`_SPLITS`).
- `llama`: SentencePiece BPE with byte fallback. Spaces are `▁`, one is put before the
  text when `add_space_prefix`; merges come from the file or, when it has none, from the
  vocabulary ranked by score, as SentencePiece's BPE applies them.
Control tokens (type 3) become special added tokens, user-defined ones (4) plain added
tokens, so both are matched whole in text; BOS (and EOS) are added as the file says.
"""

from __future__ import annotations

import functools

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend
from tokenizers.processors import TemplateProcessing

from pdserve.core.errors import ModelLoadError
from pdserve.core.gguf_file import GGUFVocab

_CONTROL, _USER_DEFINED = 3, 4
_SPACE = "\u2581"  # SentencePiece's space

# `tokenizer.ggml.pre` -> the split before byte-level BPE: a regex isolated as a pre-token,
# optionally after splitting every digit apart (None: GPT-2's own regex, in ByteLevel).
_GPT2 = None
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# name -> (regex, digits apart)
_SPLITS: dict[str, tuple[str | None, bool]] = {
    "default": (_GPT2, False),
    "gpt2": (_GPT2, False),
    "gpt-2": (_GPT2, False),
    "smollm": (_GPT2, True),
    "starcoder": (_GPT2, True),
    "refact": (_GPT2, True),
    "llama3": (_LLAMA3, False),
    "llama-v3": (_LLAMA3, False),
    "llama-bpe": (_LLAMA3, False),
    "smaug-bpe": (_LLAMA3, False),
    "qwen2": (_QWEN2, False),
    "deepseek-r1-qwen": (_QWEN2, False),
}


def gguf_tokenizer(vocab: GGUFVocab, source: str) -> Backend:
    """The tokenizer `vocab` describes, or ModelLoadError naming what is not served."""
    if vocab.model == "gpt2":
        backend = _byte_level(vocab, source)
    elif vocab.model == "llama":
        backend = _sentencepiece(vocab)
    else:
        raise ModelLoadError(
            f"{source}: tokenizer.ggml.model {vocab.model!r} is not served; supported: gpt2, llama"
        )
    _add_special_tokens(backend, vocab)
    backend.post_processor = _post_processor(vocab)
    return backend


def _byte_level(vocab: GGUFVocab, source: str) -> Backend:
    pre = vocab.pre or "default"
    if pre not in _SPLITS:
        raise ModelLoadError(
            f"{source}: tokenizer.ggml.pre {pre!r} is not served; "
            f"supported: {', '.join(sorted(_SPLITS))}"
        )
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    ids = {
        token if set(token) <= spelled else "".join(alphabet[b] for b in token.encode()): i
        for i, token in enumerate(vocab.tokens)
    }
    merges = [tuple(merge.split(" ", 1)) for merge in vocab.merges]
    backend = Backend(models.BPE(ids, merges, fuse_unk=False, byte_fallback=False))
    regex, digits_apart = _SPLITS[pre]
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits_apart else []
    if regex is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps.append(pre_tokenizers.Split(Regex(regex), behavior="isolated"))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    backend.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece(vocab: GGUFVocab) -> Backend:
    ids = {token: i for i, token in enumerate(vocab.tokens)}
    if vocab.merges:
        merges = [tuple(merge.split(" ", 1)) for merge in vocab.merges]
    else:
        merges = _merges_by_score(vocab.tokens, vocab.scores)
    unk = vocab.tokens[vocab.unk_token_id] if vocab.unk_token_id is not None else None
    backend = Backend(models.BPE(ids, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    steps = [normalizers.Prepend(_SPACE)] if vocab.add_space_prefix else []
    steps.append(normalizers.Replace(" ", _SPACE))
    backend.normalizer = normalizers.Sequence(steps)
    strip = [decoders.Strip(" ", 1, 0)] if vocab.add_space_prefix else []
    backend.decoder = decoders.Sequence(
        [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    return backend


def _merges_by_score(tokens: tuple[str, ...], scores: tuple[float, ...]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, best merged token first (SentencePiece
    merges the pair whose result scores highest); ties by the pieces' ids."""
    ids = {token: i for i, token in enumerate(tokens)}
    ranked = []
    for token, score in zip(tokens, scores, strict=True):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-score, ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _add_special_tokens(backend: Backend, vocab: GGUFVocab) -> None:
    types = vocab.token_types or (1,) * len(vocab.tokens)
    pairs = list(zip(vocab.tokens, types, strict=True))
    backend.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, kind in pairs if kind == _CONTROL]
    )
    backend.add_tokens(
        [AddedToken(t, normalized=False) for t, kind in pairs if kind == _USER_DEFINED]
    )


def _post_processor(vocab: GGUFVocab) -> TemplateProcessing:
    def token(token_id: int | None, wanted: bool) -> list[tuple[str, int]]:
        return [(vocab.tokens[token_id], token_id)] if wanted and token_id is not None else []

    bos = token(vocab.bos_token_id, vocab.add_bos_token)
    eos = token(vocab.eos_token_id, vocab.add_eos_token)
    first, last = [name for name, _ in bos], [name for name, _ in eos]
    return TemplateProcessing(
        single=[*first, "$A", *last],
        pair=[*first, "$A", *last, *first, "$B:1", *last],
        special_tokens=list(dict(bos + eos).items()),
    )


@functools.cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's spelling of each byte: printable ones as themselves, the rest from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelling = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling
