"""RecentDispatches: what the router sent since a worker's last load report."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
from fuzz_support import InProcessServers, start_router, start_worker, wait_for
from manual_clock import Clock

from pdserve.api.v1 import router_pb2, router_pb2_grpc
from pdserve.core.block_hash import prompt_block_hashes
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.workers import WorkerInfo
from pdserve.router.colocation import LiveColocation
from pdserve.router.disaggregation import Placement, Reason, Targets
from pdserve.router.dispatches import MAX_DISPATCHED_HASHES, RecentDispatches
from pdserve.router.policy import CacheAwarePrefill, MostFreeDecode
from pdserve.rpc.wire import sampling_params_to_proto

BLOCK_SIZE = 16


def decode(address: str, free_blocks: int = 100, updated_at: float = 999.0) -> WorkerInfo:
    return WorkerInfo(
        worker_id=address,
        role="decode",
        address=address,
        free_blocks=free_blocks,
        total_blocks=100,
        updated_at=updated_at,
    )


def prefill(address: str, cached: list[str] | None = None, updated_at: float = 999.0):
    return WorkerInfo(
        worker_id=address,
        role="prefill",
        address=address,
        block_size=BLOCK_SIZE,
        cached_block_hashes=cached if cached is not None else [],
        updated_at=updated_at,
    )


def hashes_of(seed: int, num_tokens: int = 200) -> list[str]:
    return prompt_block_hashes([seed * 1000 + i for i in range(num_tokens)], BLOCK_SIZE)


def route(policy, dispatches, workers, hashes) -> str:
    """Rank, then record the dispatch to the first, as the router does."""
    first = policy.rank(dispatches.adjust(workers), hashes)[0]
    dispatches.record(first.address, block_hashes=hashes)
    return first.address


def test_a_burst_alternates_between_equal_workers_instead_of_piling_on_one():
    clock, policy = Clock(), MostFreeDecode()
    dispatches = RecentDispatches(clock=clock)
    workers = [decode("10.0.0.1:1"), decode("10.0.0.2:1")]  # the same stale snapshot throughout
    chosen = []
    for _ in range(6):
        first = policy.rank(dispatches.adjust(workers), num_blocks_needed=4)[0]
        dispatches.record(first.address, num_blocks=4)
        chosen.append(first.address)
        clock.now += 0.01
    assert chosen == ["10.0.0.1:1", "10.0.0.2:1"] * 3


def test_dispatches_the_snapshot_already_reflects_are_not_counted_again():
    clock = Clock()
    dispatches = RecentDispatches(clock=clock)
    dispatches.record("a:1", num_blocks=5)
    clock.now += 0.5
    dispatches.record("a:1", num_blocks=7)
    (before,) = dispatches.adjust([decode("a:1", updated_at=999.0)])
    assert (before.free_blocks, before.waiting) == (100 - 12, 2)
    (between,) = dispatches.adjust([decode("a:1", updated_at=1000.2)])  # saw the first only
    assert (between.free_blocks, between.waiting) == (100 - 7, 1)


def test_prompt_tokens_sent_since_a_report_join_the_workers_prefill_queue():
    # What the remote-or-colocated decision reads between heartbeats: a long prompt just
    # sent to a prefill worker is its queue before the worker's next report says so.
    clock = Clock()
    dispatches = RecentDispatches(clock=clock)
    dispatches.record("p:1", num_tokens=1500)
    clock.now += 0.5
    dispatches.record("p:1", num_tokens=40)
    reported = dataclasses.replace(prefill("p:1"), queued_prefill_tokens=100)
    (before,) = dispatches.adjust([reported])
    assert (before.queued_prefill_tokens, before.waiting) == (100 + 1540, 2)
    saw_the_first = dataclasses.replace(reported, updated_at=1000.2)
    (between,) = dispatches.adjust([saw_the_first])
    assert between.queued_prefill_tokens == 100 + 40


def test_old_dispatches_drop_out_after_the_horizon_and_others_are_untouched():
    clock = Clock()
    dispatches = RecentDispatches(horizon_s=2.0, clock=clock)
    dispatches.record("a:1", num_blocks=5)
    untouched = decode("b:1")
    assert dispatches.adjust([untouched])[0] is untouched
    clock.now += 2.5  # a snapshot that never moved (a stopped or fast-clocked worker)
    stale = decode("a:1", updated_at=0.0)
    assert dispatches.adjust([stale])[0] is stale


def test_thousands_of_dispatches_count_exactly_across_expiry_and_trimming():
    """Against a plain recount, while old dispatches expire and the lists get trimmed."""
    clock = Clock()
    dispatches = RecentDispatches(horizon_s=2.0, clock=clock)
    sent: list[tuple[float, int]] = []  # every dispatch to a:1, as (time, blocks)
    for i in range(6000):
        blocks = i % 7
        dispatches.record("a:1", num_blocks=blocks, num_tokens=3 * blocks)
        sent.append((clock.now, blocks))
        clock.now += 0.001
        if i % 250 == 0:
            # a worker that reported 0.4 s ago, and one whose report never moves
            for snapshot_at in (clock.now - 0.4, 0.0):
                (seen,) = dispatches.adjust([decode("a:1", updated_at=snapshot_at)])
                unseen = [b for at, b in sent if at > snapshot_at and at >= clock.now - 2.0]
                assert (seen.waiting, seen.free_blocks) == (len(unseen), 100 - sum(unseen)), i
                assert seen.queued_prefill_tokens == 3 * sum(unseen), i


def test_a_clock_that_steps_back_never_hides_a_dispatch():
    clock = Clock()
    dispatches = RecentDispatches(clock=clock)
    dispatches.record("a:1", num_blocks=3)
    clock.now -= 0.5  # NTP stepped the wall clock back
    dispatches.record("a:1", num_blocks=4)
    (seen,) = dispatches.adjust([decode("a:1", updated_at=999.9)])  # before both
    assert (seen.waiting, seen.free_blocks) == (2, 100 - 7)


def test_the_horizon_must_be_positive():
    with pytest.raises(ValueError, match="horizon_s"):
        RecentDispatches(horizon_s=0)


# -- what ended since a report ---------------------------------------------------------


def busy(address: str, updated_at: float = 999.0, **load) -> WorkerInfo:
    """A decode worker whose report counts one running request holding 10 blocks, with
    64 tokens to go at most; `load` overrides."""
    fields = {"running": 1, "free_blocks": 90, "shortest_running_output": 64, **load}
    return dataclasses.replace(decode(address, updated_at=updated_at), **fields)


def test_a_request_that_ended_since_the_report_no_longer_counts_there():
    clock = Clock()
    dispatches = RecentDispatches(clock=clock)
    dispatches.ended("a:1", requests=1, num_blocks=10)  # its stream's last token, relayed

    (seen,) = dispatches.adjust([busy("a:1")])

    assert (seen.running, seen.waiting, seen.free_blocks) == (0, 0, 100)
    assert seen.shortest_running_output == 0  # nothing left running: no output to protect


def test_an_ending_the_report_already_reflects_is_not_taken_off_again():
    clock = Clock()
    dispatches = RecentDispatches(clock=clock)
    dispatches.ended("a:1", requests=1, num_blocks=10)
    newer = busy("a:1", updated_at=clock.now + 0.1)  # a later request runs there now

    assert dispatches.adjust([newer])[0] is newer


def test_an_ending_comes_off_what_waits_first_then_off_what_runs():
    dispatches = RecentDispatches(clock=Clock())
    dispatches.ended("a:1", requests=2, num_blocks=20)

    (seen,) = dispatches.adjust([busy("a:1", running=2, waiting=1, free_blocks=70)])

    assert (seen.running, seen.waiting, seen.free_blocks) == (1, 0, 90)
    assert seen.shortest_running_output == 64  # one still runs: its report stands


def test_endings_never_take_a_worker_below_idle():
    """A request that ended before the worker ever reported it comes off a report that
    never held it: the view stops at idle and all blocks free, and the next report is
    exact again."""
    dispatches = RecentDispatches(clock=Clock())
    dispatches.ended("a:1", requests=3, num_blocks=30, num_tokens=500)

    (seen,) = dispatches.adjust([busy("a:1", queued_prefill_tokens=100)])

    assert (seen.running, seen.waiting, seen.free_blocks) == (0, 0, 100)
    assert seen.queued_prefill_tokens == 0


def test_a_prompt_computed_leaves_the_queue_and_its_request_leaves_the_worker():
    """A colocated prompt, as the runner reports it: dispatched with its blocks and
    tokens; at its first token the tokens leave the queue; at its stream's end the
    request and its blocks leave. The view goes back to the report, step by step."""
    clock = Clock()
    dispatches = RecentDispatches(clock=clock)
    report = busy("a:1")
    dispatches.record("a:1", num_blocks=4, num_tokens=40)
    (sent,) = dispatches.adjust([report])
    assert (sent.running, sent.waiting, sent.free_blocks, sent.queued_prefill_tokens) == (
        1,
        1,
        86,
        40,
    )

    clock.now += 0.05
    dispatches.ended("a:1", num_tokens=40)
    (computed,) = dispatches.adjust([report])
    assert (computed.waiting, computed.free_blocks, computed.queued_prefill_tokens) == (1, 86, 0)

    clock.now += 1.0
    dispatches.ended("a:1", requests=1, num_blocks=4)
    (done,) = dispatches.adjust([report])
    assert (done.running, done.waiting, done.free_blocks, done.queued_prefill_tokens) == (
        1,
        0,
        90,
        0,
    )


def test_dispatches_and_endings_count_exactly_against_a_recount():
    """Thousands of each, interleaved, while old ones expire and the lists get trimmed."""
    clock = Clock()
    dispatches = RecentDispatches(horizon_s=2.0, clock=clock)
    events: list[tuple[float, int, int]] = []  # (time, +1 sent / -1 ended, blocks)
    for i in range(6000):
        blocks = i % 5
        if i % 3 == 2:
            dispatches.ended("a:1", requests=1, num_blocks=blocks, num_tokens=2 * blocks)
            events.append((clock.now, -1, blocks))
        else:
            dispatches.record("a:1", num_blocks=blocks, num_tokens=2 * blocks)
            events.append((clock.now, 1, blocks))
        clock.now += 0.001
        if i % 250 == 0:
            report = busy("a:1", running=1000, free_blocks=5000, queued_prefill_tokens=10_000)
            report = dataclasses.replace(report, total_blocks=10_000)
            for snapshot_at in (clock.now - 0.4, 0.0):
                report = dataclasses.replace(report, updated_at=snapshot_at)
                (seen,) = dispatches.adjust([report])
                live = [
                    (sign, b)
                    for at, sign, b in events
                    if at > snapshot_at and at >= clock.now - 2.0
                ]
                net = sum(sign for sign, _ in live)
                net_blocks = sum(sign * b for sign, b in live)
                assert seen.running + seen.waiting == 1000 + net, i
                assert seen.free_blocks == 5000 - net_blocks, i
                assert seen.queued_prefill_tokens == 10_000 + 2 * net_blocks, i


def test_a_decode_worker_whose_last_request_ended_takes_the_next_short_prompt_itself():
    """The short workload's case: the decode worker's report, up to a second old, still
    counts the request whose last token the router relayed. Read as it is, the worker
    looks busy and the pool idle, and the prompt is sent through the pool for nothing."""
    clock = Clock()
    dispatches = RecentDispatches(clock=clock)
    placement = LiveColocation(Targets(ttft_s=0.25, tpot_s=0.05))
    # 40 tokens at 2 a ms: 20 ms either way, and the remote path's hop (20 ms, until
    # measured) on top; busy, the decode worker's half step in progress and the 30 ms step
    # the prompt joins (45 ms) cost more than the hop
    assert placement.hop.ms == 20
    decode_report = busy("d:1", step_time_ms=30.0, prefill_tokens_per_s=2000.0)
    pool = [prefill("p:1")]

    def decided():
        [decode_now] = dispatches.adjust([decode_report])
        return placement.decide(decode_now, dispatches.adjust(pool), hashes_of(1, 40), 40)

    assert decided().placement is Placement.REMOTE  # it waits out half a step, then joins one
    dispatches.ended("d:1", requests=1, num_blocks=10)
    d = decided()
    assert (d.placement, d.reason) == (Placement.COLOCATED, Reason.COLOCATED_FASTER)


# -- block hashes ----------------------------------------------------------------------


def test_hashes_sent_to_a_worker_count_as_cached_there_at_once():
    dispatches = RecentDispatches(clock=Clock())
    hashes = hashes_of(1)
    dispatches.record("a:1", block_hashes=hashes)
    untouched = prefill("b:1")

    seen, same = dispatches.adjust([prefill("a:1", cached=["old"]), untouched])

    assert seen.cached_block_hashes[0] == "old"  # the worker's own report, then ours
    assert sorted(seen.cached_block_hashes[1:]) == sorted(hashes)
    assert seen.waiting == 1
    assert same is untouched


def test_hashes_count_even_against_a_newer_snapshot_that_lacks_them():
    """A heartbeat newer than the dispatch may predate its prefill: it says nothing."""
    clock = Clock()
    dispatches = RecentDispatches(clock=clock)
    hashes = hashes_of(1)
    dispatches.record("a:1", block_hashes=hashes)
    clock.now += 0.5

    (seen,) = dispatches.adjust([prefill("a:1", updated_at=clock.now - 0.1)])

    assert (sorted(seen.cached_block_hashes), seen.waiting) == (sorted(hashes), 0)


def test_hashes_expire_with_the_horizon():
    clock = Clock()
    dispatches = RecentDispatches(horizon_s=2.0, clock=clock)
    dispatches.record("a:1", block_hashes=hashes_of(1))
    clock.now += 1.5
    dispatches.record("a:1", block_hashes=hashes_of(2))
    clock.now += 1.0  # the first dispatch is past the horizon, the second is not
    stale = prefill("a:1", updated_at=clock.now)

    (seen,) = dispatches.adjust([stale])

    assert sorted(seen.cached_block_hashes) == sorted(hashes_of(2))
    clock.now += 1.5
    assert dispatches.adjust([stale])[0] is stale


def test_past_the_cap_the_oldest_hashes_go_and_a_repeated_prefix_is_new_again():
    dispatches = RecentDispatches(clock=Clock())
    shared = hashes_of(1)
    dispatches.record("a:1", block_hashes=shared)
    for seed in range(3, 303):  # 300 prompts of 12 blocks
        dispatches.record("a:1", block_hashes=hashes_of(seed))
    dispatches.record("a:1", block_hashes=shared)  # a hit: the newest again
    for seed in range(303, 353):  # 50 more: 12 * (1 + 300 + 50) is past the cap
        dispatches.record("a:1", block_hashes=hashes_of(seed))

    (seen,) = dispatches.adjust([prefill("a:1")])

    cached = set(seen.cached_block_hashes)
    assert len(cached) == MAX_DISPATCHED_HASHES
    assert set(shared) <= cached
    assert not set(hashes_of(3)) & cached  # the oldest, never repeated


def test_a_prompt_longer_than_the_cap_keeps_its_first_blocks():
    dispatches = RecentDispatches(clock=Clock())
    hashes = hashes_of(1, num_tokens=(MAX_DISPATCHED_HASHES + 10) * BLOCK_SIZE + 1)

    dispatches.record("a:1", block_hashes=hashes)

    (seen,) = dispatches.adjust([prefill("a:1")])
    assert set(seen.cached_block_hashes) == set(hashes[:MAX_DISPATCHED_HASHES])


def test_the_cached_view_is_one_list_until_a_dispatch_or_a_new_snapshot():
    """So the policy builds each worker's hash set once per change, not per request."""
    clock = Clock()
    dispatches = RecentDispatches(clock=clock)
    dispatches.record("a:1", block_hashes=hashes_of(1))
    snapshot = prefill("a:1", updated_at=clock.now + 0.1)
    first = dispatches.adjust([snapshot])[0].cached_block_hashes

    assert dispatches.adjust([snapshot])[0].cached_block_hashes is first
    assert (
        dispatches.adjust([prefill("a:1", updated_at=1000.1)])[0].cached_block_hashes is not first
    )
    dispatches.record("a:1", block_hashes=hashes_of(2))
    assert dispatches.adjust([snapshot])[0].cached_block_hashes is not first


