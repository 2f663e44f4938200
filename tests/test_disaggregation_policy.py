"""Where a prompt is prefilled, decided from live load: exact decisions on crafted snapshots,
no servers (router/disaggregation.py), and what the router learns from its own requests
(router/colocation.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
import urllib.request

import grpc
import pytest
from manual_clock import Clock

from pdserve.api.v1 import decode_pb2, router_pb2, router_pb2_grpc
from pdserve.cluster.load import worker_load
from pdserve.cluster.local import ClusterShape, LocalCluster
from pdserve.core.block_hash import prompt_block_hashes
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.workers import WorkerInfo
from pdserve.engine.llm_engine import LLMEngine
from pdserve.router.colocation import (
    ERROR_SAMPLES,
    HOP_SAMPLES,
    SAMPLE_MAX_AGE_S,
    EstimateErrors,
    FirstTokenTimer,
    LiveColocation,
    RemoteHop,
)
from pdserve.router.config import RouterConfig
from pdserve.router.disaggregation import (
    DEFAULT_PREFILL_TOKENS_PER_S,
    DEFAULT_REMOTE_HOP_MS,
    Placement,
    PlacementMode,
    Reason,
    Snapshot,
    Targets,
    WorkerLoad,
    decide,
)
from pdserve.router.policy import ColocationRule
from pdserve.rpc.wire import sampling_params_to_proto
from pdserve.telemetry.metrics import metrics_url
from pdserve.worker.engine_loop import StepStats

pytestmark = pytest.mark.cluster

RATE = 2000.0  # prefill tokens per second: 2 tokens per ms
TARGETS = Targets(ttft_s=0.2, tpot_s=0.05)


def load(
    queued_tokens: int = 0,
    num_queued: int = 0,
    step_ms: float = 0.0,
    cached: int = 0,
    budget: int = 0,
    shortest_output: int = 0,
) -> WorkerLoad:
    return WorkerLoad("w", num_queued, queued_tokens, step_ms, cached, budget, shortest_output)


def snapshot(prompt: int, decode: WorkerLoad, *prefill: WorkerLoad, rate=RATE) -> Snapshot:
    return Snapshot(prompt, decode, tuple(prefill), rate)


# -- the estimates --------------------------------------------------------------------------


def test_the_estimates_follow_the_documented_formulas():
    decode = load(queued_tokens=20, num_queued=4, step_ms=16.0, shortest_output=31)
    busy = load(queued_tokens=3000, num_queued=3, step_ms=100.0, budget=512)
    d = decide(snapshot(40, decode, busy), TARGETS)

    # remote: half of max(a step, a full 512-token step) + max(a step, (min(3000, 3 * 40)
    # + 40) / 2 per ms, the 512 tokens of the step it joins / 2 per ms) + the hop
    assert d.remote_ttft_ms == pytest.approx(256 / 2 + 256 + DEFAULT_REMOTE_HOP_MS)
    # colocated (no budget reported): half a step + max(a step, (min(20, 4 * 40) + 40 + the
    # 4 requests decoding there, a token each in the step it joins) / 2)
    assert d.colocated_ttft_ms == pytest.approx(8 + 32)
    # the stall: (20 + 40) / 2; TPOT: the step + the stall over 31 - 1 tokens
    assert d.decode_stall_ms == pytest.approx(30)
    assert d.decode_tpot_ms == pytest.approx(16 + 30 / 30)


def test_a_short_prompt_joining_a_busy_worker_waits_a_whole_chunk_for_its_first_token():
    # The step it joins is filled to the token budget by the long prompt's next chunk:
    # 40 tokens alone would take 20 ms, but their first token comes with the step's end.
    # The worker's last step time says nothing (it was idle when it last measured one):
    # its budget is what tells the step's length.
    behind_one_long = load(queued_tokens=1500, num_queued=1, step_ms=0.0, budget=512)
    d = decide(snapshot(40, load(), behind_one_long), TARGETS)
    assert d.remote_ttft_ms == pytest.approx(256 / 2 + 256 + DEFAULT_REMOTE_HOP_MS)
    assert d.colocated


def test_without_a_budget_the_step_time_stands_for_the_step_a_prompt_joins():
    behind_one_long = load(queued_tokens=1500, num_queued=1, step_ms=400.0)
    d = decide(snapshot(40, load(), behind_one_long), TARGETS)
    assert d.remote_ttft_ms == pytest.approx(200 + 400 + DEFAULT_REMOTE_HOP_MS)


def test_a_cached_prefix_counts_only_the_uncached_tokens():
    d = decide(snapshot(100, load(cached=96), load(cached=0)), TARGETS)
    assert d.colocated_ttft_ms == pytest.approx(2.0)  # 4 tokens at 2 per ms
    assert d.remote_ttft_ms == pytest.approx(50 + DEFAULT_REMOTE_HOP_MS)


def test_without_a_measured_rate_the_conservative_default_stands():
    d = decide(snapshot(100, load(), load(), rate=0.0), TARGETS)
    assert d.colocated_ttft_ms == pytest.approx(100 / DEFAULT_PREFILL_TOKENS_PER_S * 1000)


# -- the decisions --------------------------------------------------------------------------


def test_on_a_quiet_cluster_a_short_prompt_is_prefilled_where_it_is_decoded():
    # the same compute either way, so the hop decides: no transfer, no second call
    d = decide(snapshot(40, load(), load()), TARGETS)
    assert (d.placement, d.reason) == (Placement.COLOCATED, Reason.COLOCATED_FASTER)
    assert d.remote_ttft_ms == pytest.approx(d.colocated_ttft_ms + DEFAULT_REMOTE_HOP_MS)


def test_a_prompt_whose_prefill_would_hold_up_the_decode_worker_goes_to_the_pool():
    # 500 tokens at 2 per ms: 250 ms during which every prompt colocated there waits
    d = decide(snapshot(500, load(), load()), TARGETS)
    assert (d.placement, d.reason) == (Placement.REMOTE, Reason.DECODE_STALL)


def test_placement_remote_sends_every_prompt_to_the_pool_while_it_has_a_worker():
    d = decide(snapshot(40, load(), load()), TARGETS, mode=PlacementMode.REMOTE)
    assert (d.placement, d.reason) == (Placement.REMOTE, Reason.ALWAYS_REMOTE)
    alone = decide(snapshot(40, load()), TARGETS, mode=PlacementMode.REMOTE)
    assert (alone.placement, alone.reason) == (Placement.COLOCATED, Reason.NO_PREFILL_WORKER)


def test_a_fixed_threshold_replaces_placement_remote_too():
    config = RouterConfig(
        model="m", redis_url="redis://x", colocate_below=64, prefill_placement="remote"
    )
    d = config.colocation.decide(worker("d:1", "decode"), [worker("p:1", "prefill")], [], 40)
    assert (d.placement, d.reason) == (Placement.COLOCATED, Reason.COLOCATE_BELOW)


def test_a_short_prompt_behind_long_prefills_is_colocated():
    busy_pool = load(queued_tokens=6000, num_queued=4, step_ms=900.0)
    d = decide(snapshot(40, load(num_queued=8, step_ms=15.0), busy_pool), TARGETS)
    assert (d.placement, d.reason) == (Placement.COLOCATED, Reason.COLOCATED_FASTER)
    assert d.colocated


def test_a_long_prompt_is_not_colocated_even_when_the_pool_is_behind():
    # 750 ms of prefill on the decode worker: every prompt colocated there meanwhile
    # would wait that long, past the 200 ms TTFT target
    busy_pool = load(queued_tokens=6000, num_queued=4, step_ms=900.0)
    decode = load(num_queued=8, step_ms=15.0, shortest_output=1000)
    d = decide(snapshot(1500, decode, busy_pool), TARGETS)
    assert (d.placement, d.reason) == (Placement.REMOTE, Reason.DECODE_STALL)
    assert d.decode_stall_ms == pytest.approx(750)


def test_colocated_prefill_already_queued_on_the_decode_worker_counts_against_its_stall():
    busy_pool = load(queued_tokens=6000, num_queued=4, step_ms=900.0)
    alone = decide(snapshot(40, load(step_ms=15.0), busy_pool), TARGETS)
    crowded = decide(
        snapshot(40, load(queued_tokens=400, num_queued=2, step_ms=15.0), busy_pool), TARGETS
    )
    assert alone.colocated
    assert (crowded.placement, crowded.reason) == (Placement.REMOTE, Reason.DECODE_STALL)


def test_the_stall_is_spread_over_the_shortest_output_running_on_the_decode_worker():
    # 40 ms of prefill: 0.3 ms on each of 128 tokens, but 40 ms on a 2-token output's one
    # interval, which takes its TPOT from 15 to 55 ms, past the 50 ms target
    pool = load(queued_tokens=20, num_queued=1, step_ms=10.0)  # remote: 5 + 50 + hop
    long_outputs = load(num_queued=3, step_ms=15.0, shortest_output=128)
    short_output = load(num_queued=3, step_ms=15.0, shortest_output=2)
    spread = decide(snapshot(80, long_outputs, pool), TARGETS)
    felt = decide(snapshot(80, short_output, pool), TARGETS)
    assert spread.colocated
    assert spread.decode_tpot_ms == pytest.approx(15 + 40 / 127)
    assert (felt.placement, felt.reason) == (Placement.REMOTE, Reason.DECODE_TPOT)
    assert felt.decode_tpot_ms == pytest.approx(55)


def test_an_idle_decode_worker_has_no_tpot_to_protect_however_slow_its_steps():
    # its last steps took 80 ms, past the 50 ms target: the prompt's own tokens will
    # take that wherever it is prefilled, and nothing else decodes there to slow down
    idle_slow = load(step_ms=80.0)
    d = decide(snapshot(40, idle_slow, load()), TARGETS)
    assert (d.placement, d.reason, d.decode_tpot_ms) == (
        Placement.COLOCATED,
        Reason.COLOCATED_FASTER,
        0.0,
    )
    busy_slow = load(num_queued=1, step_ms=80.0)  # a request decodes there: its TPOT counts
    assert decide(snapshot(40, busy_slow, load()), TARGETS).reason is Reason.DECODE_TPOT


def test_past_the_tpot_target_a_prompt_the_pool_would_keep_waiting_is_still_colocated():
    # the pool would miss the TTFT target too: one target is lost either way, and
    # colocating costs the decoding requests 40 ms over their tokens, not a chunk's wait
    busy_pool = load(queued_tokens=6000, num_queued=4, step_ms=900.0, budget=512)
    short_output = load(num_queued=3, step_ms=15.0, shortest_output=2)
    d = decide(snapshot(80, short_output, busy_pool), TARGETS)
    assert (d.placement, d.reason) == (Placement.COLOCATED, Reason.COLOCATED_FASTER)


def test_where_both_are_allowed_the_faster_one_wins():
    pool = load(queued_tokens=100, num_queued=1, step_ms=10.0)  # remote: 5 + 40 + 10 ms
    slow_decode = load(queued_tokens=0, num_queued=2, step_ms=30.0)  # colocated: 15 + 30
    tight = Targets(ttft_s=0.03, tpot_s=0.1)  # the stall (20 ms) within it
    d = decide(snapshot(40, slow_decode, pool), tight)
    assert (d.placement, d.reason) == (Placement.COLOCATED, Reason.COLOCATED_FASTER)
    slower_decode = load(queued_tokens=0, num_queued=2, step_ms=90.0)  # 45 + 90: slower
    d = decide(snapshot(40, slower_decode, pool), Targets(ttft_s=0.03, tpot_s=0.2))
    assert (d.placement, d.reason) == (Placement.REMOTE, Reason.REMOTE_FASTER)


def test_a_prompt_colocated_shares_its_step_with_every_request_decoding_there():
    # On a compute-bound engine the step it joins computes a token of each of the 60
    # requests decoding there beside its own 40: (40 + 60) / 2 per ms, not 40 / 2. On an
    # idle prefill worker it would take 20 ms and the hop.
    crowded = load(num_queued=60, step_ms=15.0, shortest_output=500)
    d = decide(snapshot(40, crowded, load()), TARGETS)
    assert d.colocated_ttft_ms == pytest.approx(15 / 2 + 50)
    assert d.remote_ttft_ms == pytest.approx(20 + DEFAULT_REMOTE_HOP_MS)
    assert (d.placement, d.reason) == (Placement.REMOTE, Reason.REMOTE_FASTER)
    # a prefill worker's requests decode elsewhere: its queue is its prompts alone
    pool = load(queued_tokens=40, num_queued=1, step_ms=15.0)
    assert decide(snapshot(40, load(), pool), TARGETS).remote_ttft_ms == pytest.approx(
        15 / 2 + 40 + DEFAULT_REMOTE_HOP_MS
    )


def test_the_best_of_several_prefill_workers_is_the_remote_estimate():
    d = decide(snapshot(40, load(), load(queued_tokens=9000, num_queued=9), load()), TARGETS)
    assert d.remote_ttft_ms == pytest.approx(20 + DEFAULT_REMOTE_HOP_MS)


def test_the_hop_is_the_median_of_recent_remote_requests_less_their_workers_own_time():
    hop = RemoteHop()
    assert hop.ms == DEFAULT_REMOTE_HOP_MS  # before any remote request
    hop.observe(waited_ms=60.0, prefill_ms=50.0)
    assert hop.ms == 10.0
    hop.observe(waited_ms=80.0, prefill_ms=50.0)
    hop.observe(waited_ms=55.0, prefill_ms=50.0)
    assert hop.ms == 10.0  # the median of 10, 30 and 5: one slow call moves it little
    hop.observe(waited_ms=70.0, prefill_ms=0.0)  # a worker that does not say
    assert hop.ms == 10.0
    for _ in range(HOP_SAMPLES):
        hop.observe(waited_ms=44.0, prefill_ms=50.0)  # clocks apart: never below 0
    assert hop.ms == 0.0  # only the last HOP_SAMPLES count


def test_the_measured_hop_is_what_the_remote_estimate_adds():
    decode = load(num_queued=2, step_ms=30.0)  # colocated: 15 + max(30, 20) = 45 ms
    pool = load()  # remote: 20 ms + the hop
    loose = Targets(ttft_s=0.2, tpot_s=0.2)
    slow = decide(Snapshot(40, decode, (pool,), RATE, remote_hop_ms=30.0), loose)
    fast = decide(Snapshot(40, decode, (pool,), RATE, remote_hop_ms=5.0), loose)
    assert (slow.placement, slow.reason) == (Placement.COLOCATED, Reason.COLOCATED_FASTER)
    assert (fast.placement, fast.reason) == (Placement.REMOTE, Reason.REMOTE_FASTER)
    assert fast.remote_ttft_ms == pytest.approx(20 + 5)
    assert fast.attributes()["pdserve.placement.remote_hop_ms"] == 5.0


def test_live_colocation_weighs_the_hop_it_measured():
    colocation = LiveColocation(TARGETS)
    colocation.hop.observe(waited_ms=57.0, prefill_ms=50.0)
    decode, pool = worker("d:1", "decode"), worker("p:1", "prefill")
    d = colocation.decide(decode, [pool], [], 40)
    assert d.snapshot.remote_hop_ms == 7.0


def test_each_paths_error_is_the_median_of_its_requests_wait_less_their_estimate():
    errors = EstimateErrors()
    assert errors.ms == {Placement.REMOTE: 0.0, Placement.COLOCATED: 0.0}  # before any
    busy_decode = load(num_queued=2, step_ms=30.0)  # colocated: 45 ms, remote: 20 + 20
    remote = decide(snapshot(40, busy_decode, load()), TARGETS)
    assert remote.placement is Placement.REMOTE
    assert remote.estimated_ttft_ms == pytest.approx(40)
    for waited_ms in (100.0, 50.0, 70.0):
        errors.observe(remote, waited_ms)
    assert errors.ms[Placement.REMOTE] == pytest.approx(30)  # of 60, 10 and 30
    # with no request of its own, the other path weighs the same error
    assert errors.ms[Placement.COLOCATED] == pytest.approx(30)
    colocated = decide(snapshot(40, load(), load()), TARGETS)  # 20 ms
    errors.observe(colocated, 12.0)
    assert errors.ms[Placement.COLOCATED] == pytest.approx(-8)  # pessimistic: below 0
    assert errors.ms[Placement.REMOTE] == pytest.approx(30)  # each learns from its own
    for _ in range(ERROR_SAMPLES):
        errors.observe(remote, 41.0)
    assert errors.ms[Placement.REMOTE] == pytest.approx(1)  # only the last ERROR_SAMPLES count


def test_a_path_that_kept_its_requests_waiting_past_its_estimate_loses_to_the_other():
    # a prefill worker woken from seconds of sleep for every prompt: 40 ms estimated,
    # 90 ms waited; the busy decode worker's 45 ms is then the faster
    busy_decode, pool = load(num_queued=2, step_ms=30.0), load()
    loose = Targets(ttft_s=0.2, tpot_s=0.2)
    naive = decide(Snapshot(40, busy_decode, (pool,), RATE), loose)
    learned = decide(Snapshot(40, busy_decode, (pool,), RATE, remote_error_ms=50.0), loose)
    assert (naive.placement, naive.reason) == (Placement.REMOTE, Reason.REMOTE_FASTER)
    assert (learned.placement, learned.reason) == (Placement.COLOCATED, Reason.COLOCATED_FASTER)
    assert learned.remote_ttft_ms == naive.remote_ttft_ms == pytest.approx(40)  # uncorrected
    assert learned.attributes()["pdserve.placement.remote_error_ms"] == 50.0
    slow_here = Snapshot(40, busy_decode, (pool,), RATE, colocated_error_ms=-10.0)
    assert decide(slow_here, loose).colocated  # 35 ms against 40: the estimate ran high


def test_a_pool_that_keeps_missing_the_ttft_target_does_not_take_a_prompt_for_tpot():
    # colocating pushes a 2-token output's TPOT past 50 ms; the pool's estimate meets the
    # 200 ms TTFT target, but its requests lately waited 200 ms past theirs
    pool = load(queued_tokens=20, num_queued=1, step_ms=10.0)  # remote: 5 + 50 + hop
    short_output = load(num_queued=3, step_ms=15.0, shortest_output=2)
    late_pool = Snapshot(80, short_output, (pool,), RATE, remote_error_ms=200.0)
    assert decide(snapshot(80, short_output, pool), TARGETS).reason is Reason.DECODE_TPOT
    assert decide(late_pool, TARGETS).placement is Placement.COLOCATED


def test_live_colocation_learns_from_the_uncorrected_estimates_so_its_errors_settle():
    # colocating would push a 2-token output's TPOT past 50 ms: every prompt goes remote
    colocation = LiveColocation(TARGETS)
    decode = worker("d:1", "decode", running=3, step_time_ms=15.0, shortest_running_output=2)
    pool = worker("p:1", "prefill", prefill_tokens_per_s=RATE)
    for _ in range(3):  # each waits 110 ms: 50 more than its 60 ms estimate
        d = colocation.decide(decode, [pool], [], 80)
        assert (d.reason, d.estimated_ttft_ms) == (Reason.DECODE_TPOT, pytest.approx(60))
        colocation.errors.observe(d, 110.0)
    assert colocation.errors.ms[Placement.REMOTE] == pytest.approx(50)  # not 50, then 0
    assert colocation.decide(decode, [pool], [], 80).snapshot.remote_error_ms == 50


def test_the_hop_and_the_errors_forget_samples_past_their_age():
    clock = Clock(0.0)
    hop, errors = RemoteHop(clock), EstimateErrors(clock)
    remote = decide(snapshot(40, load(num_queued=2, step_ms=30.0), load()), TARGETS)
    hop.observe(waited_ms=90.0, prefill_ms=50.0)
    errors.observe(remote, 100.0)  # 60 ms past its 40 ms estimate
    clock.now += SAMPLE_MAX_AGE_S / 2
    hop.observe(waited_ms=60.0, prefill_ms=50.0)
    errors.observe(remote, 50.0)
    assert (hop.ms, errors.ms[Placement.REMOTE]) == (25.0, pytest.approx(35))  # both count

    clock.now += SAMPLE_MAX_AGE_S / 2 + 0.1  # the first ones are past the age
    assert (hop.ms, errors.ms[Placement.REMOTE]) == (10.0, pytest.approx(10))
    clock.now += SAMPLE_MAX_AGE_S / 2  # and then the second ones too
    assert (hop.ms, errors.ms[Placement.REMOTE]) == (DEFAULT_REMOTE_HOP_MS, 0.0)


def test_a_path_left_after_a_slow_spell_is_tried_again_once_its_samples_age():
    """Colocating would slow no one here: the faster path wins. The pool's requests of a
    busy spell waited 60 ms past their estimates, so every prompt since was colocated
    (waiting 30 ms past its own) and taught the pool nothing. Once the spell is past the
    age, the pool is weighed with the colocated path's error: its plain estimate, 40 ms
    against the busy decode worker's 45, brings the next prompt back to it; an idle decode
    worker's 20 ms keeps it there."""
    clock = Clock(0.0)
    colocation = LiveColocation(Targets(ttft_s=0.2, tpot_s=0.2), clock=clock)
    busy = worker("d:1", "decode", running=2, step_time_ms=30.0)  # 15 + max(30, 20) ms
    idle = worker("d:1", "decode", step_time_ms=30.0)  # 20 ms
    pool = worker("p:1", "prefill", prefill_tokens_per_s=RATE)  # 20 ms + the 20 ms hop
    first = colocation.decide(busy, [pool], [], 40)
    assert (first.placement, first.estimated_ttft_ms) == (Placement.REMOTE, pytest.approx(40))
    for _ in range(3):
        colocation.errors.observe(first, 100.0)
    quiet = colocation.decide(idle, [pool], [], 40)
    assert quiet.colocated
    colocation.errors.observe(quiet, 50.0)  # 30 ms past its 20
    for _ in range(10):
        clock.now += SAMPLE_MAX_AGE_S / 10 - 0.01
        d = colocation.decide(busy, [pool], [], 40)
        assert d.colocated
        colocation.errors.observe(d, 75.0)  # 30 ms past its 45
    clock.now += 0.2

    d = colocation.decide(busy, [pool], [], 40)
    assert (d.placement, d.reason) == (Placement.REMOTE, Reason.REMOTE_FASTER)
    assert d.snapshot.remote_error_ms == d.snapshot.colocated_error_ms == pytest.approx(30)
    d = colocation.decide(idle, [pool], [], 40)
    assert (d.placement, d.reason) == (Placement.COLOCATED, Reason.COLOCATED_FASTER)


