"""A frozen decode worker (SIGSTOP) does not stall its streams: they move elsewhere.

A stopped process keeps its TCP connections open (the kernel answers for it), so the
router's Relay call did not break and every stream on that worker waited for as long as
it was frozen. Now a stream waiting for tokens while the worker's call brings nothing for
the progress timeout (10 s by default) fails over as it would for a killed worker.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest

from pdserve.api.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)
from pdserve.cluster.load import wait_idle
from pdserve.cluster.local import ClusterShape, LocalCluster
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.llm_engine import LLMEngine
from pdserve.router.relay import DEFAULT_STREAM_PROGRESS_TIMEOUT_S, DecodeRelays
from pdserve.rpc.wire import sampling_params_to_proto

pytestmark = pytest.mark.cluster

LONG = SamplingParams(temperature=0.0, max_tokens=800, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPT = [(7 * j) % 990 + 3 for j in range(40)]
# the progress timeout, then the retry: prefill again, regenerate the tokens delivered
FAILOVER_BUDGET_S = DEFAULT_STREAM_PROGRESS_TIMEOUT_S + 5.0


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("frozen")
    with LocalCluster(str(demo_model_dir), ClusterShape(prefill=1, decode=2), run_dir) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def reference_engine(demo_model_dir):
    return LLMEngine.from_pretrained(demo_model_dir)


def workers(cluster: LocalCluster, role: str):
    return [child for child in cluster.children if child.role == role]


async def running_on(decode_workers, stream: asyncio.Task):
    """The decode worker whose engine runs a request, once one does."""
    while not stream.done():
        for worker in decode_workers:
            async with grpc.aio.insecure_channel(worker.address) as channel:
                load = await decode_pb2_grpc.DecodeStub(channel).GetLoad(
                    decode_pb2.GetLoadRequest()
                )
            if load.running:
                return worker
        await asyncio.sleep(0.005)
    raise AssertionError(f"the stream ended before it decoded: {stream.result()}")


async def generate(stub, prompt: list[int], params: SamplingParams) -> list[int]:
    request = router_pb2.GenerateRequest(
        token_ids=router_pb2.TokenIds(ids=prompt),
        sampling=sampling_params_to_proto(params),
        stream=True,
    )
    return [token async for message in stub.Generate(request) for token in message.token_ids]


async def test_a_request_waiting_on_its_prefill_past_the_deadline_is_not_failed(
    cluster, reference_engine
):
    """The deadline runs once a request waits for tokens: a long prefill queue (here:
    prefill starts after three timeouts) is not taken for a frozen worker."""
    [prefill], [decode, _] = workers(cluster, "prefill"), workers(cluster, "decode")
    sampling = sampling_params_to_proto(SHORT)
    async with (
        grpc.aio.insecure_channel(prefill.address) as prefill_channel,
        grpc.aio.insecure_channel(decode.address) as decode_channel,
    ):
        relays = DecodeRelays(lambda address: decode_channel, progress_timeout_s=0.3)
        admit = decode_pb2.AdmitRequest(prompt_token_ids=PROMPT, sampling=sampling)
        lease = await decode_pb2_grpc.DecodeStub(decode_channel).Admit(admit)
        stream = relays.open(decode.address, decode_pb2.RelayAttach(lease_id=lease.lease_id))
        await asyncio.sleep(1.0)
        target = prefill_pb2.KVTarget(address=decode.address, lease_id=lease.lease_id)
        first = await prefill_pb2_grpc.PrefillStub(prefill_channel).Prefill(
            prefill_pb2.PrefillRequest(prompt_token_ids=PROMPT, sampling=sampling, target=target)
        )
        deltas: list[decode_pb2.TokenDelta] = []
        await stream.deliver(deltas.append)
        await relays.close()
    tokens = [first.first_token_id, *(t for d in deltas for t in d.token_ids)]
    assert tokens == reference_engine.generate([PROMPT], SHORT)[0].token_ids
    assert deltas[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


async def test_a_frozen_decode_worker_hands_its_stream_to_another(cluster):
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        expected = await generate(stub, PROMPT, LONG)  # undisturbed
        assert len(expected) == LONG.max_tokens
        stream = asyncio.create_task(generate(stub, PROMPT, LONG))
        victim = await running_on(workers(cluster, "decode"), stream)
        os.kill(victim.proc.pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        try:
            tokens = await asyncio.wait_for(stream, FAILOVER_BUDGET_S + 10)
            took = time.monotonic() - frozen_at
        finally:
            os.kill(victim.proc.pid, signal.SIGCONT)
    assert tokens == expected
    assert took < FAILOVER_BUDGET_S, f"the stream waited {took:.1f}s on a frozen worker"
    for worker in cluster.children:
        if worker is not cluster.router:  # the thawed worker gave back what it held too
            load = wait_idle(worker.address, worker.role)
            assert (load.free_blocks, load.running) == (load.total_blocks, 0), worker.name
