"""The router when things go wrong: bad input, a dying worker, cancels, lost clients,
deadlines and a lost Redis. Real router, worker and Redis processes on loopback."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
import time
import uuid
from dataclasses import dataclass

import grpc
import pytest
from google.protobuf.message import Message
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from procs import router_process, worker_process

from pdserve.api.v1 import common_pb2, router_pb2, router_pb2_grpc
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.rpc.wire import sampling_params_to_proto
from pdserve.state.redis_server import PrivateRedis

pytestmark = pytest.mark.cluster

# The demo model's vocabulary and context window; `cluster` checks them against ModelInfo.
VOCAB_SIZE = 1024
CONTEXT = 4096
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
# Long enough (seconds on a CPU) that a cancel, a disconnect or a deadline lands mid-decode.
LONG = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
STREAM_PROMPT = "Tokens stream back one by one while the decode worker runs"
UNKNOWN_ID = f"never-created-{uuid.uuid4().hex}"
FINISHED_ID = f"finished-{uuid.uuid4().hex}"  # `finished_request` runs it: 4 tokens
POLL_S = 0.02
# Even the demo model's peaked head leaves a near-tie now and then (top two logprobs within
# 1e-5), and a different batch on the workers moves logits by about that much and flips a
# greedy pick. Outputs are compared with the engine only where no pick is that close (a
# margin 20 times the closest flip seen).
MIN_GREEDY_MARGIN = 3e-4


@pytest.fixture(scope="module")
def cluster(demo_model_dir, redis_url, tmp_path_factory):
    """Two routers over one Redis, one prefill and one decode worker (registry discovery)."""
    logs = tmp_path_factory.mktemp("router-failure-logs")
    registry = ("--redis-url", redis_url)
    with (
        worker_process("prefill", demo_model_dir, *registry, log_dir=logs) as prefill,
        worker_process(
            "decode", demo_model_dir, *registry, "--num-kv-blocks", "600", log_dir=logs
        ) as decode,
        router_process(demo_model_dir, redis_url, log_dir=logs) as (router_a, _),
        router_process(demo_model_dir, redis_url, log_dir=logs) as (router_b, _),
    ):
        asyncio.run(wait_for_workers(router_a, 2))
        asyncio.run(wait_for_workers(router_b, 2))
        info = asyncio.run(call(router_a, "ModelInfo", router_pb2.ModelInfoRequest()))
        assert (info.vocab_size, info.max_model_len) == (VOCAB_SIZE, CONTEXT)
        yield {"prefill": prefill, "decode": decode, "routers": [router_a, router_b], "logs": logs}


@pytest.fixture(scope="module")
def engine(demo_model_dir):
    return LLMEngine.from_pretrained(demo_model_dir)


# -- helpers --------------------------------------------------------------------------------


async def call(address: str, rpc: str, request: Message, timeout: float | None = None):
    """One Router call on a fresh channel; Generate returns the list of its messages."""
    async with grpc.aio.insecure_channel(address) as channel:
        method = getattr(router_pb2_grpc.RouterStub(channel), rpc)
        if rpc == "Generate":
            return [message async for message in method(request, timeout=timeout)]
        return await method(request, timeout=timeout)


async def wait_for_workers(address: str, count: int, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        listed = await call(address, "ListWorkers", router_pb2.ListWorkersRequest())
        if sum(worker.healthy for worker in listed.workers) >= count:
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"router {address} never saw {count} healthy workers")


async def wait_for_status(
    address: str, request_id: str, statuses: set[str], timeout_s: float = 10
) -> router_pb2.RequestInfo:
    """Poll GetRequest until the request's status is one of `statuses`."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = await call(
            address, "GetRequest", router_pb2.GetRequestRequest(request_id=request_id)
        )
        if info.status in statuses or time.monotonic() > deadline:
            return info
        await asyncio.sleep(POLL_S)


