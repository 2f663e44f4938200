"""The layer-by-layer KV export of the prefill worker's engine thread."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.llm_engine import LLMEngine
from pdserve.worker.engine_loop import EXPORT_DONE, LAYERWISE_MIN_TOKENS, EngineLoop, KVExport


def exported(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, list]:
    """Run prompts as prefill-only requests; each request's exported (layer, blocks)."""
    loop = EngineLoop(engine, asyncio.new_event_loop())  # its thread is never started
    exports = {}
    for i, prompt in enumerate(prompts):
        request_id = engine.add_request(prompt, SamplingParams(max_tokens=1), f"r{i}")
        exports[request_id] = KVExport(request_id)
        loop.add_export(exports[request_id])
    while engine.has_unfinished_requests():
        loop._run_step()
    result = {}
    for request_id, export in exports.items():
        items = []
        while (item := export.chunks.get_nowait()) is not EXPORT_DONE:
            first, chunk = item
            items.append((chunk.layer, list(range(first, first + chunk.num_blocks))))
        result[request_id] = items
    return result


@pytest.mark.parametrize("budget", [24, 2048])
def test_every_block_of_every_layer_ships_exactly_once(demo_model_dir, budget):
    # A 24-token step budget splits the prompts into chunks that end mid-block.
    engine = LLMEngine.from_pretrained(demo_model_dir, max_num_batched_tokens=budget)
    prompts = [[(5 * i + j) % 900 + 3 for j in range(n)] for i, n in enumerate([70, 33, 16])]
    for (request_id, items), prompt in zip(exported(engine, prompts).items(), prompts, strict=True):
        num_blocks = -(-len(prompt) // 16)
        for layer in range(engine.model_config.num_layers):
            blocks = [b for item_layer, ids in items if item_layer == layer for b in ids]
            assert blocks == list(range(num_blocks)), (request_id, layer)


def test_a_prefix_cache_hit_still_ships_the_cached_blocks(demo_model_dir):
    engine = LLMEngine.from_pretrained(demo_model_dir)
    shared = list(range(3, 51))  # three full blocks
    exported(engine, [shared + [60]])
    [items] = exported(engine, [shared + [61, 62]]).values()
    layer0 = [b for layer, ids in items if layer == 0 for b in ids]
    assert layer0 == [0, 1, 2, 3]


class TimedQueue:
    """Stands in for an export's queue: when each item arrived."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, item) -> None:
        self.times.append(time.perf_counter())


@pytest.mark.parametrize(
    ("prompt_tokens", "layer_by_layer"),
    [(LAYERWISE_MIN_TOKENS - 1, False), (LAYERWISE_MIN_TOKENS, True)],
)
def test_a_step_exporting_little_hands_its_kv_over_when_it_ends(
    demo_model_dir, prompt_tokens, layer_by_layer
):
    engine = LLMEngine.from_pretrained(demo_model_dir, max_num_batched_tokens=2048)
    loop = EngineLoop(engine, asyncio.new_event_loop())  # its thread is never started
    steps: list[tuple[float, float]] = []
    step = engine.step

    def timed_step(on_layer_done):
        started = time.perf_counter()
        try:
            return step(on_layer_done)
        finally:
            steps.append((started, time.perf_counter()))

    engine.step = timed_step
    prompt = [3 + i % 900 for i in range(prompt_tokens)]
    engine.add_request(prompt, SamplingParams(max_tokens=1), "r")
    export = KVExport("r", chunks=TimedQueue())
    loop.add_export(export)
    loop._run_step()

    [(started, ended)] = steps
    num_layers = engine.model_config.num_layers
    assert len(export.chunks.times) == num_layers + 1  # every layer's chunk, then the end
    assert all(started < t for t in export.chunks.times)
    # while the step runs, or every one after it
    assert (export.chunks.times[0] < ended) is layer_by_layer
    assert all(t > ended for t in export.chunks.times) is not layer_by_layer


async def test_an_engine_gone_idle_reports_nothing_queued_and_nothing_running(demo_model_dir):
    # Its queues were observed before its last step, which emptied them; the thread then
    # sleeps until the next command, so unless it says so before sleeping, its load
    # reports keep the last prompt queued there (an idle prefill worker reported 18-62
    # queued tokens for seconds) and the last output running.
    engine = LLMEngine.from_pretrained(demo_model_dir)
    loop = EngineLoop(engine, asyncio.get_running_loop())
    loop.start()
    try:
        for request_id, max_tokens in (("prefill-only", 1), ("decoded", 3)):
            sink = loop.open_sink(request_id)
            params = SamplingParams(max_tokens=max_tokens)
            await loop.call(engine.add_request, [5] * 40, params, request_id)
            while not (await asyncio.wait_for(sink.queue.get(), 30)).finished:
                pass
            stats = loop.step_stats
            for _ in range(50):  # up to 5 s for the thread to reach its sleep, no command since
                if (stats.queued_prefill_tokens, stats.shortest_running_output) == (0, 0):
                    break
                await asyncio.sleep(0.1)
            assert (stats.queued_prefill_tokens, stats.shortest_running_output) == (0, 0)
    finally:
        await loop.stop()
