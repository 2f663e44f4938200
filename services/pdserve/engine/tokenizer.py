"""Text in and out of token ids: a Hugging Face `tokenizer.json` (or a GGUF's tokenizer
metadata), streaming detokenization and stop strings.

The engine itself only sees token ids; these classes sit at its edges, turning a prompt into
ids and a stream of sampled ids back into a stream of text deltas.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import ahocorasick
import tokenizers

from pdserve.core.checkpoint import find_gguf
from pdserve.core.errors import InvalidRequestError, ModelLoadError
from pdserve.core.gguf_file import GGUFCheckpoint
from pdserve.engine.gguf_tokenizer import gguf_tokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"

# What a decoder yields for bytes that are not (yet) a whole UTF-8 character.
REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special token ids the engine needs to stop.

    `encode` adds special tokens exactly as the tokenizer.json post-processor defines, which is
    what `transformers.AutoTokenizer` does for Llama and Qwen tokenizers (transformers 5 does
    not rewrite the post-processor from `add_bos_token`, so neither do we).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        eos_token_ids: frozenset[int],
        bos_token_id: int | None,
    ):
        self._backend = backend
        self._eos_token_ids = eos_token_ids
        self._bos_token_id = bos_token_id

    @classmethod
    def load(cls, model: str | Path) -> Tokenizer:
        """The tokenizer of what `--model` names: a GGUF file, or a Hugging Face directory."""
        gguf = find_gguf(model)
        if gguf is None:
            return cls.from_dir(model)
        vocab = GGUFCheckpoint.open(gguf).vocab()
        stops = {vocab.eos_token_id, vocab.eot_token_id} - {None}
        return cls(
            gguf_tokenizer(vocab, str(gguf)),
            eos_token_ids=frozenset(stops),
            bos_token_id=vocab.bos_token_id,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load `tokenizer.json` and the optional tokenizer, generation and model configs.

        Raises:
            ModelLoadError: naming the file (and field) that is missing or malformed.
        """
        model_dir = Path(model_dir)
        backend = _load_backend(model_dir / TOKENIZER_FILE)
        configs = {
            name: read_json_object(model_dir / name)
            for name in (TOKENIZER_CONFIG_FILE, GENERATION_CONFIG_FILE, MODEL_CONFIG_FILE)
        }
        return cls(
            backend,
            eos_token_ids=_eos_token_ids(backend, configs, model_dir),
            bos_token_id=_bos_token_id(backend, configs, model_dir),
        )

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary, added tokens included (a model's may be padded larger)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    def backend_json(self) -> str:
        """The whole tokenizer as Hugging Face's `tokenizer.json` text (what grammar
        libraries read a vocabulary from)."""
        return self._backend.to_str()

    def vocabulary(self) -> list[str]:
        """Every token's string as the tokenizer stores it (byte-level BPE's mapped
        characters, not decoded text), indexed by id."""
        vocab = self._backend.get_vocab(with_added_tokens=True)
        tokens = [""] * (max(vocab.values()) + 1)
        for token, token_id in vocab.items():
            tokens[token_id] = token
        return tokens

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Without `add_special_tokens`, only what the text says (a rendered chat prompt
        already holds its BOS): as `transformers`' `apply_chat_template` tokenizes.

        Releases the GIL while it runs (`encode_batch` does, `encode` does not), so a
        thread can tokenize a long prompt while the caller's event loop serves others.
        """
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_batch(
        self, texts: Sequence[str], *, add_special_tokens: bool = True
    ) -> list[list[int]]:
        """`encode` of each text, on the tokenizer's own threads."""
        return [
            e.ids
            for e in self._backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        ]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Ids the tokenizer does not know (a padded model vocabulary) decode to nothing."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _load_backend(path: Path) -> tokenizers.Tokenizer:
    if not path.is_file():
        raise ModelLoadError(f"{path}: missing (a Hugging Face tokenizer.json is required)")
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises a bare Exception for every parse error
        raise ModelLoadError(f"{path}: malformed tokenizer.json: {e}") from e


def _eos_token_ids(
    backend: tokenizers.Tokenizer, configs: dict[str, dict], model_dir: Path
) -> frozenset[int]:
    # generation_config.json overrides config.json, as in transformers; the tokenizer's own
    # eos_token is a stop as well.
    name = GENERATION_CONFIG_FILE
    if "eos_token_id" not in configs[name]:
        name = MODEL_CONFIG_FILE
    eos_ids = _token_ids(configs[name], "eos_token_id", model_dir / name)
    name = TOKENIZER_CONFIG_FILE
    eos_token_id = _special_token_id(backend, configs[name], "eos_token", model_dir / name)
    if eos_token_id is not None:
        eos_ids.add(eos_token_id)
    return frozenset(eos_ids)


def _bos_token_id(
    backend: tokenizers.Tokenizer, configs: dict[str, dict], model_dir: Path
) -> int | None:
    name = TOKENIZER_CONFIG_FILE
    bos_token_id = _special_token_id(backend, configs[name], "bos_token", model_dir / name)
    if bos_token_id is not None:
        return bos_token_id
    for name in (GENERATION_CONFIG_FILE, MODEL_CONFIG_FILE):
        bos_ids = _token_ids(configs[name], "bos_token_id", model_dir / name)
        if len(bos_ids) > 1:
            raise ModelLoadError(f"{model_dir / name}: field bos_token_id: expected one id")
        if bos_ids:
            return bos_ids.pop()
    return None


def read_json_object(path: Path) -> dict:
    """An optional JSON object file: {} when absent, ModelLoadError when malformed."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: malformed JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_ids(config: dict, field: str, path: Path) -> set[int]:
    """`field` as a set of ids: configs write an int, a list of ints or null."""
    value = config.get(field)
    if value is None:
        return set()
    values = value if isinstance(value, list) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ModelLoadError(f"{path}: field {field}: expected token ids, got {value!r}")
    return set(values)


def _special_token_id(
    backend: tokenizers.Tokenizer, tokenizer_config: dict, field: str, path: Path
) -> int | None:
    """The id of a token named in tokenizer_config.json, as a string or an AddedToken dict."""
    token = tokenizer_config.get(field)
    if isinstance(token, dict):
        token = token.get("content")
    if token is None:
        return None
    if not isinstance(token, str):
        raise ModelLoadError(f"{path}: field {field}: expected a token string, got {token!r}")
    token_id = backend.token_to_id(token)
    if token_id is None:
        raise ModelLoadError(f"{path}: field {field}: {token!r} is not in the vocabulary")
    return token_id


# Prompt tokens decoded as context before the first output token, so that a tokenizer that
# strips the leading space of the first decoded token (SentencePiece "▁") does not strip it.
_NUM_PROMPT_CONTEXT_TOKENS = 5
# A UTF-8 character is at most 4 bytes, so an unfinished one spans at most 3 pending tokens.
# A replacement character still at the end after this many tokens comes from invalid bytes,
# not an unfinished character, and is emitted; so are runs of skipped special tokens. This
# bounds the window, and so the cost per token.
_MAX_PENDING_TOKENS = 6


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text deltas.

    It decodes a small window `[prefix | pending]` of token ids and emits the text beyond the
    decoded prefix. The prefix (the tokens emitted last time, or the tail of the prompt) gives
    each new token the context it decodes in: a SentencePiece "▁" keeps its space and byte
    tokens join into characters. Text ending in an unfinished UTF-8 character is held back
    until the character is complete. Each push costs O(window), never O(output length).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # invariant: _window_ids[:_num_prefix_tokens] decode to _prefix_text, and the rest are
        # pending: pushed but not yet emitted
        self._window_ids = list(prompt_token_ids[-_NUM_PROMPT_CONTEXT_TOKENS:])
        self._num_prefix_tokens = len(self._window_ids)
        self._prefix_text = self._decode(self._window_ids)

    def push(self, token_id: int) -> str:
        """Add one sampled token; return the text it completes (often "", never half a char)."""
        self._window_ids.append(token_id)
        text = self._decode(self._window_ids)
        num_pending = len(self._window_ids) - self._num_prefix_tokens
        if num_pending < _MAX_PENDING_TOKENS and (
            len(text) <= len(self._prefix_text)  # e.g. a skipped special token
            or text.endswith(REPLACEMENT_CHAR)
        ):
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """The held-back text, unfinished characters included, for when the output ends."""
        return self._advance(self._decode(self._window_ids))

    def _advance(self, text: str) -> str:
        delta = text[len(self._prefix_text) :]
        # the pending tokens become the next prefix
        del self._window_ids[: self._num_prefix_tokens]
        self._num_prefix_tokens = len(self._window_ids)
        self._prefix_text = self._decode(self._window_ids)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


class StopStringMatcher:
    """Finds stop strings in a stream of text deltas without ever emitting part of one.

    It holds back the longest suffix of the text seen so far that could still begin a stop
    string, so the held text is always shorter than the longest stop string. When stop strings
    overlap, the one that completes first in the stream wins (on a tie, the one that starts
    first, i.e. the longest), so the result does not depend on how the text was split into
    deltas.

    The stop strings are a `pyahocorasick` automaton whose search carries its state from
    one delta to the next (it reports matches by their end in the whole stream, longest
    first at each end). The held suffix is found from the first place in the text that
    starts with a stop string's first character and reads on to the end as a stop's prefix.
    Per delta that is 1.2-6x slower than the Python automaton pdserve had, which took
    50-100x longer to build (350 ms at the caps, on the engine's loop):
    docs/benchmarks/stop-strings.md.
    """

    def __init__(self, stops: Sequence[str]):
        for i, stop in enumerate(stops):
            if not isinstance(stop, str) or not stop:
                raise InvalidRequestError(
                    f"sampling_params.stop[{i}]", "must be a non-empty string"
                )
        automaton = ahocorasick.Automaton()
        for stop in stops:
            automaton.add_word(stop, len(stop))
        automaton.make_automaton()
        self._is_stop_prefix = automaton.match  # is the string a prefix of some stop
        self._search = automaton.iter("")
        self._first_char = re.compile("[" + "".join(map(re.escape, {s[0] for s in stops})) + "]")
        self._num_searched = 0  # characters the search has read: its end indexes count them
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def feed(self, delta: str) -> tuple[str, bool]:
        """Returns (text safe to emit now, whether a stop string was found).

        On a stop, the text is what preceded the stop string; the stop string is dropped and
        later feeds return ("", True).
        """
        if self._stopped:
            return "", True
        text = self._held + delta
        self._search.set(delta)
        for end, length in self._search:  # the first to complete, the longest ending there
            start = end + 1 - length - self._num_searched + len(self._held)
            self._held, self._stopped = "", True
            return text[:start], True
        self._num_searched += len(delta)
        num_emitted = self._num_free(text)
        self._held = text[num_emitted:]
        return text[:num_emitted], False

    def flush(self) -> str:
        """The held-back text, for when the output ends for another reason."""
        held, self._held = self._held, ""
        self._search.set("", True)  # the search starts afresh
        self._num_searched = 0
        return held

    def _num_free(self, text: str) -> int:
        """Where the longest suffix of `text` that is a stop string's prefix begins."""
        start = 0
        while (found := self._first_char.search(text, start)) is not None:
            start = found.start()
            if self._is_stop_prefix(text[start:]):
                return start
            start += 1
        return len(text)
