"""One request's trace, in process: a router, a prefill and a decode worker serving on
loopback from this process, their spans caught by an in-memory exporter.

The span tree of a disaggregated request, its parent links across the three servers
(which only the W3C context in each call's metadata, or in the Relay attach, makes),
its GenAI attributes, and the KV byte counts on both sides of the transfer. Then the
set-up from the OTEL_* variables, and what "off" leaves installed: nothing.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import grpc
import pytest
from opentelemetry import baggage, propagate, trace
from opentelemetry import context as otel_context
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
    OTLPSpanExporter as GrpcSpanExporter,
)
from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    OTLPSpanExporter as HttpSpanExporter,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON
from opentelemetry.trace import (
    INVALID_SPAN,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    StatusCode,
    TraceFlags,
    TraceState,
    format_span_id,
    format_trace_id,
)

from pdserve import router_server
from pdserve.api.v1 import router_pb2, router_pb2_grpc
from pdserve.client import AsyncClient
from pdserve.cluster.processes import service_env
from pdserve.core.block_hash import num_blocks_for
from pdserve.core.model_config import ModelConfig
from pdserve.core.phase import RequestPhase
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.router.config import RouterConfig
from pdserve.router.disaggregation import PlacementMode
from pdserve.router.session import Progress
from pdserve.rpc.wire import sampling_params_to_proto
from pdserve.telemetry import propagation, trace_export, tracing
from pdserve.telemetry.request import RequestTelemetry
from pdserve.worker import server as worker_server
from pdserve.worker.config import WorkerConfig

pytestmark = pytest.mark.cluster

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01"
PROMPT = "Tracing follows one request through every process it touches"
SAMPLING = SamplingParams(
    temperature=0.7, top_p=0.9, top_k=20, seed=7, max_tokens=6, ignore_eos=True
)
BLOCK_SIZE = 16
DTYPE_BYTES = 4  # float32
EXPORTER_TYPES = {"grpc": GrpcSpanExporter, "http": HttpSpanExporter}
OTEL_VARIABLES = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_SDK_DISABLED",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
)


class SpanCatcher(InMemorySpanExporter):
    """An in-memory exporter that says when spans arrive, so that tests wait on an event."""

    def __init__(self) -> None:
        super().__init__()
        self._arrived = threading.Condition()

    def export(self, spans):
        result = super().export(spans)
        with self._arrived:
            self._arrived.notify_all()
        return result

    def trace(self, trace_id: str, names: set, timeout_s: float = 20.0) -> list:
        """The finished spans of `trace_id`, once every one of `names` is among them: a
        name, or a (name, kind) where a client's span and its server's share the name
        (the server's may come later: a worker hands its leaf spans over in batches)."""

        def spans():
            return [
                s
                for s in self.get_finished_spans()
                if format_trace_id(s.context.trace_id) == trace_id
            ]

        def arrived() -> bool:
            found = spans()
            return names <= {s.name for s in found} | {(s.name, s.kind) for s in found}

        with self._arrived:
            self._arrived.wait_for(arrived, timeout_s)
        return spans()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServersThread:
    """A prefill worker, a decode worker and a router (static discovery), serving on an
    event loop of a thread of their own until `stop`."""

    def __init__(self, model_dir, redis_url: str):
        prefill, decode = (f"127.0.0.1:{free_port()}" for _ in range(2))
        self.router = f"127.0.0.1:{free_port()}"
        self.configs = [
            _worker_config("prefill", model_dir, prefill),
            _worker_config("decode", model_dir, decode),
        ]
        self.router_config = RouterConfig(
            model=str(model_dir),
            redis_url=redis_url,
            port=int(self.router.rpartition(":")[2]),
            discovery="static",
            prefill=[prefill],
            decode=[decode],
            grace_s=1.0,
            prefill_placement=PlacementMode.REMOTE,  # the whole path: prefill, KV, decode
        )
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._main(),))

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        servers = [worker_server.serve(config, self._stop) for config in self.configs]
        await asyncio.gather(*servers, router_server.serve(self.router_config, self._stop))

    def start(self) -> ServersThread:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=60)