def test_only_requests_placed_by_the_estimates_teach_their_errors():
    errors = EstimateErrors()
    long_prompt = decide(snapshot(500, load(), load()), TARGETS)  # it would stall decoding
    always = decide(snapshot(40, load(), load()), TARGETS, mode=PlacementMode.REMOTE)
    for d in (long_prompt, always):
        assert d.placement is Placement.REMOTE
        errors.observe(d, 5000.0)
    assert errors.ms[Placement.REMOTE] == 0.0


def test_a_colocated_request_teaches_its_path_once_at_its_first_token():
    errors, delivered = EstimateErrors(), []
    placed = decide(snapshot(40, load(), load()), TARGETS)  # colocated, 20 ms estimated
    timer = FirstTokenTimer(delivered.append, errors, placed)
    for token in (1, 2, 3):
        timer(decode_pb2.TokenDelta(token_ids=[token]))
        time.sleep(0.05)  # had the later tokens taught it too, their waits would count
    assert [list(d.token_ids) for d in delivered] == [[1], [2], [3]]
    # the first came at once: 20 ms sooner than estimated (the median of all three: +30)
    assert errors.ms[Placement.COLOCATED] == pytest.approx(-20, abs=10)


def test_no_prefill_worker_means_colocated():
    d = decide(snapshot(4000, load()), TARGETS)
    assert (d.placement, d.reason) == (Placement.COLOCATED, Reason.NO_PREFILL_WORKER)
    assert math.isnan(d.remote_ttft_ms)


