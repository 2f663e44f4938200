"""One trace across processes, over the real protocol: a local cluster (router, prefill
and decode worker, as `pdserve up` starts them) exports OTLP/gRPC to a trace receiver
this test runs (opentelemetry-proto's TraceService on loopback).

One Generate, sent with a client's traceparent, must arrive as one trace holding spans
of all three services (each named after its role, whatever OTEL_SERVICE_NAME the caller
had), linked parent to child across the processes, with a KV-transfer span counting
exactly the prompt's KV bytes.
"""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from pdserve.api.v1 import router_pb2, router_pb2_grpc
from pdserve.cluster.local import ClusterShape, LocalCluster
from pdserve.core.block_hash import num_blocks_for
from pdserve.core.model_config import ModelConfig
from pdserve.core.sampling_params import SamplingParams
from pdserve.rpc.wire import sampling_params_to_proto

pytestmark = pytest.mark.cluster

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN_ID = "b7ad6b7169203331"
BLOCK_SIZE = 16  # the engine's default
DTYPE_BYTES = 4  # float32, the default dtype on CPU
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SERVICES = {"pdserve-router", "pdserve-prefill", "pdserve-decode"}


def _value(any_value):
    return getattr(any_value, any_value.WhichOneof("value"))


def attributes_of(key_values) -> dict:
    return {kv.key: _value(kv.value) for kv in key_values}


class TraceReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace endpoint keeping every span with its service's name."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []  # (service.name, Span proto)
        self._arrived = threading.Condition()

    def Export(self, request, context):
        with self._arrived:
            for resource_spans in request.resource_spans:
                service = attributes_of(resource_spans.resource.attributes)["service.name"]
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend((service, span) for span in scope_spans.spans)
            self._arrived.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str, names: set[tuple[str, str]], timeout_s: float = 30.0):
        """The (service, span) pairs of `trace_id` once every (service, name) has come."""

        def spans():
            return [(svc, s) for svc, s in self.spans if s.trace_id.hex() == trace_id]

        with self._arrived:
            self._arrived.wait_for(
                lambda: names <= {(svc, s.name) for svc, s in spans()}, timeout_s
            )
            return spans()


@pytest.fixture(scope="module")
def receiver():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    receiver = TraceReceiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield receiver, port
    finally:
        server.stop(grace=None)


@pytest.fixture(scope="module")
def cluster(receiver, demo_model_dir, redis_url, tmp_path_factory):
    _, port = receiver
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # ms: spans leave within the test
        env.setenv("OTEL_SERVICE_NAME", "one-name-for-all")  # each child gets its role's
        env.delenv("OTEL_SDK_DISABLED", raising=False)
        run_dir = tmp_path_factory.mktemp("otlp-cluster")
        shape = ClusterShape(prefill=1, decode=1)
        with LocalCluster(str(demo_model_dir), shape, run_dir, redis=redis_url) as cluster:
            yield cluster


EXPECTED = {
    ("pdserve-router", "text_completion tiny"),
    ("pdserve-router", "admit"),
    ("pdserve-router", "prefill"),
    ("pdserve-decode", "admit"),
    ("pdserve-prefill", "prefill"),
    ("pdserve-prefill", "kv_transfer send"),
    ("pdserve-decode", "kv_transfer receive"),
    ("pdserve-decode", "decode"),
}


def test_one_generate_is_one_trace_across_router_prefill_and_decode(
    receiver, cluster, demo_model_dir
):
    spans_of, _ = receiver
    with grpc.insecure_channel(cluster.router_address) as channel:
        request = router_pb2.GenerateRequest(
            text="Every hop carries the trace context",
            sampling=sampling_params_to_proto(GREEDY),
            request_id="otlp-1",
        )
        traceparent = (("traceparent", f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01"),)
        stub = router_pb2_grpc.RouterStub(channel)
        [response] = stub.Generate(request, metadata=traceparent, timeout=60)
        info = stub.GetRequest(router_pb2.GetRequestRequest(request_id="otlp-1"))
    assert info.trace_id == TRACE_ID

    traced = spans_of.trace(TRACE_ID, EXPECTED)
    assert {(service, span.name) for service, span in traced} >= EXPECTED
    assert {service for service, _ in traced} == SERVICES
    by_id = {span.span_id.hex(): (service, span) for service, span in traced}

    def one(service: str, name: str):
        [span] = [s for svc, s in traced if (svc, s.name) == (service, name)]
        return span

    root = one("pdserve-router", "text_completion tiny")
    assert root.parent_span_id.hex() == CLIENT_SPAN_ID  # the client's span: not ours
    for service, span in traced:  # every other span hangs below the request, in any process
        assert span is root or span.parent_span_id.hex() in by_id, (service, span.name)
    links = {
        ("pdserve-decode", "admit"): ("pdserve-router", "admit"),
        ("pdserve-prefill", "prefill"): ("pdserve-router", "prefill"),
        ("pdserve-prefill", "kv_transfer send"): ("pdserve-prefill", "prefill"),
        ("pdserve-decode", "kv_transfer receive"): ("pdserve-prefill", "kv_transfer send"),
        ("pdserve-decode", "decode"): ("pdserve-router", "text_completion tiny"),
    }
    for child, expected_parent in links.items():
        parent_service, parent_span = by_id[one(*child).parent_span_id.hex()]
        assert (parent_service, parent_span.name) == expected_parent, child

    model = ModelConfig.from_dir(demo_model_dir)
    num_blocks = num_blocks_for(response.usage.prompt_tokens, BLOCK_SIZE)
    kv_bytes = model.num_layers * 2 * num_blocks * BLOCK_SIZE * model.num_kv_heads
    kv_bytes *= model.head_dim * DTYPE_BYTES
    for side in (
        ("pdserve-prefill", "kv_transfer send"),
        ("pdserve-decode", "kv_transfer receive"),
    ):
        attributes = attributes_of(one(*side).attributes)
        assert attributes["pdserve.kv_transfer.bytes"] == kv_bytes, side
        assert attributes["pdserve.request_id"] == "otlp-1", side