def _worker_config(role: str, model_dir, address: str) -> WorkerConfig:
    engine = EngineConfig(model=str(model_dir), block_size=BLOCK_SIZE, num_kv_blocks=64)
    port = int(address.rpartition(":")[2])
    return WorkerConfig(role=role, engine=engine, port=port, threads=1, grace_s=1.0)


def wait_for_workers(stub, timeout_s: float = 30.0) -> None:
    for _ in range(int(timeout_s / 0.1)):
        try:
            listed = stub.ListWorkers(router_pb2.ListWorkersRequest(), wait_for_ready=True)
        except grpc.RpcError:
            listed = None
        if listed is not None and sum(w.healthy for w in listed.workers) >= 2:
            return
        time.sleep(0.1)
    raise TimeoutError("the router never saw both workers")


@pytest.fixture(scope="module")
def catcher():
    return SpanCatcher()


@pytest.fixture(scope="module")
def tracer_provider(catcher):
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(catcher))
    tracing.install(provider)
    yield provider
    tracing.uninstall()
    provider.shutdown()


@pytest.fixture(scope="module")
def servers(tracer_provider, demo_model_dir, redis_url):
    with pytest.MonkeyPatch.context() as env:
        for name in OTEL_VARIABLES:  # the servers' own set-up must leave the test's in place
            env.delenv(name, raising=False)
        running = ServersThread(demo_model_dir, redis_url).start()
        try:
            yield running
        finally:
            running.stop()


@pytest.fixture(scope="module")
def router(servers):
    with grpc.insecure_channel(servers.router) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        wait_for_workers(stub)
        yield stub


def generate(stub, request_id: str, metadata=(), **urgency) -> list[router_pb2.GenerateResponse]:
    """Stream one request; `urgency`: its `priority` and `ttft_slo_ms`."""
    request = router_pb2.GenerateRequest(
        text=PROMPT,
        sampling=sampling_params_to_proto(SAMPLING),
        request_id=request_id,
        stream=True,
        **urgency,
    )
    return list(stub.Generate(request, metadata=metadata, timeout=60))


REQUEST_SPAN = "text_completion tiny"  # the demo model's directory is called tiny
TREE = {REQUEST_SPAN, "route decode", ("admit", SpanKind.CLIENT), ("admit", SpanKind.SERVER)}
TREE |= {"route prefill", ("prefill", SpanKind.CLIENT), ("prefill", SpanKind.SERVER)}
TREE |= {"kv_transfer send", "kv_transfer receive", "decode"}


@pytest.fixture(scope="module")
def traced(router, catcher):
    """One request sent with a client's traceparent: (its messages, its spans)."""
    metadata = (("traceparent", TRACEPARENT),)
    messages = generate(router, "traced-1", metadata, priority=-2, ttft_slo_ms=30_000)
    return messages, catcher.trace(TRACE_ID, TREE)


def one(spans, name: str, kind: SpanKind | None = None):
    [found] = [s for s in spans if s.name == name and (kind is None or s.kind == kind)]
    return found


def parent_of(span) -> str:
    return format_span_id(span.parent.span_id) if span.parent else ""


def span_id(span) -> str:
    return format_span_id(span.context.span_id)


def test_one_request_is_one_trace_under_the_clients_span(traced):
    _, spans = traced
    request = one(spans, REQUEST_SPAN)
    assert request.kind == SpanKind.SERVER
    assert parent_of(request) == CLIENT_SPAN_ID and request.parent.is_remote
    # every other span of the trace hangs below the request span, none elsewhere
    by_id = {span_id(s): s for s in spans}
    for span in spans:
        if span is not request:
            assert parent_of(span) in by_id, span.name
    assert {s.attributes["pdserve.request_id"] for s in spans} == {"traced-1"}


