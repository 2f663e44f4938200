"""KServe v2 requests and responses as the gateway reads and writes them, without a server:
tensors in both encodings (tritonclient's own (de)serializers as the oracle for the raw
one), and sampling parameters in the forms vLLM clients send."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from pdserve.api.inference import grpc_service_pb2 as pb
from pdserve.core.errors import InvalidRequestError
from pdserve.gateways.kserve.infer import parse_request
from pdserve.gateways.kserve.sampling import sampling_from_parameters, sampling_from_values
from pdserve.gateways.kserve.tensors import DataType, OutputTensor

PROMPT = "Hello there"


def raw_bytes(*values: bytes) -> bytes:
    return serialize_byte_tensor(np.array(values, dtype=np.object_)).item()


def tensor(
    name: str, datatype: str, shape=(1,), **contents
) -> pb.ModelInferRequest.InferInputTensor:
    message = pb.ModelInferRequest.InferInputTensor(name=name, datatype=datatype, shape=shape)
    if contents:
        message.contents.CopyFrom(pb.InferTensorContents(**contents))
    return message


def raw_request(*inputs: tuple[str, str, bytes]) -> pb.ModelInferRequest:
    """A request as tritonclient sends it: every input's elements in raw_input_contents."""
    return pb.ModelInferRequest(
        model_name="m",
        inputs=[tensor(name, datatype) for name, datatype, _ in inputs],
        raw_input_contents=[data for _, _, data in inputs],
    )


def field_of(request: pb.ModelInferRequest, *, streaming_call: bool = True) -> str:
    with pytest.raises(InvalidRequestError) as raised:
        parse_request(request, streaming_call=streaming_call)
    return raised.value.field


def test_typed_contents_read_as_the_raw_encoding_does():
    sampling = json.dumps({"max_tokens": 5, "temperature": 0}).encode()
    typed = pb.ModelInferRequest(
        inputs=[
            tensor("text_input", "BYTES", bytes_contents=[PROMPT.encode()]),
            tensor("sampling_parameters", "BYTES", bytes_contents=[sampling]),
            tensor("stream", "BOOL", bool_contents=[True]),
        ]
    )
    raw = raw_request(
        ("text_input", "BYTES", raw_bytes(PROMPT.encode())),
        ("sampling_parameters", "BYTES", raw_bytes(sampling)),
        ("stream", "BOOL", b"\x01"),
    )
    assert parse_request(typed, streaming_call=True) == parse_request(raw, streaming_call=True)
    call = parse_request(typed, streaming_call=True)
    assert call.generate.text == PROMPT and call.generate.stream
    assert call.generate.sampling.max_tokens == 5 and not call.prepend_prompt


@pytest.mark.parametrize(
    "request_, field",
    [
        (raw_request(("text_input", "BYTES", raw_bytes(b"abc")[:-1])), "text_input"),
        (raw_request(("text_input", "BYTES", b"\x01\x00")), "text_input"),
        (
            raw_request(("text_input", "BYTES", raw_bytes(b"a")), ("stream", "BOOL", b"\x02")),
            "stream",
        ),
        (
            pb.ModelInferRequest(
                inputs=[tensor("text_input", "BYTES"), tensor("stream", "BOOL")],
                raw_input_contents=[raw_bytes(b"a")],
            ),
            "raw_input_contents",
        ),
        (
            pb.ModelInferRequest(
                inputs=[tensor("text_input", "BYTES", bytes_contents=[b"a"])],
                raw_input_contents=[raw_bytes(b"a")],
            ),
            "text_input",
        ),
        (
            pb.ModelInferRequest(inputs=[tensor("text_input", "BYTES", bool_contents=[True])]),
            "text_input",
        ),
        (
            raw_request(("text_input", "BYTES", raw_bytes(b"a")), ("text_input", "BYTES", b"")),
            "text_input",
        ),
        (raw_request(("text_input", "BYTES", raw_bytes(b"\xff"))), "text_input"),
        (
            raw_request(("text_input", "BYTES", raw_bytes(b"a")), ("stream", "BOOL", b"\x01\x01")),
            "stream",
        ),
    ],
    ids=[
        "bytes end inside an element",
        "bytes end inside a length",
        "bool byte not 0 or 1",
        "raw for some inputs only",
        "both contents and raw",
        "contents of another type",
        "an input twice",
        "prompt not UTF-8",
        "two elements in shape [1]",
    ],
)
def test_a_malformed_tensor_is_invalid_naming_it(request_, field):
    assert field_of(request_) == field


def test_both_stream_and_streaming_are_invalid_naming_streaming():
    request = raw_request(
        ("text_input", "BYTES", raw_bytes(b"a")),
        ("stream", "BOOL", b"\x01"),
        ("streaming", "BOOL", b"\x01"),
    )
    assert field_of(request) == "streaming"


