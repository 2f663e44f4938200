"""The router as users meet it: real router, workers and Redis processes on loopback."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from procs import router_process, worker_process

from pdserve.api.v1 import common_pb2, router_pb2, router_pb2_grpc
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.llm_engine import LLMEngine
from pdserve.rpc.wire import sampling_params_to_proto

pytestmark = pytest.mark.cluster

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(demo_model_dir, redis_url, tmp_path_factory):
    """Two routers over one Redis, one prefill and one decode worker (registry discovery)."""
    logs = tmp_path_factory.mktemp("router-logs")
    registry = ("--redis-url", redis_url)
    with (
        worker_process("prefill", demo_model_dir, *registry, log_dir=logs) as prefill,
        worker_process(
            "decode", demo_model_dir, *registry, "--num-kv-blocks", "300", log_dir=logs
        ) as decode,
        router_process(demo_model_dir, redis_url, log_dir=logs) as (router_a, _),
        router_process(demo_model_dir, redis_url, log_dir=logs) as (router_b, _),
    ):
        yield {"prefill": prefill, "decode": decode, "routers": [router_a, router_b]}


@pytest.fixture(scope="module")
def engine(demo_model_dir):
    return LLMEngine.from_pretrained(demo_model_dir)


async def wait_for_workers(address: str, count: int = 2, timeout_s: float = 15) -> None:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        deadline = asyncio.get_running_loop().time() + timeout_s
        while asyncio.get_running_loop().time() < deadline:
            listed = await stub.ListWorkers(router_pb2.ListWorkersRequest())
            if sum(w.healthy for w in listed.workers) >= count:
                return
            await asyncio.sleep(0.1)
    raise TimeoutError("workers never showed up in the registry")


async def generate(address, **fields) -> list[router_pb2.GenerateResponse]:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        return [m async for m in stub.Generate(router_pb2.GenerateRequest(**fields))]


def tokens_of(messages) -> list[int]:
    return [t for m in messages for t in m.token_ids]


async def test_text_and_token_prompts_stream_the_engines_tokens(cluster, engine):
    router = cluster["routers"][0]
    await wait_for_workers(router)
    text = "The prefill worker computes the prompt once"
    [expected] = engine.generate([text], GREEDY)
    sampling = sampling_params_to_proto(GREEDY)
    by_text = await generate(router, text=text, sampling=sampling, stream=True)
    assert tokens_of(by_text) == expected.token_ids
    assert "".join(m.text for m in by_text) == expected.text
    final = by_text[-1]
    assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (
        len(expected.prompt_token_ids),
        16,
    )
    assert final.timings.ttft_ms > 0 and final.timings.total_ms >= final.timings.ttft_ms
    ids = router_pb2.TokenIds(ids=expected.prompt_token_ids)
    by_ids = await generate(router, token_ids=ids, sampling=sampling, stream=False)
    assert len(by_ids) == 1 and list(by_ids[0].token_ids) == expected.token_ids


async def test_stop_strings_and_finish_reason(cluster, engine):
    router = cluster["routers"][0]
    await wait_for_workers(router)
    text = "Decode reads every weight"
    [free] = engine.generate([text], GREEDY)
    stop = free.text[5:9]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop])
    [expected] = engine.generate([text], params)
    got = await generate(router, text=text, sampling=sampling_params_to_proto(params), stream=True)
    assert "".join(m.text for m in got) == expected.text
    assert stop not in "".join(m.text for m in got)
    assert got[-1].finish_reason == common_pb2.FINISH_REASON_STOP


async def test_resume_through_another_router_equals_the_uninterrupted_stream(cluster, engine):
    router_a, router_b = cluster["routers"]
    await wait_for_workers(router_a)
    sampling = sampling_params_to_proto(GREEDY)
    full = await generate(
        router_a, text="Resume me", request_id="resume-1", sampling=sampling, stream=True
    )
    # A client resumes from the tokens it has, i.e. after a whole message (one may carry
    # several tokens when the router or the worker coalesced them).
    for num_messages in (0, 5, len(full)):
        offset = len(tokens_of(full[:num_messages]))
        tail = await generate(
            router_b,
            request_id="resume-1",
            resume_from=offset,
            text="Resume me",
            sampling=sampling,
            stream=True,
        )
        assert tokens_of(full)[:offset] + tokens_of(tail) == tokens_of(full)
        text_before = "".join(m.text for m in full[:num_messages])
        assert text_before + "".join(m.text for m in tail) == "".join(m.text for m in full)
    async with grpc.aio.insecure_channel(router_b) as ch:
        info = await router_pb2_grpc.RouterStub(ch).GetRequest(
            router_pb2.GetRequestRequest(request_id="resume-1")
        )
    assert info.status == "finished" and info.usage.completion_tokens == 16


async def test_idempotent_retry_attaches_instead_of_running_again(cluster):
    router_a, router_b = cluster["routers"]
    await wait_for_workers(router_a)
    sampling = sampling_params_to_proto(SamplingParams(temperature=0.8, max_tokens=12))
    first, second = await asyncio.gather(
        generate(router_a, text="once only", request_id="idem-1", sampling=sampling, stream=True),
        generate(router_b, text="once only", request_id="idem-1", sampling=sampling, stream=True),
    )
    assert tokens_of(first) == tokens_of(second) and len(tokens_of(first)) == 12
    # The call that lost the race had started on the workers too; nothing of it stays.
    load = await asyncio.to_thread(cluster["decode"].wait_idle)
    assert (load.free_blocks, load.open_leases, load.running) == (load.total_blocks, 0, 0)