def test_a_fixed_threshold_overrides_the_live_decision():
    rule = ColocationRule(enabled=True, max_prompt_tokens=100)
    busy_pool = load(queued_tokens=6000, num_queued=4, step_ms=900.0)
    short = decide(snapshot(40, load(), busy_pool), TARGETS, rule)
    middle = decide(snapshot(150, load(), load()), TARGETS, rule)  # live: colocated
    assert (short.placement, short.reason) == (Placement.COLOCATED, Reason.COLOCATE_BELOW)
    assert (middle.placement, middle.reason) == (Placement.REMOTE, Reason.COLOCATE_BELOW)


def test_targets_must_be_positive():
    with pytest.raises(ValueError, match="targets"):
        Targets(ttft_s=0.0)


# -- from the workers' reports --------------------------------------------------------------


def worker(address: str, role: str, **load_fields) -> WorkerInfo:
    return WorkerInfo(worker_id=address, role=role, address=address, **load_fields)


def test_live_colocation_reads_the_reports_and_the_cached_prefix_on_each_worker():
    prompt = list(range(100, 164))  # 64 tokens: 4 blocks of 16, the last always computed
    hashes = prompt_block_hashes(prompt, 16)
    decode = worker("d:1", "decode", step_time_ms=15.0, running=3, cached_block_hashes=hashes)
    busy = worker(
        "p:1",
        "prefill",
        queued_prefill_tokens=6000,
        running=1,
        waiting=3,
        step_time_ms=900.0,
        prefill_tokens_per_s=RATE,
    )
    down = worker("p:2", "prefill", healthy=False)
    d = LiveColocation(TARGETS).decide(decode, [busy, down, decode], hashes, len(prompt))

    assert d.snapshot.decode.cached_tokens == 48
    assert [w.address for w in d.snapshot.prefill] == ["p:1"]  # not the sick, not itself
    assert d.snapshot.prefill_tokens_per_s == RATE
    assert (d.placement, d.reason) == (Placement.COLOCATED, Reason.COLOCATED_FASTER)
    attributes = d.attributes()
    assert attributes["pdserve.placement"] == "colocated"
    assert attributes["pdserve.placement.reason"] == "colocated_faster"
    assert attributes["pdserve.placement.prefill_queued_tokens"] == 6000
    assert attributes["pdserve.placement.decode_cached_tokens"] == 48