def test_bytes_outputs_encode_as_tritonclient_decodes_them():
    values = ["plain", "", "ünïcode"]
    output = OutputTensor("text_output", DataType.BYTES, [value.encode() for value in values])
    assert [item.decode() for item in deserialize_bytes_tensor(output.encode())] == values
    counts = OutputTensor("num_output_tokens", DataType.UINT32, [3, 70000])
    assert np.frombuffer(counts.encode(), dtype="<u4").tolist() == [3, 70000]


def test_unset_sampling_fields_take_vllms_defaults():
    sampling = sampling_from_values({}, "sampling_parameters")
    assert (sampling.temperature, sampling.max_tokens, sampling.top_k) == (1.0, 16, 0)
    assert sampling.top_p == 1.0 and not sampling.HasField("seed")


def test_sampling_values_as_vllm_clients_send_them():
    sampling = sampling_from_values(
        {
            "temperature": "0.5",
            "top_p": 0.9,
            "top_k": -1,  # vLLM's "no top-k"
            "max_tokens": "12",
            "ignore_eos": "true",
            "stop": "\n",
            "seed": 7,
            "min_p": None,  # null: the default
        },
        "sampling_parameters",
    )
    assert sampling.temperature == 0.5 and sampling.top_k == 0 and sampling.max_tokens == 12
    assert sampling.ignore_eos and list(sampling.stop) == ["\n"] and sampling.seed == 7
    assert sampling.min_p == 0.0


@pytest.mark.parametrize(
    "values, field",
    [
        ({"seed": -1}, "sampling_parameters.seed"),
        ({"max_tokens": 2**40}, "sampling_parameters.max_tokens"),
        ({"max_tokens": 2.5}, "sampling_parameters.max_tokens"),
        ({"ignore_eos": "yes"}, "sampling_parameters.ignore_eos"),
        ({"temperature": True}, "sampling_parameters.temperature"),
        ({"stop": [1]}, "sampling_parameters.stop"),
        ({"logprobs": 1}, "sampling_parameters"),
    ],
)
def test_an_ill_typed_or_unsupported_sampling_value_is_named(values, field):
    with pytest.raises(InvalidRequestError) as raised:
        sampling_from_values(values, "sampling_parameters")
    assert raised.value.field == field


def test_the_protocols_own_request_parameters_are_not_sampling_parameters():
    parameters = {
        "max_tokens": pb.InferParameter(int64_param=4),
        "sequence_id": pb.InferParameter(int64_param=9),
        "triton_enable_empty_final_response": pb.InferParameter(bool_param=True),
    }
    assert sampling_from_parameters(parameters, "parameters").max_tokens == 4


def with_parameters(**parameters: pb.InferParameter) -> pb.ModelInferRequest:
    request = raw_request(("text_input", "BYTES", raw_bytes(PROMPT.encode())))
    for name, value in parameters.items():
        request.parameters[name].CopyFrom(value)
    return request


@pytest.mark.parametrize(
    ("level", "priority"),
    [(0, 0), (2**31, 0), (1, -(2**31) + 1), (2, -(2**31) + 2), (2**32 - 1, 2**31 - 1)],
)
def test_tritons_priority_level_is_the_public_priority_in_the_same_order(level, priority):
    """Level 1 is Triton's highest; 0 and the default level 2**31 are pdserve's 0."""
    call = parse_request(
        with_parameters(priority=pb.InferParameter(uint64_param=level)), streaming_call=False
    )
    assert call.generate.priority == priority


def test_timeout_is_microseconds_and_the_ttft_target_is_passed_on():
    request = with_parameters(timeout=pb.InferParameter(int64_param=2_500_000))
    call = parse_request(request, streaming_call=False, ttft_slo_ms=300)
    assert call.timeout_s == 2.5 and call.generate.ttft_slo_ms == 300
    untimed = parse_request(with_parameters(), streaming_call=False)
    assert untimed.timeout_s is None and untimed.generate.ttft_slo_ms == 0
    assert untimed.generate.priority == 0
    zero = with_parameters(timeout=pb.InferParameter(int64_param=0))
    assert parse_request(zero, streaming_call=False).timeout_s is None  # Triton's: no limit


@pytest.mark.parametrize(
    "parameters",
    [
        {"priority": pb.InferParameter(uint64_param=2**32)},
        {"priority": pb.InferParameter(int64_param=-1)},
        {"priority": pb.InferParameter(double_param=1.0)},
        {"priority": pb.InferParameter(string_param="1")},
        {"timeout": pb.InferParameter(int64_param=-5)},
        {"timeout": pb.InferParameter(bool_param=True)},
    ],
)
def test_a_schedule_parameter_out_of_range_or_of_another_type_is_named(parameters):
    [name] = parameters
    assert field_of(with_parameters(**parameters), streaming_call=False) == f"parameters.{name}"
