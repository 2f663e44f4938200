"""The inference engine: paged KV cache, continuous batching, sampling. No gRPC here.

`from pdserve.engine import LLMEngine, SamplingParams` is the public entry point. The
names load lazily so that torch-free parts (the client, the router's tokenizer) do
not pay for importing torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLMEngine": "pdserve.engine.llm_engine",
    "RequestOutput": "pdserve.engine.outputs",
    "SamplingParams": "pdserve.core.sampling_params",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