def test_the_span_carries_only_the_inputs_the_decision_weighed():
    s = snapshot(40, load(cached=16), load(queued_tokens=500))
    live = decide(s, TARGETS).attributes()
    remote = decide(s, TARGETS, mode=PlacementMode.REMOTE).attributes()
    rule = ColocationRule(enabled=True, max_prompt_tokens=100)
    fixed = decide(s, TARGETS, rule).attributes()

    assert remote == {
        "pdserve.placement": "remote",
        "pdserve.placement.reason": "always_remote",
        "pdserve.placement.prompt_tokens": 40,
    }
    assert fixed == {
        "pdserve.placement": "colocated",
        "pdserve.placement.reason": "colocate_below",
        "pdserve.placement.prompt_tokens": 40,
        "pdserve.placement.decode_cached_tokens": 16,
    }
    assert live.keys() > fixed.keys()
    assert live["pdserve.placement.prefill_queued_tokens"] == 500
    assert live["pdserve.placement.ttft_target_ms"] == 200


def test_the_engine_reports_its_queued_prompt_tokens_and_its_shortest_running_output(
    demo_model_dir,
):
    engine = LLMEngine.from_pretrained(demo_model_dir, max_num_batched_tokens=64)
    for i, max_tokens in enumerate((9, 5, 7)):
        engine.add_request([3 + i] * 30, SamplingParams(max_tokens=max_tokens))
    stats = StepStats()
    stats.observe_queues(engine.scheduler)
    assert (stats.queued_prefill_tokens, stats.shortest_running_output) == (90, 0)
    engine.step()  # 64 tokens: two prompts whole (they run), 4 of the third
    stats.observe_queues(engine.scheduler)
    assert (stats.queued_prefill_tokens, stats.shortest_running_output) == (26, 5)


