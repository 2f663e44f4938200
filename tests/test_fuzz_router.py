"""Fuzz: the router's public RPCs (Generate, Cancel, GetRequest, ModelInfo, ListWorkers,
Tokenize, Detokenize), KServe's ModelInfer, and raw bytes on every port.

A router and a "both" worker serve in this process (real apps, real server skeleton,
real Redis) on loopback. Calls go through one shared channel; then raw bytes go over
TCP to every port (the router's gRPC, its OpenAI HTTP port, the worker's gRPC) and
random HTTP requests (methods, paths, headers, bodies) to the gateway. Every answer
must be a status that is not INTERNAL/UNKNOWN (HTTP: never a 5xx but 503), every
INVALID_ARGUMENT must name its field, every server must still serve afterwards, and
every KV block must be free again.
"""

from __future__ import annotations

import json
import socket

import grpc
import httpx
import pytest
from fuzz_strategies import EDGE_STRINGS, fuzz_settings, messages
from fuzz_support import (
    Findings,
    InProcessServers,
    call_hostile,
    call_with_raw_bytes,
    engine_idle,
    methods_of,
    report,
    start_router,
    start_worker,
    wait_for,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import given
from hypothesis import strategies as st

from pdserve.api.inference import grpc_service_pb2 as kserve_pb2
from pdserve.api.v1 import router_pb2, router_pb2_grpc

# fuzzing: minutes of CPU (`make test-fast` skips it)
pytestmark = pytest.mark.slow

VOCAB = 1024  # the demo model's
CALL_TIMEOUT_S = 3.0
FINDINGS = Findings()
WIRE = Findings()  # raw bytes and HTTP
TOKENS = st.integers(3, VOCAB - 1)
SAMPLING = {
    "sampling.max_tokens": st.integers(1, 3),
    "sampling.temperature": st.sampled_from([0.0, 0.8]),
    "sampling.top_p": st.floats(0.05, 1.0),
    "sampling.logprobs": st.integers(0, 4),
    "sampling.stop_token_ids": TOKENS,
    "sampling.stop": st.text(min_size=1, max_size=4),
}
REQUEST_IDS = st.one_of(st.sampled_from(EDGE_STRINGS[:12]), st.uuids().map(str))


class Cluster:
    def __init__(self, worker, router, channel):
        self.worker, self.router, self.channel = worker, router, channel
        self.engine = worker.app.worker.engine
        self.stub = router_pb2_grpc.RouterStub(channel)
        # KServe's stubs hold messages only: the one method fuzzed here, by its path
        self.model_infer = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=kserve_pb2.ModelInferRequest.SerializeToString,
            response_deserializer=kserve_pb2.ModelInferResponse.FromString,
        )
        self.http = router.fields["http"]


@pytest.fixture(scope="module")
def cluster(demo_model_dir, redis_url, request):
    servers = InProcessServers()
    try:
        worker = start_worker(
            servers, demo_model_dir, "both", engine={"num_kv_blocks": 512, "max_model_len": 64}
        )
        router = start_router(
            servers, demo_model_dir, redis_url, both=[worker.address], http_port=0
        )
        with (
            grpc.insecure_channel(router.address) as channel,
            httpx.Client(
                base_url=f"http://{router.fields['http']}", timeout=CALL_TIMEOUT_S
            ) as http,
        ):
            cluster = Cluster(worker, router, channel)
            cluster.http_client = http
            yield cluster
            assert wait_for(lambda: engine_idle([worker.app.worker.engine]), within_s=20)
    finally:
        report(request.config, "fuzz, router RPCs in process", FINDINGS)
        report(request.config, "fuzz, raw bytes and HTTP over TCP", WIRE)
        servers.close()


# -- the public API --------------------------------------------------------------------------


@fuzz_settings(900)
@given(st.data())
def test_generate(cluster, data):
    hints = {
        **SAMPLING,
        "prompt.text": st.text(min_size=1, max_size=30),
        "prompt.token_ids.ids[]": st.lists(TOKENS, min_size=1, max_size=30),
        "request_id": REQUEST_IDS,
        "resume_from": st.integers(0, 4),
    }
    request = data.draw(messages(router_pb2.GenerateRequest, hints))
    call_hostile(
        "Generate", FINDINGS, lambda: list(cluster.stub.Generate(request, timeout=CALL_TIMEOUT_S))
    )


