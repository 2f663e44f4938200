"""A decode worker dies mid-stream: the router carries its requests on elsewhere."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from procs import router_process, worker_process

from pdserve.api.v1 import decode_pb2, decode_pb2_grpc, router_pb2, router_pb2_grpc
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.structured_output import Constraint, ConstraintKind
from pdserve.engine.llm_engine import LLMEngine
from pdserve.rpc.wire import FINISH_REASONS, sampling_params_to_proto

pytestmark = pytest.mark.cluster

PARAMS = SamplingParams(temperature=0.0, max_tokens=800, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=5, max_tokens=800, ignore_eos=True)
# under a constraint: the retry's decode worker rebuilds the matcher from the first token
# and regenerates the same tokens, so the same grammar states (it may end before 800)
WORDS = SamplingParams(
    temperature=0.8,
    seed=9,
    max_tokens=800,
    constraint=Constraint(ConstraintKind.REGEX, "[a-z]+( [a-z]+)*"),
)


# 5: decode workers send several tokens per message, so a retry's messages group the
# tokens differently from the dead attempt's, and must still add each token once.
@pytest.fixture(params=[1, 5], ids=["one-step-per-message", "5-tokens-per-message"])
def cluster(request, demo_model_dir, redis_url, tmp_path):
    registry = ("--redis-url", redis_url)
    interval = ("--stream-interval", str(request.param))
    with (
        worker_process("prefill", demo_model_dir, *registry, log_dir=tmp_path) as prefill,
        worker_process("decode", demo_model_dir, *registry, log_dir=tmp_path) as victim,
        worker_process("decode", demo_model_dir, *registry, log_dir=tmp_path) as survivor,
        router_process(demo_model_dir, redis_url, *interval, log_dir=tmp_path) as (router, _),
    ):
        yield router, prefill, victim, survivor, request.param


async def stream(stub, prompt, params, request_id):
    messages = []
    async for message in stub.Generate(
        router_pb2.GenerateRequest(
            token_ids=router_pb2.TokenIds(ids=prompt),
            sampling=sampling_params_to_proto(params),
            request_id=request_id,
            stream=True,
        )
    ):
        messages.append(message)
    return messages


async def wait_until_decoding_on(worker, stub, ids, runs, timeout_s=30.0) -> None:
    """Until the worker's engine has a request in its running batch.

    Asked of the worker itself: the router's request records are written in batches,
    so a short decode can finish before its record ever says "decoding".
    """
    deadline = time.monotonic() + timeout_s
    async with worker.channel() as channel:
        load_stub = decode_pb2_grpc.DecodeStub(channel)
        while time.monotonic() < deadline and not all(run.done() for run in runs):
            if (await load_stub.GetLoad(decode_pb2.GetLoadRequest(), timeout=5)).running:
                return
            await asyncio.sleep(0.005)
    where = []
    for request_id, run in zip(ids, runs, strict=True):
        info = await stub.GetRequest(router_pb2.GetRequestRequest(request_id=request_id))
        outcome = run.exception() if run.done() else "still running"
        where.append(f"{info.status} on {info.decode_worker or '-'} ({outcome!r})")
    raise TimeoutError(f"no request decoding on {worker.address}: " + "; ".join(where))


async def test_sigkill_of_a_decode_worker_mid_stream_loses_no_token(cluster, demo_model_dir):
    router, prefill, victim, survivor, stream_interval = cluster
    prompts = [[(13 * i + 7 * j) % 990 + 3 for j in range(40 + 9 * i)] for i in range(8)]
    params = [WORDS if i in (2, 5) else PARAMS if i % 2 else SEEDED for i in range(8)]
    expected = LLMEngine.from_pretrained(demo_model_dir).generate(prompts, params)
    ids = [f"decode-death-{i}-{time.time_ns()}" for i in range(8)]
    async with grpc.aio.insecure_channel(router) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        deadline = time.monotonic() + 30
        while len((await stub.ListWorkers(router_pb2.ListWorkersRequest())).workers) < 3:
            assert time.monotonic() < deadline, "workers never registered"
            await asyncio.sleep(0.1)
        runs = [
            asyncio.create_task(stream(stub, p, s, i))
            for p, s, i in zip(prompts, params, ids, strict=True)
        ]
        await wait_until_decoding_on(victim, stub, ids, runs)
        victim.proc.kill()
        results = await asyncio.gather(*runs)
    for messages, want in zip(results, expected, strict=True):
        assert [t for m in messages for t in m.token_ids] == want.token_ids
        assert "".join(m.text for m in messages) == want.text
        assert messages[-1].finish_reason == FINISH_REASONS[want.finish_reason]
        assert [m.offset for m in messages] == sorted(m.offset for m in messages)
        if stream_interval > 1:  # the case is what it says: several tokens per message
            assert max(len(m.token_ids) for m in messages) >= stream_interval
    for worker in (survivor, prefill):
        load = worker.wait_idle()
        assert (load.free_blocks, load.running) == (load.total_blocks, 0)