def test_the_hand_off_spans_link_across_the_three_servers(traced):
    _, spans = traced
    request = one(spans, REQUEST_SPAN)
    for name in ("route decode", "route prefill"):
        assert parent_of(one(spans, name)) == span_id(request)
    # each call from the router: a CLIENT span there, the worker's SERVER span below it
    for name in ("admit", "prefill"):
        client, served = one(spans, name, SpanKind.CLIENT), one(spans, name, SpanKind.SERVER)
        assert parent_of(client) == span_id(request)
        assert parent_of(served) == span_id(client) and served.parent.is_remote
    # the KV push: from the prefill worker's span, over PushKV, to the decode worker
    send, receive = one(spans, "kv_transfer send"), one(spans, "kv_transfer receive")
    assert parent_of(send) == span_id(one(spans, "prefill", SpanKind.SERVER))
    assert parent_of(receive) == span_id(send) and receive.parent.is_remote
    # decoding, as the Relay attach carried the request's context
    decode = one(spans, "decode")
    assert parent_of(decode) == span_id(request) and decode.kind == SpanKind.SERVER


def test_the_request_span_has_the_genai_attributes_and_no_text(traced):
    messages, spans = traced
    attributes = one(spans, REQUEST_SPAN).attributes
    usage = messages[-1].usage
    assert attributes["gen_ai.operation.name"] == "text_completion"
    assert attributes["gen_ai.provider.name"] == "pdserve"
    assert attributes["gen_ai.request.model"] == "tiny"
    assert attributes["gen_ai.request.max_tokens"] == SAMPLING.max_tokens
    assert attributes["gen_ai.request.temperature"] == pytest.approx(SAMPLING.temperature)
    assert attributes["gen_ai.request.top_p"] == pytest.approx(SAMPLING.top_p)
    assert attributes["gen_ai.request.top_k"] == SAMPLING.top_k
    assert attributes["gen_ai.request.seed"] == SAMPLING.seed
    assert attributes["pdserve.request.priority"] == -2
    assert attributes["pdserve.request.ttft_slo_ms"] == 30_000
    assert attributes["pdserve.request.ttft_slo_met"] is True  # 30 s: kept
    assert attributes["gen_ai.response.id"] == "traced-1"
    assert list(attributes["gen_ai.response.finish_reasons"]) == ["length"]
    assert attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens == 6
    latency = {
        name: attributes[f"gen_ai.latency.{name}"]
        for name in ("time_in_queue", "time_to_first_token", "e2e")
    }
    assert 0 < latency["time_in_queue"] < latency["time_to_first_token"] < latency["e2e"]
    output = "".join(m.text for m in messages)
    for span in spans:  # prompts and outputs are never recorded
        for value in span.attributes.values():
            assert PROMPT not in str(value) and (len(output) < 8 or output not in str(value))


def test_the_placement_is_an_event_of_the_request_span_and_its_inputs_are_on_route_decode(
    traced,
):
    _, spans = traced
    [event] = [e for e in one(spans, REQUEST_SPAN).events if e.name == "pdserve.placement"]
    route = one(spans, "route decode").attributes
    # the event says what was decided and why; what it weighed is one level down, once
    assert dict(event.attributes) == {
        "pdserve.placement": "remote",
        "pdserve.placement.reason": route["pdserve.placement.reason"],
    }
    assert route["pdserve.placement"] == "remote"
    assert route["pdserve.placement.prompt_tokens"] > 0


def test_a_span_block_ends_its_span_restores_the_current_one_and_marks_errors(
    tracer_provider, catcher
):
    outer = trace.get_current_span()
    block = tracing.span("lookup", "block-1", attributes={"pdserve.worker": "w:1"})
    with pytest.raises(KeyError), block as inner:
        assert trace.get_current_span() is inner
        raise KeyError("gone")
    assert trace.get_current_span() is outer
    [span] = catcher.trace(format_trace_id(inner.get_span_context().trace_id), {"lookup"})
    assert span.end_time is not None and span.status.status_code == StatusCode.ERROR
    assert dict(span.attributes) == {
        "pdserve.request_id": "block-1",
        "pdserve.worker": "w:1",
        "error.type": "KeyError",
    }


