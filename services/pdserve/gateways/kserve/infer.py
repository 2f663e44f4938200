"""A ModelInferRequest as the public API's GenerateRequest, and GenerateResponses back as
ModelInferResponses: the one place where KServe inference meets the router's domain.

As in Triton's vLLM backend: `text_output` starts with the prompt unless
`exclude_input_in_output` is true, which it must be when streaming (and is by default
there); while streaming each response carries the text (and the count of tokens) since
the one before, the last one the finish reason; `return_*` inputs add outputs. The
request's `id` is the client's correlation id, echoed, never the router's request id
(which would re-attach to an earlier request of the same id). The request's `priority`
and `timeout` parameters are Triton's schedule policy (`schedule`); the client's TTFT
target comes as the call's `x-slo-ttft-ms` metadata, as the OpenAI API's header.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from pdserve.api.inference import grpc_service_pb2 as pb
from pdserve.api.v1 import common_pb2, router_pb2
from pdserve.core.errors import InvalidRequestError
from pdserve.gateways.kserve.model import INPUT_SHAPES, INPUT_TYPES, MODEL_VERSION, Input, Output
from pdserve.gateways.kserve.sampling import (
    has_sampling_parameters,
    sampling_from_json,
    sampling_from_parameters,
)
from pdserve.gateways.kserve.schedule import priority_from_parameters, timeout_from_parameters
from pdserve.gateways.kserve.tensors import (
    DataType,
    InputTensor,
    OutputTensor,
    add_outputs,
    read_inputs,
)
from pdserve.rpc.wire import FINISH_REASON_NAMES, is_final

FINAL_RESPONSE = "triton_final_response"  # the parameter that ends a request's responses
NOT_FINISHED = "None"  # finish_reason before the last response, as the vLLM backend says
REQUEST_PARAMETERS = "parameters"
# How the frontend names request fields in its errors, and the inputs that carry them.
_PROMPT_FIELDS = ("prompt", "prompt.text")
_SAMPLING_FIELD = "sampling"
_ADDED_OUTPUTS = {
    Input.RETURN_FINISH_REASON: Output.FINISH_REASON,
    Input.RETURN_NUM_INPUT_TOKENS: Output.NUM_INPUT_TOKENS,
    Input.RETURN_NUM_OUTPUT_TOKENS: Output.NUM_OUTPUT_TOKENS,
}


@dataclass(frozen=True, slots=True)
class InferCall:
    """One inference request, checked: what to run, and how to answer."""

    id: str  # the client's, echoed
    generate: router_pb2.GenerateRequest
    prepend_prompt: bool  # text_output starts with the prompt
    outputs: tuple[Output, ...]  # what each response carries
    sampling_source: str  # the input (or "parameters") the sampling fields came in
    timeout_s: float | None = None  # the `timeout` parameter's; None: no limit

    @property
    def prompt(self) -> str:
        return self.generate.text

    def protocol_error(self, exc: InvalidRequestError) -> InvalidRequestError:
        """The frontend's error about a request field, naming the tensor it came in."""
        if exc.field in _PROMPT_FIELDS:
            return InvalidRequestError(Input.TEXT_INPUT, exc.message)
        if exc.field.split(".", 1)[0] == _SAMPLING_FIELD:
            return InvalidRequestError(
                self.sampling_source + exc.field.removeprefix(_SAMPLING_FIELD), exc.message
            )
        return exc


def parse_request(
    request: pb.ModelInferRequest, *, streaming_call: bool, ttft_slo_ms: int = 0
) -> InferCall:
    """Check a request's inputs and make its GenerateRequest; errors name the tensor (or
    the parameter). `ttft_slo_ms` is the client's TTFT target (0: none).

    Without `streaming_call` (ModelInfer) there is one response, so `stream` must not be
    true."""
    tensors = {tensor.name: tensor for tensor in _read_inputs(request)}
    if Input.TEXT_INPUT not in tensors:
        raise InvalidRequestError(Input.TEXT_INPUT, "is required")
    try:
        text = _scalar(tensors, Input.TEXT_INPUT).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(Input.TEXT_INPUT, "is not valid UTF-8") from exc
    stream = _stream(tensors)
    if stream and not streaming_call:
        raise InvalidRequestError(
            _stream_input(tensors), "ModelInfer gives one response: stream with ModelStreamInfer"
        )
    sampling, source = _sampling(tensors, request.parameters)
    generate = router_pb2.GenerateRequest(
        text=text,
        sampling=sampling,
        stream=stream,
        priority=priority_from_parameters(request.parameters, REQUEST_PARAMETERS),
        ttft_slo_ms=ttft_slo_ms,
    )
    return InferCall(
        id=request.id,
        generate=generate,
        prepend_prompt=_prepend_prompt(tensors, stream),
        outputs=_outputs(tensors, request.outputs),
        sampling_source=source,
        timeout_s=timeout_from_parameters(request.parameters, REQUEST_PARAMETERS),
    )


def _read_inputs(request: pb.ModelInferRequest) -> list[InputTensor]:
    tensors = read_inputs(request, INPUT_TYPES)
    for tensor in tensors:
        expected = INPUT_SHAPES[tensor.name]
        if tensor.shape != expected:
            raise InvalidRequestError(
                tensor.name, f"shape must be {list(expected)}, got {list(tensor.shape)}"
            )
    return tensors


