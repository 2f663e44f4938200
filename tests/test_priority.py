"""A request's priority (lower runs first, as vLLM's): from the public API and the OpenAI
body through the router to the prefill worker's scheduler, on a real cluster."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from pydantic import ValidationError

from pdserve.api.v1 import decode_pb2, prefill_pb2_grpc, router_pb2, router_pb2_grpc
from pdserve.cluster.local import ClusterShape, LocalCluster
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.llm_engine import LLMEngine
from pdserve.gateways.openai.convert import completion_requests
from pdserve.gateways.openai.protocol import CompletionRequest
from pdserve.rpc.wire import sampling_params_to_proto

PROMPT_TOKENS = 600  # 150 steps of 4 tokens on the prefill worker
STEP_TOKENS = 4


def test_the_engine_keeps_the_priority_a_request_was_added_with(demo_model_dir):
    engine = LLMEngine.from_pretrained(demo_model_dir, num_kv_blocks=16, block_size=4)
    urgent = engine.add_request([5, 6, 7], SamplingParams(max_tokens=1), priority=-3)
    usual = engine.add_request([5, 6, 8], SamplingParams(max_tokens=1))

    assert engine.scheduler.get_request(urgent).priority == -3
    assert engine.scheduler.get_request(usual).priority == 0


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


async def test_a_lower_priority_value_gets_its_first_token_before_earlier_prompts(cluster):
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        first = asyncio.create_task(first_token_at(stub, 10, priority=0))
        second = asyncio.create_task(first_token_at(stub, 300, priority=0))
        # Both are on the prefill worker, one running; a fixed wait once let a loaded
        # machine finish one before the urgent prompt got there.
        await on_the_prefill_worker(cluster, 2)
        urgent = await first_token_at(stub, 600, priority=-1)
        usual = await asyncio.gather(first, second)

    # Without the priority the least-work order would put it last: same length, later.
    assert urgent < min(usual)
