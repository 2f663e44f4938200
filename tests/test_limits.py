"""What one request may hold, and that a big one does not stop the router: prompt bytes
before tokenizing, prompt tokens, stop strings, the request id, the message size; and a
long prompt tokenized off the event loop while a short request is served.

A real router over a colocated worker (default limits: the tiny model's window is 4,096
tokens, so prompts may be 32 x 4,096 = 131,072 bytes), and a second router over the same
workers that lets a 1 MB prompt through to its tokenizer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from procs import router_process

from pdserve.api.v1 import router_pb2, router_pb2_grpc
from pdserve.cluster.local import ClusterShape, LocalCluster
from pdserve.core.sampling_params import MAX_STOP_STRINGS, PROMPT_BYTES_PER_TOKEN, SamplingParams
from pdserve.router.config import RouterConfig
from pdserve.rpc.wire import sampling_params_to_proto
from pdserve.state.record import MAX_ERROR_CHARS, MAX_RECORD_BYTES, RequestRecord

pytestmark = pytest.mark.cluster

MAX_MODEL_LEN = 4096  # the tiny demo model's
MAX_PROMPT_BYTES = PROMPT_BYTES_PER_TOKEN * MAX_MODEL_LEN
SHORT = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
BIG_PROMPT_BYTES = 1_000_000  # about 1 s to tokenize on an idle core


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    with LocalCluster(
        str(demo_model_dir),
        ClusterShape(prefill=0, decode=0, colocated=1),
        tmp_path_factory.mktemp("limits"),
    ) as local:
        yield local


@pytest.fixture(scope="module")
def roomy_router(cluster, demo_model_dir, tmp_path_factory):
    """A router over the same worker whose --max-prompt-bytes lets BIG_PROMPT_BYTES in."""
    logs = tmp_path_factory.mktemp("limits-roomy")
    limit = ("--max-prompt-bytes", str(2 * BIG_PROMPT_BYTES))
    with router_process(demo_model_dir, cluster.redis, *limit, log_dir=logs) as (address, _):
        yield address


def generate_request(text: str = "Hello", **sampling) -> router_pb2.GenerateRequest:
    params = dataclasses.replace(SHORT, **sampling)
    return router_pb2.GenerateRequest(text=text, sampling=sampling_params_to_proto(params))


async def call(address: str, request: router_pb2.GenerateRequest):
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        return [message async for message in stub.Generate(request)]


async def refusal(address: str, request: router_pb2.GenerateRequest) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call(address, request)
    return caught.value


def violation(error: grpc.aio.AioRpcError) -> tuple[str, str]:
    """(field, description) of the error's BadRequest detail."""
    bad_request = error_details_pb2.BadRequest()
    status = rpc_status.from_call(error)
    assert any(detail.Unpack(bad_request) for detail in status.details), error
    (only,) = bad_request.field_violations
    return only.field, only.description