def test_a_span_reaches_the_sdk_with_the_ids_and_times_it_ran(tracer_provider, catcher):
    """A span started on an event loop, as a request's are, reaches the processors with
    the ids its children carried and the times it ran."""

    async def decide():
        with tracing.span("request", "deferred-1") as parent:
            before = time.time_ns()
            with pytest.raises(KeyError), tracing.start_span("route decode", "deferred-1") as s:
                s.set_attribute("pdserve.worker", "w:1")
                s.add_event("tried", {"pdserve.worker": "w:0"})
                raise KeyError("no worker")
            after = time.time_ns()
        return parent.get_span_context(), before, after

    parent, before, after = asyncio.run(decide())
    spans = catcher.trace(format_trace_id(parent.trace_id), {"request", "route decode"})
    span = one(spans, "route decode")
    assert one(spans, "request").context == parent
    assert parent_of(span) == format_span_id(parent.span_id)
    assert before <= span.start_time <= span.end_time <= after  # when it ran, not the flush
    assert span.status.status_code == StatusCode.ERROR
    assert dict(span.attributes) == {
        "pdserve.request_id": "deferred-1",
        "pdserve.worker": "w:1",
        "error.type": "KeyError",
    }
    [event] = span.events
    assert (event.name, dict(event.attributes)) == ("tried", {"pdserve.worker": "w:0"})
    assert before <= event.timestamp <= after


UNSAMPLED_PARENT = SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=TraceFlags(0))


@pytest.mark.parametrize(
    ("sampler", "parent"),
    [
        (ALWAYS_OFF, None),  # the sampler's own call decides
        (None, UNSAMPLED_PARENT),  # the default sampler follows its parent
    ],
    ids=["always_off", "default-unsampled-parent"],
)
def test_a_span_the_sampler_drops_still_hands_its_context_on(tracer_provider, sampler, parent):
    """Dropped, a span records nothing, but its children carry its ids and sampled=0."""
    catcher = SpanCatcher()  # the provider's shutdown stops it
    provider = TracerProvider(sampler=sampler)
    provider.add_span_processor(SimpleSpanProcessor(catcher))
    tracing.install(provider)
    current = NonRecordingSpan(parent) if parent else INVALID_SPAN  # a root without one
    token = otel_context.attach(trace.set_span_in_context(current))
    try:
        with tracing.span("request", "dropped-1") as dropped:
            child = tracing.start_span("route decode", "dropped-1")
            child.end()
        context = dropped.get_span_context()
        assert not dropped.is_recording() and context.is_valid
        assert not context.trace_flags.sampled
        if parent is not None:
            assert context.trace_id == parent.trace_id and context.span_id != parent.span_id
        assert child.get_span_context().trace_id == context.trace_id
        tracing.flush()
        assert not catcher.trace(format_trace_id(context.trace_id), set(), timeout_s=0)
    finally:
        otel_context.detach(token)
        tracing.install(tracer_provider)  # the module's
        provider.shutdown()


def test_span_limits_bound_what_a_span_exports_as_the_sdks_own(tracer_provider, monkeypatch):
    """OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT and OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT, as the SDK
    applies them (the oldest attribute dropped, long strings cut)."""
    catcher = SpanCatcher()  # the provider's shutdown stops it
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "2")
    monkeypatch.setenv("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "3")
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(catcher))
    given = {"a": "abcdef", "b": 1}
    tracing.install(provider)
    try:
        ours = tracing.start_span("limited", "limited-1", attributes=given)
        ours.end()  # no event loop runs here: to the processors at once
        sdks = provider.get_tracer("t").start_span(
            "limited", attributes={tracing.REQUEST_ID: "limited-1", **given}
        )
        sdks.end()
        [exported] = catcher.trace(format_trace_id(ours.get_span_context().trace_id), set())
        [expected] = catcher.trace(format_trace_id(sdks.get_span_context().trace_id), set())
        assert dict(exported.attributes) == dict(expected.attributes) == {"a": "abc", "b": 1}
        assert exported.dropped_attributes == expected.dropped_attributes == 1
    finally:
        tracing.install(tracer_provider)  # the module's
        provider.shutdown()