def test_workers_that_left_are_forgotten_once_their_dispatches_expire():
    clock = Clock()
    dispatches = RecentDispatches(horizon_s=2.0, clock=clock)
    dispatches.record("gone:1", block_hashes=hashes_of(1))
    dispatches.record("here:1", block_hashes=hashes_of(2))
    clock.now += 2.5
    dispatches.record("here:1", block_hashes=hashes_of(3))

    dispatches.adjust([prefill("here:1")])  # the departed worker is never listed again

    assert len(dispatches) == 1


# -- with the cache-aware prefill policy -----------------------------------------------


@pytest.mark.parametrize("heartbeat_has_it", [False, True], ids=["at-once", "after-a-pause"])
def test_repeats_one_at_a_time_stay_on_the_worker_holding_the_prefix(heartbeat_has_it):
    """Two idle prefill workers whose snapshots do not move while the repeats run: the
    router counts its own finished dispatches as still queued, and still keeps them."""
    clock, policy = Clock(), CacheAwarePrefill()
    dispatches = RecentDispatches(clock=clock)
    hashes = hashes_of(1)
    first = route(policy, dispatches, [prefill("10.0.0.1:1"), prefill("10.0.0.2:1")], hashes)
    if heartbeat_has_it:  # the holder reported its cache; our dispatch is past the horizon
        clock.now += 5.0
    holder_cache = hashes if heartbeat_has_it else []
    workers = [prefill("10.0.0.1:1", holder_cache, clock.now), prefill("10.0.0.2:1")]

    chosen = []
    for _ in range(4):
        clock.now += 0.2
        chosen.append(route(policy, dispatches, workers, hashes))

    assert chosen == [first] * 4