# -- a real cluster: a busy prefill pool -------------------------------------------------------

# enough long prompts that their queue outlasts the wait for the router to see it, even
# on a quiet machine (at 4 tokens a step: 3,000 steps)
LONG_PROMPT, NUM_LONG, SHORT_PROMPT = 1000, 12, 8
# a heartbeat (1 s) and a discovery refresh (0.5 s): the router has seen a newer report
ROUTER_SEES_REPORT_S = 2.0


@pytest.fixture(scope="module")
def busy_cluster(demo_model_dir, tmp_path_factory):
    """A prefill and a decode worker computing 4 prompt tokens a step (so long prompts
    queue for seconds), and a router aiming at TTFT <= 50 ms and TPOT <= 100 ms."""
    with LocalCluster(
        model=str(demo_model_dir),
        shape=ClusterShape(prefill=1, decode=1),
        run_dir=tmp_path_factory.mktemp("placement"),
        worker_args=["--max-num-batched-tokens", "4"],
        router_args=[
            *("--prefill-placement", "live"),  # the suite's default is remote (conftest)
            *("--ttft-target", "0.05", "--tpot-target", "0.1"),
        ],
        metrics=True,
    ) as started:
        yield started


def generate_request(first_id: int, length: int) -> router_pb2.GenerateRequest:
    prompt = [3 + (first_id + i) % 1000 for i in range(length)]  # within the vocabulary
    return router_pb2.GenerateRequest(
        token_ids=router_pb2.TokenIds(ids=prompt),
        sampling=sampling_params_to_proto(SamplingParams(max_tokens=2, ignore_eos=True)),
        request_id=f"req-{first_id}-{length}",
    )


