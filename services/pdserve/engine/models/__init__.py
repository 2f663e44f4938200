"""Model definitions. One decoder serves Llama, Qwen2 and Mistral (they differ in config only)."""

from pdserve.engine.models.llama import LlamaFamilyModel

__all__ = ["LlamaFamilyModel"]
