"""The P:D planner (`pdserve plan`): each pool's capacity within its SLO measured from a bench
record, the workers a load needs, and the scaling decisions of `pdserve planner`.

The arithmetic is checked on crafted requests with exact numbers; then a small real bench
run (a local prefill:1,decode:1 cluster) is planned from, and the plan is checked against
the record's raw JSON, recomputed here without the planner's reader.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import threading
import time

import pytest

from pdserve.bench.loadgen import RequestResult
from pdserve.bench.metrics import SLO
from pdserve.cluster.local import ClusterShape
from pdserve.planner.capacity import (
    NoCapacityError,
    Pool,
    config_capacity,
    measure,
    measure_pools,
    pool_load,
)
from pdserve.planner.config import PlannerConfig, parse_shapes
from pdserve.planner.live import LiveLoadError, PrometheusLoad
from pdserve.planner.plan import Load, make_plan, plan_json, workers_needed
from pdserve.planner.record import RecordedRun, RecordError, parse_record
from pdserve.planner.scaling import Bounds, ScalingPolicy, decide

pytestmark = pytest.mark.cluster

SLO_300_20 = SLO(ttft_ms=300, tpot_ms=20)


def request(ttft: float, gap: float, tokens: int = 10, prompt: int = 100, ok: bool = True):
    """A measured request: first token at `ttft` s, then one every `gap` s."""
    times = [ttft + gap * i for i in range(tokens)]
    return RequestResult(0, "k", False, prompt, tokens, 0.0, times, None, "" if ok else "boom")


def run(config: str, rate: float, results: list, duration_s: float = 10.0) -> RecordedRun:
    shape = ClusterShape.parse(config)
    return RecordedRun(config, shape.prefill, shape.decode, rate, duration_s, tuple(results))


# a prefill:2,decode:1 sweep over 10 s windows: TTFT fine up to 2 req/s, half missed at 4;
# TPOT fine at every rate
SWEEP = [
    run("prefill:2,decode:1", 1, [request(0.1, 0.010)] * 10),
    run("prefill:2,decode:1", 2, [request(0.2, 0.015)] * 20),
    run("prefill:2,decode:1", 4, [request(0.2, 0.019)] * 20 + [request(0.5, 0.019)] * 20),
]


# -- capacity -------------------------------------------------------------------------------


def test_a_pools_load_is_its_tokens_per_second_per_worker_and_the_share_meeting_its_slo():
    prefill = pool_load(SWEEP[2], Pool.PREFILL, SLO_300_20)
    assert prefill.tokens_per_s_per_worker == 40 * 100 / 10 / 2  # 200 prompt tok/s each
    assert prefill.attainment == 0.5
    decode = pool_load(SWEEP[2], Pool.DECODE, SLO_300_20)
    assert decode.tokens_per_s_per_worker == 40 * 10 / 10 / 1  # 40 output tok/s
    assert decode.attainment == 1.0


def test_a_failed_request_misses_both_pools_slos():
    failed = run("prefill:1,decode:1", 1, [request(0.1, 0.01), request(0.1, 0.01, ok=False)])
    assert pool_load(failed, Pool.PREFILL, SLO_300_20).attainment == 0.5
    assert pool_load(failed, Pool.DECODE, SLO_300_20).attainment == 0.5


def test_a_single_token_request_has_no_tpot_to_miss():
    one = run("prefill:1,decode:1", 1, [request(0.1, 0.0, tokens=1)])
    assert pool_load(one, Pool.DECODE, SLO(300, 1)).attainment == 1.0


def test_capacity_is_the_load_at_the_highest_rate_up_to_which_every_rate_met_the_goal():
    loads = [pool_load(r, Pool.PREFILL, SLO_300_20) for r in SWEEP]
    capacity = config_capacity(loads, Pool.PREFILL)
    assert (capacity.tokens_per_s, capacity.rate, capacity.bounded) == (100.0, 2, True)


def test_a_pool_never_pushed_past_its_slo_has_a_lower_bound_for_capacity():
    loads = [pool_load(r, Pool.DECODE, SLO_300_20) for r in SWEEP]
    capacity = config_capacity(loads, Pool.DECODE)
    assert (capacity.tokens_per_s, capacity.rate, capacity.bounded) == (40.0, 4, False)
    assert "lower bound" in capacity.describe()


def test_a_miss_at_a_lower_rate_is_not_rescued_by_a_lucky_higher_one():
    sweep = [
        run("prefill:1,decode:1", 1, [request(0.1, 0.01)] * 10),
        run("prefill:1,decode:1", 2, [request(0.9, 0.01)] * 20),
        run("prefill:1,decode:1", 4, [request(0.1, 0.01)] * 40),
    ]
    capacity = measure(sweep, Pool.PREFILL, SLO_300_20)
    assert (capacity.rate, capacity.tokens_per_s) == (1, 100.0)


def test_the_best_configuration_measures_a_pool_and_none_measures_one_that_always_missed():
    other = [run("prefill:1,decode:2", 1, [request(0.1, 0.01)] * 30)]  # 300 prompt tok/s each
    assert measure(SWEEP + other, Pool.PREFILL, SLO_300_20).config == "prefill:1,decode:2"
    assert measure(SWEEP + other, Pool.DECODE, SLO_300_20).tokens_per_s == 40.0  # SWEEP's
    assert measure(SWEEP, Pool.PREFILL, SLO(50, 20)) is None
    with pytest.raises(NoCapacityError, match=r"prefill pool met its SLO \(TTFT <= 50 ms\)"):
        measure_pools(SWEEP, SLO(50, 20))


def test_a_relative_ttft_slo_judges_each_request_by_its_own_kind():
    # long prompts take 1 s to their first token, 3x their 0.4 s alone would allow 1.2 s;
    # the 200 ms floor alone (an absolute SLO) would fail every one of them
    long = dataclasses.replace(request(1.0, 0.01, prompt=2000), kind="long")
    short = dataclasses.replace(request(0.15, 0.01), kind="short")
    sweep = [run("prefill:1,decode:1", 1, [long, short] * 10)]
    relative = SLO(200, 20, ttft_scale=3, solo_ttft_ms={"long": 400, "short": 50})
    assert measure(sweep, Pool.PREFILL, relative).attainment == 1.0
    assert measure(sweep, Pool.PREFILL, SLO(200, 20)) is None
    assert relative.overridden(ttft_ms=2000, tpot_ms=None) == SLO(
        2000, 20, None, relative.solo_ttft_ms
    )


# -- plans ----------------------------------------------------------------------------------


def test_workers_needed_rounds_up_never_below_one_and_ignores_float_noise():
    assert workers_needed(900, 300) == 3
    assert workers_needed(901, 300) == 4
    assert workers_needed(0, 300) == 1
    assert workers_needed(0.1 * 3, 0.1) == 3  # 3.0000000000000004 workers is 3
    assert workers_needed(900, 300, headroom=0.1) == 4  # 990 tok/s
    for bad in ((900, 0), (900, -1)):
        with pytest.raises(ValueError):
            workers_needed(*bad)
    with pytest.raises(ValueError, match="headroom"):
        workers_needed(900, 300, headroom=-0.5)


def test_a_plan_divides_each_pools_load_by_its_measured_capacity():
    capacities = measure_pools(SWEEP, SLO_300_20)  # prefill 100, decode 40 tok/s per worker
    load = Load.at_rate(5, prompt_tokens=100, output_tokens=10)  # 500 and 50 tok/s
    plan = make_plan(load, capacities, SLO_300_20)
    assert (plan.workers(Pool.PREFILL), plan.workers(Pool.DECODE)) == (5, 2)
    assert plan.ratio == "prefill:5,decode:2"
    doc = plan_json(plan)
    assert doc["pools"]["prefill"]["utilization"] == 1.0
    assert doc["pools"]["decode"]["utilization"] == 50 / 80
    assert doc["pools"]["decode"]["lower_bound"] is True
    assert doc["pools"]["prefill"]["measured_at_rps"] == 2
    assert "500.0 tok/s offered" in doc["pools"]["prefill"]["reason"]


# -- scaling decisions ----------------------------------------------------------------------

POLICY = ScalingPolicy(Bounds(1, 6), hysteresis=0.2, cooldown_s=300)


def test_a_pool_scales_up_at_once_even_inside_its_cool_down():
    decision = decide(Pool.DECODE, POLICY, 2, 401, 100, now=10, last_change_at=5)
    assert (decision.target, decision.changed) == (5, True)


def test_a_pool_scales_up_no_further_than_its_max():
    decision = decide(Pool.DECODE, POLICY, 2, 5000, 100, now=0, last_change_at=None)
    assert decision.target == 6 and "capped at max 6" in decision.reason


def test_a_load_within_the_hysteresis_keeps_the_pool_as_it_is():
    # 290 tok/s needs 3, but 290 x 1.2 = 348 still needs 4: stay at 4
    decision = decide(Pool.DECODE, POLICY, 4, 290, 100, now=1000, last_change_at=None)
    assert decision.target == 4 and "hysteresis" in decision.reason


def test_a_pool_scales_down_only_after_its_cool_down():
    # 240 tok/s: 240 x 1.2 = 288 fits in 3 of 4
    held = decide(Pool.DECODE, POLICY, 4, 240, 100, now=299, last_change_at=0)
    assert held.target == 4 and "cool-down, 1 s left" in held.reason
    down = decide(Pool.DECODE, POLICY, 4, 240, 100, now=300, last_change_at=0)
    assert down.target == 3


def test_a_pool_outside_its_bounds_is_brought_back_at_once():
    assert decide(Pool.PREFILL, POLICY, 9, 0, 100, now=0, last_change_at=0).target == 6
    assert decide(Pool.PREFILL, POLICY, 0, 0, 100, now=0, last_change_at=0).target == 1


def test_bounds_refuse_a_pool_of_zero_or_a_min_over_its_max():
    for low, high in ((0, 2), (3, 2)):
        with pytest.raises(ValueError, match="min"):
            Bounds(low, high)


def test_the_planner_config_names_the_field_it_refuses():
    with pytest.raises(ValueError, match="exactly one of prometheus_url and rate"):
        PlannerConfig(record="r.json")
    with pytest.raises(ValueError, match="min_decode/max_decode"):
        PlannerConfig(record="r.json", rate=1, min_decode=5, max_decode=2)
    assert parse_shapes(["10.0.0.5:50051=1:2"]) == {"10.0.0.5:50051": ClusterShape(1, 2)}
    with pytest.raises(ValueError, match="NAME=PREFILL:DECODE"):
        parse_shapes(["prefill:1,decode:2"])


# -- records --------------------------------------------------------------------------------


def test_a_record_that_does_not_parse_is_refused_naming_the_field():
    base = {"slo": {"ttft_ms": 300, "tpot_ms": 20}, "duration_s": 10}
    with pytest.raises(RecordError, match="no field 'configs'"):
        parse_record(base, "r.json", {})
    bad_request = {"rate": 1, "requests": [{"kind": "k"}]}
    configs = [{"name": "prefill:1,decode:1", "runs": [bad_request]}]
    with pytest.raises(RecordError, match=r"runs\[rate=1\]\.requests\[0\]"):
        parse_record({**base, "configs": configs}, "r.json", {})
    with pytest.raises(RecordError, match="colocated:2: not a prefill:P,decode:D shape"):
        parse_record({**base, "configs": [{"name": "colocated:2", "runs": []}]}, "r.json", {})


def test_a_rate_run_several_times_offered_its_load_over_every_runs_window():
    request = {"index": 0, "kind": "k", "warmup": False, "prompt_tokens": 8, "max_tokens": 4}
    run = {"rate": 2, "requests": [{**request, "sent_at": 0.0, "repeat": k} for k in (0, 1)]}
    record = {
        "slo": {"ttft_ms": 300, "tpot_ms": 20},
        "duration_s": 10,
        "repeats": 3,
        "configs": [{"name": "prefill:1,decode:1", "runs": [run]}],
    }
    [recorded] = parse_record(record, "r.json", {}).runs
    assert recorded.duration_s == 30 and len(recorded.results) == 2
    assert parse_record({**record, "repeats": 1}, "r.json", {}).runs[0].duration_s == 10


def test_pdserve_plan_refuses_a_record_it_cannot_read_in_one_line(tmp_path):
    missing = tmp_path / "missing.json"
    done = subprocess.run(
        [sys.executable, "-m", "pdserve", "plan", str(missing), "--rate", "1"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("pdserve plan: ") and str(missing) in done.stderr
    assert "Traceback" not in done.stderr


# -- a real record --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bench_record(demo_model_dir, tmp_path_factory):
    """A small real sweep of a local prefill:1,decode:1 cluster, written by `pdserve bench`."""
    out = tmp_path_factory.mktemp("bench")
    command = [sys.executable, "-m", "pdserve", "bench", "--compare", "prefill:1,decode:1"]
    command += ["--model", str(demo_model_dir), "--prompt-len", "uniform:16:64"]
    command += ["--output-len", "fixed:8", "--rates", "8,16", "--duration", "1"]
    command += ["--warmup", "1", "--drain", "20", "--out", str(out)]
    command += ["--ttft-slo-ms", "1000", "--tpot-slo-ms", "200"]
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # its own Redis
    subprocess.run(command, check=True, capture_output=True, timeout=150, env=env)
    return out / "custom.json"


def _raw_load(data: dict, rate: float, key: str, workers: int) -> float:
    """A pool's tokens per second per worker at `rate`, straight from the raw JSON."""
    [config] = data["configs"]
    [run] = [r for r in config["runs"] if r["rate"] == rate]
    measured = [r for r in run["requests"] if not r["warmup"]]
    return sum(r[key] for r in measured) / data["duration_s"] / workers


