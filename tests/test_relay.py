"""Relay: many requests' tokens on one call per (router, decode worker).

Real prefill and decode worker processes on loopback; the router's end of the call
(`pdserve.router.relay.DecodeRelays`) runs in the test, and some tests speak the
protocol by hand to check what goes over the wire.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time

import grpc
import pytest
from procs import worker_process

from pdserve.api.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.llm_engine import LLMEngine
from pdserve.router.relay import DecodeRelays
from pdserve.rpc.wire import sampling_params_to_proto

pytestmark = pytest.mark.cluster

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
UNFINISHED = common_pb2.FINISH_REASON_UNSPECIFIED


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("relay-logs")
    with (
        worker_process("prefill", demo_model_dir, log_dir=logs) as prefill,
        # --orphan-timeout 0: a call that ends aborts what is on it (tests/test_orphans.py
        # has the default, where a router taking a request over re-attaches it)
        worker_process(
            "decode",
            demo_model_dir,
            "--num-kv-blocks",
            "600",
            "--orphan-timeout",
            "0",
            log_dir=logs,
        ) as decode,
    ):
        yield prefill, decode


@pytest.fixture(scope="module")
def reference_engine(demo_model_dir):
    return LLMEngine.from_pretrained(demo_model_dir)


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(rng.randrange(1, 60))] for _ in range(count)]


def generate(prompt: list[int], params: SamplingParams, interval: int = 1):
    sampling = sampling_params_to_proto(params)
    request = decode_pb2.LocalGenerateRequest(prompt_token_ids=prompt, sampling=sampling)
    return decode_pb2.RelayAttach(stream_interval=interval, generate=request)


async def attach_generations(call, batch: list[list[int]], params: SamplingParams) -> None:
    """By hand on a raw Relay call: stream ids 1, 2, ... in order."""
    for stream_id, prompt in enumerate(batch, start=1):
        attach = generate(prompt, params)
        attach.stream_id = stream_id
        await call.write(decode_pb2.RelayCommand(attach=attach))


async def collect(stream) -> tuple[list[int], list[decode_pb2.TokenDelta]]:
    deltas: list[decode_pb2.TokenDelta] = []
    await stream.deliver(deltas.append)
    return [t for d in deltas for t in d.token_ids], deltas


async def disaggregated(relays, prefill_stub, decode_stub, decode_address, prompt, params):
    """Admit, attach the lease to the relay, prefill: the router's sequence."""
    sampling = sampling_params_to_proto(params)
    lease = await decode_stub.Admit(
        decode_pb2.AdmitRequest(prompt_token_ids=prompt, sampling=sampling)
    )
    stream = relays.open(decode_address, decode_pb2.RelayAttach(lease_id=lease.lease_id))
    first = await prefill_stub.Prefill(
        prefill_pb2.PrefillRequest(
            prompt_token_ids=prompt,
            sampling=sampling,
            target=prefill_pb2.KVTarget(address=decode_address, lease_id=lease.lease_id),
        )
    )
    tokens, deltas = await collect(stream)
    return [first.first_token_id, *tokens], deltas[-1]


async def test_many_disaggregated_requests_share_one_call(cluster, reference_engine):
    prefill, decode = cluster
    batch = prompts(16, seed=1)
    expected = reference_engine.generate(batch, GREEDY)
    relays = DecodeRelays(lambda address: channels[address])
    async with prefill.channel() as pch, decode.channel() as dch:
        channels = {decode.address: dch}
        prefill_stub, decode_stub = (
            prefill_pb2_grpc.PrefillStub(pch),
            decode_pb2_grpc.DecodeStub(dch),
        )
        results = await asyncio.gather(
            *(
                disaggregated(relays, prefill_stub, decode_stub, decode.address, prompt, GREEDY)
                for prompt in batch
            )
        )
        assert len(relays._connections) == 1  # one call carried all sixteen
        await relays.close()
    for (tokens, last), prompt, want in zip(results, batch, expected, strict=True):
        assert tokens == want.token_ids
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert last.usage.completion_tokens == GREEDY.max_tokens
        assert last.usage.prompt_tokens == len(prompt)
    assert decode.wait_idle().free_blocks == decode.total_blocks


@pytest.mark.parametrize("interval", [1, 5])
async def test_colocated_generations_stream_the_engines_tokens(cluster, reference_engine, interval):
    _, decode = cluster
    batch = prompts(8, seed=2)
    expected = reference_engine.generate(batch, GREEDY)
    async with decode.channel() as channel:
        relays = DecodeRelays(lambda address: channel)
        results = await asyncio.gather(
            *(
                collect(relays.open(decode.address, generate(prompt, GREEDY, interval)))
                for prompt in batch
            )
        )
        await relays.close()
    for (tokens, deltas), want in zip(results, expected, strict=True):
        assert tokens == want.token_ids
        assert "".join(d.text for d in deltas) == want.text
        # the first message at once, then `interval` tokens or more each (more when the
        # sender fell behind), the last: what is left
        sizes = [len(d.token_ids) for d in deltas]
        assert all(size >= interval for size in sizes[1:-1]), sizes
    assert decode.wait_idle().free_blocks == decode.total_blocks


async def test_one_batch_carries_a_step_of_every_request(cluster):
    """What the call is for: concurrent requests share messages."""
    _, decode = cluster
    # long enough that all eight run together even where the writes are slow (a loaded
    # machine: with 12 tokens, each could finish before the next attach arrived)
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    async with decode.channel() as channel:
        call = decode_pb2_grpc.DecodeStub(channel).Relay()
        await attach_generations(call, prompts(8, seed=3), params)
        finished, most_streams_in_a_batch = set(), 0
        while len(finished) < 8:
            batch = await call.read()
            most_streams_in_a_batch = max(most_streams_in_a_batch, len(batch.items))
            finished |= {i.stream_id for i in batch.items if i.delta.finish_reason != UNFINISHED}
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF  # the worker ends the call when we do
    assert most_streams_in_a_batch >= 4
    assert decode.wait_idle().free_blocks == decode.total_blocks


