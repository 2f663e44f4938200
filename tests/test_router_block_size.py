"""The router's KV block size is the workers': it hashes prompts and counts blocks in it,
and refuses a pool whose workers disagree. Real worker and router processes."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from procs import router_process, worker_process

from pdserve.api.v1 import common_pb2, decode_pb2, decode_pb2_grpc, router_pb2, router_pb2_grpc
from pdserve.core.block_hash import prompt_block_hashes
from pdserve.core.errors import PreconditionError
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.workers import WorkerInfo
from pdserve.router.handoff import Attempt
from pdserve.router.runner import Pool
from pdserve.rpc.wire import sampling_params_to_proto

pytestmark = pytest.mark.cluster

BLOCK_SIZE = 32
PROMPT = [(17 * i) % 900 + 5 for i in range(100)]  # 3 full blocks of 32, and a partial one
LONG = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
# PROMPT + LONG hold ceil(1000 / 32) = 32 blocks of 32 at their longest (63 blocks of 16):
# 100 - 32 = 68 > 50 left on the roomy worker, where a count of 16s would see 100 - 63 = 37.
LONG_BLOCKS = 32
ROOMY_BLOCKS, SMALL_BLOCKS = 100, 50


def worker(address: str, role: str, block_size: int) -> WorkerInfo:
    return WorkerInfo(worker_id=address, role=role, address=address, block_size=block_size)


# -- the arithmetic -----------------------------------------------------------------------


def test_an_attempt_hashes_and_counts_in_the_pools_block_size():
    pool = Pool([worker("d:1", "decode", 32)], [worker("p:1", "prefill", 32)])
    sampling = sampling_params_to_proto(LONG)
    attempt = Attempt("r", PROMPT, sampling).for_block_size(pool.block_size)
    assert attempt.block_hashes == prompt_block_hashes(PROMPT, 32)
    assert len(attempt.block_hashes) == 3  # (100 - 1) // 32: the last token's block never
    assert attempt.num_blocks_needed == LONG_BLOCKS


def test_a_pool_whose_workers_disagree_on_the_block_size_is_refused():
    pool = Pool([worker("d:1", "decode", 32)], [worker("p:1", "prefill", 16)])
    with pytest.raises(PreconditionError) as raised:
        _ = pool.block_size
    message = str(raised.value)
    assert "block size" in message and "d:1" in message and "p:1" in message


# -- a cluster at block size 32 -----------------------------------------------------------


def static_discovery(prefill, decodes) -> tuple[str, ...]:
    """Router flags for exactly these workers (no other test's workers in the registry)."""
    decode_addresses = ",".join(d.address for d in decodes)
    return ("--discovery", "static", "--prefill", prefill.address, "--decode", decode_addresses)


async def wait_for_workers(stub, count: int, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        listed = await stub.ListWorkers(router_pb2.ListWorkersRequest())
        if sum(w.healthy for w in listed.workers) >= count:
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"the router never saw {count} healthy workers")


def generate_request(prompt, params, request_id="") -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        token_ids=router_pb2.TokenIds(ids=prompt),
        sampling=sampling_params_to_proto(params),
        request_id=request_id,
        stream=True,
    )


async def final_message(stub, prompt, params, request_id="") -> router_pb2.GenerateResponse:
    messages = [m async for m in stub.Generate(generate_request(prompt, params, request_id))]
    return messages[-1]


@pytest.fixture(scope="module")
def cluster32(demo_model_dir, redis_url, tmp_path_factory):
    """A prefill worker and two decode workers (one roomier) at block size 32, a router."""
    logs = tmp_path_factory.mktemp("block-size-logs")
    size = ("--block-size", str(BLOCK_SIZE))
    with (
        worker_process("prefill", demo_model_dir, *size, log_dir=logs) as prefill,
        worker_process(
            "decode", demo_model_dir, *size, "--num-kv-blocks", str(ROOMY_BLOCKS), log_dir=logs
        ) as roomy,
        worker_process(
            "decode", demo_model_dir, *size, "--num-kv-blocks", str(SMALL_BLOCKS), log_dir=logs
        ) as small,
        router_process(
            demo_model_dir, redis_url, *static_discovery(prefill, [roomy, small]), log_dir=logs
        ) as (router, _),
    ):
        yield router, prefill, roomy, small


