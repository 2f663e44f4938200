"""The router's KServe v2 / Triton gRPC API as tritonclient meets it: real router, workers
and Redis on loopback, the official `tritonclient[grpc]` client, the native Generate as
the oracle."""

from __future__ import annotations

import json
import queue
import time

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from procs import router_process, worker_process
from tritonclient.utils import InferenceServerException

from pdserve.api.v1 import common_pb2, router_pb2, router_pb2_grpc
from pdserve.core.phase import RequestPhase
from pdserve.state.record import RequestRecord

pytestmark = pytest.mark.cluster

MODEL = "tiny-llama"
PROMPT = "The decode worker streams every token"
GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
STREAM_WAIT_S = 30


@pytest.fixture(scope="module")
def cluster(demo_model_dir, redis_url, tmp_path_factory):
    """One prefill and one decode worker behind a router that serves the model as MODEL."""
    logs = tmp_path_factory.mktemp("kserve-logs")
    registry = ("--redis-url", redis_url)
    with (
        worker_process("prefill", demo_model_dir, *registry, log_dir=logs) as prefill,
        worker_process(
            "decode", demo_model_dir, *registry, "--num-kv-blocks", "300", log_dir=logs
        ) as decode,
        router_process(demo_model_dir, redis_url, "--served-model-name", MODEL, log_dir=logs) as (
            router,
            _,
        ),
    ):
        client = triton.InferenceServerClient(router)
        try:
            _wait_ready(client)
            yield {"router": router, "decode": decode, "prefill": prefill, "client": client}
        finally:
            client.close()


def _wait_ready(client: triton.InferenceServerClient, timeout_s: float = 30) -> None:
    """Until the router sees its workers: ServerReady turns true."""
    deadline = time.monotonic() + timeout_s
    while not client.is_server_ready():
        if time.monotonic() > deadline:
            raise TimeoutError("the router never became ready")
        time.sleep(0.1)


def native_text(router: str, prompt: str = PROMPT, **sampling) -> router_pb2.GenerateResponse:
    """The router's own Generate for the same request: the oracle."""
    with grpc.insecure_channel(router) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        request = router_pb2.GenerateRequest(
            text=prompt, sampling=common_pb2.SamplingParams(**sampling), stream=False
        )
        [response] = list(stub.Generate(request))
    return response


def bytes_input(name: str, value: bytes | str) -> triton.InferInput:
    tensor = triton.InferInput(name, [1], "BYTES")
    data = value.encode() if isinstance(value, str) else value
    tensor.set_data_from_numpy(np.array([data], dtype=np.object_))
    return tensor


def bool_input(name: str, value: bool) -> triton.InferInput:
    tensor = triton.InferInput(name, [1], "BOOL")
    tensor.set_data_from_numpy(np.array([value], dtype=bool))
    return tensor


def llm_inputs(prompt: str = PROMPT, sampling=GREEDY, **flags: bool) -> list[triton.InferInput]:
    """The inputs a client of Triton's vLLM backend sends."""
    inputs = [bytes_input("text_input", prompt)]
    if sampling is not None:
        inputs.append(bytes_input("sampling_parameters", json.dumps(sampling)))
    inputs += [bool_input(name, value) for name, value in flags.items()]
    return inputs


def text_of(result) -> str:
    return result.as_numpy("text_output")[0].decode()


def is_final(result) -> bool:
    return result.get_response().parameters["triton_final_response"].bool_param


def stream(client: triton.InferenceServerClient, requests: dict[str, list], **options):
    """Send each (id -> inputs) on one stream; every request's results (or error) in order."""
    arrived: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: arrived.put((result, error)))
    try:
        for request_id, inputs in requests.items():
            client.async_stream_infer(MODEL, inputs, request_id=request_id, **options)
        results: dict[str, list] = {request_id: [] for request_id in requests}
        pending = set(requests)
        while pending:
            result, error = arrived.get(timeout=STREAM_WAIT_S)
            if error is not None:
                request_id = _id_of_error(error, pending)
                results[request_id].append(error)
                pending.discard(request_id)
                continue
            request_id = result.get_response().id
            results[request_id].append(result)
            if is_final(result):
                pending.discard(request_id)
        return results
    finally:
        client.stop_stream()


def _id_of_error(error: InferenceServerException, pending: set[str]) -> str:
    # tritonclient hands a streamed error to the callback without its response: these
    # tests send at most one failing request per stream
    assert len(pending) == 1, "one request at a time when an error is expected"
    return next(iter(pending))


# -- health and metadata ------------------------------------------------------------------


