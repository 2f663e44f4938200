"""`pdserve bench`: workload plans, statistics and goodput on crafted data, and a tiny sweep
against a real local cluster whose result files must add up. Also what the component
benchmarks in bench/ share (paired runs, the machine's CPU accounting), and that every
one of those scripts starts."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from procs import alive, descendants_of

from pdserve.bench.component import alternate
from pdserve.bench.cores import split_table
from pdserve.bench.loadgen import RequestResult
from pdserve.bench.machine import OWN, REST, CpuSample, CpuWindow, cpu_seconds
from pdserve.bench.markdown import markdown
from pdserve.bench.metrics import SLO, goodput, percentile, slo_attainment, summarize
from pdserve.bench.plots import plot_cdfs, plot_latency_vs_rate
from pdserve.bench.report import BenchResult, ConfigRun, RateRun, slo_grid_cells, to_json
from pdserve.bench.sweep import rotation
from pdserve.bench.workload import (
    FIRST_PROMPT_ID,
    MIXED,
    PROMPT_ID_LIMIT,
    Fixed,
    LogNormal,
    Poisson,
    Uniform,
    custom_workload,
    parse_length,
    plan,
)
from pdserve.cluster.local import ClusterShape
from pdserve.commands.bench import add_parser, log_dir_name, target_names

pytestmark = pytest.mark.cluster

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REPO = Path(__file__).resolve().parents[1]
BENCH_SCRIPTS = sorted(p.name for p in (REPO / "bench").glob("*.py"))


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdserve")
    add_parser(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


def finished(
    index: int,
    ttft: float,
    gap: float,
    tokens: int,
    sent_at: float = 0.0,
    warmup: bool = False,
    kind: str = "k",
    repeat: int = 0,
) -> RequestResult:
    """A finished request: first token at `ttft` s, then one token every `gap` s."""
    times = [ttft + gap * i for i in range(tokens)]
    return RequestResult(index, kind, warmup, 8, tokens, sent_at, times, repeat=repeat)


# -- workload ------------------------------------------------------------------------------


def test_length_specs_parse_and_print_back():
    for text in ("fixed:7", "uniform:16:64", "lognormal:100:1:4:2048"):
        assert str(parse_length(text)) == text
    assert parse_length("uniform:2:5") == Uniform(2, 5)
    for bad in ("fixed", "fixed:0", "uniform:9:3", "normal:1:2", "uniform:a:3", "fixed:1:2"):
        with pytest.raises(ValueError):
            parse_length(bad)


def test_lognormal_lengths_stay_within_their_clip_and_have_a_long_tail():
    dist, rng = LogNormal(100, 1.0, 4, 2048), random.Random(0)
    lengths = [dist.sample(rng) for _ in range(5000)]
    assert min(lengths) >= 4 and max(lengths) <= 2048
    assert 80 <= percentile(lengths, 50) <= 120
    assert percentile(lengths, 99) > 5 * percentile(lengths, 50)


def test_a_plan_is_a_function_of_its_seed():
    a = plan(MIXED, rate=2.0, duration_s=30, num_warmup=3, seed=7)
    assert a == plan(MIXED, rate=2.0, duration_s=30, num_warmup=3, seed=7)
    assert a != plan(MIXED, rate=2.0, duration_s=30, num_warmup=3, seed=8)


def test_each_repeated_run_of_a_rate_draws_arrivals_and_prompts_of_its_own():
    """`--repeats`: a run again of the same prompts would hit the prefix cache, and of the
    same arrivals would sample the workload no more widely. Run 0 is the unrepeated plan."""
    once = plan(MIXED, rate=2.0, duration_s=30, num_warmup=3, seed=7)
    assert plan(MIXED, rate=2.0, duration_s=30, num_warmup=3, seed=7, repeat=0) == once
    again = plan(MIXED, rate=2.0, duration_s=30, num_warmup=3, seed=7, repeat=1)
    assert {p.repeat for p in once} == {0} and {p.repeat for p in again} == {1}
    assert [p.send_at for p in again[:10]] != [p.send_at for p in once[:10]]
    first_blocks = {tuple(p.prompt_token_ids[:16]) for p in once}
    assert not any(tuple(p.prompt_token_ids[:16]) in first_blocks for p in again)
    assert again == plan(MIXED, rate=2.0, duration_s=30, num_warmup=3, seed=7, repeat=1)


def test_rates_of_a_sweep_share_kinds_lengths_and_arrival_pattern_but_not_prompts():
    slow = plan(MIXED, rate=1.0, duration_s=20, num_warmup=2, seed=0)
    fast = plan(MIXED, rate=4.0, duration_s=20, num_warmup=2, seed=0)
    assert len(fast) > len(slow)
    for s, f in zip(slow, fast, strict=False):
        assert (s.kind, len(s.prompt_token_ids), s.max_tokens) == (
            f.kind,
            len(f.prompt_token_ids),
            f.max_tokens,
        )
        assert f.send_at == pytest.approx(s.send_at / 4)
    # fresh prompt ids at each rate: no run's prefills hit a prefix cache the last one filled
    first_blocks = {tuple(p.prompt_token_ids[:16]) for p in slow}
    assert not any(tuple(p.prompt_token_ids[:16]) in first_blocks for p in fast)


def test_warm_up_requests_come_first_then_duration_seconds_of_arrivals():
    planned = plan(MIXED, rate=5.0, duration_s=10, num_warmup=4, seed=1)
    assert [p.warmup for p in planned[:4]] == [True] * 4
    assert not any(p.warmup for p in planned[4:])
    window_start = planned[4].send_at
    assert all(p.send_at - window_start < 10 for p in planned[4:])
    assert [p.send_at for p in planned] == sorted(p.send_at for p in planned)
    assert [p.index for p in planned] == list(range(len(planned)))
    # Poisson at 5/s for 10 s: about 50 arrivals (mean 50, sd ~7)
    assert 30 <= len(planned) - 4 <= 70


def test_the_mixed_workload_sends_its_kinds_in_their_shares_and_lengths():
    planned = plan(MIXED, rate=10.0, duration_s=100, num_warmup=0, seed=0)
    kinds = {k.name: k for k in MIXED.kinds}
    for p in planned:
        kind = kinds[p.kind]
        assert kind.prompt_len.low <= len(p.prompt_token_ids) <= kind.prompt_len.high
        assert p.max_tokens == kind.output_len.n
        assert all(FIRST_PROMPT_ID <= t < PROMPT_ID_LIMIT for t in p.prompt_token_ids)
    long_share = sum(p.kind == "long-prompt" for p in planned) / len(planned)
    assert long_share == pytest.approx(kinds["long-prompt"].share, abs=0.05)
    assert isinstance(kinds["decode-heavy"].output_len, Fixed)


# -- metrics -------------------------------------------------------------------------------


def test_percentile_interpolates_between_ranks_as_numpy_does():
    values = [random.Random(3).uniform(0, 100) for _ in range(37)] + [5.0, 5.0]
    for q in (0, 1, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert percentile([4.0], 99) == 4.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_tpot_is_the_mean_gap_after_the_first_token_and_itls_are_every_gap():
    result = RequestResult(0, "k", False, 8, 4, 0.0, [0.5, 0.6, 0.9, 1.1])
    assert result.ttft == 0.5 and result.e2e == 1.1
    assert result.tpot == pytest.approx(0.2)
    assert result.itls == pytest.approx([0.1, 0.3, 0.2])
    assert RequestResult(0, "k", False, 8, 1, 0.0, [0.5]).tpot is None


def test_a_summary_counts_leave_out_warm_ups_and_failed_requests_miss_the_slo():
    slo = SLO(ttft_ms=1000, tpot_ms=100)
    results = [
        finished(0, ttft=5.0, gap=1.0, tokens=4, warmup=True),  # way off, but a warm-up
        finished(1, ttft=0.2, gap=0.05, tokens=4, sent_at=1.0),  # meets both
        finished(2, ttft=2.0, gap=0.05, tokens=4, sent_at=2.0),  # TTFT misses
        finished(3, ttft=0.2, gap=0.5, tokens=4, sent_at=3.0),  # TPOT misses
        RequestResult(4, "k", False, 8, 4, 4.0, [0.1], error="cut off"),
    ]
    s = summarize(Poisson(2.0), results, slo)
    assert (s.num_requests, s.num_completed, s.num_failed, s.num_warmup) == (4, 3, 1, 1)
    assert s.num_output_tokens == 12
    assert s.slo_attainment == pytest.approx(0.25)
    assert s.window_s == pytest.approx(3.0 + 0.2 + 1.5 - 1.0)  # last token of request 3
    assert s.output_throughput == pytest.approx(12 / s.window_s)
    assert s.ttft.count == 3 and s.ttft.p50 == pytest.approx(200.0)
    assert s.itl.count == 9


def test_a_summary_of_a_repeated_rate_pools_its_runs_over_the_sum_of_their_windows():
    """Each run's `sent_at` counts from its own start: the runs' windows add up, they do
    not overlap."""
    results = [finished(i, ttft=0.1, gap=0.1, tokens=10, sent_at=i * 0.5) for i in range(3)]
    again = [finished(i, 0.3, gap=0.1, tokens=10, sent_at=i * 0.5, repeat=1) for i in range(3)]
    s = summarize(Poisson(1.0), results + again, SLO(ttft_ms=1000, tpot_ms=100))
    assert s.window_s == pytest.approx((1.0 + 1.0) + (1.0 + 1.2))
    assert s.request_throughput == pytest.approx(6 / s.window_s)
    assert (s.num_requests, s.ttft.count) == (6, 6)


def test_goodput_is_the_highest_rate_up_to_which_every_rate_meets_the_goal():
    assert goodput({1: 1.0, 2: 0.9, 4: 0.8}) == 2  # exactly 90% counts
    assert goodput({4: 1.0, 1: 1.0, 2: 1.0}) == 4  # the order of the sweep is irrelevant
    assert goodput({1: 1.0, 2: 0.5, 4: 1.0}) == 1  # a lucky rate after a miss: no
    assert goodput({1: 0.8, 2: 1.0}) == 0
    assert goodput({}) == 0


def test_slo_attainment_judges_each_measured_request_against_both_slos():
    results = [finished(i, ttft=0.1 if i < 9 else 3.0, gap=0.01, tokens=3) for i in range(10)]
    results.append(finished(10, ttft=9.0, gap=9.0, tokens=3, warmup=True))
    assert slo_attainment(results, SLO(ttft_ms=1000, tpot_ms=100)) == pytest.approx(0.9)
    assert slo_attainment(results, SLO(ttft_ms=5000, tpot_ms=100)) == 1.0
    assert slo_attainment(results, SLO(ttft_ms=5000, tpot_ms=5)) == 0.0
    assert slo_attainment([], SLO(ttft_ms=1, tpot_ms=1)) == 0.0


# -- SLOs relative to the solo calibration, the grid ----------------------------------------

RELATIVE = SLO(200, 50, ttft_scale=3).calibrated(
    {"short": {"ttft_ms": 40.0, "tpot_ms": 14.0}, "long": {"ttft_ms": 900.0, "tpot_ms": 15.0}}
)


def test_a_relative_ttft_slo_is_scale_times_each_kinds_median_alone_but_never_below_the_floor():
    assert RELATIVE.ttft_ms_for("short") == 200  # 3 x 40 = 120: the floor
    assert RELATIVE.ttft_ms_for("long") == 2700
    assert RELATIVE.ttft_ms_for("uncalibrated") == 200
    assert SLO(8000, 50).calibrated({"long": {"ttft_ms": 900.0}}).ttft_ms_for("long") == 8000
    assert RELATIVE.ttft_text() == "TTFT <= 3x alone (>= 200 ms)"
    with pytest.raises(ValueError, match="scale"):
        SLO(200, 50, ttft_scale=0)


def test_each_request_is_judged_against_its_own_kinds_ttft_slo():
    short_at_1s = finished(0, ttft=1.0, gap=0.01, tokens=4, kind="short")
    long_at_1s = finished(1, ttft=1.0, gap=0.01, tokens=4, kind="long")
    assert not RELATIVE.met_by(short_at_1s)
    assert RELATIVE.met_by(long_at_1s)
    assert slo_attainment([short_at_1s, long_at_1s], RELATIVE) == 0.5


def test_the_grid_halves_and_doubles_both_slos_and_marks_the_pair_asked_for():
    cells = slo_grid_cells(RELATIVE)
    assert [[requested for _, requested in row] for row in cells] == [
        [False, False, False],
        [False, True, False],
        [False, False, False],
    ]
    tighter = cells[0][0][0]
    assert (tighter.ttft_scale, tighter.ttft_ms, tighter.tpot_ms) == (1.5, 100, 25)
    assert tighter.ttft_ms_for("long") == 1350


def two_kind_result(tmp_path) -> BenchResult:
    """A crafted two-rate run of the mixed workload's kinds, one configuration."""
    solo = {
        "decode-heavy": {"ttft_ms": 40.0, "tpot_ms": 14.0},
        "long-prompt": {"ttft_ms": 900.0, "tpot_ms": 15.0},
    }
    slo = SLO(200, 50, ttft_scale=3).calibrated(solo)
    runs = []
    for rate, ttft in ((1.0, 0.1), (2.0, 3.0)):
        results = [
            finished(0, ttft=ttft, gap=0.02, tokens=8, kind="decode-heavy"),
            finished(1, ttft=ttft * 10, gap=0.02, tokens=8, kind="long-prompt"),
        ]
        runs.append(RateRun(Poisson(rate), summarize(Poisson(rate), results, slo), results))
    config = ConfigRun("disaggregated", "127.0.0.1:1", solo=solo, runs=runs)
    return BenchResult(MIXED, [1.0, 2.0], 10, 10, 0, 0, slo, "cmd", "m", {}, [config])


