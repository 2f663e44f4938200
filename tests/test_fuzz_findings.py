"""What the fuzz suite found, one regression test each: hostile input that reached a
handler as an unplanned exception (INTERNAL), or an INVALID_ARGUMENT naming no field."""

from __future__ import annotations

import grpc
import pytest
from fuzz_support import InProcessServers, start_worker

from pdserve.api.v1 import decode_pb2, decode_pb2_grpc, kv_transfer_pb2
from pdserve.core.errors import LeaseRangeError
from pdserve.kv.lease import LeaseTable, LeaseTerms
from pdserve.rpc.errors import rpc_errors
from pdserve.rpc.registration import add_servicer

DECODE = decode_pb2.DESCRIPTOR.services_by_name["Decode"]
TIMEOUT_S = 10


@pytest.fixture(scope="module")
def worker(demo_model_dir):
    servers = InProcessServers()
    try:
        served = start_worker(servers, demo_model_dir, "decode", engine={"num_kv_blocks": 32})
        with grpc.insecure_channel(served.address) as channel:
            yield served, channel
    finally:
        servers.close()


def push(channel, messages: list[bytes]) -> grpc.RpcError:
    """PushKV of raw messages; the error it ends with."""
    call = channel.stream_unary(
        "/pdserve.v1.KVTransfer/PushKV", request_serializer=bytes, response_deserializer=bytes
    )
    with pytest.raises(grpc.RpcError) as refused:
        call(iter(messages), timeout=TIMEOUT_S)
    return refused.value


def test_a_kv_chunk_without_five_dimensions_is_invalid_argument_naming_its_shape(worker):
    served, channel = worker
    lease = decode_pb2_grpc.DecodeStub(channel).Admit(
        decode_pb2.AdmitRequest(prompt_token_ids=[5, 6, 7], sampling={"max_tokens": 2}),
        timeout=TIMEOUT_S,
    )
    for shape in ([], [2], [2, 1, 16]):  # [] and [2] reached `shape[1]`: IndexError, INTERNAL
        chunk = kv_transfer_pb2.KVChunk(lease_id=lease.lease_id, shape=shape)
        error = push(channel, [chunk.SerializeToString()])
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details().startswith("kv_chunk.shape: has ")
    decode_pb2_grpc.DecodeStub(channel).Release(decode_pb2.ReleaseRequest(lease_id=lease.lease_id))
    engine = served.app.worker.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_push_kv_message_that_does_not_parse_is_invalid_argument(worker):
    _, channel = worker
    # A length-delimited field running past the end: protobuf's DecodeError, which the
    # zero-copy parser raised inside gRPC (an opaque INTERNAL for the sender).
    error = push(channel, [b"\x0a\x7fabc"])
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "request: is not a valid KVChunk"
    # Invalid UTF-8 in the lease id names the field.
    error = push(channel, [b"\x0a\x02\xc3\x28"])
    assert (error.code(), error.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "lease_id: is not valid UTF-8",
    )


class EchoRelay(decode_pb2_grpc.DecodeServicer):
    """A Decode servicer whose Relay reads every command (as KServe's stream does)."""

    @rpc_errors
    async def Relay(self, request_iterator, context):  # noqa: N802 (gRPC's name)
        async for _ in request_iterator:
            yield decode_pb2.RelayBatch()


async def test_a_streamed_request_that_does_not_parse_is_invalid_argument_naming_the_field():
    server = grpc.aio.server()
    add_servicer(EchoRelay(), DECODE, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.stream_stream(
                "/pdserve.v1.Decode/Relay", request_serializer=bytes, response_deserializer=bytes
            )
            good = decode_pb2.RelayCommand(detach=decode_pb2.RelayDetach(stream_id=1))
            # attach.lease_id holding invalid UTF-8, after one good command
            bad = b"\x0a\x04\x1a\x02\xc3\x28"
            replies = call(iter([good.SerializeToString(), bad]), timeout=TIMEOUT_S)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in replies:
                    pass
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details() == "command.attach.request.lease_id: is not valid UTF-8"
    finally:
        await server.stop(None)


def test_a_chunk_outside_its_lease_names_the_chunk_s_field():
    table = LeaseTable(num_layers=2)
    lease = table.issue("r", 1, LeaseTerms(ttl_s=10.0, max_lifetime_s=60.0))
    with pytest.raises(LeaseRangeError, match=r"^kv_chunk\.layer: 2 outside \[0, 2\)"):
        table.check_chunk(lease.lease_id, 2, 0, 1)
    with pytest.raises(LeaseRangeError, match=r"^kv_chunk\.first_block: blocks \[-5, -4\)"):
        table.check_chunk(lease.lease_id, 0, -5, 1)