def test_server_and_model_report_live_and_ready_under_the_served_name(cluster):
    client = cluster["client"]
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(MODEL)
    assert client.is_model_ready(MODEL, "1")
    assert not client.is_model_ready("another-model")
    assert not client.is_model_ready(MODEL, "2")
    metadata = client.get_server_metadata()
    assert metadata.name == "pdserve" and "schedule_policy" in metadata.extensions


def test_a_router_whose_workers_are_unreachable_is_live_but_not_ready(
    demo_model_dir, redis_url, tmp_path
):
    nobody = "127.0.0.1:9"  # no worker listens there
    static = ("--discovery", "static", "--both", nobody, "--served-model-name", MODEL)
    with router_process(demo_model_dir, redis_url, *static, log_dir=tmp_path) as (router, _):
        client = triton.InferenceServerClient(router)
        try:
            assert client.is_server_live()
            assert not client.is_server_ready() and not client.is_model_ready(MODEL)
        finally:
            client.close()


def test_model_metadata_lists_the_vllm_backends_inputs_and_outputs(cluster):
    metadata = cluster["client"].get_model_metadata(MODEL)
    assert metadata.name == MODEL and list(metadata.versions) == ["1"]
    inputs = {tensor.name: (tensor.datatype, list(tensor.shape)) for tensor in metadata.inputs}
    assert inputs["text_input"] == ("BYTES", [1])
    assert inputs["sampling_parameters"] == ("BYTES", [1])
    for flag in ("stream", "streaming", "exclude_input_in_output", "return_finish_reason"):
        assert inputs[flag] == ("BOOL", [1])
    outputs = {tensor.name: tensor.datatype for tensor in metadata.outputs}
    assert outputs == {
        "text_output": "BYTES",
        "finish_reason": "BYTES",
        "num_input_tokens": "UINT32",
        "num_output_tokens": "UINT32",
    }


def test_model_config_is_decoupled_and_parses_in_tritonclient(cluster):
    config = cluster["client"].get_model_config(MODEL).config
    assert config.name == MODEL and config.max_batch_size == 0
    assert config.model_transaction_policy.decoupled
    optional = {tensor.name: tensor.optional for tensor in config.input}
    assert optional["text_input"] is False and optional["stream"] is True


def test_an_unknown_model_is_not_found(cluster):
    client = cluster["client"]
    with pytest.raises(InferenceServerException) as raised:
        client.get_model_metadata("another-model")
    assert raised.value.status() == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException) as raised:
        client.infer("another-model", llm_inputs())
    assert raised.value.status() == "StatusCode.NOT_FOUND" and MODEL in raised.value.message()


# -- ModelInfer ---------------------------------------------------------------------------


def test_infer_returns_the_prompt_then_the_native_completion(cluster):
    expected = native_text(cluster["router"], **GREEDY)
    result = cluster["client"].infer(MODEL, llm_inputs())
    assert text_of(result) == PROMPT + expected.text


def test_infer_without_the_input_and_with_the_counts_and_finish_reason(cluster):
    expected = native_text(cluster["router"], **GREEDY)
    inputs = llm_inputs(
        exclude_input_in_output=True,
        return_finish_reason=True,
        return_num_input_tokens=True,
        return_num_output_tokens=True,
    )
    result = cluster["client"].infer(MODEL, inputs)
    assert text_of(result) == expected.text
    assert result.as_numpy("finish_reason")[0] == b"length"
    assert result.as_numpy("num_input_tokens").tolist() == [expected.usage.prompt_tokens]
    assert result.as_numpy("num_output_tokens").tolist() == [8]


def test_requested_outputs_select_among_those_produced(cluster):
    inputs = llm_inputs(return_finish_reason=True, return_num_output_tokens=True)
    outputs = [triton.InferRequestedOutput("num_output_tokens")]
    result = cluster["client"].infer(MODEL, inputs, outputs=outputs)
    assert [output.name for output in result.get_response().outputs] == ["num_output_tokens"]


def test_sampling_parameters_may_come_as_request_parameters(cluster):
    expected = native_text(cluster["router"], temperature=0, max_tokens=3, ignore_eos=True)
    parameters = {"temperature": 0, "max_tokens": "3", "ignore_eos": True}
    inputs = llm_inputs(sampling=None, exclude_input_in_output=True)
    result = cluster["client"].infer(MODEL, inputs, parameters=parameters)
    assert text_of(result) == expected.text


def test_stop_strings_end_the_text_before_them(cluster):
    free = native_text(cluster["router"], **GREEDY).text
    stop = free[4:7]
    sampling = {**GREEDY, "stop": stop}
    inputs = llm_inputs(sampling=sampling, exclude_input_in_output=True, return_finish_reason=True)
    result = cluster["client"].infer(MODEL, inputs)
    assert text_of(result) == free[: free.index(stop)]
    assert result.as_numpy("finish_reason")[0] == b"stop"


