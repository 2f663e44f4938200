"""A decode worker dies mid-stream: the router carries its requests on elsewhere."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from procs import router_process, worker_process

from pdserve.api.v1 import common_pb2, router_pb2, router_pb2_grpc
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.wire import sampling_params_to_proto

PARAMS = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=5, max_tokens=96, ignore_eos=True)


@pytest.fixture
def cluster(demo_model_dir, redis_url, tmp_path):
    registry = ("--redis-url", redis_url)
    with (
        worker_process("prefill", demo_model_dir, *registry, log_dir=tmp_path) as prefill,
        worker_process("decode", demo_model_dir, *registry, log_dir=tmp_path) as victim,
        worker_process("decode", demo_model_dir, *registry, log_dir=tmp_path) as survivor,
        router_process(demo_model_dir, redis_url, log_dir=tmp_path) as (router, _),
    ):
        yield router, prefill, victim, survivor


async def stream(stub, prompt, params, request_id):
    messages = []
    async for message in stub.Generate(router_pb2.GenerateRequest(
        token_ids=router_pb2.TokenIds(ids=prompt), sampling=sampling_params_to_proto(params),
        request_id=request_id, stream=True,
    )):  # fmt: skip
        messages.append(message)
    return messages


async def wait_until_decoding_on(stub, ids, address, timeout_s=30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for request_id in ids:
            try:
                info = await stub.GetRequest(router_pb2.GetRequestRequest(request_id=request_id))
            except grpc.aio.AioRpcError:
                continue
            if info.status == "decoding" and info.decode_worker == address:
                return
        await asyncio.sleep(0.02)
    raise TimeoutError(f"no request decoding on {address}")


async def test_sigkill_of_a_decode_worker_mid_stream_loses_no_token(cluster, demo_model_dir):
    router, prefill, victim, survivor = cluster
    prompts = [[(13 * i + 7 * j) % 990 + 3 for j in range(40 + 9 * i)] for i in range(8)]
    params = [PARAMS if i % 2 else SEEDED for i in range(8)]
    expected = LLMEngine.from_pretrained(demo_model_dir).generate(prompts, params)
    ids = [f"decode-death-{i}-{time.time_ns()}" for i in range(8)]
    async with grpc.aio.insecure_channel(router) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        deadline = time.monotonic() + 30
        while len((await stub.ListWorkers(router_pb2.ListWorkersRequest())).workers) < 3:
            assert time.monotonic() < deadline, "workers never registered"
            await asyncio.sleep(0.1)
        runs = [asyncio.create_task(stream(stub, p, s, i))
                for p, s, i in zip(prompts, params, ids, strict=True)]  # fmt: skip
        await wait_until_decoding_on(stub, ids, victim.address)
        victim.proc.kill()
        results = await asyncio.gather(*runs)
    for messages, want in zip(results, expected, strict=True):
        assert [t for m in messages for t in m.token_ids] == want.token_ids
        assert "".join(m.text for m in messages) == want.text
        assert messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert [m.offset for m in messages] == sorted(m.offset for m in messages)
    for worker in (survivor, prefill):
        load = worker.wait_idle()
        assert (load.free_blocks, load.running) == (load.total_blocks, 0)
