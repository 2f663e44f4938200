"""A model's fingerprint: what two workers compare before trusting each other's KV."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

from pdserve.engine.loader import weight_files

# Hashing every weight byte of a multi-GB checkpoint would delay start-up by
# seconds; the headers (names, dtypes, shapes, offsets) plus sampled bytes of the
# data tell apart different checkpoints, and different random initialisations.
SAMPLE_BYTES = 1 << 20


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