async def most_blocks_held(worker, stop: asyncio.Event) -> int:
    """The most blocks `worker` held at once until `stop`, by its own GetLoad, polled on
    one channel (a request's whole life is watched, however the scheduler delays us)."""
    most = 0
    async with worker.channel() as channel:
        stub = decode_pb2_grpc.DecodeStub(channel)
        while True:
            load = await stub.GetLoad(decode_pb2.GetLoadRequest())
            most = max(most, load.total_blocks - load.free_blocks)
            if stop.is_set():
                return most
            await asyncio.sleep(0.005)


async def test_requests_are_admitted_by_their_blocks_of_32(cluster32):
    """The roomy worker (100 blocks) takes a long request (32 blocks of 32) and still has
    more room than the small one (50): the next request goes there too. A router that
    counted blocks of 16 would see the roomy one at 100 - 63 and send it to the small one."""
    router, _, roomy, small = cluster32
    async with grpc.aio.insecure_channel(router) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        await wait_for_workers(stub, 3)
        long_id, short_id = f"long-{time.time_ns()}", f"short-{time.time_ns()}"
        stop = asyncio.Event()
        watch = asyncio.create_task(most_blocks_held(roomy, stop))
        stream = stub.Generate(generate_request(PROMPT, LONG, long_id))
        first = await stream.read()  # admitted, prefilled, decoding
        short = await final_message(stub, PROMPT[:10], SHORT, short_id)
        rest = []
        while (message := await stream.read()) is not grpc.aio.EOF:
            rest.append(message)
        stop.set()
        reserved = await watch
        infos = [
            await stub.GetRequest(router_pb2.GetRequestRequest(request_id=request_id))
            for request_id in (long_id, short_id)
        ]
    # the worker's own count, in blocks of 32: from the prompt's 4 (its blocks grow as it
    # decodes, to 32 for its last few tokens) to the long request's 32 and the short one's
    # 1 if they overlapped; a worker counting in 16s would have gone past 33
    assert 4 <= reserved <= LONG_BLOCKS + 1
    assert rest[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == LONG.max_tokens
    assert short.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert [info.decode_worker for info in infos] == [roomy.address, roomy.address]
    for decode in (roomy, small):
        load = await asyncio.to_thread(decode.wait_idle)
        assert load.free_blocks == load.total_blocks


async def test_a_repeated_prompt_hits_whole_blocks_of_32(cluster32):
    router, *_ = cluster32
    prompt = [token + 1 for token in PROMPT]  # cached nowhere yet
    async with grpc.aio.insecure_channel(router) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        await wait_for_workers(stub, 3)
        cached = [
            (await final_message(stub, prompt, SHORT)).usage.cached_prompt_tokens for _ in range(2)
        ]
    assert cached == [0, 96]  # (100 - 1) // 32 full blocks


# -- a mixed pool -------------------------------------------------------------------------


async def test_a_pool_of_mixed_block_sizes_is_refused_as_failed_precondition(
    demo_model_dir, redis_url, tmp_path
):
    with (
        worker_process("prefill", demo_model_dir, "--block-size", "16", log_dir=tmp_path) as p,
        worker_process("decode", demo_model_dir, "--block-size", "32", log_dir=tmp_path) as d,
        router_process(demo_model_dir, redis_url, *static_discovery(p, [d]), log_dir=tmp_path) as (
            router,
            _,
        ),
    ):
        async with grpc.aio.insecure_channel(router) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            await wait_for_workers(stub, 2)
            request_id = f"mixed-{time.time_ns()}"
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await final_message(stub, PROMPT, SHORT, request_id)
            info = await stub.GetRequest(router_pb2.GetRequestRequest(request_id=request_id))
        assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        details = raised.value.details()
        assert "block size" in details and p.address in details and d.address in details
        assert info.status == "failed"
        load = d.wait_idle()
        assert (load.free_blocks, load.open_leases) == (load.total_blocks, 0)
