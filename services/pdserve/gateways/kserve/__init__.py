"""The KServe v2 inference protocol (Open Inference Protocol) over gRPC, with Triton's
streaming extension: `inference.GRPCInferenceService` on the router's gRPC port.

The model it serves is the router's (`--served-model-name`), with the inputs and outputs
of Triton's vLLM backend, so that clients written for Triton + vLLM (`tritonclient`,
KServe's) work unchanged. `tensors` is the protocol's tensor encoding, `model` the
model's signature, `sampling` and `infer` the conversions to and from the public API's
messages, `stream` one ModelStreamInfer call, `servicer` the handlers.
"""

from pdserve.gateways.kserve.servicer import SERVICE, KServeServicer

__all__ = ["SERVICE", "KServeServicer"]
