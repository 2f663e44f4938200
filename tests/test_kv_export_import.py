"""A prompt's KV computed by one engine, shipped as bytes layer by layer, continued by another."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from pdserve.core.errors import KVCapacityError, UnknownRequestError
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def prefill_and_export(engine: LLMEngine, prompt: list[int], params: SamplingParams):
    """Run only the prompt, exporting each layer as soon as it is computed."""
    request_id = engine.add_request(prompt, dataclasses.replace(params, max_tokens=1))
    chunks = []

    def on_layer_done(layer: int, plan) -> None:
        assert [s.request.request_id for s in plan.scheduled] == [request_id]
        [export] = engine.export_layer(layer, plan, {request_id: 0})
        assert (export.first_block, export.prompt_done) == (0, True)  # the whole prompt, at once
        chunks.append(export.chunk)

    deltas = []
    while not deltas:
        deltas = engine.step(on_layer_done)
    [delta] = deltas
    return delta.token_ids[0], chunks


@pytest.mark.parametrize("length", [1, 15, 16, 17, 70])
def test_disaggregated_continuation_equals_one_engine(demo_model_dir, length):
    prompt = [(7 * i + 3) % 900 + 3 for i in range(length)]
    [expected] = LLMEngine.from_pretrained(demo_model_dir).generate([prompt], GREEDY)

    prefill = LLMEngine.from_pretrained(demo_model_dir)
    first_token, chunks = prefill_and_export(prefill, prompt, GREEDY)
    num_layers = prefill.model_config.num_layers
    assert [c.layer for c in chunks] == list(range(num_layers))  # one per layer, in order
    assert chunks[0].num_blocks == -(-length // 16)

    decode = LLMEngine.from_pretrained(demo_model_dir, num_kv_blocks=40)
    decode.reserve_kv(prompt, GREEDY, "r1")
    for chunk in chunks:
        decode.import_kv("r1", chunk)
    decode.commit_kv("r1", first_token)
    tokens, text = [first_token], ""
    while decode.has_unfinished_requests():
        for delta in decode.step():
            tokens += delta.token_ids
            text += delta.text
    assert tokens == expected.token_ids
    assert text == expected.text[len(prefill.tokenizer.decode([first_token])) :]
    assert decode.block_manager.num_free_blocks == 40


def test_seeded_sampling_survives_the_hand_off(demo_model_dir):
    # Seeds are per output position, so the decode engine draws exactly what the
    # single engine would have drawn after the prefill engine's first token.
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=16, ignore_eos=True)
    prompt = list(range(10, 40))
    [expected] = LLMEngine.from_pretrained(demo_model_dir).generate([prompt], params)
    prefill = LLMEngine.from_pretrained(demo_model_dir)
    first, chunks = prefill_and_export(prefill, prompt, params)
    decode = LLMEngine.from_pretrained(demo_model_dir)
    decode.reserve_kv(prompt, params, "s")
    for chunk in chunks:
        decode.import_kv("s", chunk)
    decode.commit_kv("s", first)
    out = [first]
    while decode.has_unfinished_requests():
        out += [t for d in decode.step() for t in d.token_ids]
    assert out == expected.token_ids


def test_corrupt_chunk_is_rejected_and_release_frees_everything(demo_model_dir):
    prompt = list(range(3, 40))
    prefill = LLMEngine.from_pretrained(demo_model_dir)
    _, chunks = prefill_and_export(prefill, prompt, GREEDY)
    decode = LLMEngine.from_pretrained(demo_model_dir, num_kv_blocks=10)
    decode.reserve_kv(prompt, GREEDY, "c")
    bad = dataclasses.replace(chunks[0], data=b"\x00" + chunks[0].data[1:])
    with pytest.raises(ValueError, match="checksum"):
        decode.import_kv("c", bad)
    wrong_shape = dataclasses.replace(chunks[0], shape=(2, 1, *chunks[0].shape[2:]))
    with pytest.raises(ValueError, match="expected"):
        decode.import_kv("c", wrong_shape)
    decode.release_kv("c")
    assert decode.block_manager.num_free_blocks == 10
    with pytest.raises(UnknownRequestError):
        decode.import_kv("c", chunks[0])


def test_reserve_without_room_raises_capacity_error(demo_model_dir):
    decode = LLMEngine.from_pretrained(demo_model_dir, num_kv_blocks=4)
    decode.reserve_kv(list(range(3, 50)), SamplingParams(max_tokens=8), "a")  # 3 of 4 blocks
    with pytest.raises(KVCapacityError):
        decode.reserve_kv(list(range(3, 40)), SamplingParams(max_tokens=8), "b")
    decode.abort("a")
    assert decode.block_manager.num_free_blocks == 4


def test_reservations_from_another_thread_while_the_engine_steps(demo_model_dir):
    """A decode worker reserves on its event loop's thread while its engine thread steps:
    no block is ever handed out twice, the running requests' tokens do not change, and
    the pool is whole at the end. (Under the GIL a missing lock rarely shows in one run;
    this checks the cross-thread path works, not that every interleaving is safe.)"""
    prompts = [[3 + (7 * i + j) % 900 for j in range(20 + 9 * i)] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    expected = LLMEngine.from_pretrained(demo_model_dir).generate(prompts, params)

    engine = LLMEngine.from_pretrained(demo_model_dir, num_kv_blocks=96)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=f"run-{i}")
    stop, problems, num_reserved = threading.Event(), [], 0

    def reserve_and_release() -> None:
        nonlocal num_reserved
        while not stop.is_set():
            request_id = f"reserved-{num_reserved}"
            try:
                block_ids = engine.reserve_kv(list(range(3, 3 + 40)), params, request_id)
            except KVCapacityError:
                continue
            with engine._state_lock:  # what the running requests hold right now
                held = {b for r in engine.scheduler.running for b in r.block_ids}
            if held & set(block_ids):
                problems.append(f"{request_id} got blocks a running request holds")
            engine.release_kv(request_id)
            num_reserved += 1

    reserver = threading.Thread(target=reserve_and_release)
    reserver.start()
    tokens: dict[str, list[int]] = {}
    try:
        while engine.has_unfinished_requests():
            for delta in engine.step():
                tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
    finally:
        stop.set()
        reserver.join()
    assert not problems
    assert num_reserved > 0
    assert [tokens[f"run-{i}"] for i in range(len(prompts))] == [e.token_ids for e in expected]
    assert engine.block_manager.num_free_blocks == 96