async def test_cancel_stops_one_request_and_frees_its_blocks(cluster):
    _, decode = cluster
    async with decode.channel() as channel:
        relays = DecodeRelays(lambda address: channel)
        streams = [relays.open(decode.address, generate(p, LONG)) for p in prompts(2, seed=4)]
        counts = [0, 0]

        def counter(i):
            def count(delta):
                counts[i] += len(delta.token_ids)

            return count

        tasks = [asyncio.create_task(s.deliver(counter(i))) for i, s in enumerate(streams)]
        while min(counts) < 5:
            await asyncio.sleep(0.01)
        tasks[0].cancel()  # the client went away: the runner's finally cancels its stream
        streams[0].cancel()
        await asyncio.to_thread(wait_running, decode, 1)
        before = counts[1]
        while counts[1] < before + 5:  # the other request carries on
            await asyncio.sleep(0.01)
        tasks[1].cancel()
        streams[1].cancel()
        load = await asyncio.to_thread(decode.wait_idle)
        assert (load.running, load.free_blocks) == (0, decode.total_blocks)
        await relays.close()


def wait_running(worker, count: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while worker.load().running != count:
        assert time.monotonic() < deadline, f"never {count} running"
        time.sleep(0.02)


async def test_without_orphans_closing_the_call_aborts_every_request_on_it(cluster):
    _, decode = cluster
    async with decode.channel() as channel:
        call = decode_pb2_grpc.DecodeStub(channel).Relay()
        await attach_generations(call, prompts(4, seed=5), LONG)
        await call.read()
        call.cancel()  # the router went away
    load = await asyncio.to_thread(decode.wait_idle)
    assert (load.running, load.free_blocks) == (0, decode.total_blocks)


async def test_a_bad_attach_fails_its_stream_only(cluster, reference_engine):
    _, decode = cluster
    prompt = prompts(1, seed=6)[0]
    # long enough to still run when the last attach reuses its stream id, however late
    # a loaded machine reads it
    params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    want = reference_engine.generate([prompt], params)[0]
    async with decode.channel() as channel:
        call = decode_pb2_grpc.DecodeStub(channel).Relay()
        good = generate(prompt, params)
        good.stream_id = 1
        commands = [
            decode_pb2.RelayAttach(stream_id=2, lease_id="no-such-lease"),
            decode_pb2.RelayAttach(stream_id=3),  # neither a lease nor a generation
            good,
            decode_pb2.RelayAttach(stream_id=1, lease_id="x"),  # stream id in use
        ]
        for attach in commands:
            await call.write(decode_pb2.RelayCommand(attach=attach))
        errors: list[tuple[int, int, str]] = []  # stream id, code, message
        tokens: list[int] = []
        finished = False
        while not finished or len(errors) < 3:
            for item in (await call.read()).items:
                if item.error_code:
                    errors.append((item.stream_id, item.error_code, item.error_message))
                else:
                    tokens += item.delta.token_ids
                    finished = item.delta.finish_reason != UNFINISHED
        call.cancel()
    assert sorted((stream_id, code) for stream_id, code, _ in errors) == [
        (1, grpc.StatusCode.INVALID_ARGUMENT.value[0]),  # stream id 1 already in use
        (2, grpc.StatusCode.NOT_FOUND.value[0]),
        (3, grpc.StatusCode.INVALID_ARGUMENT.value[0]),
    ]
    assert any("attach.request" in message for _, _, message in errors)
    assert tokens == want.token_ids  # the good one, untouched by the others' errors


async def test_the_deadline_ends_the_stream_and_the_request(cluster):
    _, decode = cluster
    async with decode.channel() as channel:
        relays = DecodeRelays(lambda address: channel)
        stream = relays.open(decode.address, generate(prompts(1, seed=7)[0], LONG), timeout=0.5)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await collect(stream)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        load = await asyncio.to_thread(decode.wait_idle)
        assert (load.running, load.free_blocks) == (0, decode.total_blocks)
        await relays.close()


async def test_a_draining_worker_finishes_its_streams_then_ends_the_call(
    demo_model_dir, tmp_path, reference_engine
):
    prompt = prompts(1, seed=8)[0]
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    want = reference_engine.generate([prompt], params)[0]
    with worker_process("decode", demo_model_dir, log_dir=tmp_path) as decode:
        async with decode.channel() as channel:
            relays = DecodeRelays(lambda address: channel)
            stream = relays.open(decode.address, generate(prompt, params))
            seen: list[int] = []
            collecting = asyncio.create_task(stream.deliver(lambda d: seen.extend(d.token_ids)))
            while not seen:
                await asyncio.sleep(0.01)
            decode.proc.send_signal(signal.SIGTERM)  # drain: finish what runs, then exit
            await collecting
            assert seen == want.token_ids
            # The call ended with the worker's last stream: a new request gets UNAVAILABLE.
            late = relays.open(decode.address, generate(prompt, GREEDY))
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await collect(late)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            # The worker ends the call once nothing is attached (the late attach may have
            # been refused on it first); a call that ended is not kept for the address.
            for _ in range(100):
                if not relays._connections:
                    break
                await asyncio.sleep(0.05)
            assert not relays._connections
            await relays.close()
        assert decode.proc.wait(timeout=30) == 0