@pytest.mark.timeout(180)
def test_pdserve_plan_sizes_the_pools_from_a_real_bench_record(bench_record):
    data = json.loads(bench_record.read_text())
    rate = 40.0
    plan = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve",
            "plan",
            str(bench_record),
            "--rate",
            f"{rate:g}",
            "--json",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    doc = json.loads(plan.stdout)
    measured = [r for c in data["configs"] for run in c["runs"] for r in run["requests"]]
    measured = [r for r in measured if not r["warmup"]]
    mean_prompt = sum(r["prompt_tokens"] for r in measured) / len(measured)
    assert doc["load"]["prompt_tokens_per_s"] == pytest.approx(rate * mean_prompt)
    assert doc["load"]["output_tokens_per_s"] == pytest.approx(rate * 8)
    for pool, key in (("prefill", "prompt_tokens"), ("decode", "max_tokens")):
        p = doc["pools"][pool]
        capacity = _raw_load(data, p["measured_at_rps"], key, workers=1)
        assert p["capacity_tokens_per_s_per_worker"] == pytest.approx(capacity)
        offered = doc["load"][f"{'prompt' if pool == 'prefill' else 'output'}_tokens_per_s"]
        assert p["workers"] == max(1, math.ceil(offered / capacity - 1e-9))
    assert doc["shape"] == f"prefill:{doc['pools']['prefill']['workers']},decode:" + str(
        doc["pools"]["decode"]["workers"]
    )
    table = subprocess.run(
        [sys.executable, "-m", "pdserve", "plan", str(bench_record), "--rate", "40"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert table.splitlines()[0].split()[:2] == ["POOL", "WORKERS"]
    assert f"Shape: {doc['shape']}." in table


# -- the live load --------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_the_live_load_is_the_routers_token_rates_from_prometheus(tmp_path):
    """A real Prometheus scrapes a real metrics endpoint whose router counters grow at 1000
    prompt and 100 output tokens a second (a worker's series beside them must not count)."""
    from prometheus_client import CollectorRegistry, Counter
    from test_prometheus import Prometheus
    from test_prometheus import _binary as prometheus_tool

    from pdserve.telemetry.endpoint import MetricsServer

    registry = CollectorRegistry()
    prompt = Counter("pdserve:prompt_tokens", "prompt", ("role",), registry=registry)
    output = Counter("pdserve:generation_tokens", "output", ("role",), registry=registry)
    server = MetricsServer(registry, "127.0.0.1", 0)  # pdserve's own: names as written
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    stop = threading.Event()

    def grow():
        """Each counter at its rate times the time since the start, however late a wake-up."""
        start, done = time.monotonic(), 0
        while not stop.wait(0.05):
            due = int(100 * (time.monotonic() - start)) - done  # hundredths of a second
            prompt.labels("router").inc(10 * due)
            output.labels("router").inc(due)
            prompt.labels("prefill").inc(50 * due)  # a worker's own count: not the offered load
            done += due

    grower = threading.Thread(target=grow, daemon=True)
    grower.start()
    prometheus = Prometheus(prometheus_tool("prometheus"), [f"127.0.0.1:{port}"], tmp_path)
    try:
        prometheus.wait_ready()
        live = PrometheusLoad(prometheus.url, window_s=5)
        series = 'pdserve:prompt_tokens_total{role="router"}'
        last_scrape = f"timestamp({series})"
        deadline = time.monotonic() + 30
        while prometheus.value(f"count_over_time({series}[5s])") in (None, 1, 2, 3):
            assert time.monotonic() < deadline, "Prometheus scraped too few samples"
            time.sleep(0.25)
        # ask right after a scrape, so that the window ends at its newest sample (a rate
        # extrapolates only half a scrape interval past it)
        seen = prometheus.value(last_scrape)
        while prometheus.value(last_scrape) == seen:
            assert time.monotonic() < deadline, "Prometheus stopped scraping"
            time.sleep(0.02)
        load = live.load()
        assert load.prompt_tokens_per_s == pytest.approx(1000, rel=0.25)
        assert load.output_tokens_per_s == pytest.approx(100, rel=0.25)
        assert live.query('sum(rate(pdserve:no_such_total{role="router"}[5s]))') == 0.0
    finally:
        stop.set()
        prometheus.stop()
        server.shutdown()
        server.server_close()
    with pytest.raises(LiveLoadError, match="127.0.0.1"):
        PrometheusLoad(prometheus.url, timeout_s=1).load()  # stopped: unreachable
