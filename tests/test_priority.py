"""A request's priority (lower runs first, as vLLM's) and its client's TTFT target: from
the public API, the Python client, the OpenAI body or header and Triton's client (its
`priority` level, the `x-slo-ttft-ms` metadata) through the router to the prefill
worker's scheduler, on a real cluster."""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import openai
import pytest
import tritonclient.grpc.aio as triton
from pydantic import ValidationError
from transformers import AutoTokenizer

from pdserve.api.v1 import decode_pb2, prefill_pb2_grpc, router_pb2, router_pb2_grpc
from pdserve.client import AsyncClient
from pdserve.cluster.local import ClusterShape, LocalCluster
from pdserve.core.checkpoint import served_name
from pdserve.core.errors import InvalidRequestError
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.llm_engine import LLMEngine
from pdserve.gateways.openai.convert import completion_requests
from pdserve.gateways.openai.protocol import CompletionRequest
from pdserve.gateways.ttft_target import ttft_slo_ms_from_header
from pdserve.rpc.wire import sampling_params_to_proto

pytestmark = pytest.mark.cluster

PROMPT_TOKENS = 600  # 150 steps of 4 tokens on the prefill worker
STEP_TOKENS = 4
TARGET_PROMPT_TOKENS = 2_000  # the TTFT target's test


def test_the_engine_keeps_the_priority_a_request_was_added_with(demo_model_dir):
    engine = LLMEngine.from_pretrained(demo_model_dir, num_kv_blocks=16, block_size=4)
    urgent = engine.add_request([5, 6, 7], SamplingParams(max_tokens=1), priority=-3)
    usual = engine.add_request([5, 6, 8], SamplingParams(max_tokens=1))

    assert engine.scheduler.get_request(urgent).priority == -3
    assert engine.scheduler.get_request(usual).priority == 0


def test_the_engine_keeps_a_ttft_deadline_and_times_its_steps(demo_model_dir):
    engine = LLMEngine.from_pretrained(demo_model_dir, num_kv_blocks=16, block_size=4)
    timed = engine.add_request([5, 6, 7], SamplingParams(max_tokens=1), ttft_deadline=12.5)
    assert engine.scheduler.get_request(timed).ttft_deadline == 12.5
    assert engine.scheduler.pace.seconds_per_token == 0.0
    engine.step()
    assert engine.scheduler.pace.seconds_per_token > 0.0


@pytest.mark.parametrize("value", ["-5", "1.5", "soon", "4294967296", "", "²"])
def test_a_ttft_slo_header_that_is_not_whole_milliseconds_is_an_error_naming_it(value):
    with pytest.raises(InvalidRequestError, match="whole number of milliseconds") as raised:
        ttft_slo_ms_from_header(value)
    assert raised.value.field == "x-slo-ttft-ms"


def test_a_ttft_slo_header_is_whole_milliseconds_and_none_is_no_target():
    assert ttft_slo_ms_from_header(None) == 0
    assert ttft_slo_ms_from_header(" 250 ") == 250
    assert ttft_slo_ms_from_header("4294967295") == 2**32 - 1


def test_the_openai_body_takes_vllms_priority_field_within_an_int32():
    [request] = completion_requests(CompletionRequest(prompt="hi", priority=-2)).requests
    assert request.priority == -2
    assert completion_requests(CompletionRequest(prompt="hi")).requests[0].priority == 0
    with pytest.raises(ValidationError, match="priority"):
        CompletionRequest(prompt="hi", priority=2**31)


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    """A prefill and a decode worker that prefill 4 tokens a step; every prompt remote."""
    with LocalCluster(
        model=str(demo_model_dir),
        shape=ClusterShape(prefill=1, decode=1),
        run_dir=tmp_path_factory.mktemp("priority"),
        worker_args=["--max-num-batched-tokens", str(STEP_TOKENS)],
        router_args=["--colocate-below", "1"],  # no prompt is shorter: all go remote
        http_port=0,
    ) as started:
        yield started


async def first_token_at(stub, first_id: int, priority: int) -> float:
    """Stream one long prompt; the monotonic time its first token arrived."""
    prompt = [3 + (first_id + i) % 1000 for i in range(PROMPT_TOKENS)]  # within the vocabulary
    request = router_pb2.GenerateRequest(
        token_ids=router_pb2.TokenIds(ids=prompt),
        sampling=sampling_params_to_proto(SamplingParams(max_tokens=2, ignore_eos=True)),
        stream=True,
        priority=priority,
    )
    async for _ in stub.Generate(request, timeout=60):
        return time.monotonic()
    raise AssertionError("no token")


async def on_the_prefill_worker(cluster, count: int) -> None:
    """Poll the prefill worker's load until `count` requests run or wait there."""
    [worker] = [w for w in cluster.workers if w.role == "prefill"]
    async with grpc.aio.insecure_channel(worker.address) as channel:
        get_load = prefill_pb2_grpc.PrefillStub(channel).GetLoad
        deadline = time.monotonic() + 30
        while True:
            load = await get_load(decode_pb2.GetLoadRequest(), timeout=10)
            if load.running + load.waiting >= count:
                return
            assert time.monotonic() < deadline, f"the prefill worker holds {load}"
            await asyncio.sleep(0.005)