def _invalid(client, inputs, **options) -> str:
    with pytest.raises(InferenceServerException) as raised:
        client.infer(MODEL, inputs, **options)
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT", raised.value.message()
    return raised.value.message()


def _wrong_shape():
    tensor = triton.InferInput("text_input", [2], "BYTES")
    tensor.set_data_from_numpy(np.array([b"a", b"b"], dtype=np.object_))
    return [tensor]


BAD_REQUESTS = {
    # what is wrong: (the inputs, the name the error must give)
    "wrong datatype": ([bytes_input("text_input", PROMPT), bytes_input("stream", "no")], "stream"),
    "wrong shape": (_wrong_shape(), "text_input"),
    "unknown input": (llm_inputs() + [bool_input("return_logprobs", True)], "return_logprobs"),
    "missing prompt": ([bytes_input("sampling_parameters", "{}")], "text_input"),
    "bad JSON": (
        [bytes_input("text_input", PROMPT), bytes_input("sampling_parameters", "{")],
        "sampling_parameters",
    ),
    "unsupported sampling field": (llm_inputs(sampling={"n": 2, "best_of": 2}), "best_of, n"),
    "invalid sampling value": (
        llm_inputs(sampling={"top_p": 1.5}),
        "sampling_parameters.top_p",
    ),
    "ill-typed sampling value": (
        llm_inputs(sampling={"max_tokens": "many"}),
        "sampling_parameters.max_tokens",
    ),
    "empty prompt": (llm_inputs(prompt=""), "text_input"),
    "stream on ModelInfer": (llm_inputs(stream=True), "stream"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_tensors_are_invalid_argument_naming_the_input(cluster, case):
    inputs, name = BAD_REQUESTS[case]
    assert name in _invalid(cluster["client"], inputs)


def test_request_parameters_beside_the_sampling_input_are_invalid(cluster):
    message = _invalid(cluster["client"], llm_inputs(), parameters={"temperature": 1})
    assert "parameters" in message


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"priority": 2**32}, "parameters.priority"),  # past Triton's highest level number
        ({"headers": {"x-slo-ttft-ms": "soon"}}, "x-slo-ttft-ms"),
    ],
)
def test_a_bad_priority_or_ttft_target_is_invalid_argument_naming_it(cluster, options, name):
    assert _invalid(cluster["client"], llm_inputs(), **options).startswith(name)


def test_priority_and_a_ttft_target_leave_the_completion_as_it_was(cluster):
    expected = native_text(cluster["router"], **GREEDY)
    headers = {"x-slo-ttft-ms": "60000"}
    result = cluster["client"].infer(MODEL, llm_inputs(), priority=1, headers=headers)
    assert text_of(result) == PROMPT + expected.text


def test_a_request_past_its_timeout_parameter_is_deadline_exceeded_and_frees_its_kv(cluster):
    """Triton's `timeout` (microseconds) bounds the whole request; the call has none."""
    long = {"temperature": 0, "max_tokens": 3500, "ignore_eos": True}  # far more than 1 s
    started = time.monotonic()
    with pytest.raises(InferenceServerException) as raised:
        cluster["client"].infer(MODEL, llm_inputs(sampling=long), timeout=1_000_000)
    assert raised.value.status() == "StatusCode.DEADLINE_EXCEEDED", raised.value.message()
    assert time.monotonic() - started < STREAM_WAIT_S
    load = cluster["decode"].wait_idle(timeout_s=5)
    assert (load.free_blocks, load.open_leases, load.running) == (load.total_blocks, 0, 0)


# -- ModelStreamInfer ---------------------------------------------------------------------


def test_streamed_text_concatenates_to_the_native_generate(cluster):
    # long enough that a loaded machine cannot hand the whole output over in one message
    # (8 tokens once came as one: every delta had arrived before the stream was read)
    sampling = {**GREEDY, "max_tokens": 128}
    expected = native_text(cluster["router"], **sampling)
    flags = {"stream": True, "return_finish_reason": True, "return_num_output_tokens": True}
    [results] = stream(cluster["client"], {"one": llm_inputs(sampling=sampling, **flags)}).values()
    assert "".join(text_of(result) for result in results) == expected.text
    assert [is_final(result) for result in results] == [False] * (len(results) - 1) + [True]
    assert sum(int(r.as_numpy("num_output_tokens")[0]) for r in results) == 128
    reasons = [result.as_numpy("finish_reason")[0] for result in results]
    assert reasons[-1] == b"length" and set(reasons[:-1]) <= {b"None"}
    assert len(results) > 1  # it streamed