def test_the_record_keeps_its_shape_and_adds_each_kinds_slo_and_the_grid(tmp_path):
    data = to_json(two_kind_result(tmp_path))
    [config] = data["configs"]
    request = config["runs"][0]["requests"][0]
    assert {"kind", "warmup", "token_times"} <= request.keys()
    assert data["slo"]["ttft_scale"] == 3
    assert data["slo"]["ttft_ms_by_kind"] == {"decode-heavy": 200, "long-prompt": 2700}
    asked = [cell for cell in data["slo_grid"] if cell["requested"]]
    assert len(data["slo_grid"]) == 9 and len(asked) == 1
    # at 1 req/s both kinds are within (100 ms <= 200, 1 s <= 2.7 s); at 2 req/s neither
    assert asked[0]["goodput_rps"] == {"disaggregated": 1.0}
    assert config["goodput_rps"] == 1.0
    text = markdown(two_kind_result(tmp_path), [])
    assert "| TTFT <= 3x alone (>= 200 ms) |" in text and "**1**" in text
    assert "decode-heavy 200 ms, long-prompt 2700 ms" in text


def test_the_report_of_repeated_runs_gives_each_runs_ratios_beside_the_pooled_ones():
    slo = SLO(ttft_ms=1000, tpot_ms=100)

    def config(name: str, ttfts: tuple[float, float]) -> ConfigRun:
        results = [
            finished(i, ttft=ttft, gap=0.01, tokens=4, sent_at=i * 0.2, repeat=repeat)
            for repeat, ttft in enumerate(ttfts)
            for i in range(5)
        ]
        run = RateRun(Poisson(1.0), summarize(Poisson(1.0), results, slo), results)
        return ConfigRun(name, "127.0.0.1:1", runs=[run])

    # the second cluster is 1.5x slower in run 1 and 0.5x as slow in run 2
    configs = [config("a", (0.2, 0.4)), config("b", (0.3, 0.2))]
    result = BenchResult(MIXED, [1.0], 1, 10, 0, 0, slo, "cmd", "m", {}, configs, repeats=2)
    text = markdown(result, [])
    assert "run 2 times with arrivals and prompts of their own and pooled" in text
    assert "| 1 | TTFT p90 | 400 | 300 | 0.75x |" in text  # pooled: each over both runs
    by_run = text[text.index("## Run by run") :]
    assert "| 1 | 1 | TTFT p90 | 200 | 300 | 1.50x |" in by_run
    assert "| 1 | 2 | TTFT p90 | 400 | 200 | 0.50x |" in by_run
    assert to_json(result)["repeats"] == 2
    assert "## Run by run" not in markdown(dataclasses.replace(result, repeats=1), [])


