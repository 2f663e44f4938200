"""API keys at the router, against one real cluster (Redis, a prefill and a decode worker,
a router with `--api-key-file`, its OpenAI HTTP port and metrics), every process tracing
to an OTLP receiver on loopback.

What is refused without a valid key (UNAUTHENTICATED, one message for every way a key is
wrong; 401 in OpenAI's shape), what answers without one (health, GET /health, the metrics
port), a key over its limits (RESOURCE_EXHAUSTED with RetryInfo; 429 with Retry-After),
request ids scoped to their key, and no key and no prompt in any log line or span.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc
import httpx
import openai
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status
from test_tracing_otlp import TraceReceiver, receiver  # noqa: F401 (the OTLP receiver fixture)

from pdserve.api.inference import grpc_service_pb2 as kserve_pb2
from pdserve.api.v1 import router_pb2, router_pb2_grpc
from pdserve.cluster.local import ClusterShape, LocalCluster
from pdserve.core.sampling_params import SamplingParams
from pdserve.router.auth.caller import KeyLimits
from pdserve.router.auth.gate import INVALID_KEY_MESSAGE
from pdserve.router.auth.keys import new_key, revoked, write_key_file
from pdserve.rpc.wire import sampling_params_to_proto

pytestmark = pytest.mark.cluster

MODEL = "keyed"
UNKNOWN_KEY, _ = new_key("nobody", KeyLimits())  # a key in pdserve's form, of no file
SECRET_PROMPT = "Quartz zebras lantern the marmalade harbour"  # must never be logged
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
LIMITS = {
    "owner": KeyLimits(),
    "other": KeyLimits(),
    "rpm": KeyLimits(requests_per_minute=2),
    "concurrency": KeyLimits(concurrent_requests=1),
    "http-rpm": KeyLimits(requests_per_minute=1),
    "revoked": KeyLimits(),
}


@dataclass
class Keyed:
    cluster: LocalCluster
    keys: dict[str, str]  # name -> the key itself
    receiver: TraceReceiver


@pytest.fixture(scope="module")
def keyed(receiver, demo_model_dir, redis_url, tmp_path_factory):  # noqa: F811 (the fixture)
    catcher, port = receiver
    secrets_dir = tmp_path_factory.mktemp("keys")
    made = {name: new_key(name, limits) for name, limits in LIMITS.items()}
    entries = [revoked(e) if name == "revoked" else e for name, (_, e) in made.items()]
    key_file = secrets_dir / "api-keys.json"
    write_key_file(key_file, entries)
    keys = {name: key for name, (key, _) in made.items()}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        env.delenv("OTEL_SDK_DISABLED", raising=False)
        run_dir = tmp_path_factory.mktemp("keyed-cluster")
        with LocalCluster(
            str(demo_model_dir),
            ClusterShape(prefill=1, decode=1),
            run_dir,
            redis=redis_url,
            router_args=["--api-key-file", str(key_file)],
            api_key=keys["owner"],
            http_port=0,
            served_model_name=MODEL,
            metrics=True,
        ) as cluster:
            yield Keyed(cluster, keys, catcher)


@pytest.fixture(scope="module")
def channel(keyed):
    with grpc.insecure_channel(keyed.cluster.router_address) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    return router_pb2_grpc.RouterStub(channel)


def auth(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def generate_request(request_id: str = "", params=GREEDY, text=SECRET_PROMPT, **fields):
    return router_pb2.GenerateRequest(
        text=text, sampling=sampling_params_to_proto(params), request_id=request_id, **fields
    )


def refusal(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        call()
    return refused.value


def detail(error: grpc.RpcError, kind):
    for packed in rpc_status.from_call(error).details:
        if packed.Is(kind.DESCRIPTOR):
            found = kind()
            packed.Unpack(found)
            return found
    return None


# -- who gets in ------------------------------------------------------------------------------


def wrong_headers(keys: dict[str, str]) -> dict[str, list[tuple[str, str]]]:
    owner = keys["owner"]
    return {
        "missing": [],
        "not bearer": [("authorization", f"Basic {owner}")],
        "wrong secret": auth(owner[:-3] + ("xyz" if not owner.endswith("xyz") else "abc")),
        "unknown": auth(UNKNOWN_KEY),
        "revoked": auth(keys["revoked"]),
        "garbage": auth("sk-123"),
    }


def test_no_wrong_unknown_or_revoked_key_is_unauthenticated_with_one_message(keyed, stub):
    seen = {}
    info = router_pb2.ModelInfoRequest()
    for why, metadata in wrong_headers(keyed.keys).items():
        unary = refusal(lambda m=metadata: stub.ModelInfo(info, metadata=m))
        streamed = refusal(lambda m=metadata: list(stub.Generate(generate_request(), metadata=m)))
        for error in (unary, streamed):
            assert error.code() is grpc.StatusCode.UNAUTHENTICATED, why
            seen[why] = error.details()
    assert set(seen.values()) == {INVALID_KEY_MESSAGE}


def test_a_valid_key_calls_every_method(keyed, stub):
    info = stub.ModelInfo(router_pb2.ModelInfoRequest(), metadata=auth(keyed.keys["owner"]))
    assert info.model == MODEL
    [message] = stub.Generate(generate_request(), metadata=auth(keyed.keys["owner"]), timeout=60)
    assert len(message.token_ids) == GREEDY.max_tokens


def test_health_answers_without_a_key_and_reflection_and_kserve_do_not(channel):
    health = health_pb2_grpc.HealthStub(channel)
    reply = health.Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    listing = iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    error = refusal(lambda: list(reflection.ServerReflectionInfo(listing, timeout=5)))
    assert error.code() is grpc.StatusCode.UNAUTHENTICATED
    server_live = channel.unary_unary(
        "/inference.GRPCInferenceService/ServerLive",
        request_serializer=kserve_pb2.ServerLiveRequest.SerializeToString,
        response_deserializer=kserve_pb2.ServerLiveResponse.FromString,
    )
    error = refusal(lambda: server_live(kserve_pb2.ServerLiveRequest(), timeout=5))
    assert error.code() is grpc.StatusCode.UNAUTHENTICATED


# -- limits -----------------------------------------------------------------------------------


def test_a_key_over_its_requests_per_minute_gets_resource_exhausted_with_retry_info(keyed, stub):
    metadata = auth(keyed.keys["rpm"])
    for _ in range(2):
        list(stub.Generate(generate_request(), metadata=metadata, timeout=60))
    error = refusal(lambda: list(stub.Generate(generate_request(), metadata=metadata)))
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "2 requests per minute" in error.details()
    retry = detail(error, error_details_pb2.RetryInfo)
    assert 0 < retry.retry_delay.ToTimedelta().total_seconds() <= 60
    quota = detail(error, error_details_pb2.QuotaFailure)
    assert quota.violations[0].description == "requests_per_minute"
    # other keys are not held back by it
    list(stub.Generate(generate_request(), metadata=auth(keyed.keys["other"]), timeout=60))


def test_a_key_at_its_concurrency_waits_for_its_running_request(keyed, stub):
    metadata = auth(keyed.keys["concurrency"])
    running = stub.Generate(generate_request(params=LONG, stream=True), metadata=metadata)
    next(running)  # it holds the key's one slot
    error = refusal(lambda: list(stub.Generate(generate_request(), metadata=metadata)))
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "1 concurrent requests" in error.details()
    assert detail(error, error_details_pb2.RetryInfo) is not None
    running.cancel()
    deadline = time.monotonic() + 10
    while True:  # the slot comes back once the router has seen the call end
        try:
            list(stub.Generate(generate_request(), metadata=metadata, timeout=60))
            break
        except grpc.RpcError as exc:
            assert exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert time.monotonic() < deadline, "the slot never came back"
            time.sleep(0.1)


# -- HTTP -------------------------------------------------------------------------------------


def test_the_openai_client_with_a_bad_key_gets_authentication_error(keyed):
    url = keyed.cluster.openai_url
    for key in (keyed.keys["revoked"], "sk-not-ours"):
        with (
            openai.OpenAI(base_url=url, api_key=key, max_retries=0) as client,
            pytest.raises(openai.AuthenticationError) as refused,
        ):
            client.completions.create(model=MODEL, prompt=SECRET_PROMPT, max_tokens=2)
        assert refused.value.status_code == 401
        assert refused.value.code == "invalid_api_key"
        assert refused.value.body["message"] == INVALID_KEY_MESSAGE
        assert refused.value.body["type"] == "invalid_request_error"


def test_the_openai_client_with_a_good_key_completes(keyed):
    with openai.OpenAI(
        base_url=keyed.cluster.openai_url, api_key=keyed.keys["owner"], max_retries=0
    ) as client:
        greedy = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
        completion = client.completions.create(
            model=MODEL, prompt=SECRET_PROMPT, max_tokens=3, **greedy
        )
        assert completion.usage.completion_tokens == 3
        assert [m.id for m in client.models.list().data] == [MODEL]


def test_an_http_key_over_its_limit_gets_429_with_retry_after(keyed):
    with openai.OpenAI(
        base_url=keyed.cluster.openai_url, api_key=keyed.keys["http-rpm"], max_retries=0
    ) as client:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    assert refused.value.status_code == 429
    assert 1 <= int(refused.value.response.headers["retry-after"]) <= 60


def test_only_health_and_the_metrics_port_answer_http_without_a_key(keyed):
    root = keyed.cluster.openai_url.removesuffix("/v1")
    assert httpx.get(f"{root}/health").status_code == 200
    for path in ("/v1/models", "/version", "/metrics"):
        reply = httpx.get(f"{root}{path}")
        assert reply.status_code == 401, path
        assert reply.json()["error"]["code"] == "invalid_api_key"
    metrics = httpx.get(f"http://{keyed.cluster.router.metrics_address}/metrics")
    assert metrics.status_code == 200 and "pdserve" in metrics.text


# -- ids are the key's ------------------------------------------------------------------------


def test_request_ids_are_scoped_to_their_key(keyed, stub):
    owner, other = auth(keyed.keys["owner"]), auth(keyed.keys["other"])
    [mine] = stub.Generate(generate_request("shared-id"), metadata=owner, timeout=60)
    assert mine.request_id == "shared-id"
    info = stub.GetRequest(router_pb2.GetRequestRequest(request_id="shared-id"), metadata=owner)
    assert info.request_id == "shared-id" and info.usage.completion_tokens == 4

    lookup = router_pb2.GetRequestRequest(request_id="shared-id")
    for call in (
        lambda: stub.GetRequest(lookup, metadata=other),
        lambda: stub.Cancel(router_pb2.CancelRequest(request_id="shared-id"), metadata=other),
        lambda: list(stub.Generate(generate_request("shared-id", resume_from=0), metadata=other)),
    ):
        error = refusal(call)
        assert error.code() is grpc.StatusCode.NOT_FOUND
        assert "shared-id" in error.details() and keyed.keys["owner"] not in error.details()
    # the other key's same id is a request of its own, whatever it asks
    [theirs] = stub.Generate(
        generate_request("shared-id", text="another prompt"), metadata=other, timeout=60
    )
    assert theirs.request_id == "shared-id"
    # and the owner resumes its own, not the other's
    [again] = stub.Generate(generate_request("shared-id", resume_from=0), metadata=owner)
    assert list(again.token_ids) == list(mine.token_ids)


def test_a_reused_id_with_another_prompt_is_already_exists_in_the_keys_own_namespace(keyed, stub):
    owner = auth(keyed.keys["owner"])
    list(stub.Generate(generate_request("mine-2"), metadata=owner, timeout=60))
    error = refusal(
        lambda: list(stub.Generate(generate_request("mine-2", text="else"), metadata=owner))
    )
    assert error.code() is grpc.StatusCode.ALREADY_EXISTS
    assert error.details().startswith("request_id: 'mine-2' is taken")


# -- secrets stay out of logs and spans (run last: it reads what the others left) -------------


def test_zz_no_key_and_no_prompt_in_any_log_line_or_span(keyed, stub):
    metadata = auth(keyed.keys["owner"])
    [message] = stub.Generate(generate_request("traced-secret"), metadata=metadata, timeout=60)
    info = stub.GetRequest(
        router_pb2.GetRequestRequest(request_id="traced-secret"), metadata=metadata
    )
    spans = keyed.receiver.trace(info.trace_id, {("pdserve-router", f"text_completion {MODEL}")})
    assert spans, "the request was not traced"
    presented = [v for headers in wrong_headers(keyed.keys).values() for _, v in headers]
    secrets = [*keyed.keys.values(), *(value.split(" ", 1)[1] for value in presented)]
    secrets += [SECRET_PROMPT, SECRET_PROMPT.split()[1]]  # a word of it too
    written = {p.name: p.read_text() for p in keyed.cluster.run_dir.glob("*.log")}
    assert "router.log" in written
    everything = {**written, "spans": "\n".join(str(span) for _, span in keyed.receiver.spans)}
    for source, text in everything.items():
        for secret in secrets:
            assert secret not in text, f"{source} holds a secret"