def test_streaming_is_accepted_as_the_name_of_stream(cluster):
    expected = native_text(cluster["router"], **GREEDY)
    [results] = stream(cluster["client"], {"dyn": llm_inputs(streaming=True)}).values()
    assert len(results) > 1 and "".join(map(text_of, results)) == expected.text


def test_requests_on_one_stream_run_side_by_side_matched_by_id(cluster):
    other = "A second prompt on the same stream"
    expected = {
        "a": native_text(cluster["router"], **GREEDY).text,
        "b": native_text(cluster["router"], other, **GREEDY).text,
    }
    requests = {"a": llm_inputs(stream=True), "b": llm_inputs(other, stream=True)}
    results = stream(cluster["client"], requests)
    assert {rid: "".join(map(text_of, got)) for rid, got in results.items()} == expected


def test_a_request_that_does_not_stream_gets_one_final_response_with_the_prompt(cluster):
    expected = native_text(cluster["router"], **GREEDY)
    [results] = stream(cluster["client"], {"whole": llm_inputs()}).values()
    assert len(results) == 1 and is_final(results[0])
    assert text_of(results[0]) == PROMPT + expected.text


def test_a_streamed_requests_error_is_its_response_and_the_stream_goes_on(cluster):
    client = cluster["client"]
    arrived: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: arrived.put((result, error)))
    try:
        client.async_stream_infer(MODEL, llm_inputs(sampling={"temperature": "hot"}))
        _, error = arrived.get(timeout=STREAM_WAIT_S)
        assert error is not None and "sampling_parameters.temperature" in error.message()
        bad_stream = llm_inputs(stream=True, exclude_input_in_output=False)
        client.async_stream_infer(MODEL, bad_stream)
        _, error = arrived.get(timeout=STREAM_WAIT_S)
        assert error is not None and "exclude_input_in_output" in error.message()
        client.async_stream_infer(MODEL, llm_inputs(stream=True), request_id="after")
        result, error = arrived.get(timeout=STREAM_WAIT_S)
        assert error is None and result.get_response().id == "after"
    finally:
        client.stop_stream(cancel_requests=True)


def _cancelled_requests(redis_client, created_after: float) -> set[bytes]:
    """The ids of the requests created after `created_after` (time.time()) that Redis
    records as cancelled: not an earlier test's, whose cancel may be recorded late."""
    keys = list(redis_client.scan_iter(match="pdserve:req:*"))
    records = [
        (key, RequestRecord.from_json(value))
        for key, value in zip(keys, redis_client.mget(keys) if keys else [], strict=True)
        if value is not None
    ]
    return {
        key
        for key, record in records
        if record.status is RequestPhase.CANCELLED and record.created_at >= created_after
    }


def test_a_cancelled_stream_cancels_its_request_and_frees_its_kv(cluster, redis_client):
    client = cluster["client"]
    started = time.time()
    arrived: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: arrived.put((result, error)))
    try:
        # far more tokens than the decode worker makes before wait_idle gives up
        long = {"temperature": 0, "max_tokens": 3500, "ignore_eos": True}
        client.async_stream_infer(MODEL, llm_inputs(sampling=long, stream=True))
        result, error = arrived.get(timeout=STREAM_WAIT_S)
        assert error is None and not is_final(result)
        held = cluster["decode"].load()
        assert held.free_blocks < held.total_blocks  # the request holds decode blocks now
    finally:
        client.stop_stream(cancel_requests=True)
    load = cluster["decode"].wait_idle(timeout_s=5)
    assert (load.free_blocks, load.open_leases, load.running) == (load.total_blocks, 0, 0)
    deadline = time.monotonic() + 5
    while len(_cancelled_requests(redis_client, started)) != 1:
        assert time.monotonic() < deadline, "the request was never recorded as cancelled"
        time.sleep(0.05)


def test_reflection_describes_the_inference_service_beside_the_routers(cluster):
    # a reflection client (grpcurl, Postman) can call both without the protos
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    with grpc.insecure_channel(cluster["router"]) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        assert {"inference.GRPCInferenceService", "pdserve.v1.Router"} <= set(
            database.get_services()
        )
        inference = database.FindFileContainingSymbol("inference.GRPCInferenceService")
        router = database.FindFileContainingSymbol("pdserve.v1.Router")
    assert "ModelStreamInfer" in {method.name for method in inference.service[0].method}
    assert "Generate" in {method.name for method in router.service[0].method}