def test_the_clusters_take_turns_starting_so_each_run_is_first_as_often():
    assert [rotation(turn, 2) for turn in range(4)] == [[0, 1], [1, 0], [0, 1], [1, 0]]
    assert [rotation(turn, 3) for turn in range(3)] == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]


def test_the_plots_draw_each_request_kind(tmp_path):
    result = two_kind_result(tmp_path)
    for plot in (plot_cdfs, plot_latency_vs_rate):
        data = plot(result, tmp_path / f"{plot.__name__}.png").read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) < 200_000


def test_ttft_slo_scale_makes_a_relative_slo_whose_floor_is_ttft_slo_ms():
    from pdserve.commands.bench import BenchConfig

    router = ["--router", "127.0.0.1:1"]
    relative = BenchConfig.from_args(bench_args(*router, "--ttft-slo-scale", "3")).slo
    assert (relative.ttft_scale, relative.ttft_ms) == (3, 200)
    floor = BenchConfig.from_args(
        bench_args(*router, "--ttft-slo-scale", "3", "--ttft-slo-ms", "500")
    ).slo
    assert floor.ttft_ms == 500
    absolute = BenchConfig.from_args(bench_args(*router)).slo
    assert (absolute.ttft_scale, absolute.ttft_ms) == (None, 2000)


