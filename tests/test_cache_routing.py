"""Cache-aware routing as a user meets it: two prefill workers, one decode worker, real
processes; a repeated prompt goes to the prefill worker that holds its prefix, every time.

`cached_prompt_tokens` is what the prefill worker found in its own prefix cache, so a
repeat sent to the other worker reports 0 and fails the test.
"""

from __future__ import annotations

import time

import pytest

from pdserve.client import Client, SamplingParams
from pdserve.cluster.local import ClusterShape, LocalCluster
from pdserve.router.dispatches import DEFAULT_HORIZON_S

NUM_PROMPT_TOKENS = 200
NUM_REPEATS = 4
PARAMS = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
# past the router's memory of its own dispatches, so the repeats after it are routed by
# what the workers' heartbeats (one a second) report of their caches
PAUSE_S = DEFAULT_HORIZON_S + 1.0


@pytest.fixture(scope="module", params=[16, 32], ids=lambda size: f"block{size}")
def cluster(request, demo_model_dir, redis_url, tmp_path_factory):
    """One cluster per block size for the module: prefill:2, decode:1, registry discovery."""
    block_size = request.param
    with (
        LocalCluster(
            model=str(demo_model_dir),
            shape=ClusterShape(prefill=2, decode=1),
            run_dir=tmp_path_factory.mktemp(f"cache-routing-{block_size}"),
            worker_args=["--block-size", str(block_size)],
            redis=redis_url,
        ) as started,
        Client(started.router_address, timeout=60) as client,
    ):
        yield client, block_size


def prompt(seed: int) -> list[int]:
    """A prompt no other test sends: its blocks are cached nowhere yet."""
    return [10 + (seed * 7919 + i * 31) % 900 for i in range(NUM_PROMPT_TOKENS)]


def cached_tokens(client: Client, token_ids: list[int], times: int) -> list[int]:
    """cached_prompt_tokens of `times` runs of the prompt, one after the other."""
    return [client.generate(token_ids, PARAMS).usage.cached_prompt_tokens for _ in range(times)]


def cacheable(block_size: int) -> int:
    # full blocks, except the one holding the last token (the model must compute it)
    return (NUM_PROMPT_TOKENS - 1) // block_size * block_size


def test_repeats_in_a_row_all_hit_the_worker_holding_the_prefix(cluster):
    client, block_size = cluster
    token_ids = prompt(seed=1)

    assert cached_tokens(client, token_ids, 1) == [0]
    assert cached_tokens(client, token_ids, NUM_REPEATS) == [cacheable(block_size)] * NUM_REPEATS


def test_repeats_after_a_pause_all_hit_the_worker_holding_the_prefix(cluster):
    client, block_size = cluster
    token_ids = prompt(seed=2)
    assert cached_tokens(client, token_ids, 1) == [0]

    time.sleep(PAUSE_S)

    assert cached_tokens(client, token_ids, NUM_REPEATS) == [cacheable(block_size)] * NUM_REPEATS
