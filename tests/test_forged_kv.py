"""KV that someone pushed into a decode worker misleads no other request, and KV that is
not finite is refused.

Whoever can reach a decode worker's KV port can Admit a prompt, push random floats under
a valid crc32 and commit: the request they forged is theirs to spoil. Before this, its
blocks joined the prefix cache, and every later request with that prompt read them.
Now imported KV is shared only when the worker trusts its prefill pool
(`--trust-prefill-kv`, by default on exactly when TLS is on).
"""

from __future__ import annotations

import math
import uuid

import grpc
import numpy as np
import pytest
from fuzz_support import InProcessServers

from pdserve.api.v1 import decode_pb2, decode_pb2_grpc, kv_transfer_pb2, kv_transfer_pb2_grpc
from pdserve.core.errors import InvalidRequestError
from pdserve.core.flags import ConfigError, add_flags, config_from_args
from pdserve.core.kv_chunk import KVLayerChunk, crc32
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import Request
from pdserve.rpc.wire import sampling_params_to_proto
from pdserve.worker.config import WorkerConfig
from pdserve.worker.server import WorkerApp, server_options

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = [5 + (i * 37) % 400 for i in range(48)]  # three full blocks of 16
LATER_PROMPT = PROMPT + [11, 12, 13, 14]
NUM_KV_BLOCKS = 64
TIMEOUT_S = 30


def worker_config(model_dir, **settings) -> WorkerConfig:
    engine = EngineConfig(model=str(model_dir), num_kv_blocks=NUM_KV_BLOCKS)
    return WorkerConfig(role="decode", engine=engine, **settings)


@pytest.fixture(scope="module")
def workers(demo_model_dir):
    """(a decode worker as configured by default, one that trusts its prefill pool)."""
    servers = InProcessServers()
    try:
        served = [
            servers.serve(WorkerApp(config), server_options(config))
            for config in (
                worker_config(demo_model_dir),
                worker_config(demo_model_dir, trust_prefill_kv=True),
            )
        ]
        yield served
    finally:
        servers.close()


@pytest.fixture(scope="module")
def clean_tokens(demo_model_dir) -> list[int]:
    """What a worker that never saw forged KV generates for the later prompt."""
    [out] = LLMEngine.from_pretrained(demo_model_dir).generate([LATER_PROMPT], GREEDY)
    return out.token_ids