def test_a_burst_of_distinct_prompts_still_alternates_between_prefill_workers():
    clock, policy = Clock(), CacheAwarePrefill()
    dispatches = RecentDispatches(clock=clock)
    workers = [prefill("10.0.0.1:1"), prefill("10.0.0.2:1")]

    chosen = [route(policy, dispatches, workers, hashes_of(seed)) for seed in range(6)]

    assert chosen == ["10.0.0.1:1", "10.0.0.2:1"] * 3


# -- a real router: every dispatch has its ending -------------------------------------------

SHORT, LONG = 8, 40  # prompt tokens: under and over the cluster's --colocate-below


@pytest.fixture(scope="module")
def served(demo_model_dir, redis_url):
    """A prefill and a decode worker and a router in this process (static discovery);
    prompts under 16 tokens are prefilled on the decode worker, the others remote."""
    servers = InProcessServers()
    try:
        engine = {"num_kv_blocks": 256, "max_model_len": 128}
        pool = start_worker(servers, demo_model_dir, "prefill", engine=engine)
        decoder = start_worker(servers, demo_model_dir, "decode", engine=engine)
        router = start_router(
            servers,
            demo_model_dir,
            redis_url,
            prefill=[pool.address],
            decode=[decoder.address],
            colocate_below=16,
        )
        yield router, pool.address, decoder.address
    finally:
        servers.close()


