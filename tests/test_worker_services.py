"""A worker's services before and after its model loads, on a real server in this process."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.api.v1 import decode_pb2, decode_pb2_grpc, kv_transfer_pb2, kv_transfer_pb2_grpc
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.llm_engine import LLMEngine
from pdserve.rpc.registration import add_servicer
from pdserve.rpc.wire import sampling_params_to_proto
from pdserve.worker.config import WorkerConfig
from pdserve.worker.services import WorkerServices
from pdserve.worker.worker import Worker

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


async def expect_unavailable(call) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "loading" in err.value.details()


async def test_calls_are_unavailable_until_the_worker_exists_then_served(demo_model_dir):
    services = WorkerServices("decode")
    server = grpc.aio.server()
    for service in services.services:
        add_servicer(service.servicer, service.descriptor, server, parsers=service.parsers)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    worker = None
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            decode = decode_pb2_grpc.DecodeStub(channel)
            kv = kv_transfer_pb2_grpc.KVTransferStub(channel)
            generate = decode_pb2.LocalGenerateRequest(
                prompt_token_ids=[5, 6, 7], sampling=sampling_params_to_proto(GREEDY)
            )
            # Unary, server-streaming and client-streaming calls alike, while it loads.
            await expect_unavailable(decode.GetLoad(decode_pb2.GetLoadRequest()))
            await expect_unavailable(decode.Generate(generate).read())
            await expect_unavailable(kv.PushKV(iter([kv_transfer_pb2.KVChunk()])))

            engine = await asyncio.to_thread(
                LLMEngine.from_pretrained, demo_model_dir, num_kv_blocks=64
            )
            [want] = engine.generate([[5, 6, 7]], GREEDY)
            config = WorkerConfig(role="decode", engine=engine.config)
            worker = Worker(config, engine, "fingerprint", port)
            worker.start()
            services.open(worker)

            load = await decode.GetLoad(decode_pb2.GetLoadRequest())
            assert (load.role, load.total_blocks, load.free_blocks) == ("decode", 64, 64)
            assert load.block_size == engine.config.block_size
            tokens = [t async for delta in decode.Generate(generate) for t in delta.token_ids]
            assert tokens == want.token_ids
    finally:
        await server.stop(grace=None)
        if worker is not None:
            await worker.close()