def text_prompt(cluster, first_id: int, num_tokens: int) -> str:
    """A text of about `num_tokens` tokens (KServe takes text), unlike any other test's."""
    tokenizer = AutoTokenizer.from_pretrained(cluster.model)
    words = " ".join(f"w{first_id + i}" for i in range(num_tokens // 2))  # 2+ tokens each
    ids = tokenizer.encode(words, add_special_tokens=False)
    assert len(ids) >= num_tokens
    return tokenizer.decode(ids[:num_tokens])


async def answer_over_kserve(cluster, text: str, **options) -> float:
    """Triton's client, one token: the monotonic time its answer (the first token) came."""
    prompt = triton.InferInput("text_input", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
    sampling = triton.InferInput("sampling_parameters", [1], "BYTES")
    sampling.set_data_from_numpy(np.array([b'{"max_tokens": 1}'], dtype=np.object_))
    client = triton.InferenceServerClient(cluster.router_address)
    try:
        model = served_name(cluster.model)
        await client.infer(model, [prompt, sampling], client_timeout=60, **options)
        return time.monotonic()
    finally:
        await client.close()


def urgent_over_grpc(cluster):
    async def send(stub) -> float:
        return await first_token_at(stub, 600, priority=-1)

    return send


def urgent_over_kserve(cluster):
    """Triton's highest level (1); a prompt no shorter than the one waiting, its text made
    before the others are sent (loading the tokenizer takes a while)."""
    text = text_prompt(cluster, 900, PROMPT_TOKENS + 20)

    async def send(stub) -> float:
        return await answer_over_kserve(cluster, text, priority=1)

    return send


@pytest.mark.parametrize("door", [urgent_over_grpc, urgent_over_kserve])
async def test_a_lower_priority_value_gets_its_first_token_before_earlier_prompts(cluster, door):
    send_urgent = door(cluster)
    first_id = 10 if door is urgent_over_grpc else 1300
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        first = asyncio.create_task(first_token_at(stub, first_id, priority=0))
        second = asyncio.create_task(first_token_at(stub, first_id + 100, priority=0))
        # Both are on the prefill worker, one running; a fixed wait once let a loaded
        # machine finish one before the urgent prompt got there.
        await on_the_prefill_worker(cluster, 2)
        urgent = await send_urgent(stub)
        usual = await asyncio.gather(first, second)

    # Without the priority the least-work order would put it after the prompt that was
    # waiting (the later of the two): same length, later. The one running may be done
    # before it arrives, on a loaded machine.
    assert urgent < max(usual)


def long_prompt(first_id: int) -> list[int]:
    """Long enough (500 steps) that the first prompt is still running when the second one
    gets to the worker, on a loaded machine too."""
    return [3 + (first_id + i) % 1000 for i in range(TARGET_PROMPT_TOKENS)]  # in the vocabulary


async def first_token_over_http(cluster, first_id: int, ttft_slo_ms: int) -> float:
    """The OpenAI API's streamed completion, with the `x-slo-ttft-ms` header."""
    async with openai.AsyncOpenAI(base_url=cluster.openai_url, api_key="unused") as client:
        [model] = (await client.models.list()).data
        chunks = await client.completions.create(
            model=model.id,
            prompt=long_prompt(first_id),
            max_tokens=2,
            stream=True,
            extra_headers={"x-slo-ttft-ms": str(ttft_slo_ms)},
            extra_body={"ignore_eos": True},
        )
        async for _ in chunks:
            return time.monotonic()
    raise AssertionError("no token")


async def first_token_from_client(cluster, first_id: int, ttft_slo_ms: int) -> float:
    """The Python client's stream, with its `ttft_slo_ms`."""
    async with AsyncClient(cluster.router_address, timeout=60) as client:
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        async for _ in client.stream(long_prompt(first_id), params, ttft_slo_ms=ttft_slo_ms):
            return time.monotonic()
    raise AssertionError("no token")


async def first_token_over_kserve(cluster, first_id: int, ttft_slo_ms: int) -> float:
    """Triton's client, with the `x-slo-ttft-ms` metadata; a little shorter than the
    long prompts (its text's tokens are counted again by the router)."""
    text = text_prompt(cluster, first_id, TARGET_PROMPT_TOKENS - 50)
    return await answer_over_kserve(cluster, text, headers={"x-slo-ttft-ms": str(ttft_slo_ms)})


@pytest.mark.parametrize(
    ("send_late", "first_id"),
    [(first_token_over_http, 20), (first_token_from_client, 40), (first_token_over_kserve, 60)],
)
async def test_a_prompt_that_cannot_make_its_ttft_target_yields_to_one_that_can(
    cluster, send_late, first_id
):
    """The first prompt's target (1 ms) is lost the moment it arrives; it starts alone,
    then pauses when a prompt of the same length that can make its target arrives.
    Without targets the least-work order would keep the first going: it has less left.
    (Prompts no other test sends: a prefix-cache hit would make one instant.)"""
    late = asyncio.create_task(send_late(cluster, first_id, ttft_slo_ms=1))
    await on_the_prefill_worker(cluster, 1)
    on_time = await first_token_from_client(cluster, first_id + 300, ttft_slo_ms=60_000)
    assert on_time < await late
