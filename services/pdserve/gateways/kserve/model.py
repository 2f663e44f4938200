"""The model as KServe v2 clients see it: the inputs and outputs of Triton's vLLM backend.

One model, under the router's served name, in version "1". Every input has shape [1]
(no batch dimension: max_batch_size 0, as the vLLM backend has it); `text_input` alone
is required. The outputs are 1-D, one element per response. Its transaction policy is
decoupled: ModelStreamInfer gives a request any number of responses.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import pdserve
from pdserve.api.inference import grpc_service_pb2 as pb
from pdserve.api.inference import model_config_pb2 as config_pb
from pdserve.gateways.kserve.tensors import DataType

MODEL_VERSION = "1"
SERVER_NAME = "pdserve"
BACKEND = "pdserve"
# The protocol extensions served beside the core: ModelConfig, request parameters
# (sampling parameters may come as the request's parameters), and the schedule policy
# (the `priority` and `timeout` parameters).
EXTENSIONS = ("model_configuration", "parameters", "schedule_policy")
_CONFIG_TYPES = {
    DataType.BOOL: config_pb.TYPE_BOOL,
    DataType.UINT32: config_pb.TYPE_UINT32,
    DataType.BYTES: config_pb.TYPE_STRING,
}
ANY_SIZE = -1


class Input(enum.StrEnum):
    TEXT_INPUT = "text_input"  # the prompt, UTF-8
    STREAM = "stream"  # one response per message of the stream, not one at the end
    STREAMING = "streaming"  # the same, as Dynamo's frontend names it
    SAMPLING_PARAMETERS = "sampling_parameters"  # JSON: temperature, max_tokens, stop ...
    EXCLUDE_INPUT_IN_OUTPUT = "exclude_input_in_output"  # text_output without the prompt
    RETURN_FINISH_REASON = "return_finish_reason"
    RETURN_NUM_INPUT_TOKENS = "return_num_input_tokens"
    RETURN_NUM_OUTPUT_TOKENS = "return_num_output_tokens"


class Output(enum.StrEnum):
    TEXT_OUTPUT = "text_output"
    FINISH_REASON = "finish_reason"  # stop, length or abort; "None" before the last response
    NUM_INPUT_TOKENS = "num_input_tokens"  # the prompt's
    NUM_OUTPUT_TOKENS = "num_output_tokens"  # this response's


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    datatype: DataType
    shape: tuple[int, ...]
    optional: bool = True


INPUTS = (
    TensorSpec(Input.TEXT_INPUT, DataType.BYTES, (1,), optional=False),
    TensorSpec(Input.STREAM, DataType.BOOL, (1,)),
    TensorSpec(Input.STREAMING, DataType.BOOL, (1,)),
    TensorSpec(Input.SAMPLING_PARAMETERS, DataType.BYTES, (1,)),
    TensorSpec(Input.EXCLUDE_INPUT_IN_OUTPUT, DataType.BOOL, (1,)),
    TensorSpec(Input.RETURN_FINISH_REASON, DataType.BOOL, (1,)),
    TensorSpec(Input.RETURN_NUM_INPUT_TOKENS, DataType.BOOL, (1,)),
    TensorSpec(Input.RETURN_NUM_OUTPUT_TOKENS, DataType.BOOL, (1,)),
)
OUTPUTS = (
    TensorSpec(Output.TEXT_OUTPUT, DataType.BYTES, (ANY_SIZE,)),
    TensorSpec(Output.FINISH_REASON, DataType.BYTES, (ANY_SIZE,)),
    TensorSpec(Output.NUM_INPUT_TOKENS, DataType.UINT32, (1,)),
    TensorSpec(Output.NUM_OUTPUT_TOKENS, DataType.UINT32, (ANY_SIZE,)),
)
INPUT_TYPES = {spec.name: spec.datatype for spec in INPUTS}
INPUT_SHAPES = {spec.name: spec.shape for spec in INPUTS}


def server_metadata() -> pb.ServerMetadataResponse:
    return pb.ServerMetadataResponse(
        name=SERVER_NAME, version=pdserve.__version__, extensions=EXTENSIONS
    )


def model_metadata(model_name: str) -> pb.ModelMetadataResponse:
    def tensors(specs: tuple[TensorSpec, ...]):
        return [
            pb.ModelMetadataResponse.TensorMetadata(
                name=spec.name, datatype=spec.datatype.value, shape=spec.shape
            )
            for spec in specs
        ]

    return pb.ModelMetadataResponse(
        name=model_name,
        versions=[MODEL_VERSION],
        platform=BACKEND,
        inputs=tensors(INPUTS),
        outputs=tensors(OUTPUTS),
    )


def model_config(model_name: str) -> pb.ModelConfigResponse:
    config = config_pb.ModelConfig(
        name=model_name,
        backend=BACKEND,
        max_batch_size=0,
        input=[
            config_pb.ModelInput(
                name=spec.name,
                data_type=_CONFIG_TYPES[spec.datatype],
                dims=spec.shape,
                optional=spec.optional,
            )
            for spec in INPUTS
        ],
        output=[
            config_pb.ModelOutput(
                name=spec.name, data_type=_CONFIG_TYPES[spec.datatype], dims=spec.shape
            )
            for spec in OUTPUTS
        ],
        model_transaction_policy=config_pb.ModelTransactionPolicy(decoupled=True),
    )
    return pb.ModelConfigResponse(config=config)