def _scalar(tensors: Mapping[str, InputTensor], name: Input, default=None):
    """The one element of an input of shape [1], or `default` when it was not given."""
    tensor = tensors.get(name)
    return default if tensor is None else tensor.elements[0]


def _stream_input(tensors: Mapping[str, InputTensor]) -> Input:
    if Input.STREAM in tensors and Input.STREAMING in tensors:
        raise InvalidRequestError(Input.STREAMING, "give stream or streaming, not both")
    return Input.STREAMING if Input.STREAMING in tensors else Input.STREAM


def _stream(tensors: Mapping[str, InputTensor]) -> bool:
    return bool(_scalar(tensors, _stream_input(tensors), False))


def _prepend_prompt(tensors: Mapping[str, InputTensor], stream: bool) -> bool:
    exclude = _scalar(tensors, Input.EXCLUDE_INPUT_IN_OUTPUT)
    prepend = not stream if exclude is None else not exclude
    if prepend and stream:
        raise InvalidRequestError(
            Input.EXCLUDE_INPUT_IN_OUTPUT, "must be true when streaming (the output has no prompt)"
        )
    return prepend


def _sampling(
    tensors: Mapping[str, InputTensor], parameters: Mapping[str, pb.InferParameter]
) -> tuple[common_pb2.SamplingParams, str]:
    """The sampling parameters, and where they came from: the input or the parameters."""
    json_text = _scalar(tensors, Input.SAMPLING_PARAMETERS)
    if json_text is None:
        return sampling_from_parameters(parameters, REQUEST_PARAMETERS), REQUEST_PARAMETERS
    if has_sampling_parameters(parameters):
        raise InvalidRequestError(
            REQUEST_PARAMETERS, f"give sampling parameters here or in {Input.SAMPLING_PARAMETERS}"
        )
    return sampling_from_json(json_text, Input.SAMPLING_PARAMETERS), Input.SAMPLING_PARAMETERS


def _outputs(
    tensors: Mapping[str, InputTensor],
    requested: list[pb.ModelInferRequest.InferRequestedOutputTensor],
) -> tuple[Output, ...]:
    """text_output and the outputs the return_* inputs add; of them, the ones requested
    (all when the request names none)."""
    produced = [Output.TEXT_OUTPUT]
    produced += [output for flag, output in _ADDED_OUTPUTS.items() if _scalar(tensors, flag)]
    if not requested:
        return tuple(produced)
    known = [output.value for output in Output]
    names = set()
    for output in requested:
        if output.name not in known:
            raise InvalidRequestError(
                output.name or "outputs", f"unknown output (the model's: {', '.join(known)})"
            )
        names.add(output.name)
    return tuple(output for output in produced if output in names)


@dataclass(slots=True)
class InferResponses:
    """Builds one request's responses from its GenerateResponses, in order."""

    call: InferCall
    model_name: str
    count_prompt_tokens: Callable[[str], int]  # for responses before usage is known
    _num_sent: int = field(default=0, init=False)
    _num_input_tokens: int | None = field(default=None, init=False)

    def response(self, message: router_pb2.GenerateResponse) -> pb.ModelInferResponse:
        response = pb.ModelInferResponse(
            model_name=self.model_name, model_version=MODEL_VERSION, id=self.call.id
        )
        add_outputs(response, [self._output(name, message) for name in self.call.outputs])
        self._num_sent += 1
        return response

    def _output(self, name: Output, message: router_pb2.GenerateResponse) -> OutputTensor:
        match name:
            case Output.TEXT_OUTPUT:
                prefix = self.call.prompt if self.call.prepend_prompt and not self._num_sent else ""
                return OutputTensor(name, DataType.BYTES, [(prefix + message.text).encode()])
            case Output.FINISH_REASON:
                reason = FINISH_REASON_NAMES[message.finish_reason] or NOT_FINISHED
                return OutputTensor(name, DataType.BYTES, [reason.encode()])
            case Output.NUM_INPUT_TOKENS:
                return OutputTensor(name, DataType.UINT32, [self._prompt_tokens(message)])
            case Output.NUM_OUTPUT_TOKENS:
                return OutputTensor(name, DataType.UINT32, [len(message.token_ids)])

    def _prompt_tokens(self, message: router_pb2.GenerateResponse) -> int:
        if is_final(message):
            return message.usage.prompt_tokens
        if self._num_input_tokens is None:
            self._num_input_tokens = self.count_prompt_tokens(self.call.prompt)
        return self._num_input_tokens


def mark_final(response: pb.ModelInferResponse, final: bool) -> pb.ModelInferResponse:
    """Set the parameter by which a streaming client knows a request's last response."""
    response.parameters[FINAL_RESPONSE].bool_param = final
    return response


def error_response(request: pb.ModelInferRequest, message: str) -> pb.ModelStreamInferResponse:
    """A streamed request's failure: its last response, carrying the error's message."""
    failed = pb.ModelInferResponse(
        model_name=request.model_name, model_version=request.model_version, id=request.id
    )
    return pb.ModelStreamInferResponse(
        error_message=message, infer_response=mark_final(failed, True)
    )
