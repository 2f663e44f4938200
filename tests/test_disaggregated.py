"""Prefill and decode workers as real processes on loopback, KV handed over gRPC."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from procs import worker_process

from pdserve.api.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.wire import sampling_params_to_proto
from pdserve.worker.handoff import disaggregated_generate

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=42, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    """One prefill and two decode workers."""
    logs = tmp_path_factory.mktemp("logs")
    with (
        worker_process("prefill", demo_model_dir, log_dir=logs) as prefill,
        worker_process("decode", demo_model_dir, "--num-kv-blocks", "400", log_dir=logs) as d1,
        worker_process("decode", demo_model_dir, "--num-kv-blocks", "400", log_dir=logs) as d2,
    ):
        yield prefill, [d1, d2]


@pytest.fixture(scope="module")
def reference_engine(demo_model_dir):
    return LLMEngine.from_pretrained(demo_model_dir)


def prompts(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in lengths]


async def run(prefill, decode, prompt, params, request_id=""):
    """Tokens of one disaggregated request, the final delta."""
    async with prefill.channel() as pch, decode.channel() as dch:
        tokens, last = [], None
        async for delta in disaggregated_generate(
            prefill_pb2_grpc.PrefillStub(pch), decode_pb2_grpc.DecodeStub(dch), decode.address,
            prompt, sampling_params_to_proto(params), request_id,
        ):  # fmt: skip
            tokens += delta.token_ids
            last = delta
    return tokens, last


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_disaggregated_equals_one_process(cluster, reference_engine, params):
    prefill, (decode, _) = cluster
    batch = prompts([1, 15, 16, 17, 100, 2000], seed=1)
    expected = reference_engine.generate(batch, params)
    for prompt, want in zip(batch, expected, strict=True):
        tokens, last = await run(prefill, decode, prompt, params)
        assert tokens == want.token_ids, f"prompt of {len(prompt)} tokens"
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert last.usage.completion_tokens == params.max_tokens
        assert last.usage.prompt_tokens == len(prompt)
    assert decode.wait_idle().free_blocks == decode.total_blocks
    assert prefill.wait_idle().running == 0


async def test_32_concurrent_requests_over_two_decode_workers(cluster, reference_engine):
    prefill, decodes = cluster
    rng = random.Random(2)
    batch = prompts([rng.randrange(1, 300) for _ in range(32)], seed=3)
    params = [GREEDY if i % 2 else SEEDED for i in range(32)]
    expected = reference_engine.generate(batch, params)
    results = await asyncio.gather(*(
        run(prefill, decodes[i % 2], prompt, params[i], f"c{i}") for i, prompt in enumerate(batch)
    ))  # fmt: skip
    assert [tokens for tokens, _ in results] == [e.token_ids for e in expected]
    for worker in decodes:
        load = worker.wait_idle()
        assert (load.free_blocks, load.open_leases) == (worker.total_blocks, 0)


async def test_first_token_that_finishes_skips_decode(cluster, reference_engine):
    prefill, (decode, _) = cluster
    one = SamplingParams(temperature=0.0, max_tokens=1)
    tokens, last = await run(prefill, decode, prompts([40], seed=4)[0], one)
    [expected] = reference_engine.generate(prompts([40], seed=4), one)
    assert tokens == expected.token_ids
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    load = decode.wait_idle()
    assert (load.free_blocks, load.open_leases) == (decode.total_blocks, 0)


async def test_admission_without_room_is_resource_exhausted_with_retry_info(cluster):
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    _, (_, decode) = cluster
    params = sampling_params_to_proto(SamplingParams(max_tokens=4))
    async with decode.channel() as ch:
        stub = decode_pb2_grpc.DecodeStub(ch)
        held = await stub.Admit(decode_pb2.AdmitRequest(
            prompt_token_ids=prompts([3990], seed=5)[0], sampling=params))  # fmt: skip
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Admit(decode_pb2.AdmitRequest(
                prompt_token_ids=prompts([3200], seed=6)[0], sampling=params))  # fmt: skip
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        status = rpc_status.from_call(err.value)
        retry = error_details_pb2.RetryInfo()
        assert any(detail.Unpack(retry) for detail in status.details)
        released = await stub.Release(decode_pb2.ReleaseRequest(lease_id=held.lease_id))
        assert released.released
    load = decode.wait_idle()
    assert (load.free_blocks, load.open_leases) == (decode.total_blocks, 0)


async def test_colocated_generate_on_a_both_worker(demo_model_dir, reference_engine, tmp_path):
    with worker_process("both", demo_model_dir, log_dir=tmp_path) as both:
        batch = prompts([5, 33], seed=6)
        expected = reference_engine.generate(batch, GREEDY)
        async with both.channel() as ch:
            stub = decode_pb2_grpc.DecodeStub(ch)
            for prompt, want in zip(batch, expected, strict=True):
                tokens = []
                async for delta in stub.Generate(decode_pb2.GenerateRequest(
                    prompt_token_ids=prompt, sampling=sampling_params_to_proto(GREEDY)
                )):  # fmt: skip
                    tokens += delta.token_ids
                assert tokens == want.token_ids
        # A both worker is a prefill and a decode worker at once.
        tokens, _ = await run(both, both, batch[1], GREEDY)
        assert tokens == expected[1].token_ids


def test_prefill_request_without_target_is_invalid(cluster):
    prefill, _ = cluster
    with grpc.insecure_channel(prefill.address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            prefill_pb2_grpc.PrefillStub(ch).Prefill(
                prefill_pb2.PrefillRequest(prompt_token_ids=[5, 6, 7]), timeout=10
            )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "target" in err.value.details()
