"""Cache-aware routing as a user meets it: two prefill workers, one decode worker, real
processes; a repeated prompt is prefilled where its prefix is cached, every time, and its
usage says how many of its tokens that cache served.

In both placements (`--prefill-placement`): `remote` sends every prompt to the prefill
worker that holds its prefix; `live`, the default, prefills these short prompts on the idle
decode worker, which holds it too. `cached_prompt_tokens` is what the engine that computed
the prompt found in its own prefix cache, so a repeat computed elsewhere reports 0 and
fails the test, and so does a colocated prefill's count lost on the way to the client.
"""

from __future__ import annotations

import itertools
import time

import pytest

from pdserve.client import Client, SamplingParams
from pdserve.cluster.local import ClusterShape, LocalCluster
from pdserve.router.dispatches import DEFAULT_HORIZON_S

pytestmark = pytest.mark.cluster

NUM_PROMPT_TOKENS = 200
NUM_REPEATS = 4
PARAMS = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
# past the router's memory of its own dispatches, so the repeats after it are routed by
# what the workers' heartbeats (one a second) report of their caches
PAUSE_S = DEFAULT_HORIZON_S + 1.0
# where each placement prefills a repeat: the prefill pool, or (live, the prompt short
# and the cluster idle) the decode worker itself
PREFILLED_ON = {"remote": "prefill", "live": "decode"}


@pytest.fixture(
    scope="module",
    params=list(itertools.product(PREFILLED_ON, [16, 32])),
    ids=lambda param: f"{param[0]}-block{param[1]}",
)
def cluster(request, demo_model_dir, redis_url, tmp_path_factory):
    """One cluster per placement and block size for the module: prefill:2, decode:1,
    registry discovery."""
    placement, block_size = request.param
    with (
        LocalCluster(
            model=str(demo_model_dir),
            shape=ClusterShape(prefill=2, decode=1),
            run_dir=tmp_path_factory.mktemp(f"cache-routing-{placement}-{block_size}"),
            worker_args=["--block-size", str(block_size)],
            router_args=["--prefill-placement", placement],
            redis=redis_url,
        ) as started,
        Client(started.router_address, timeout=60) as client,
    ):
        yield client, block_size, placement


def prompt(seed: int) -> list[int]:
    """A prompt no other test sends: its blocks are cached nowhere yet."""
    return [10 + (seed * 7919 + i * 31) % 900 for i in range(NUM_PROMPT_TOKENS)]


def runs(client: Client, token_ids: list[int], times: int) -> list[tuple[int, str]]:
    """(cached_prompt_tokens, the role of the worker that prefilled it) of `times` runs of
    the prompt, one after the other; the request's record agrees with its usage."""
    results = []
    for _ in range(times):
        completion = client.generate(token_ids, PARAMS)
        info = client.get_request(completion.request_id)
        assert info.usage.cached_prompt_tokens == completion.usage.cached_prompt_tokens
        role = "decode" if info.prefill_worker == info.decode_worker else "prefill"
        results.append((completion.usage.cached_prompt_tokens, role))
    return results


def cacheable(block_size: int) -> int:
    # full blocks, except the one holding the last token (the model must compute it)
    return (NUM_PROMPT_TOKENS - 1) // block_size * block_size


def test_repeats_in_a_row_all_hit_the_worker_holding_the_prefix(cluster):
    client, block_size, placement = cluster
    token_ids = prompt(seed=1)

    [(cached, _)] = runs(client, token_ids, 1)
    assert cached == 0
    expected = (cacheable(block_size), PREFILLED_ON[placement])
    assert runs(client, token_ids, NUM_REPEATS) == [expected] * NUM_REPEATS


def test_repeats_after_a_pause_all_hit_the_worker_holding_the_prefix(cluster):
    client, block_size, placement = cluster
    token_ids = prompt(seed=2)
    [(cached, _)] = runs(client, token_ids, 1)
    assert cached == 0

    time.sleep(PAUSE_S)

    expected = (cacheable(block_size), PREFILLED_ON[placement])
    assert runs(client, token_ids, NUM_REPEATS) == [expected] * NUM_REPEATS
