"""Fuzz: every worker RPC (Prefill; Decode Admit, Generate, Stream, Relay, Release,
GetLoad; KVTransfer Handshake, PushKV, CommitKV, RenewLease) with hostile messages.

One "both" worker serves all three services in this process, on its real server
skeleton (lenient parsing, PushKV's zero-copy parser, the error mapping), on loopback,
through one shared channel. Every answer must be a status that is not INTERNAL/UNKNOWN,
every INVALID_ARGUMENT must name its field, and once the calls are done every KV block
is free again.
"""

from __future__ import annotations

import math
import uuid

import grpc
import numpy as np
import pytest
from fuzz_strategies import Exactly, fuzz_settings, messages
from fuzz_support import (
    Findings,
    InProcessServers,
    call_hostile,
    call_with_raw_bytes,
    engine_idle,
    methods_of,
    report,
    start_worker,
    wait_for,
)
from hypothesis import given
from hypothesis import strategies as st

from pdserve.api.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from pdserve.core.kv_chunk import crc32
from pdserve.core.sampling_params import SamplingParams
from pdserve.rpc.wire import sampling_params_to_proto

# fuzzing: minutes of CPU (`make test-fast` skips it)
pytestmark = pytest.mark.slow

VOCAB = 1024  # the demo model's
MAX_MODEL_LEN = 64  # bounds what an accepted hostile max_tokens costs
CALL_TIMEOUT_S = 3.0
FINDINGS = Findings()
TOKENS = st.integers(3, VOCAB - 1)
PROMPTS = st.lists(TOKENS, min_size=1, max_size=40)
SAMPLING = {
    "sampling.max_tokens": st.integers(1, 3),
    "sampling.temperature": st.sampled_from([0.0, 0.8]),
    "sampling.top_p": st.floats(0.05, 1.0),
    "sampling.top_k": st.integers(0, 50),
    "sampling.seed": st.integers(0, 2**64 - 1),
    "sampling.logprobs": st.integers(0, 4),
    "sampling.stop_token_ids": TOKENS,
    "sampling.stop": st.text(min_size=1, max_size=4),
}
GREEDY = sampling_params_to_proto(SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))


class Worker:
    def __init__(self, served, channel):
        self.served, self.channel = served, channel
        self.address = served.address
        self.engine = served.app.worker.engine
        self.layout = served.app.worker.layout
        self.decode = decode_pb2_grpc.DecodeStub(channel)
        self.kv = kv_transfer_pb2_grpc.KVTransferStub(channel)
        self.prefill = prefill_pb2_grpc.PrefillStub(channel)

    def admit(self, prompt) -> decode_pb2.Lease:
        request = decode_pb2.AdmitRequest(
            request_id=uuid.uuid4().hex, prompt_token_ids=prompt, sampling=GREEDY
        )
        return self.decode.Admit(request, timeout=CALL_TIMEOUT_S)

    def release(self, lease_id: str) -> None:
        self.decode.Release(decode_pb2.ReleaseRequest(lease_id=lease_id), timeout=CALL_TIMEOUT_S)


@pytest.fixture(scope="module")
def worker(demo_model_dir, request):
    servers = InProcessServers()
    try:
        served = start_worker(
            servers,
            demo_model_dir,
            "both",
            engine={"num_kv_blocks": 512, "max_model_len": MAX_MODEL_LEN},
            lease_ttl_s=1.0,
            max_lease_ttl_s=1.0,
            max_lease_lifetime_s=3.0,
            orphan_timeout_s=1.0,  # what a call left attached is aborted as quickly
        )
        with grpc.insecure_channel(served.address) as channel:
            yield Worker(served, channel)
            # Leases nobody completes expire within their TTL; every block comes back.
            assert wait_for(lambda: engine_idle([served.app.worker.engine]), within_s=20)
    finally:
        report(request.config, "fuzz, worker RPCs in process", FINDINGS)
        servers.close()


def stream(method, call) -> list | None:
    return call_hostile(method, FINDINGS, lambda: list(call()))


# -- Decode ----------------------------------------------------------------------------------