@fuzz_settings(400)
@given(st.data())
def test_request_id_calls(cluster, data):
    hints = {"request_id": REQUEST_IDS}
    cancel = data.draw(messages(router_pb2.CancelRequest, hints))
    call_hostile("Cancel", FINDINGS, lambda: cluster.stub.Cancel(cancel, timeout=CALL_TIMEOUT_S))
    get = data.draw(messages(router_pb2.GetRequestRequest, hints))
    call_hostile("GetRequest", FINDINGS, lambda: cluster.stub.GetRequest(get, timeout=5))


@fuzz_settings(400)
@given(st.data())
def test_model_info_list_workers_tokenize(cluster, data):
    stub = cluster.stub
    for method, cls in (
        ("ModelInfo", router_pb2.ModelInfoRequest),
        ("ListWorkers", router_pb2.ListWorkersRequest),
        ("Tokenize", router_pb2.TokenizeRequest),
        ("Detokenize", router_pb2.DetokenizeRequest),
    ):
        message = data.draw(messages(cls))
        call_hostile(method, FINDINGS, lambda m=method, r=message: getattr(stub, m)(r, timeout=5))


def _tensor(name: str, datatype: str, shape, elements) -> kserve_pb2.ModelInferRequest:
    tensor = kserve_pb2.ModelInferRequest.InferInputTensor(name=name, datatype=datatype)
    tensor.shape.extend(shape)
    if datatype == "BYTES":
        tensor.contents.bytes_contents.extend(elements)
    elif datatype == "BOOL":
        tensor.contents.bool_contents.extend(elements)
    return tensor


SAMPLING_JSON = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": st.one_of(st.integers(1, 3), st.integers(), st.just("7"), st.none()),
        "temperature": st.one_of(st.floats(0, 2), st.just("0.1"), st.just(float("nan"))),
        "stop": st.one_of(st.lists(st.text(max_size=3), max_size=3), st.text(max_size=3)),
        "seed": st.one_of(st.integers(), st.none()),
        "top_k": st.integers(-5, 50),
    },
).map(lambda d: json.dumps(d).encode())
INPUTS = st.lists(
    st.one_of(
        st.builds(
            _tensor,
            st.just("text_input"),
            st.sampled_from(["BYTES", "BYTES", "INT32"]),
            st.sampled_from([[1], [1], [2], [], [-1]]),
            st.lists(
                st.one_of(st.text(max_size=20).map(str.encode), st.binary(max_size=8)),
                min_size=1,
                max_size=2,
            ),
        ),
        st.builds(
            _tensor,
            st.just("sampling_parameters"),
            st.just("BYTES"),
            st.just([1]),
            st.lists(st.one_of(SAMPLING_JSON, st.binary(max_size=8)), min_size=1, max_size=1),
        ),
        st.builds(
            _tensor,
            st.sampled_from(["stream", "exclude_input_in_output", "return_finish_reason"]),
            st.just("BOOL"),
            st.just([1]),
            st.lists(st.booleans(), min_size=1, max_size=2),
        ),
    ),
    max_size=4,
)


# Most requests ask for one token: the gateway's default (16) made each call a generation.
SHORT = _tensor("sampling_parameters", "BYTES", [1], [b'{"max_tokens": 1}'])
SHORT_INPUTS = st.tuples(INPUTS, st.booleans()).map(lambda t: t[0] + [SHORT] * t[1])


@fuzz_settings(100)  # each a generation when it is valid: the slowest cases of the suite
@given(st.data())
def test_kserve_model_infer(cluster, data):
    name = cluster.router.app.config.model_name
    hints = {"model_name": st.just(name), "inputs[]": SHORT_INPUTS}
    request = data.draw(messages(kserve_pb2.ModelInferRequest, hints))
    call_hostile("ModelInfer", FINDINGS, lambda: cluster.model_infer(request, timeout=5))


METHODS = methods_of(
    router_pb2.DESCRIPTOR.services_by_name["Router"],
    kserve_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"],
)


@fuzz_settings(700)
@given(st.sampled_from(METHODS), st.lists(st.binary(max_size=200), min_size=1, max_size=3))
def test_random_bytes_as_requests(cluster, method, payloads):
    service, descriptor = method
    call_with_raw_bytes(cluster.channel, service, descriptor, payloads, FINDINGS, CALL_TIMEOUT_S)


