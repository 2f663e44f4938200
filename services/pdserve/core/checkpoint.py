"""A checkpoint on disk: its safetensors files, and its fingerprint (what two workers
compare before trusting each other's KV). No torch: the router reads these too."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from pdserve.core.errors import ModelLoadError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Hashing every weight byte of a multi-GB checkpoint would delay start-up by
# seconds; the headers (names, dtypes, shapes, offsets) plus sampled bytes of the
# data tell apart different checkpoints, and different random initialisations.
SAMPLE_BYTES = 1 << 20


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


def model_fingerprint(model_dir: str | Path) -> str:
    model_dir = Path(model_dir)
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