async def assert_invalid(address, request, field: str, words: str) -> None:
    error = await refusal(address, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    named, description = violation(error)
    assert named == field
    assert words in description, description


# -- each limit, named ------------------------------------------------------------------


async def test_a_prompt_over_the_byte_limit_is_refused_naming_the_limit(cluster):
    text = "a" * (MAX_PROMPT_BYTES + 1)
    await assert_invalid(
        cluster.router_address, generate_request(text), "prompt.text", str(MAX_PROMPT_BYTES)
    )


async def test_prompt_bytes_are_counted_in_utf8_not_characters(cluster):
    text = "界" * (MAX_PROMPT_BYTES // 2)  # fewer characters than the limit, 1.5x its bytes
    await assert_invalid(cluster.router_address, generate_request(text), "prompt.text", "bytes")


async def test_token_ids_that_fill_the_window_are_refused_before_they_are_read(cluster):
    request = router_pb2.GenerateRequest(
        token_ids=router_pb2.TokenIds(ids=[5] * MAX_MODEL_LEN),
        sampling=sampling_params_to_proto(SHORT),
    )
    words = f"{MAX_MODEL_LEN} tokens; the context window is {MAX_MODEL_LEN}"
    await assert_invalid(cluster.router_address, request, "prompt.token_ids", words)


async def test_a_text_within_the_bytes_but_over_the_window_is_refused_once_tokenized(cluster):
    text = "the quick brown fox jumps. " * 4000  # 108,000 bytes: about 20,000 tokens
    await assert_invalid(cluster.router_address, generate_request(text), "prompt", "context window")


async def test_more_stop_strings_than_the_limit_are_refused(cluster):
    request = generate_request(stop=[f"s{i}" for i in range(17)])
    await assert_invalid(cluster.router_address, request, "sampling.stop", "the limit is 16")


async def test_a_stop_string_over_the_length_limit_is_refused(cluster):
    request = generate_request(stop=["ok", "x" * 257])
    await assert_invalid(cluster.router_address, request, "sampling.stop[1]", "the limit is 256")


async def test_stop_strings_at_the_limits_are_served(cluster):
    stops = ["\x00" * 255 + str(i % 10) for i in range(16)]  # never in the output
    messages = await call(cluster.router_address, generate_request(stop=stops))
    assert sum(len(m.token_ids) for m in messages) == SHORT.max_tokens


async def test_a_request_id_over_256_bytes_is_refused(cluster):
    request = generate_request()
    request.request_id = "i" * 257
    await assert_invalid(cluster.router_address, request, "request_id", "256 bytes")


async def test_a_message_past_the_receive_limit_is_refused_and_the_router_serves_on(cluster):
    limits = RouterConfig(model="m", redis_url="redis://unused").request_limits(MAX_MODEL_LEN)
    text = "a" * (limits.max_message_bytes() + 1)
    error = await refusal(cluster.router_address, generate_request(text))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # gRPC's: before parsing
    messages = await call(cluster.router_address, generate_request())
    assert sum(len(m.token_ids) for m in messages) == SHORT.max_tokens


# -- a long prompt is tokenized off the event loop ----------------------------------------


async def test_a_short_request_is_served_while_a_long_prompt_is_tokenized(roomy_router):
    big = generate_request("lorem ipsum dolor sit amet, " * (BIG_PROMPT_BYTES // 28))
    finished: list[str] = []

    async def run(name: str, request) -> float:
        started = time.perf_counter()
        try:
            await call(roomy_router, request)
        except grpc.aio.AioRpcError as exc:  # the big one: over the window once tokenized
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert violation(exc)[0] == "prompt"
        finished.append(name)
        return time.perf_counter() - started

    await call(roomy_router, generate_request())  # the router's channels are warm
    big_task = asyncio.create_task(run("big", big))
    await asyncio.sleep(0.2)  # its bytes are in (1 MB on loopback); its tokenizing has begun
    short_s = await run("short", generate_request())
    big_s = await big_task
    print(
        f"\ntokenizing {len(big.text)} bytes took the big call {big_s:.2f} s; "
        f"a short request meanwhile {short_s:.3f} s end to end"
    )
    assert finished == ["short", "big"]


# -- the limits' own checks ---------------------------------------------------------------


def test_the_prompt_byte_limit_defaults_to_32_bytes_per_token_of_the_window():
    config = RouterConfig(model="m", redis_url="redis://unused")
    assert config.request_limits(MAX_MODEL_LEN).max_prompt_bytes == 131_072
    roomy = RouterConfig(model="m", redis_url="redis://unused", max_prompt_bytes=5)
    assert roomy.request_limits(MAX_MODEL_LEN).max_prompt_bytes == 5


@pytest.mark.parametrize(
    "setting",
    [
        {"max_stop_strings": MAX_STOP_STRINGS + 1},
        {"max_stop_length": 0},
        {"max_prompt_bytes": 0},
        {"max_queued_requests": -1},
        {"queue_timeout_s": 0.0},
        {"max_concurrent_streams": 0},
    ],
    ids=lambda setting: next(iter(setting)),
)
def test_a_router_with_an_impossible_limit_refuses_to_start(setting):
    name = next(iter(setting))
    with pytest.raises(ValueError, match=name):
        RouterConfig(model="m", redis_url="redis://unused", **setting)


def test_a_request_record_stays_under_its_size_bound_whatever_the_client_sent():
    worst = "\x01"  # JSON writes it as \\u0001: six bytes for one
    record = RequestRecord(
        request_id=worst * 256,
        status="failed",
        prompt_tokens=MAX_MODEL_LEN,
        prefill_worker="prefill-0.pdserve-prefill.default.svc.cluster.local:50051",
        decode_worker="decode-0.pdserve-decode.default.svc.cluster.local:50051",
        error="UNAVAILABLE: " + worst * 100_000,
        request_digest="f" * 64,
    )
    data = record.to_json()
    assert len(data.encode()) <= MAX_RECORD_BYTES
    assert len(RequestRecord.from_json(data).error) == MAX_ERROR_CHARS