def generate_request(
    text: str = "a valid prompt", params: SamplingParams = GREEDY, **fields
) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        text=text, sampling=sampling_params_to_proto(params), stream=True, **fields
    )


def with_sampling(**fields) -> router_pb2.GenerateRequest:
    """A valid greedy request whose sampling has `fields` set (as the proto takes them)."""
    return router_pb2.GenerateRequest(
        text="a valid prompt", sampling=common_pb2.SamplingParams(**{"max_tokens": 4, **fields})
    )


def token_prompt(*ids: int) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        token_ids=router_pb2.TokenIds(ids=ids), sampling=common_pb2.SamplingParams(max_tokens=4)
    )


def tokens_of(messages) -> list[int]:
    return [token for message in messages for token in message.token_ids]


def field_violations(error: grpc.RpcError) -> list[str]:
    """The fields named by the BadRequest detail of an error's rich status."""
    status = rpc_status.from_call(error)
    fields = []
    for detail in status.details if status is not None else ():
        bad_request = error_details_pb2.BadRequest()
        if detail.Unpack(bad_request):
            fields += [violation.field for violation in bad_request.field_violations]
    return fields


def has_retry_info(error: grpc.RpcError) -> bool:
    status = rpc_status.from_call(error)
    return status is not None and any(
        detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR) for detail in status.details
    )


def clear_greedy_cases(
    engine: LLMEngine, num: int, params: SamplingParams, seed: int, lengths: tuple[int, int]
) -> list[tuple[list[int], RequestOutput]]:
    """`num` random prompts (lengths in [low, high)), each with the engine's greedy output
    (with logprobs), keeping only prompts whose picks all win by MIN_GREEDY_MARGIN or more."""
    rng = random.Random(seed)
    candidates = [
        [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randrange(*lengths))]
        for _ in range(2 * num)
    ]
    outputs = engine.generate(candidates, dataclasses.replace(params, logprobs=2))
    cases = [
        (prompt, output)
        for prompt, output in zip(candidates, outputs, strict=True)
        if greedy_margin(output) >= MIN_GREEDY_MARGIN
    ]
    assert len(cases) >= num, "too few prompts with clear greedy picks"
    return cases[:num]


def greedy_margin(output) -> float:
    """How close the output came to a tie: the smallest top-1 minus top-2 logprob."""
    return min(position.top[0][1] - position.top[1][1] for position in output.logprobs)


# -- bad input ------------------------------------------------------------------------------


@dataclass(frozen=True, repr=False)
class BadCall:
    """A Router call that must fail with `code`, naming `field` in its BadRequest detail,
    or (where no field applies) with `details` in its status message."""

    rpc: str
    request: Message
    code: grpc.StatusCode
    field: str = ""
    details: str = ""

    def __repr__(self) -> str:  # the oversized request must never be printed whole
        return f"BadCall({self.rpc}, {self.code.name}, {self.field or self.details!r})"


INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
BAD_CALLS = [
    pytest.param(
        BadCall(
            "Generate",
            router_pb2.GenerateRequest(text="", sampling=common_pb2.SamplingParams(max_tokens=4)),
            INVALID,
            "prompt.text",
        ),
        id="empty-text-prompt",
    ),
    pytest.param(
        BadCall(
            "Generate",
            router_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=4)),
            INVALID,
            "prompt",
        ),
        id="no-prompt",
    ),
    pytest.param(
        BadCall("Generate", token_prompt(5, VOCAB_SIZE), INVALID, "prompt.token_ids[1]"),
        id="token-id-past-the-vocabulary",
    ),
    pytest.param(
        BadCall("Generate", token_prompt(-1, 5), INVALID, "prompt.token_ids[0]"),
        id="negative-token-id",
    ),
    pytest.param(
        BadCall("Generate", token_prompt(*[7] * CONTEXT), INVALID, "prompt.token_ids"),
        id="prompt-fills-the-context",
    ),
    pytest.param(
        BadCall("Generate", with_sampling(max_tokens=0), INVALID, "sampling.max_tokens"),
        id="max-tokens-0",
    ),
    pytest.param(
        BadCall("Generate", with_sampling(max_tokens=CONTEXT), INVALID, "sampling.max_tokens"),
        id="max-tokens-past-the-context",
    ),
    pytest.param(
        BadCall("Generate", with_sampling(temperature=-0.5), INVALID, "sampling.temperature"),
        id="negative-temperature",
    ),
    pytest.param(
        BadCall(
            "Generate", with_sampling(temperature=float("nan")), INVALID, "sampling.temperature"
        ),
        id="nan-temperature",
    ),
    pytest.param(
        BadCall("Generate", with_sampling(top_p=0.0), INVALID, "sampling.top_p"), id="top-p-0"
    ),
    pytest.param(
        BadCall("Generate", with_sampling(top_p=1.5), INVALID, "sampling.top_p"), id="top-p-1.5"
    ),
    pytest.param(
        BadCall("Generate", with_sampling(top_k=-1), INVALID, "sampling.top_k"), id="negative-top-k"
    ),
    pytest.param(
        BadCall("Generate", with_sampling(min_p=2.0), INVALID, "sampling.min_p"), id="min-p-2"
    ),
    pytest.param(
        BadCall(
            "Generate",
            with_sampling(repetition_penalty=0.0),
            INVALID,
            "sampling.repetition_penalty",
        ),
        id="repetition-penalty-0",
    ),
    pytest.param(
        BadCall(
            "Generate", with_sampling(frequency_penalty=3.0), INVALID, "sampling.frequency_penalty"
        ),
        id="frequency-penalty-3",
    ),
    pytest.param(
        BadCall("Generate", with_sampling(logprobs=21), INVALID, "sampling.logprobs"),
        id="logprobs-21",
    ),
    pytest.param(
        BadCall(
            "Generate",
            with_sampling(stop_token_ids=[3, VOCAB_SIZE]),
            INVALID,
            "sampling.stop_token_ids[1]",
        ),
        id="stop-token-id-past-vocab",
    ),
    pytest.param(
        BadCall("Generate", with_sampling(stop=["ok", ""]), INVALID, "sampling.stop[1]"),
        id="empty-stop-string",
    ),
    pytest.param(
        BadCall(
            "Generate", with_sampling(max_tokens=4, min_tokens=5), INVALID, "sampling.min_tokens"
        ),
        id="min-tokens-above-max-tokens",
    ),
    pytest.param(
        BadCall(
            "GetRequest",
            router_pb2.GetRequestRequest(request_id=UNKNOWN_ID),
            NOT_FOUND,
            details=UNKNOWN_ID,
        ),
        id="get-unknown-request",
    ),
    pytest.param(
        BadCall(
            "Cancel", router_pb2.CancelRequest(request_id=UNKNOWN_ID), NOT_FOUND, details=UNKNOWN_ID
        ),
        id="cancel-unknown-request",
    ),
    pytest.param(
        BadCall(
            "Generate",
            generate_request(request_id=UNKNOWN_ID, resume_from=0),
            NOT_FOUND,
            details=UNKNOWN_ID,
        ),
        id="resume-unknown-request",
    ),
    pytest.param(
        BadCall(
            "Generate",
            generate_request(
                request_id=FINISHED_ID,
                resume_from=5,
                params=SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
            ),
            grpc.StatusCode.OUT_OF_RANGE,
            "resume_from",
        ),
        id="resume-past-the-end",
    ),
    pytest.param(
        BadCall(
            "Detokenize",
            router_pb2.DetokenizeRequest(token_ids=[5, VOCAB_SIZE]),
            INVALID,
            "token_ids[1]",
        ),
        id="detokenize-id-past-the-vocabulary",
    ),
    pytest.param(
        BadCall(
            "Generate",
            router_pb2.GenerateRequest(
                text="x" * (17 << 20), sampling=common_pb2.SamplingParams(max_tokens=4)
            ),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            details="larger than max",
        ),
        id="message-over-16-mib",
    ),
]