def test_off_a_span_is_the_no_op_span(tracer_provider):
    tracing.uninstall()
    try:
        assert tracing.start_span("route decode", "r") is INVALID_SPAN
    finally:
        tracing.install(tracer_provider)


def test_worker_spans_say_what_prefill_and_decode_did(traced):
    messages, spans = traced
    prefill = one(spans, "prefill", SpanKind.SERVER).attributes
    assert prefill["gen_ai.usage.input_tokens"] == messages[-1].usage.prompt_tokens
    assert prefill["pdserve.prefill.cached_tokens"] == 0
    assert prefill["gen_ai.latency.time_in_queue"] >= 0
    assert prefill["gen_ai.latency.time_in_model_prefill"] > 0
    decode = one(spans, "decode").attributes
    assert decode["gen_ai.usage.output_tokens"] == SAMPLING.max_tokens - 1  # 1: prefill's
    assert decode["pdserve.decode.time_per_output_token"] > 0


def test_both_sides_of_the_kv_transfer_count_the_prompts_kv_bytes(traced, demo_model_dir):
    messages, spans = traced
    model = ModelConfig.from_dir(demo_model_dir)
    num_blocks = num_blocks_for(messages[-1].usage.prompt_tokens, BLOCK_SIZE)
    kv_bytes = model.num_layers * 2 * num_blocks * BLOCK_SIZE * model.num_kv_heads
    kv_bytes *= model.head_dim * DTYPE_BYTES
    for name in ("kv_transfer send", "kv_transfer receive"):
        attributes = one(spans, name).attributes
        assert attributes["pdserve.kv_transfer.bytes"] == kv_bytes, name
        assert attributes["pdserve.kv_transfer.layers"] == model.num_layers, name
        assert attributes["pdserve.kv_transfer.chunks"] >= model.num_layers, name


def test_get_request_returns_the_trace_id(router, traced):
    info = router.GetRequest(router_pb2.GetRequestRequest(request_id="traced-1"))
    assert info.trace_id == TRACE_ID


def test_without_a_traceparent_the_router_starts_the_trace(router, catcher):
    generate(router, "untraced-1")
    info = router.GetRequest(router_pb2.GetRequestRequest(request_id="untraced-1"))
    assert len(info.trace_id) == 32 and info.trace_id != TRACE_ID
    spans = catcher.trace(info.trace_id, TREE)
    assert one(spans, REQUEST_SPAN).parent is None
    assert {s.attributes["pdserve.request_id"] for s in spans} == {"untraced-1"}


def test_the_python_client_sends_its_callers_trace_context(servers, router, catcher):
    async def call_inside_a_span() -> str:
        app_tracer = TracerProvider().get_tracer("app")  # the application's own SDK
        with app_tracer.start_as_current_span("app work") as app_span:
            async with AsyncClient(servers.router) as client:
                await client.generate(PROMPT, SAMPLING, request_id="client-traced-1")
        return format(app_span.get_span_context().span_id, "016x")

    app_span_id = asyncio.run(call_inside_a_span())
    info = router.GetRequest(router_pb2.GetRequestRequest(request_id="client-traced-1"))
    root = one(catcher.trace(info.trace_id, TREE), REQUEST_SPAN)
    assert parent_of(root) == app_span_id


def test_a_failed_request_marks_its_spans_failed_with_the_error_type(router, catcher):
    # more KV than the decode worker has (64 blocks): its Admit refuses the request
    too_long = SamplingParams(temperature=0.0, max_tokens=1100, ignore_eos=True)
    request = router_pb2.GenerateRequest(
        text=PROMPT, sampling=sampling_params_to_proto(too_long), request_id="failed-1"
    )
    with pytest.raises(grpc.RpcError) as failed:
        list(router.Generate(request, timeout=60))
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    info = router.GetRequest(router_pb2.GetRequestRequest(request_id="failed-1"))
    spans = catcher.trace(info.trace_id, {REQUEST_SPAN, ("admit", SpanKind.SERVER)})
    request_span = one(spans, REQUEST_SPAN)
    assert request_span.status.status_code == StatusCode.ERROR
    assert request_span.attributes["error.type"] == "INVALID_ARGUMENT"
    assert request_span.attributes["pdserve.outcome"] == "failed"
    admitted = one(spans, "admit", SpanKind.SERVER)
    assert admitted.status.status_code == StatusCode.ERROR
    assert admitted.attributes["error.type"] == "InvalidRequestError"