@fuzz_settings(800)
@given(st.data())
def test_admit(worker, data):
    hints = {**SAMPLING, "prompt_token_ids[]": PROMPTS, "lease_ttl_ms": st.integers(0, 2000)}
    request = data.draw(messages(decode_pb2.AdmitRequest, hints))
    lease = call_hostile("Admit", FINDINGS, lambda: worker.decode.Admit(request, timeout=5))
    if lease is not None:
        worker.release(lease.lease_id)


@fuzz_settings(400)
@given(st.data())
def test_local_generate(worker, data):
    hints = {**SAMPLING, "prompt_token_ids[]": PROMPTS, "stream_interval": st.integers(0, 4)}
    request = data.draw(messages(decode_pb2.LocalGenerateRequest, hints))
    stream("Generate", lambda: worker.decode.Generate(request, timeout=CALL_TIMEOUT_S))


LEASE_IDS = st.sampled_from(["", "x", "A" * 32, "lease\x00", "\u202e" * 3])


@fuzz_settings(200)
@given(st.data(), st.booleans())
def test_stream_and_release_with_wrong_or_spent_leases(worker, data, spent):
    lease_ids = LEASE_IDS
    if spent:  # a real lease id, released already
        lease = worker.admit([5, 6, 7])
        worker.release(lease.lease_id)
        lease_ids = st.just(lease.lease_id)
    hints = {"lease_id": lease_ids, "stream_interval": st.integers(0, 4)}
    request = data.draw(messages(decode_pb2.StreamRequest, hints))
    stream("Stream", lambda: worker.decode.Stream(request, timeout=CALL_TIMEOUT_S))
    release = decode_pb2.ReleaseRequest(lease_id=request.lease_id)
    call_hostile("Release", FINDINGS, lambda: worker.decode.Release(release, timeout=5))
    renew = kv_transfer_pb2.RenewLeaseRequest(lease_id=request.lease_id)
    call_hostile("RenewLease", FINDINGS, lambda: worker.kv.RenewLease(renew, timeout=5))


@fuzz_settings(300)
@given(st.data())
def test_relay(worker, data):
    hints = {
        **{"attach.generate." + k: v for k, v in SAMPLING.items()},
        "attach.generate.prompt_token_ids[]": PROMPTS,
        "attach.stream_id": st.integers(0, 3),
        "detach.stream_id": st.integers(0, 3),
        "attach.lease_id": LEASE_IDS,
    }
    commands = data.draw(st.lists(messages(decode_pb2.RelayCommand, hints), max_size=4))
    batches = stream("Relay", lambda: worker.decode.Relay(iter(commands), timeout=CALL_TIMEOUT_S))
    for batch in batches or ():
        for item in batch.items:  # a request's own error rides on the call: same rules
            assert item.error_code not in (grpc.StatusCode.INTERNAL.value[0], 2), item


# -- Prefill ---------------------------------------------------------------------------------


@fuzz_settings(300)
@given(st.data())
def test_prefill(worker, data):
    # Targets on this machine only: the worker connects to what it is given.
    addresses = st.sampled_from([worker.address, "", "127.0.0.1:1", "no such:host", "[::1"])
    hints = {
        **SAMPLING,
        "prompt_token_ids[]": PROMPTS,
        "target.address": Exactly(addresses),
        "target.lease_id": LEASE_IDS,
    }
    request = data.draw(messages(prefill_pb2.PrefillRequest, hints))
    call_hostile("Prefill", FINDINGS, lambda: worker.prefill.Prefill(request, timeout=5))


# -- KVTransfer ------------------------------------------------------------------------------


@fuzz_settings(500)
@given(st.data())
def test_handshake(worker, data):
    layout = worker.layout
    hints = {
        f"layout.{f.name}": st.just(getattr(layout, f.name))
        for f in kv_transfer_pb2.KVLayout.DESCRIPTOR.fields
    }
    hints["protocol_version"] = st.integers(0, 5)
    request = data.draw(messages(kv_transfer_pb2.HandshakeRequest, hints))
    call_hostile("Handshake", FINDINGS, lambda: worker.kv.Handshake(request, timeout=5))