async def placed(stub, request: router_pb2.GenerateRequest) -> router_pb2.RequestInfo:
    """Run the request to its end; where the router put it."""
    async for _ in stub.Generate(request, timeout=120):
        pass
    return await stub.GetRequest(router_pb2.GetRequestRequest(request_id=request.request_id))


async def test_a_short_prompt_behind_long_prefills_is_colocated_and_a_long_one_is_not(
    busy_cluster,
):
    [prefill] = [w for w in busy_cluster.workers if w.role == "prefill"]
    async with grpc.aio.insecure_channel(busy_cluster.router_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        longs = [
            asyncio.create_task(placed(stub, generate_request(100 * i, LONG_PROMPT)))
            for i in range(NUM_LONG)
        ]
        deadline = time.monotonic() + 30
        while worker_load(prefill.address, "prefill").queued_prefill_tokens < LONG_PROMPT:
            assert time.monotonic() < deadline, "the long prompts never queued"
            await asyncio.sleep(0.05)
        await asyncio.sleep(ROUTER_SEES_REPORT_S)

        short = await placed(stub, generate_request(7, SHORT_PROMPT))
        late_long = await placed(stub, generate_request(11, LONG_PROMPT))
        first_long = await longs[0]
        await asyncio.gather(*longs)

    assert short.prefill_worker == short.decode_worker  # colocated
    assert late_long.prefill_worker == prefill.address != late_long.decode_worker
    assert first_long.prefill_worker == prefill.address
    assert worker_load(prefill.address, "prefill").step_token_budget == 4
    with urllib.request.urlopen(metrics_url(busy_cluster.router.metrics_address)) as answer:
        text = answer.read().decode()
    assert _has_series(text, outcome="colocated", reason="colocated_faster")
    assert _has_series(text, outcome="cache_miss", reason="decode_stall")
    # measured on the long prompts' remote path
    [hop] = [line for line in text.splitlines() if line.startswith("pdserve:remote_hop_seconds{")]
    assert 0 < float(hop.rsplit(" ", 1)[1]) != DEFAULT_REMOTE_HOP_MS / 1000
    # and each path's estimate error: the short prompt's taught the colocated one; the
    # long ones, sent to the pool for the stall, taught nothing (their queue says nothing
    # of a short prompt's wait)
    errors = {
        line.split('placement="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("pdserve:ttft_estimate_error_seconds{")
    }
    assert errors.keys() == {"remote", "colocated"}
    # the remote path, with no request of its own to learn from, weighs the colocated one's
    assert errors["remote"] == errors["colocated"] != 0


def _has_series(text: str, **labels: str) -> bool:
    """Whether routing_decisions_total has a series with these labels and a count > 0."""
    for line in text.splitlines():
        if not line.startswith("pdserve:routing_decisions_total{"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1]) > 0
    return False


# -- the client's own TTFT target -----------------------------------------------------------


def with_budget(snapshot_: Snapshot, ttft_budget_ms: float) -> Snapshot:
    return dataclasses.replace(snapshot_, ttft_budget_ms=ttft_budget_ms)


def test_a_client_that_allows_seconds_lets_a_busy_pool_keep_the_decodes_tpot():
    # the pool misses the router's 200 ms (rule 3 would colocate: a target lost either
    # way), but this client allows 2 s: the prompt goes remote, the decodes keep 50 ms
    busy_pool = load(queued_tokens=600, num_queued=2, step_ms=250.0, budget=512)
    short_output = load(num_queued=3, step_ms=15.0, shortest_output=2)
    plain = snapshot(80, short_output, busy_pool)
    assert decide(plain, TARGETS).colocated
    d = decide(with_budget(plain, 2000.0), TARGETS)
    assert (d.placement, d.reason) == (Placement.REMOTE, Reason.DECODE_TPOT)
    assert 200 < d.remote_ttft_ms < 2000
    assert d.attributes()["pdserve.placement.request_ttft_budget_ms"] == 2000.0


def test_a_client_that_allows_less_than_the_router_does_not_colocate_more():
    # the router's 200 ms sends it remote (75 ms) for the decodes' TPOT; this client's
    # 30 ms, which the pool cannot meet, changes nothing: colocating for it put the
    # decode worker's TPOT over its target in the serving benchmark
    pool = load(queued_tokens=20, num_queued=1, step_ms=10.0)
    short_output = load(num_queued=3, step_ms=15.0, shortest_output=2)
    plain = snapshot(80, short_output, pool)
    tight = decide(with_budget(plain, 30.0), TARGETS)
    assert (tight.placement, tight.reason) == (Placement.REMOTE, Reason.DECODE_TPOT)
    assert decide(plain, TARGETS).reason is Reason.DECODE_TPOT
    assert "pdserve.placement.request_ttft_budget_ms" not in decide(plain, TARGETS).attributes()