def test_retries_and_failovers_are_events_of_the_request_span(tracer_provider, catcher):
    unavailable = grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone"
    )
    telemetry = RequestTelemetry(
        "events-1", sampling_params_to_proto(SAMPLING), model="tiny", prompt_tokens=3
    )
    telemetry.on_failover("127.0.0.1:1", unavailable)
    telemetry.on_retry(1, unavailable)
    telemetry.finish(Progress(), RequestPhase.CANCELLED, "abort", completion_tokens=0)
    [span] = catcher.trace(telemetry.trace_id, {REQUEST_SPAN})
    events = [(e.name, dict(e.attributes)) for e in span.events]
    assert events == [
        ("failover", {"pdserve.worker": "127.0.0.1:1", "error.type": "UNAVAILABLE"}),
        ("retry", {"pdserve.attempt": 1, "error.type": "UNAVAILABLE"}),
    ]
    assert span.status.status_code == StatusCode.UNSET  # a cancel is no error
    assert list(span.attributes["gen_ai.response.finish_reasons"]) == ["abort"]


# -- set-up from the standard variables -------------------------------------------------


@pytest.fixture
def otel_env(monkeypatch):
    for name in OTEL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def exporter_of(provider):
    [processor] = provider._active_span_processor._span_processors
    assert isinstance(processor, BatchSpanProcessor)
    return processor._batch_processor._exporter


def test_without_an_endpoint_tracing_is_off(otel_env):
    assert trace_export.provider_from_env("router") is None
    otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    otel_env.setenv("OTEL_SDK_DISABLED", "true")
    assert trace_export.provider_from_env("router") is None


@pytest.mark.parametrize(
    ("protocol", "module"),
    [(None, "grpc"), ("grpc", "grpc"), ("http/protobuf", "http")],
)
def test_an_endpoint_turns_tracing_on_with_its_protocol(otel_env, protocol, module):
    otel_env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:4317")
    if protocol is not None:
        otel_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    provider = trace_export.provider_from_env("decode")
    try:
        exporter = exporter_of(provider)
        assert isinstance(exporter, EXPORTER_TYPES[module])
        assert provider.resource.attributes["service.name"] == "pdserve-decode"
    finally:
        provider.shutdown()


def test_an_unknown_protocol_is_refused(otel_env):
    otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    otel_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="http/json"):
        trace_export.provider_from_env("router")


def test_service_name_resource_and_sampler_come_from_the_variables(otel_env):
    otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    otel_env.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=staging")
    otel_env.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    otel_env.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    provider = trace_export.provider_from_env("prefill")
    try:
        attributes = provider.resource.attributes
        assert attributes["service.name"] == "pdserve-prefill"  # the role's, by default
        assert attributes["deployment.environment"] == "staging"
        assert provider.sampler.rate == 0.25
    finally:
        provider.shutdown()
    otel_env.setenv("OTEL_SERVICE_NAME", "edge-router")
    provider = trace_export.provider_from_env("router")
    try:
        assert provider.resource.attributes["service.name"] == "edge-router"
    finally:
        provider.shutdown()


def test_off_nothing_is_installed_and_spans_cost_nothing(tracer_provider):
    tracing.uninstall()
    try:
        assert not tracing.enabled()
        assert tracing.start_span("decode", "r") is INVALID_SPAN
        assert propagation.outgoing_metadata() is None
        assert propagation.trace_carrier() == {}
        assert tracing.context_with(INVALID_SPAN) is None
    finally:
        tracing.install(tracer_provider)