@pytest.fixture(scope="module")
def finished_request(cluster):
    """FINISHED_ID, run to its end (4 tokens) so it can be resumed."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    messages = asyncio.run(
        call(
            cluster["routers"][0],
            "Generate",
            generate_request(request_id=FINISHED_ID, params=params),
        )
    )
    assert len(tokens_of(messages)) == 4
    return FINISHED_ID


async def assert_fails_as(address: str, bad: BadCall) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call(address, bad.rpc, bad.request)
    error = raised.value
    assert error.code() == bad.code, error.details()
    if bad.field:
        assert field_violations(error) == [bad.field], error.details()
    else:
        assert bad.details in error.details()


@pytest.mark.parametrize("bad", BAD_CALLS)
async def test_bad_input_is_refused_with_its_code_and_field(cluster, finished_request, bad):
    await assert_fails_as(cluster["routers"][0], bad)


async def test_the_router_serves_normally_after_every_bad_input(cluster, finished_request, engine):
    router = cluster["routers"][0]
    bad_calls = [param.values[0] for param in BAD_CALLS if not param.marks]
    await asyncio.gather(*(assert_fails_as(router, bad) for bad in bad_calls))
    [expected] = engine.generate(["after the storm"], GREEDY)
    got = await call(router, "Generate", generate_request("after the storm"))
    assert tokens_of(got) == expected.token_ids
    assert got[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


async def test_text_prompt_that_is_not_utf8_is_invalid_argument_naming_prompt_text(cluster):
    # proto3 strings must be UTF-8, so no generated client can send this: build it by hand.
    # Field 1 (text), length 2, bytes ff fe; then a valid sampling (field 3).
    sampling = router_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=4))
    raw = b"\x0a\x02\xff\xfe" + sampling.SerializeToString()
    async with grpc.aio.insecure_channel(cluster["routers"][0]) as channel:
        generate = channel.unary_stream(
            "/pdserve.v1.Router/Generate",
            request_serializer=lambda data: data,
            response_deserializer=router_pb2.GenerateResponse.FromString,
        )
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            [message async for message in generate(raw)]
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
    assert field_violations(raised.value) == ["prompt.text"]


# -- a prefill worker dies mid-flight -------------------------------------------------------


@pytest.fixture
def second_prefill(cluster, demo_model_dir, redis_url):
    """A second prefill worker in the cluster's registry, and a router of its own that
    takes the two prefill workers in turn (so half the requests always land on each)."""
    logs = cluster["logs"]
    with (
        worker_process(
            "prefill", demo_model_dir, "--redis-url", redis_url, log_dir=logs
        ) as prefill,
        router_process(
            demo_model_dir, redis_url, "--prefill-policy", "round_robin", log_dir=logs
        ) as (router, _),
    ):
        yield prefill, router


async def test_sigkill_of_a_prefill_worker_mid_flight_loses_no_request(
    cluster, second_prefill, engine
):
    victim, router = second_prefill
    await wait_for_workers(router, 3)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    cases = clear_greedy_cases(engine, 16, params, seed=11, lengths=(200, 400))
    ids = [f"kill-{i}-{uuid.uuid4().hex}" for i in range(16)]
    # A prefill takes milliseconds here, far too short to aim a kill at. So freeze the
    # victim first: the requests sent to it wait inside it, and the SIGKILL is certain to
    # strike while they are in flight.
    os.kill(victim.proc.pid, signal.SIGSTOP)
    try:
        runs = [
            asyncio.create_task(
                call(
                    router,
                    "Generate",
                    router_pb2.GenerateRequest(
                        token_ids=router_pb2.TokenIds(ids=prompt),
                        request_id=request_id,
                        stream=True,
                        sampling=sampling_params_to_proto(params),
                    ),
                )
            )
            for (prompt, _), request_id in zip(cases, ids, strict=True)
        ]
        stuck = await first_prefilling_on(router, ids, victim.address)
    finally:
        victim.proc.kill()  # SIGKILL works on a stopped process too
    results = await asyncio.gather(*runs)
    for got, (_, want) in zip(results, cases, strict=True):
        assert tokens_of(got) == want.token_ids
        assert got[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    info = await call(router, "GetRequest", router_pb2.GetRequestRequest(request_id=stuck))
    assert (info.status, info.prefill_worker) == ("finished", cluster["prefill"].address)
    for worker in (cluster["decode"], cluster["prefill"]):
        load = worker.wait_idle()
        assert (load.free_blocks, load.open_leases, load.running) == (load.total_blocks, 0, 0)


async def first_prefilling_on(
    router: str, ids: list[str], worker: str, timeout_s: float = 10
) -> str:
    """The id of a request the router has handed to `worker` for prefill."""
    deadline = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(router) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        while time.monotonic() < deadline:
            for request_id in ids:
                try:
                    info = await stub.GetRequest(
                        router_pb2.GetRequestRequest(request_id=request_id)
                    )
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.NOT_FOUND:  # not created yet
                        continue
                    raise
                if info.status == "prefilling" and info.prefill_worker == worker:
                    return request_id
            await asyncio.sleep(POLL_S)
    raise TimeoutError(f"no request reached prefill worker {worker}")


# -- cancel, disconnect, deadline -----------------------------------------------------------


async def test_cancel_through_the_other_router_aborts_the_stream_and_frees_blocks(cluster):
    router_a, router_b = cluster["routers"]
    request_id = f"cancel-{uuid.uuid4().hex}"
    async with grpc.aio.insecure_channel(router_a) as channel:
        stream = router_pb2_grpc.RouterStub(channel).Generate(
            generate_request(STREAM_PROMPT, LONG, request_id=request_id)
        )
        messages = [await stream.read()]  # decoding has begun
        cancelled = await call(router_b, "Cancel", router_pb2.CancelRequest(request_id=request_id))
        while (message := await stream.read()) is not grpc.aio.EOF:
            messages.append(message)
    assert cancelled.cancelled
    assert messages[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert len(tokens_of(messages)) < LONG.max_tokens
    info = await wait_for_status(router_b, request_id, {"cancelled"})
    assert (info.status, info.finish_reason) == ("cancelled", common_pb2.FINISH_REASON_ABORT)
    load = cluster["decode"].wait_idle()
    assert (load.free_blocks, load.open_leases, load.running) == (load.total_blocks, 0, 0)


async def test_cancel_of_a_finished_request_reports_nothing_cancelled(cluster, finished_request):
    response = await call(
        cluster["routers"][1], "Cancel", router_pb2.CancelRequest(request_id=finished_request)
    )
    assert not response.cancelled


async def test_client_that_goes_away_mid_stream_frees_the_decode_blocks(cluster):
    router = cluster["routers"][0]
    request_id = f"disconnect-{uuid.uuid4().hex}"
    async with grpc.aio.insecure_channel(router) as channel:
        stream = router_pb2_grpc.RouterStub(channel).Generate(
            generate_request(STREAM_PROMPT, LONG, request_id=request_id)
        )
        for _ in range(3):
            await stream.read()
        held = cluster["decode"].load()
        assert held.free_blocks < held.total_blocks  # the request holds decode blocks now
        stream.cancel()
    load = cluster["decode"].wait_idle()
    assert (load.free_blocks, load.open_leases, load.running) == (load.total_blocks, 0, 0)


async def test_a_client_that_leaves_while_the_router_waits_to_send_is_recorded_cancelled(
    cluster,
):
    router = cluster["routers"][0]
    request_id = f"slow-reader-{uuid.uuid4().hex}"
    # With 20 alternatives per token the output (~200 KB) is far more than the client's
    # fixed 64 KiB HTTP/2 window (no BDP probing), so once the client stops reading the
    # router's handler is left blocked in a send.
    params = SamplingParams(temperature=0.0, max_tokens=800, ignore_eos=True, logprobs=20)
    async with grpc.aio.insecure_channel(router, options=[("grpc.http2.bdp_probe", 0)]) as channel:
        stream = router_pb2_grpc.RouterStub(channel).Generate(
            generate_request(STREAM_PROMPT, params, request_id=request_id)
        )
        await stream.read()
        load = cluster["decode"].wait_idle(timeout_s=30)  # the router holds all the output
        assert load.free_blocks == load.total_blocks
        info = await call(router, "GetRequest", router_pb2.GetRequestRequest(request_id=request_id))
        assert info.status == "decoding" and info.usage.completion_tokens < params.max_tokens
        stream.cancel()
    info = await wait_for_status(router, request_id, {"cancelled"}, timeout_s=5)
    assert (info.status, info.finish_reason) == ("cancelled", common_pb2.FINISH_REASON_ABORT)


async def test_client_deadline_ends_the_call_and_frees_both_workers(cluster):
    router = cluster["routers"][0]
    request_id = f"deadline-{uuid.uuid4().hex}"
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call(
            router,
            "Generate",
            generate_request(STREAM_PROMPT, LONG, request_id=request_id),
            timeout=0.3,
        )
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 2
    for worker in (cluster["decode"], cluster["prefill"]):
        load = worker.wait_idle()
        assert (load.free_blocks, load.open_leases, load.running) == (load.total_blocks, 0, 0)


# -- Redis goes away ------------------------------------------------------------------------


@pytest.fixture
def router_on_private_redis(cluster, demo_model_dir):
    """A router with static discovery of the cluster's workers and a Redis of its own,
    which the test may stop (`redis.stop()`)."""
    redis = PrivateRedis().start()
    try:
        with router_process(
            demo_model_dir,
            redis.url,
            "--discovery",
            "static",
            "--prefill",
            cluster["prefill"].address,
            "--decode",
            cluster["decode"].address,
            log_dir=cluster["logs"],
        ) as (router, _):
            yield router, redis
    finally:
        redis.stop()


async def test_without_redis_a_new_request_fails_fast_as_unavailable(
    router_on_private_redis, cluster
):
    router, redis = router_on_private_redis
    await wait_for_workers(router, 2)
    assert tokens_of(await call(router, "Generate", generate_request()))  # serving before
    redis.stop()
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call(router, "Generate", generate_request(), timeout=10)
    assert time.monotonic() - started < 3
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "request state unavailable" in raised.value.details()
    assert has_retry_info(raised.value)
    # The request started on the workers while Redis was asked; nothing of it stays there.
    for worker in (cluster["prefill"], cluster["decode"]):
        load = worker.wait_idle()
        assert (load.free_blocks, load.open_leases, load.running) == (load.total_blocks, 0, 0)


async def test_a_stream_running_when_redis_stops_still_completes(
    router_on_private_redis, cluster, engine
):
    router, redis = router_on_private_redis
    await wait_for_workers(router, 2)
    params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    [expected] = engine.generate([STREAM_PROMPT], params)
    async with grpc.aio.insecure_channel(router) as channel:
        stream = router_pb2_grpc.RouterStub(channel).Generate(
            generate_request(STREAM_PROMPT, params)
        )
        messages = [await stream.read()]
        redis.stop()
        while (message := await stream.read()) is not grpc.aio.EOF:
            messages.append(message)
    assert tokens_of(messages) == expected.token_ids
    assert messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    load = cluster["decode"].wait_idle()
    assert (load.free_blocks, load.open_leases, load.running) == (load.total_blocks, 0, 0)