def chunk_for(lease, layer: int, first: int, count: int, values) -> kv_transfer_pb2.KVChunk:
    layout = lease.layout
    shape = [2, count, layout.block_size, layout.num_kv_heads, layout.head_dim]
    data = np.asarray(values, dtype=np.float32).repeat(math.prod(shape) // len(values) + 1)
    payload = data[: math.prod(shape)].tobytes()
    return kv_transfer_pb2.KVChunk(
        lease_id=lease.lease_id,
        layer=layer,
        first_block=first,
        dtype=layout.dtype,
        shape=shape,
        data=payload,
        crc32=crc32(payload),
    )


def spoil(chunk: kv_transfer_pb2.KVChunk, how: str, value) -> kv_transfer_pb2.KVChunk:
    """The chunk with one thing wrong (or, for "none", as it was)."""
    spoiled = kv_transfer_pb2.KVChunk()
    spoiled.CopyFrom(chunk)
    if how == "truncated":
        spoiled.data = chunk.data[: value % max(1, len(chunk.data))]
    elif how == "crc":
        spoiled.crc32 = chunk.crc32 ^ (1 + value % 2**31)
    elif how == "lease":
        spoiled.lease_id = chunk.lease_id[:-1] + "?"
    elif how == "shape":
        del spoiled.shape[value % 6 :]
    elif how == "dtype":
        spoiled.dtype = ("float16", "bfloat16", "", "int8")[value % 4]
    elif how == "block":
        spoiled.first_block = value % 2**31 - 2**30
    elif how == "layer":
        spoiled.layer = value % 2**31 - 2**30
    return spoiled


SPOILS = ("none", "none", "truncated", "crc", "lease", "shape", "dtype", "block", "layer")
VALUES = st.lists(
    st.sampled_from([0.0, 1.0, -2.5, float("nan"), float("inf"), 1e30]), min_size=1, max_size=3
)
PIECES = st.tuples(
    st.integers(0, 2),
    st.integers(0, 3),
    st.integers(1, 3),
    VALUES,
    st.sampled_from(SPOILS),
    st.integers(0, 2**32),
)


@fuzz_settings(400)
@given(PROMPTS, st.lists(PIECES, max_size=6), st.integers(-1, VOCAB), st.booleans())
def test_push_and_commit_kv(worker, prompt, pieces, first_token, commit):
    """Real leases, chunks in any order, overlapping, truncated, misdirected, with bad
    checksums or NaN; then maybe a commit. A lease left open expires."""
    lease = worker.admit(prompt)
    chunks = [
        spoil(chunk_for(lease, layer, first, count, values), how, value)
        for layer, first, count, values, how, value in pieces
    ]
    call_hostile("PushKV", FINDINGS, lambda: worker.kv.PushKV(iter(chunks), timeout=5))
    if commit:
        request = kv_transfer_pb2.CommitKVRequest(
            lease_id=lease.lease_id, first_token_id=first_token
        )
        call_hostile("CommitKV", FINDINGS, lambda: worker.kv.CommitKV(request, timeout=5))
    worker.release(lease.lease_id)


@fuzz_settings(400)
@given(st.data())
def test_hostile_kv_chunks_and_commits(worker, data):
    chunks = data.draw(st.lists(messages(kv_transfer_pb2.KVChunk), max_size=3))
    call_hostile("PushKV", FINDINGS, lambda: worker.kv.PushKV(iter(chunks), timeout=5))
    commit = data.draw(messages(kv_transfer_pb2.CommitKVRequest, {"lease_id": LEASE_IDS}))
    call_hostile("CommitKV", FINDINGS, lambda: worker.kv.CommitKV(commit, timeout=5))


# -- raw bytes as every method's request -----------------------------------------------------

METHODS = methods_of(
    decode_pb2.DESCRIPTOR.services_by_name["Decode"],
    kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"],
    prefill_pb2.DESCRIPTOR.services_by_name["Prefill"],
)


@fuzz_settings(800)
@given(st.sampled_from(METHODS), st.lists(st.binary(max_size=200), min_size=1, max_size=3))
def test_random_bytes_as_requests(worker, method, payloads):
    service, descriptor = method
    call_with_raw_bytes(worker.channel, service, descriptor, payloads, FINDINGS, 2)
