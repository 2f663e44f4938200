"""The inference engine: paged KV cache, continuous batching, sampling. No gRPC here."""

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams

__all__ = ["LLMEngine", "RequestOutput", "SamplingParams"]