def test_send_ttft_slo_gives_each_request_its_kinds_bound_in_whole_ms():
    from pdserve.commands.bench import BenchConfig

    router = ["--router", "127.0.0.1:1"]
    kept = BenchConfig.from_args(bench_args(*router, "--ttft-slo-scale", "3")).slo
    assert not kept.sent and kept.ttft_ms_sent("long") == 0  # the servers are not told
    sent = BenchConfig.from_args(bench_args(*router, "--ttft-slo-scale", "3", "--send-ttft-slo"))
    slo = sent.slo.calibrated({"long": {"ttft_ms": 633.4}, "short": {"ttft_ms": 20.0}})
    assert (slo.ttft_ms_sent("long"), slo.ttft_ms_sent("short")) == (1900, 200)


def test_a_shape_listed_again_is_measured_under_a_name_and_a_log_folder_of_its_own():
    """An A/A run (`--compare colocated:2 colocated:2`) measures two identical clusters:
    the spread a ratio between shapes sits in on the machine."""
    listed = ["colocated:2", "prefill:1,decode:1", "colocated:2", "colocated:2"]
    names = target_names([ClusterShape.parse(text) for text in listed])
    assert names == ["colocated:2", "prefill:1,decode:1", "colocated:2 #2", "colocated:2 #3"]
    folders = [log_dir_name(name) for name in names]
    assert folders == ["colocated2", "prefill1-decode1", "colocated2-2", "colocated2-3"]