def test_once_its_requests_end_the_router_counts_nothing_outstanding_on_any_worker(served):
    """Whatever path each request took (colocated, remote, refused at the door), the
    router's view of each worker goes back to the worker's own report once they end:
    every dispatch it counted has its ending."""
    router, pool, decoder = served
    runner = router.app.runner
    runner.dispatches = RecentDispatches(horizon_s=600.0)  # nothing expires while we look
    too_long = [3] * 500  # past max_model_len: the decode worker refuses it at Admit
    with grpc.insecure_channel(router.address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        for prompt in ([3] * SHORT, [5] * LONG, too_long, [7] * LONG):
            request = router_pb2.GenerateRequest(
                token_ids=router_pb2.TokenIds(ids=prompt),
                sampling=sampling_params_to_proto(SamplingParams(max_tokens=4, ignore_eos=True)),
            )
            try:
                list(stub.Generate(request, timeout=60))
            except grpc.RpcError as exc:
                assert prompt is too_long, exc.details()

    # as the workers last reported, a while ago: each busy, 40 tokens queued
    reported = {
        address: dataclasses.replace(
            busy(address, updated_at=0.0, running=3, queued_prefill_tokens=40),
            total_blocks=100,
        )
        for address in (pool, decoder)
    }

    def outstanding() -> dict[str, tuple[int, int, int, int]]:
        return {
            w.address: (w.running, w.waiting, w.free_blocks, w.queued_prefill_tokens)
            for w in runner.dispatches.adjust(list(reported.values()))
        }

    settled = dict.fromkeys((pool, decoder), (3, 0, 90, 40))
    assert wait_for(lambda: outstanding() == settled, within_s=10), outstanding()
