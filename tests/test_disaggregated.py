"""Prefill and decode workers as real processes on loopback, KV handed over gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

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
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.llm_engine import LLMEngine
from pdserve.router.handoff import Attempt, ChannelPool, HandOff
from pdserve.rpc.wire import sampling_params_to_proto

pytestmark = pytest.mark.cluster

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
    """Tokens of one disaggregated request, the final delta (the router's hand-off)."""
    attempt = Attempt(request_id, prompt, sampling_params_to_proto(params))
    channels, tokens, last = ChannelPool(), [], None
    async with HandOff(channels) as handoff:
        async for delta in handoff.generate(prefill.address, decode.address, attempt):
            tokens += delta.token_ids
            last = delta
    await channels.close()
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
    results = await asyncio.gather(
        *(
            run(prefill, decodes[i % 2], prompt, params[i], f"c{i}")
            for i, prompt in enumerate(batch)
        )
    )
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
        held = await stub.Admit(
            decode_pb2.AdmitRequest(prompt_token_ids=prompts([3990], seed=5)[0], sampling=params)
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Admit(
                decode_pb2.AdmitRequest(
                    prompt_token_ids=prompts([3200], seed=6)[0], sampling=params
                )
            )
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        status = rpc_status.from_call(err.value)
        retry = error_details_pb2.RetryInfo()
        assert any(detail.Unpack(retry) for detail in status.details)
        released = await stub.Release(decode_pb2.ReleaseRequest(lease_id=held.lease_id))
        assert released.released
    load = decode.wait_idle()
    assert (load.free_blocks, load.open_leases) == (decode.total_blocks, 0)


async def test_admissions_abandoned_mid_call_leave_no_block_reserved(cluster):
    """A caller that gives up on Admit (deadline, cancel) while the engine reserves."""
    _, (_, decode) = cluster
    params = sampling_params_to_proto(SamplingParams(max_tokens=4))
    async with decode.channel() as ch:
        stub = decode_pb2_grpc.DecodeStub(ch)
        for i, prompt in enumerate(prompts([300] * 60, seed=9)):
            # Leases that were issued all the same expire quickly; reservations that the
            # caller abandoned before their lease existed must be freed by the worker.
            request = decode_pb2.AdmitRequest(
                prompt_token_ids=prompt, sampling=params, lease_ttl_ms=200
            )
            with contextlib.suppress(grpc.aio.AioRpcError):
                await stub.Admit(request, timeout=0.0005 * (i % 10 + 1))
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
                async for delta in stub.Generate(
                    decode_pb2.LocalGenerateRequest(
                        prompt_token_ids=prompt, sampling=sampling_params_to_proto(GREEDY)
                    )
                ):
                    tokens += delta.token_ids
                assert tokens == want.token_ids
        # A both worker is a prefill and a decode worker at once, for the same request id.
        tokens, _ = await run(both, both, batch[1], GREEDY, request_id="same-id")
        assert tokens == expected[1].token_ids


def test_prefill_request_without_target_is_invalid(cluster):
    prefill, _ = cluster
    with grpc.insecure_channel(prefill.address) as ch, pytest.raises(grpc.RpcError) as err:
        prefill_pb2_grpc.PrefillStub(ch).Prefill(
            prefill_pb2.PrefillRequest(prompt_token_ids=[5, 6, 7]), timeout=10
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "target" in err.value.details()


# -- the hand-off refuses what it must, and strands nothing --------------------------------


def admit(decode, prompt, params=GREEDY, ttl_ms=0) -> decode_pb2.Lease:
    with grpc.insecure_channel(decode.address) as ch:
        return decode_pb2_grpc.DecodeStub(ch).Admit(
            decode_pb2.AdmitRequest(
                prompt_token_ids=prompt,
                lease_ttl_ms=ttl_ms,
                sampling=sampling_params_to_proto(params),
            ),
            timeout=10,
        )


def release(decode, lease_id) -> bool:
    with grpc.insecure_channel(decode.address) as ch:
        stub = decode_pb2_grpc.DecodeStub(ch)
        return stub.Release(decode_pb2.ReleaseRequest(lease_id=lease_id), timeout=10).released


def layer_chunk(lease: decode_pb2.Lease, layer: int, num_blocks: int | None = None):
    import zlib

    from pdserve.core.kv_chunk import KVLayerChunk

    layout = lease.layout
    n = lease.num_blocks if num_blocks is None else num_blocks
    shape = (2, n, layout.block_size, layout.num_kv_heads, layout.head_dim)
    data = bytes(4 * 2 * n * layout.block_size * layout.num_kv_heads * layout.head_dim)
    return KVLayerChunk(layer, layout.dtype, shape, data, zlib.crc32(data))


def push(decode, lease_id, items):
    from pdserve.kv.transfer import KVPusher

    with KVPusher(decode.address, num_streams=1) as pusher:
        return pusher.push(lease_id, items, timeout=10)


def expect_push_error(decode, lease_id, items, code):
    from pdserve.kv.transfer import KVPushError

    with pytest.raises(KVPushError) as err:
        push(decode, lease_id, items)
    assert err.value.code == code, err.value


def assert_idle(worker):
    load = worker.wait_idle()
    assert (load.free_blocks, load.open_leases, load.running) == (worker.total_blocks, 0, 0)


def test_corrupt_misplaced_and_unknown_chunks_are_rejected(cluster):
    import dataclasses

    _, (decode, _) = cluster
    lease = admit(decode, prompts([40], seed=7)[0])
    good = layer_chunk(lease, 0)
    corrupt = dataclasses.replace(good, checksum=good.checksum ^ 1)
    expect_push_error(decode, lease.lease_id, [(0, corrupt)], grpc.StatusCode.DATA_LOSS)
    expect_push_error(
        decode, lease.lease_id, [(0, layer_chunk(lease, 99))], grpc.StatusCode.INVALID_ARGUMENT
    )
    expect_push_error(
        decode,
        lease.lease_id,
        [(2, layer_chunk(lease, 0, num_blocks=2))],
        grpc.StatusCode.INVALID_ARGUMENT,
    )  # blocks 2..3 of a 3-block lease
    expect_push_error(decode, "not-a-lease", [(0, good)], grpc.StatusCode.NOT_FOUND)
    # Half the layers is not a complete KV: commit refuses.
    push(decode, lease.lease_id, [(0, good)])
    with grpc.insecure_channel(decode.address) as ch:
        from pdserve.api.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

        with pytest.raises(grpc.RpcError) as err:
            kv_transfer_pb2_grpc.KVTransferStub(ch).CommitKV(
                kv_transfer_pb2.CommitKVRequest(lease_id=lease.lease_id, first_token_id=5),
                timeout=10,
            )
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert release(decode, lease.lease_id)
    assert not release(decode, lease.lease_id)  # once only
    assert_idle(decode)


def test_a_lease_whose_kv_never_arrives_expires_and_frees_its_blocks(cluster):
    _, (decode, _) = cluster
    lease = admit(decode, prompts([100], seed=8)[0], ttl_ms=200)
    assert decode.load().free_blocks < decode.total_blocks
    assert_idle(decode)
    expect_push_error(
        decode, lease.lease_id, [(0, layer_chunk(lease, 0))], grpc.StatusCode.NOT_FOUND
    )


# Renewed every third of it: a renewal more than two thirds late ends the lease, which a
# 300 ms TTL once met in CI's full suite on two cores.
LEASE_TTL_MS = 1000


@pytest.mark.parametrize("known_ttl", [True, False], ids=["ttl-granted", "ttl-unknown"])
async def test_a_renewed_lease_outlives_its_ttl_and_expires_once_renewals_stop(cluster, known_ttl):
    from pdserve.api.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
    from pdserve.worker.prefill import keep_lease_open

    _, (decode, _) = cluster
    lease = admit(decode, prompts([60], seed=9)[0], ttl_ms=LEASE_TTL_MS)
    assert lease.ttl_ms == LEASE_TTL_MS  # as granted: the first renewal waits a third of it
    async with decode.channel() as channel:
        kv = kv_transfer_pb2_grpc.KVTransferStub(channel)
        ttl_ms = lease.ttl_ms if known_ttl else 0  # 0: renewed at once, to learn it
        keeper = asyncio.create_task(keep_lease_open(kv, lease.lease_id, ttl_ms))
        await asyncio.sleep(4 * LEASE_TTL_MS / 1000)  # what a prompt queued there may wait
        assert not keeper.done()
        renewed = await kv.RenewLease(kv_transfer_pb2.RenewLeaseRequest(lease_id=lease.lease_id))
        assert renewed.ttl_ms == LEASE_TTL_MS and renewed.deadline_unix_ms > lease.deadline_unix_ms
        keeper.cancel()
    assert_idle(decode)  # with nobody renewing, it expires and frees its blocks
    expect_push_error(
        decode, lease.lease_id, [(0, layer_chunk(lease, 0))], grpc.StatusCode.NOT_FOUND
    )


async def test_cancelled_decode_stream_frees_blocks_at_once(cluster):
    prefill, (decode, _) = cluster
    long = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
    attempt = Attempt("", prompts([50], seed=9)[0], sampling_params_to_proto(long))
    channels = ChannelPool()
    handoff = HandOff(channels)
    stream = handoff.generate(prefill.address, decode.address, attempt)
    received = 0
    async for delta in stream:
        received += len(delta.token_ids)
        if received >= 5:
            break
    await stream.aclose()  # detaches from the Relay call, which stays open
    await asyncio.to_thread(assert_idle, decode)
    await asyncio.to_thread(assert_idle, prefill)
    await handoff.close()
    await channels.close()


@pytest.fixture(scope="module")
def slow_prefill(demo_model_dir, tmp_path_factory):
    """A prefill worker that computes a prompt 16 tokens per engine step: a long prompt
    is still computing a few hundred steps after it starts."""
    logs = tmp_path_factory.mktemp("slow-prefill")
    args = ("--max-num-batched-tokens", "16")
    with worker_process("prefill", demo_model_dir, *args, log_dir=logs) as prefill:
        yield prefill


async def test_cancelled_prefill_releases_the_lease_on_both_sides(cluster, slow_prefill):
    # The caller leaves while its prompt computes. (A caller that leaves after the reply
    # left a committed lease whose stream never attached: the decode worker reaps that one
    # later, so cancelling at a fixed time after the call proved nothing when a warm,
    # cached prompt came back first.)
    _, (decode, _) = cluster
    prompt = prompts([3000], seed=11)[0]  # in no prefix cache
    lease = admit(decode, prompt)
    async with slow_prefill.channel() as ch:
        call = prefill_pb2_grpc.PrefillStub(ch).Prefill(
            prefill_pb2.PrefillRequest(
                prompt_token_ids=prompt,
                sampling=sampling_params_to_proto(GREEDY),
                target=prefill_pb2.KVTarget(address=decode.address, lease_id=lease.lease_id),
            )
        )
        while (await asyncio.to_thread(slow_prefill.load)).running == 0:
            await asyncio.sleep(0.002)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    assert_idle(decode)
    assert_idle(slow_prefill)


def test_model_mismatch_is_refused_at_handshake(demo_model_dir, cluster, tmp_path):
    from pdserve.engine.demo_model import write_demo_model

    prefill, _ = cluster
    other_model = write_demo_model(tmp_path / "other", size="tiny", seed=1)
    with worker_process("decode", other_model, log_dir=tmp_path) as other:
        lease = admit(other, [5, 6, 7])
        with grpc.insecure_channel(prefill.address) as ch, pytest.raises(grpc.RpcError) as err:
            prefill_pb2_grpc.PrefillStub(ch).Prefill(
                prefill_pb2.PrefillRequest(
                    prompt_token_ids=[5, 6, 7],
                    sampling=sampling_params_to_proto(GREEDY),
                    target=prefill_pb2.KVTarget(address=other.address, lease_id=lease.lease_id),
                ),
                timeout=20,
            )
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "model_fingerprint" in err.value.details()
        assert not release(other, lease.lease_id)  # the prefill worker gave it back already
        assert_idle(other)
    assert_idle(prefill)


def test_health_serving_then_sigterm_drains_and_exits_cleanly(demo_model_dir, tmp_path):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from procs import stop

    # --reflection: a worker lists its services only when asked to (off by default)
    with worker_process("decode", demo_model_dir, "--reflection", log_dir=tmp_path) as decode:
        with grpc.insecure_channel(decode.address) as ch:
            check = health_pb2_grpc.HealthStub(ch).Check
            for service in ("", "pdserve.v1.Decode", "pdserve.v1.KVTransfer"):
                response = check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert response.status == health_pb2.HealthCheckResponse.SERVING
            from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
                ProtoReflectionDescriptorDatabase,
            )

            services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
            assert {
                "pdserve.v1.Decode",
                "pdserve.v1.KVTransfer",
                "grpc.health.v1.Health",
            } <= services
        assert stop(decode.proc) == 0
        with grpc.insecure_channel(decode.address) as ch, pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)


async def test_prefill_prefix_cache_skips_compute_but_ships_every_block(cluster, reference_engine):
    prefill, (decode, _) = cluster
    shared = prompts([64], seed=11)[0]
    first, second = shared + [7, 8, 9], shared + [10, 11, 12, 13]
    expected = reference_engine.generate([first, second], GREEDY)
    tokens_a, last_a = await run(prefill, decode, first, GREEDY, "prefix-a")
    tokens_b, last_b = await run(prefill, decode, second, GREEDY, "prefix-b")
    assert [tokens_a, tokens_b] == [e.token_ids for e in expected]
    # The second prompt's 4 shared full blocks came from the prefill worker's cache,
    # yet the decode worker (which had none of them) continued it correctly.
    assert last_b.usage.cached_prompt_tokens == 64
    assert_idle(decode)


# -- the per-request calls: Stream and Generate, one request on the Relay's path ------------


async def stream_call(prefill, decode, prompt, params, stream_interval=1):
    """Admit, open Stream, Prefill: one request without the router. The prefill response
    and the Stream call's messages."""
    async with decode.channel() as dch, prefill.channel() as pch:
        stub = decode_pb2_grpc.DecodeStub(dch)
        sampling = sampling_params_to_proto(params)
        lease = await stub.Admit(
            decode_pb2.AdmitRequest(prompt_token_ids=prompt, sampling=sampling)
        )
        stream = stub.Stream(
            decode_pb2.StreamRequest(lease_id=lease.lease_id, stream_interval=stream_interval)
        )
        first = await prefill_pb2_grpc.PrefillStub(pch).Prefill(
            prefill_pb2.PrefillRequest(
                prompt_token_ids=prompt,
                sampling=sampling,
                target=prefill_pb2.KVTarget(address=decode.address, lease_id=lease.lease_id),
            )
        )
        return first, [message async for message in stream]


async def test_a_stream_call_sends_its_lease_s_tokens_by_stream_interval(cluster, reference_engine):
    prefill, (decode, _) = cluster
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompt = prompts([40], seed=12)[0]
    [want] = reference_engine.generate([prompt], params)
    first, messages = await stream_call(prefill, decode, prompt, params, stream_interval=4)
    assert [first.first_token_id, *(t for m in messages for t in m.token_ids)] == want.token_ids
    assert first.text + "".join(m.text for m in messages) == want.text
    sizes = [len(m.token_ids) for m in messages]
    assert all(size >= 4 for size in sizes[1:-1])  # the first and the last go out at once
    assert [m.finish_reason for m in messages[:-1]] == [common_pb2.FINISH_REASON_UNSPECIFIED] * (
        len(messages) - 1
    )
    last = messages[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (40, 30)
    assert_idle(decode)


async def test_a_prefill_answer_says_how_long_the_worker_took_within_the_caller_s_wait(cluster):
    prefill, (decode, _) = cluster
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    started = time.perf_counter()
    first, _ = await stream_call(prefill, decode, prompts([40], seed=13)[0], params)
    waited_ms = (time.perf_counter() - started) * 1000
    assert 0 < first.prefill_ms < waited_ms  # the rest is the hop the router measures
    assert_idle(decode)


async def test_a_stream_call_ends_with_its_lease(cluster):
    _, (decode, _) = cluster
    async with decode.channel() as ch:
        stub = decode_pb2_grpc.DecodeStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Stream(decode_pb2.StreamRequest(lease_id="no-such-lease")).read()
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        # Its KV never arrives: the stream fails when the lease expires.
        lease = await asyncio.to_thread(admit, decode, prompts([30], seed=13)[0], ttl_ms=300)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Stream(decode_pb2.StreamRequest(lease_id=lease.lease_id)).read()
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # Released by its holder while (or before) the stream waits: NOT_FOUND either way.
        lease = await asyncio.to_thread(admit, decode, prompts([30], seed=14)[0])
        stream = stub.Stream(decode_pb2.StreamRequest(lease_id=lease.lease_id))
        assert await asyncio.to_thread(release, decode, lease.lease_id)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stream.read()
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    await asyncio.to_thread(assert_idle, decode)


async def test_a_generate_call_refuses_a_bad_request_and_stops_when_cancelled(
    cluster, reference_engine
):
    _, (decode, _) = cluster
    long = sampling_params_to_proto(SamplingParams(max_tokens=2000, ignore_eos=True))
    async with decode.channel() as ch:
        stub = decode_pb2_grpc.DecodeStub(ch)
        bad = decode_pb2.LocalGenerateRequest(prompt_token_ids=[10**6], sampling=long)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Generate(bad).read()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompt" in err.value.details()
        call = stub.Generate(
            decode_pb2.LocalGenerateRequest(prompt_token_ids=prompts([20])[0], sampling=long)
        )
        assert (await call.read()).token_ids
        call.cancel()
    await asyncio.to_thread(assert_idle, decode)