def layer_chunks(lease: decode_pb2.Lease, values=None) -> list[kv_transfer_pb2.KVChunk]:
    """One KVChunk per layer covering the lease's blocks: random floats (or `values(layer,
    array)` applied to them), each with its valid crc32."""
    layout, rng = lease.layout, np.random.default_rng(0)
    shape = (2, lease.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    chunks = []
    for layer in range(layout.num_layers):
        array = rng.standard_normal(math.prod(shape)).astype(np.float32)
        if values is not None:
            values(layer, array)
        data = array.tobytes()
        chunks.append(
            kv_transfer_pb2.KVChunk(
                lease_id=lease.lease_id,
                layer=layer,
                first_block=0,
                dtype=layout.dtype,
                shape=shape,
                data=data,
                crc32=crc32(data),
            )
        )
    return chunks


def admit(channel, prompt) -> decode_pb2.Lease:
    return decode_pb2_grpc.DecodeStub(channel).Admit(
        decode_pb2.AdmitRequest(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=prompt,
            sampling=sampling_params_to_proto(GREEDY),
        ),
        timeout=TIMEOUT_S,
    )


def forge(address: str) -> None:
    """Admit PROMPT, push random KV for it with valid checksums, commit: all accepted."""
    with grpc.insecure_channel(address) as channel:
        lease = admit(channel, PROMPT)
        kv = kv_transfer_pb2_grpc.KVTransferStub(channel)
        result = kv.PushKV(iter(layer_chunks(lease)), timeout=TIMEOUT_S)
        assert result.chunks == lease.layout.num_layers
        kv.CommitKV(
            kv_transfer_pb2.CommitKVRequest(lease_id=lease.lease_id, first_token_id=7),
            timeout=TIMEOUT_S,
        )


def generate(address: str, prompt) -> tuple[list[int], decode_pb2.TokenDelta]:
    """Decode.Generate on the worker: its tokens and its last message (with usage)."""
    with grpc.insecure_channel(address) as channel:
        request = decode_pb2.LocalGenerateRequest(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=prompt,
            sampling=sampling_params_to_proto(GREEDY),
        )
        deltas = list(decode_pb2_grpc.DecodeStub(channel).Generate(request, timeout=TIMEOUT_S))
    return [t for d in deltas for t in d.token_ids], deltas[-1]


def test_forged_kv_is_not_served_to_a_later_request_with_its_prefix(workers, clean_tokens):
    untrusting, _ = workers
    engine = untrusting.app.worker.engine
    forge(untrusting.address)
    # Nor does the worker tell routers it holds that prefix (heartbeats send these).
    assert not engine.block_manager.cached_block_hashes() & set(_prompt_hashes(engine, PROMPT))
    tokens, last = generate(untrusting.address, LATER_PROMPT)
    assert last.usage.cached_prompt_tokens == 0
    assert tokens == clean_tokens


def test_a_worker_that_trusts_its_prefill_pool_shares_imported_kv(workers):
    _, trusting = workers
    forge(trusting.address)
    _, last = generate(trusting.address, LATER_PROMPT)
    assert last.usage.cached_prompt_tokens == len(PROMPT)


@pytest.mark.parametrize("bad_value", [np.nan, np.inf, -np.inf])
def test_kv_that_is_not_finite_is_refused_naming_the_field_and_layer(workers, bad_value):
    untrusting, _ = workers
    engine = untrusting.app.worker.engine

    def spoil(layer, array):
        if layer == 1:
            array[12345 % array.size] = bad_value

    with grpc.insecure_channel(untrusting.address) as channel:
        lease = admit(channel, PROMPT)
        kv = kv_transfer_pb2_grpc.KVTransferStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            kv.PushKV(iter(layer_chunks(lease, spoil)), timeout=TIMEOUT_S)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details() == "kv_chunk.data: layer 1 holds NaN or infinite values"
        with pytest.raises(grpc.RpcError) as incomplete:  # layer 1 never arrived
            kv.CommitKV(kv_transfer_pb2.CommitKVRequest(lease_id=lease.lease_id, first_token_id=7))
        assert incomplete.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        released = decode_pb2_grpc.DecodeStub(channel).Release(
            decode_pb2.ReleaseRequest(lease_id=lease.lease_id), timeout=TIMEOUT_S
        )
        assert released.released
    assert engine.block_manager.num_free_blocks == NUM_KV_BLOCKS


def test_a_first_token_outside_the_vocabulary_is_refused_before_the_commit(workers):
    untrusting, _ = workers
    with grpc.insecure_channel(untrusting.address) as channel:
        lease = admit(channel, PROMPT)
        kv = kv_transfer_pb2_grpc.KVTransferStub(channel)
        kv.PushKV(iter(layer_chunks(lease)), timeout=TIMEOUT_S)
        for token in (-1, 2**31 - 1):
            with pytest.raises(grpc.RpcError) as refused:
                kv.CommitKV(
                    kv_transfer_pb2.CommitKVRequest(lease_id=lease.lease_id, first_token_id=token)
                )
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.details().startswith("first_token_id: ")
        assert (
            decode_pb2_grpc.DecodeStub(channel)
            .Release(decode_pb2.ReleaseRequest(lease_id=lease.lease_id))
            .released
        )


# -- the parts: the block pool, the engine's import, the setting -----------------------------


def _prompt_hashes(engine: LLMEngine, prompt) -> list[bytes]:
    probe = Request("probe", list(prompt), GREEDY)
    manager = BlockManager(1, engine.config.block_size)
    return [manager._block_hash(probe, i) for i in range(len(prompt) // manager.block_size)]


def test_a_private_request_s_blocks_are_never_found_until_it_recomputes_them():
    manager = BlockManager(num_blocks=8, block_size=4)
    imported = Request("imported", list(range(10, 22)), GREEDY)  # three full blocks
    assert manager.allocate_slots(imported, 12) == [0, 1, 2]
    manager.keep_private(imported)
    imported.num_computed_tokens = 12
    manager.cache_full_blocks(imported)
    later = Request("later", list(range(10, 22)) + [1], GREEDY)
    assert manager.get_computed_blocks(later) == ([], 0)
    # Preempted, it recomputes its KV here: then its blocks are this engine's own.
    manager.free(imported)
    imported.num_computed_tokens = 0
    assert manager.allocate_slots(imported, 12) == [3, 4, 5]
    imported.num_computed_tokens = 12
    manager.cache_full_blocks(imported)
    assert manager.get_computed_blocks(later) == ([3, 4, 5], 12)


def test_the_engine_refuses_a_nan_chunk_and_writes_nothing(demo_model_dir):
    engine = LLMEngine.from_pretrained(demo_model_dir, num_kv_blocks=8)
    [block_id] = engine.reserve_kv([5, 6, 7], GREEDY, "r")
    before = engine.kv_cache.blocks[0, :, block_id].clone()
    shape = (2, 1, *engine.kv_cache.block_shape)
    array = np.ones(math.prod(shape), dtype=np.float32)
    array[-1] = np.nan
    data = array.tobytes()
    with pytest.raises(InvalidRequestError) as refused:
        engine.import_kv("r", KVLayerChunk(0, "float32", shape, data, crc32(data)))
    assert (refused.value.field, refused.value.message) == (
        "kv_chunk.data",
        "layer 0 holds NaN or infinite values",
    )
    assert engine.kv_cache.blocks[0, :, block_id].equal(before)
    engine.release_kv("r")


@pytest.mark.parametrize(
    ("argv", "environ", "shares"),
    [
        ([], {}, False),  # TLS off, nothing said: imported KV stays private
        (["--trust-prefill-kv"], {}, True),
        ([], {"PDSERVE_TRUST_PREFILL_KV": "true"}, True),
        (["--no-trust-prefill-kv"], {"PDSERVE_TRUST_PREFILL_KV": "true"}, False),
    ],
)
def test_trust_prefill_kv_is_a_flag_and_a_variable(argv, environ, shares, demo_model_dir):
    import argparse

    parser = argparse.ArgumentParser()
    add_flags(parser, WorkerConfig)
    args = parser.parse_args(["decode", "--model", str(demo_model_dir), *argv])
    config = config_from_args(WorkerConfig, args, environ)
    assert config.shares_imported_kv is shares


def test_trust_prefill_kv_refuses_what_is_not_a_boolean(demo_model_dir):
    import argparse

    parser = argparse.ArgumentParser()
    add_flags(parser, WorkerConfig)
    args = parser.parse_args(["decode", "--model", str(demo_model_dir)])
    with pytest.raises(ConfigError, match="PDSERVE_TRUST_PREFILL_KV"):
        config_from_args(WorkerConfig, args, {"PDSERVE_TRUST_PREFILL_KV": "maybe"})


def _push_refused(kv, chunks) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as refused:
        kv.PushKV(iter(chunks), timeout=TIMEOUT_S)
    return refused.value.code()


def test_a_forged_or_replayed_lease_id_writes_into_no_request_s_blocks(workers):
    """A lease id is the one credential of a KV write: a made-up id reaches no blocks, and
    an id replayed once its lease was committed (or given back) reaches none either."""
    untrusting, _ = workers
    engine = untrusting.app.worker.engine
    with grpc.insecure_channel(untrusting.address) as channel:
        kv = kv_transfer_pb2_grpc.KVTransferStub(channel)
        victim = admit(channel, PROMPT)  # another request's lease, its KV not yet there
        free_before = engine.block_manager.num_free_blocks
        forged = decode_pb2.Lease()
        forged.CopyFrom(victim)
        forged.lease_id = uuid.uuid4().hex  # the victim's shape, an id nobody was given
        assert _push_refused(kv, layer_chunks(forged)) == grpc.StatusCode.NOT_FOUND
        assert engine.block_manager.num_free_blocks == free_before
        # the victim's own push still goes through, and its commit ends the lease
        assert kv.PushKV(iter(layer_chunks(victim)), timeout=TIMEOUT_S).chunks > 0
        commit = kv_transfer_pb2.CommitKVRequest(lease_id=victim.lease_id, first_token_id=7)
        kv.CommitKV(commit, timeout=TIMEOUT_S)
        replayed = _push_refused(kv, layer_chunks(victim, _poison))
        assert replayed in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)
        with pytest.raises(grpc.RpcError) as again:
            kv.CommitKV(commit, timeout=TIMEOUT_S)
        assert again.value.code() in (
            grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.FAILED_PRECONDITION,
        )


def _poison(layer: int, array) -> None:
    array[:] = 1e4  # finite, wrong: what a replay would try to slip in