def carried(context) -> tuple:
    """What a context carries to the next hop: its span's context and its baggage."""
    return trace.get_current_span(context).get_span_context(), dict(baggage.get_all(context))


def sdk_headers() -> dict[str, str]:
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


@pytest.mark.parametrize("sampled", [True, False])
def test_a_lone_traceparent_is_written_as_the_sdk_writes_it(tracer_provider, sampled):
    sampler = ALWAYS_ON if sampled else ALWAYS_OFF
    span = TracerProvider(sampler=sampler).get_tracer("t").start_span("s")
    with trace.use_span(span):
        assert propagation.W3CTraceparent.write() == sdk_headers()
        assert propagation.trace_carrier() == sdk_headers()
    assert propagation.W3CTraceparent.write() == {} == sdk_headers()  # no span: no header


def test_a_tracestate_or_baggage_is_left_to_the_sdk(tracer_provider):
    span_context = SpanContext(
        int(TRACE_ID, 16), int(CLIENT_SPAN_ID, 16), True, TraceFlags(1), TraceState([("k", "v")])
    )
    with trace.use_span(NonRecordingSpan(span_context)):
        assert propagation.W3CTraceparent.write() is None
        assert (
            propagation.trace_carrier()
            == sdk_headers()
            == {
                "traceparent": TRACEPARENT,
                "tracestate": "k=v",
            }
        )
    token = otel_context.attach(baggage.set_baggage("tenant", "a"))
    try:
        assert propagation.W3CTraceparent.write() is None
        assert propagation.trace_carrier() == sdk_headers() == {"baggage": "tenant=a"}
    finally:
        otel_context.detach(token)


@pytest.mark.parametrize("flags", ["00", "01", "03"])
def test_a_lone_traceparent_is_read_as_the_sdk_reads_it(tracer_provider, flags):
    carrier = {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-{flags}"}
    fast = propagation.W3CTraceparent.read(carrier)
    assert carried(fast) == carried(propagate.extract(carrier))
    span_context = trace.get_current_span(fast).get_span_context()
    assert span_context.is_remote and span_context.trace_flags == int(flags, 16)
    assert carried(propagation.parent_from(carrier)) == carried(propagate.extract(carrier))


@pytest.mark.parametrize(
    "carrier",
    [
        {"traceparent": TRACEPARENT.upper()},  # hex must be lower case
        {"traceparent": f"01-{TRACE_ID}-{CLIENT_SPAN_ID}-01"},  # a later version
        {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01-extra"},
        {"traceparent": f"00-{'0' * 32}-{CLIENT_SPAN_ID}-01"},  # an invalid trace id
        {"traceparent": f"00-{TRACE_ID}-{'0' * 16}-01"},
        {"traceparent": f" {TRACEPARENT}"},
        {"traceparent": TRACEPARENT, "tracestate": "k=v"},
        {"traceparent": TRACEPARENT, "baggage": "tenant=a"},
        {"tracestate": "k=v"},
    ],
)
def test_anything_but_a_plain_traceparent_is_read_by_the_sdk(tracer_provider, carrier):
    assert propagation.W3CTraceparent.read(carrier) is None
    assert carried(propagation.parent_from(carrier)) == carried(propagate.extract(carrier))


@pytest.mark.parametrize(
    ("configured", "served"),
    [
        (None, True),
        ("tracecontext,baggage", True),
        (" tracecontext ", True),
        ("baggage,tracecontext", True),
        ("b3", False),
        ("tracecontext,b3", False),
        ("baggage", False),
        ("none", False),
    ],
)
def test_only_the_default_propagators_let_a_traceparent_skip_the_sdk(configured, served):
    assert propagation.W3CTraceparent.serves(configured) is served


def test_pdserve_up_names_each_child_after_its_role():
    for role in ("router", "prefill", "decode", "both"):
        assert service_env(role) == {"OTEL_SERVICE_NAME": f"pdserve-{role}"}