def test_bad_flags_fail_before_anything_starts(capsys):
    router = ["--router", "127.0.0.1:1"]  # never called: the flags fail first
    for argv in (
        [*router, "--rates", "1,x"],
        [*router, "--rates", "0,1"],
        [*router, "--prompt-len", "fixed:4"],
        [*router, "--rates", "1,2", "--timeline-rate", "3"],
        [*router, "--ttft-slo-scale", "0"],
        [*router, "--repeats", "0"],
        ["--compare", "prefill:1"],
        [*router, "--rates", "1", "--concurrency", "2"],  # one load or the other
        [*router, "--concurrency", "0"],
        [*router, "--num-requests", "5"],  # a rate runs --duration
        [*router, "--concurrency", "2", "--num-requests", "5", "--duration", "3"],
        [*router, "--extra-body", "{}"],  # an OpenAI target's
        ["--target", "vllm:http://127.0.0.1:1/v1"],
        ["--target", "openai:http://127.0.0.1:1/v1", "--extra-body", "[1]"],
        ["--target", "openai:http://127.0.0.1:1/v1", "--extra-body", '{"ignore_eos": false}'],
        ["--target", "openai:http://127.0.0.1:1/v1", "--send-ttft-slo"],  # no such field
        ["--target", "openai:http://127.0.0.1:1/v1", "--tls-ca", __file__],
    ):
        args = bench_args(*argv)
        assert args.run(args) == 1, argv
    err = capsys.readouterr().err
    assert "timeline-rate" in err and "--send-ttft-slo needs a pdserve target" in err