# -- over TCP: raw bytes on every port, random HTTP at the gateway ---------------------------

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def _ports(cluster) -> list[str]:
    return [cluster.router.address, cluster.http, cluster.worker.address]


@fuzz_settings(400)
@given(st.integers(0, 2), st.booleans(), st.binary(max_size=512))
def test_raw_bytes_on_every_port(cluster, port_index, with_preface, payload):
    """Whatever arrives on a port, the server drops or answers it, and goes on serving."""
    host, port = _ports(cluster)[port_index].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=2) as sock:
        sock.sendall((PREFACE if with_preface else b"") + payload)
        sock.shutdown(socket.SHUT_WR)
        try:
            while sock.recv(65536):
                pass
        except (TimeoutError, ConnectionResetError):
            pass
    WIRE.record("raw bytes", grpc.StatusCode.OK, None)


HEADER_NAMES = st.sampled_from(
    ["content-type", "content-length", "authorization", "transfer-encoding", "accept", "x-a"]
)
HEADER_VALUES = st.one_of(
    st.sampled_from(["application/json", "text/plain", "Bearer x", "chunked", "-1", "9" * 30]),
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=20),
)
PATHS = st.one_of(
    st.sampled_from(
        [
            "/v1/completions",
            "/v1/chat/completions",
            "/v1/models",
            "/v1/models/x",
            "/health",
            "/version",
            "/metrics",
            "/",
            "/v1/completions/../../etc/passwd",
            "/%00",
            "/v1//models",
        ]
    ),
    st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=30).map(
        lambda s: "/" + s
    ),
)
JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=10)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
COMPLETION_BODIES = st.fixed_dictionaries(
    {"model": st.one_of(st.just("demo"), st.text(max_size=5))},
    optional={
        "prompt": st.one_of(st.text(max_size=20), st.lists(TOKENS, max_size=5), JSON_VALUES),
        "messages": st.one_of(
            st.lists(
                st.fixed_dictionaries(
                    {
                        "role": st.sampled_from(["user", "system", "x"]),
                        "content": st.text(max_size=10),
                    }
                ),
                max_size=2,
            ),
            JSON_VALUES,
        ),
        "max_tokens": st.one_of(st.integers(1, 3), st.integers(), JSON_VALUES),
        "temperature": st.one_of(st.floats(), JSON_VALUES),
        "stream": st.booleans(),
        "n": st.integers(-1, 3),
        "logprobs": st.one_of(st.integers(-1, 5), st.booleans()),
        "stop": JSON_VALUES,
    },
)
BODIES = st.one_of(
    COMPLETION_BODIES.map(lambda d: json.dumps(d).encode()),
    st.binary(max_size=200),
    JSON_VALUES.map(lambda v: json.dumps(v).encode()),
)


@fuzz_settings(700)
@given(
    st.sampled_from(["GET", "POST", "PUT", "DELETE", "OPTIONS", "HEAD", "PATCH"]),
    PATHS,
    st.dictionaries(HEADER_NAMES, HEADER_VALUES, max_size=3),
    BODIES,
)
def test_random_http_requests(cluster, method, path, headers, body):
    # httpx sets the framing headers itself and sends no value HTTP forbids
    headers = {
        k: v.strip() or "x"
        for k, v in headers.items()
        if k not in ("content-length", "transfer-encoding")
    }
    try:
        response = cluster.http_client.request(method, path, headers=headers, content=body)
    except httpx.TimeoutException:
        WIRE.record("HTTP", grpc.StatusCode.DEADLINE_EXCEEDED, path)
        return
    WIRE.record("HTTP", grpc.StatusCode.OK, None)
    assert response.status_code < 500 or response.status_code == 503, (
        f"{method} {path}: {response.status_code} {response.text[:300]}"
    )


def test_every_port_still_serves_after_the_fuzzing(cluster):
    for address in (cluster.router.address, cluster.worker.address):
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert httpx.get(f"http://{cluster.http}/health", timeout=5).status_code == 200
    reply = cluster.stub.Generate(
        router_pb2.GenerateRequest(
            token_ids=router_pb2.TokenIds(ids=[5, 6, 7]),
            sampling={"max_tokens": 2, "ignore_eos": True},
        ),
        timeout=30,
    )
    assert sum(len(r.token_ids) for r in reply) == 2
