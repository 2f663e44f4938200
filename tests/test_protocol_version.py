"""Routers and workers of adjacent releases work together during a rolling upgrade;
peers further apart are refused with a clear error, never a corrupt transfer."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.api.v1 import decode_pb2, decode_pb2_grpc, kv_transfer_pb2, kv_transfer_pb2_grpc
from pdserve.core import protocol
from pdserve.core.protocol import PROTOCOL_VERSION, UNVERSIONED, IncompatiblePeerError, check_peer
from pdserve.core.workers import WorkerInfo
from pdserve.engine.llm_engine import LLMEngine
from pdserve.router.discovery.pool import WorkerPool
from pdserve.rpc.registration import add_servicer
from pdserve.rpc.wire.router import worker_info_from_load
from pdserve.worker.config import WorkerConfig
from pdserve.worker.services import WorkerServices
from pdserve.worker.worker import Worker


@pytest.mark.parametrize(
    ("ours", "theirs", "works"),
    [
        (5, 4, True),
        (5, 5, True),
        (5, 6, True),  # a rolling upgrade's two releases
        (5, 3, False),
        (5, 7, False),
        (5, UNVERSIONED, False),
    ],
)
def test_only_peers_at_most_one_release_apart_work_together(monkeypatch, ours, theirs, works):
    monkeypatch.setattr(protocol, "PROTOCOL_VERSION", ours)
    assert protocol.compatible(theirs) is works


@pytest.mark.parametrize("version", [UNVERSIONED, PROTOCOL_VERSION + 2, PROTOCOL_VERSION + 7])
def test_an_incompatible_peer_is_refused_naming_both_versions(version):
    with pytest.raises(IncompatiblePeerError) as err:
        check_peer(version, "decode worker d1")
    message = str(err.value)
    assert "decode worker d1" in message and f"speaks version {PROTOCOL_VERSION}" in message


def worker(address: str, version: int) -> WorkerInfo:
    return WorkerInfo(address, "decode", address, protocol_version=version, updated_at=1.0)


def test_the_router_does_not_route_to_an_incompatible_worker():
    pool = WorkerPool()
    pool.replace(
        [
            worker("same:1", PROTOCOL_VERSION),
            worker("next:1", PROTOCOL_VERSION + 1),
            worker("far:1", PROTOCOL_VERSION + 2),
        ]
    )
    assert [w.address for w in pool.workers("decode")] == ["next:1", "same:1"]


def test_a_registry_entry_without_a_version_is_from_an_older_release():
    info = worker("d:1", PROTOCOL_VERSION)
    entry = info.to_json().replace(b',"protocol_version":%d' % PROTOCOL_VERSION, b"")
    assert WorkerInfo.from_json(info.to_json()).protocol_version == PROTOCOL_VERSION
    assert WorkerInfo.from_json(entry).protocol_version == UNVERSIONED


def test_a_get_load_answer_carries_the_workers_version():
    load = decode_pb2.WorkerLoad(role="decode", protocol_version=PROTOCOL_VERSION + 1)
    info = worker_info_from_load(load, address="d:1", role="decode", updated_at=0.0)
    assert info.protocol_version == PROTOCOL_VERSION + 1
    old = worker_info_from_load(
        decode_pb2.WorkerLoad(role="decode"), address="d:1", role="decode", updated_at=0.0
    )
    assert old.protocol_version == UNVERSIONED


async def test_the_kv_handshake_refuses_a_prefill_worker_two_releases_away(demo_model_dir):
    services = WorkerServices("decode")
    server = grpc.aio.server()
    for service in services.services:
        add_servicer(service.servicer, service.descriptor, server, parsers=service.parsers)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    engine = await asyncio.to_thread(LLMEngine.from_pretrained, demo_model_dir, num_kv_blocks=16)
    decode_worker = Worker(WorkerConfig(role="decode", engine=engine.config), engine, "fp", port)
    decode_worker.start()
    services.open(decode_worker)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            kv = kv_transfer_pb2_grpc.KVTransferStub(channel)
            load = await decode_pb2_grpc.DecodeStub(channel).GetLoad(decode_pb2.GetLoadRequest())
            assert load.protocol_version == PROTOCOL_VERSION

            def hello(version: int) -> kv_transfer_pb2.HandshakeRequest:
                return kv_transfer_pb2.HandshakeRequest(
                    layout=decode_worker.layout, sender="p1", protocol_version=version
                )

            reply = await kv.Handshake(hello(PROTOCOL_VERSION + 1))
            assert reply.protocol_version == PROTOCOL_VERSION
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await kv.Handshake(hello(PROTOCOL_VERSION + 2))
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "prefill worker p1" in err.value.details()
            assert f"version {PROTOCOL_VERSION + 2}" in err.value.details()
    finally:
        await server.stop(grace=None)
        await decode_worker.close()