def test_without_matplotlib_bench_says_what_to_install_before_it_starts(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    args = bench_args("--router", "127.0.0.1:1")  # never called: the check comes first
    assert args.run(args) == 1
    assert "pip install 'pdserve[bench]'" in capsys.readouterr().err


def test_pdserve_and_its_bench_command_load_without_matplotlib():
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "import pdserve.cli, pdserve.commands.bench, pdserve.bench.plots"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- what the component benchmarks share -------------------------------------------------


def test_paired_runs_warm_up_untimed_then_rotate_so_each_round_starts_elsewhere():
    calls: list[str] = []

    def side(name: str):
        return lambda: calls.append(name) or f"{name}{len(calls)}"

    a_runs, b_runs = alternate(3, 2, side("a"), side("b"))
    assert calls == ["a", "b", "a", "b"] + ["a", "b", "b", "a", "a", "b"]
    assert (a_runs, b_runs) == (["a5", "a8", "a9"], ["b6", "b7", "b10"])
    calls.clear()
    runs = alternate(3, 0, side("a"), side("b"), side("c"))
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert [len(r) for r in runs] == [3, 3, 3]


def test_a_cpu_window_counts_the_named_process_apart_from_the_rest_of_the_machine():
    with CpuWindow({"test": os.getpid()}) as window:
        end = time.process_time() + 0.3
        while time.process_time() < end:  # busy: CPU time of this process
            pass
    assert window.cpu_s["test"] >= 0.2  # clock ticks: 10 ms granularity
    assert window.wall_s >= 0.3
    assert window.others_s is not None and window.others_s >= 0
    assert "other processes used" in window.others_line(noisy_share=1.0)


def test_a_cpu_sample_splits_a_window_into_groups_this_process_and_the_rest():
    spin = "import time\nend = time.process_time() + 0.4\nwhile time.process_time() < end: pass"
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()\n" + spin], stdin=subprocess.PIPE
    )
    try:
        pids = {"spinner": (child.pid,), OWN: (os.getpid(),)}
        before = CpuSample.take(pids)
        child.stdin.close()  # now it spins 0.4 s, then exits: sample while it is alive
        end = time.process_time() + 0.2
        while time.process_time() < end:  # this process busy too, meanwhile
            pass
        time.sleep(0.4)
        after = CpuSample.take(pids)
    finally:
        child.wait(10)
    used = after.seconds_since(before)
    assert set(used) == {"spinner", OWN, REST}
    assert used["spinner"] >= 0.2 and used[OWN] >= 0.15  # clock ticks: 10 ms granularity
    assert used[REST] >= 0
    assert after.at - before.at >= 0.6


def test_the_cpu_split_gives_each_role_and_what_stayed_idle_of_the_machine():
    def run(rate: float, cores: dict[str, float]) -> RateRun:
        return RateRun(Poisson(rate), summarize(Poisson(rate), [], SLO(1000, 100)), [], cores)

    roles = {"router": 0.05, "prefill": 0.44, "decode": 0.96}
    runs = [run(1, {**roles, OWN: 0.1, REST: 0.05}), run(2, {**roles, OWN: 0.2})]
    header, rows = split_table(runs, cpus=2)
    assert header == ["req/s", "router", "prefill", "decode", OWN, REST, "idle (of 2)"]
    assert rows == [
        ["1", "0.05", "0.44", "0.96", "0.10", "0.05", "0.40"],
        ["2", "0.05", "0.44", "0.96", "0.20", "-", "-"],  # no /proc/stat: idle unknown
    ]
    assert runs[0].cluster_cores == pytest.approx(1.45)
    given = run(1, {OWN: 0.1, REST: 1.2})  # a router given by address: no role measured
    assert given.cluster_cores is None
    assert split_table([given], cpus=2)[1] == [["1", "0.10", "1.20", "0.70"]]
    assert split_table([run(1, {})], cpus=2)[1] == []


def test_cpu_seconds_of_a_process_that_exited_is_an_error_not_zero():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert cpu_seconds([os.getpid()]) > 0
    with pytest.raises(ProcessLookupError):
        cpu_seconds([os.getpid(), proc.pid])


@pytest.mark.parametrize("script", BENCH_SCRIPTS)
def test_every_component_benchmark_starts_from_any_directory(script, tmp_path):
    """`--help` imports everything the script needs, from the installed package alone."""
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout


# -- a real sweep --------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_tiny_sweep_writes_results_that_add_up(demo_model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)  # the cluster's own private Redis
    out = tmp_path / "out"
    args = bench_args(
        "--compare",
        "colocated:1",
        "--model",
        str(demo_model_dir),
        "--prompt-len",
        "uniform:4:24",
        "--output-len",
        "fixed:6",
        "--rates",
        "4,8",
        "--duration",
        "1.5",
        "--repeats",
        "2",
        "--warmup",
        "2",
        "--drain",
        "20",
        "--ttft-slo-ms",
        "500",
        "--tpot-slo-ms",
        "100",
        "--send-ttft-slo",
        "--out",
        str(out),
    )
    assert args.run(args) == 0

    data = json.loads((out / "custom.json").read_text())
    [config] = data["configs"]
    assert config["name"] == "colocated:1"
    assert config["goodput_rps"] in (0, 4, 8)
    assert [run["rate"] for run in config["runs"]] == [4, 8]
    for run in config["runs"]:
        s, requests = run["summary"], run["requests"]
        cores = run["cores"]
        assert set(cores) == {"router", "colocated", OWN, REST}
        assert min(cores["router"], cores["colocated"], cores[OWN]) > 0
        assert run["cluster_cores"] == pytest.approx(cores["router"] + cores["colocated"])
        workload = custom_workload("uniform:4:24", "fixed:6")
        planned = [p for k in (0, 1) for p in plan(workload, run["rate"], 1.5, 2, 0, repeat=k)]
        assert [r["prompt_tokens"] for r in requests] == [len(p.prompt_token_ids) for p in planned]
        assert [r["repeat"] for r in requests] == [p.repeat for p in planned]
        assert s["num_requests"] + s["num_warmup"] == len(requests)
        assert s["num_completed"] + s["num_failed"] + s["num_short"] == s["num_requests"]
        assert s["num_failed"] == s["num_short"] == 0
        assert (run["vllm"]["backend"], run["vllm"]["completed"]) == ("pdserve", s["num_completed"])
        done = [r for r in requests if not r["warmup"]]
        assert all(len(r["token_times"]) == r["max_tokens"] == 6 for r in requests)
        assert s["num_output_tokens"] == sum(len(r["token_times"]) for r in done)
        assert all(r["timings"]["ttft_ms"] > 0 for r in requests)
        for name in ("ttft", "tpot", "itl", "e2e"):
            stats = s[name]
            assert stats["p50"] <= stats["p90"] <= stats["p99"] <= stats["max"]
        assert 0 <= s["slo_attainment"] <= 1
    assert data["repeats"] == 2
    assert data["slo"]["sent"] is True and data["command"].endswith(" --send-ttft-slo")
    text = (out / "custom.md").read_text()
    assert "colocated:1" in text
    assert "TTFT <= 500 ms (sent with each request)" in text
    assert f"| req/s | colocated | router | {OWN} | {REST} | idle (of {os.cpu_count()}) |" in text
    for figure in ("custom-cdf.png", "custom-vs-rate.png", "custom-timeline.png"):
        data = (out / figure).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) < 200_000


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("shapes", "after"),
    [
        (["colocated:1", "colocated:1"], "router at"),  # while the second cluster starts
        (["colocated:1"], "alone:"),  # while it measures
    ],
    ids=["starting", "measuring"],
)
def test_sigterm_stops_the_clusters_bench_started(demo_model_dir, tmp_path, shapes, after):
    """Their processes run in sessions of their own: nothing but bench itself stops them."""
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # a private Redis too
    command = [sys.executable, "-m", "pdserve", "bench", "--compare", *shapes]
    command += ["--model", str(demo_model_dir), "--rates", "1", "--duration", "600"]
    command += ["--out", str(tmp_path / "out")]
    bench = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    children: list[int] = []
    try:
        for line in bench.stderr:
            if after in line:
                break
        children = descendants_of(bench.pid)
        assert children, "the first cluster's processes are the bench's children"
        bench.terminate()
        assert bench.wait(timeout=90) == 143  # 128 + SIGTERM, after stopping them
        assert not [pid for pid in children if alive(pid)]
    finally:
        if bench.poll() is None:
            bench.kill()
        for pid in children:
            if alive(pid):
                os.kill(pid, 9)
