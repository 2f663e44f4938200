"""`pdserve bench --target openai:URL`: the benchmark driving an OpenAI-compatible server,
here pdserve's own HTTP door (one local cluster for the module), closed loop and open
loop; a server that stops early reported as short; the SSE parser on the door's own bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json

import httpx
import pytest

from pdserve.bench.loadgen import RequestResult, run_closed, run_plan
from pdserve.bench.metrics import SLO, summarize
from pdserve.bench.report import BenchResult, ConfigRun, RateRun, vllm_fields
from pdserve.bench.sse import EventStream
from pdserve.bench.targets import (
    OpenAITarget,
    PdserveTarget,
    RequestFailed,
    TokenCount,
    parse_target,
    read_chunk,
)
from pdserve.bench.workload import Concurrency, closed_plan, custom_workload, plan
from pdserve.cluster.local import ClusterShape, LocalCluster
from pdserve.commands.bench import add_parser

pytestmark = pytest.mark.cluster

MODEL = "demo-openai"
MAX_TOKENS = 8
WORKLOAD = ("--prompt-len", "uniform:4:24", "--output-len", f"fixed:{MAX_TOKENS}")
SLOS = ("--ttft-slo-ms", "2000", "--tpot-slo-ms", "500")
VOCAB = range(1024)  # the tiny demo model's (padded) vocabulary: every token it can sample
STATS = {"ttft": "ttft", "tpot": "tpot", "itl": "itl", "e2e": "e2el"}  # ours: vLLM's


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    with LocalCluster(
        str(demo_model_dir),
        ClusterShape(colocated=1),
        tmp_path_factory.mktemp("bench-openai"),
        http_port=0,
        served_model_name=MODEL,
    ) as local:
        yield local


@pytest.fixture(scope="module")
def door_bytes(cluster) -> list[bytes]:
    """One streamed completion as the door sends it, read as the bench reads it: the body
    the bench sends (`OpenAITarget`), the bytes as they came off the socket."""
    body = {
        "model": MODEL,
        "prompt": [5, 6, 7, 8, 9],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{cluster.openai_url}/completions", json=body) as response:
        assert response.status_code == 200
        return list(response.iter_raw())


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdserve")
    add_parser(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


def run_bench(cluster, out, *argv: str) -> dict:
    args = bench_args("--target", f"openai:{cluster.openai_url}", *WORKLOAD, *SLOS, *argv)
    args.out = str(out)
    assert args.run(args) == 0
    return json.loads((out / "custom.json").read_text())


def assert_every_request_generated_what_was_asked(run: dict) -> None:
    for request in run["requests"]:
        assert request["error"] == "" and not request["short"]
        assert request["finish_reason"] == "length"
        assert request["counted_by"] == TokenCount.USAGE
        assert request["num_output_tokens"] == request["max_tokens"] == MAX_TOKENS
        times = request["token_times"]
        assert 1 <= len(times) <= MAX_TOKENS and times == sorted(times) and times[0] > 0


def assert_the_vllm_fields_are_ours(run: dict, data: dict) -> None:
    """The run's vLLM-named fields (`vllm bench serve --save-result`) against our own."""
    s, vllm = run["summary"], run["vllm"]
    done = [r for r in run["requests"] if not r["warmup"]]
    assert vllm["date"] == data["date"] and len(vllm["date"]) == len("20250101-120000")
    assert (vllm["backend"], vllm["model_id"], vllm["tokenizer_id"]) == ("openai", MODEL, MODEL)
    assert vllm["num_prompts"] == vllm["completed"] == s["num_completed"] == len(done)
    assert vllm["failed"] == 0 and vllm["duration"] == s["window_s"] > 0
    assert vllm["total_input_tokens"] == sum(r["prompt_tokens"] for r in done)
    assert vllm["total_output_tokens"] == s["num_output_tokens"] == MAX_TOKENS * len(done)
    assert vllm["request_throughput"] == pytest.approx(len(done) / s["window_s"])
    assert vllm["output_throughput"] == pytest.approx(MAX_TOKENS * len(done) / s["window_s"])
    total = vllm["total_input_tokens"] + vllm["total_output_tokens"]
    assert vllm["total_token_throughput"] == pytest.approx(total / s["window_s"])
    assert 0 <= vllm["request_goodput"] <= vllm["request_throughput"]
    assert vllm["request_goodput"] == pytest.approx(s["slo_attainment"] * len(done) / s["window_s"])
    for ours, theirs in STATS.items():
        stats = s[ours]
        assert vllm[f"mean_{theirs}_ms"] == stats["mean"] > 0
        assert vllm[f"median_{theirs}_ms"] == stats["p50"]
        assert vllm[f"p99_{theirs}_ms"] == stats["p99"]
        assert vllm[f"std_{theirs}_ms"] == stats["std"] >= 0
    assert s["tpot"]["count"] == len(done)  # every request has more than one token
    assert vllm["mean_ttft_ms"] < vllm["mean_e2el_ms"]


# -- closed loop, open loop ------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_closed_loop_keeps_n_requests_in_flight_each_generating_max_tokens(cluster, tmp_path):
    data = run_bench(
        cluster, tmp_path, "--concurrency", "1,3", "--num-requests", "6", "--warmup", "1"
    )
    assert (data["rates"], data["concurrencies"], data["num_requests"]) == ([], [1, 3], 6)
    [config] = data["configs"]
    assert config["backend"] == "openai" and config["address"] == cluster.openai_url
    for run, n in zip(config["runs"], (1, 3), strict=True):
        assert run["concurrency"] == n and "rate" not in run  # no rate to take it for
        assert_every_request_generated_what_was_asked(run)
        s, requests = run["summary"], run["requests"]
        assert (s["concurrency"], s["rate"]) == (n, None)
        assert (s["num_requests"], s["num_warmup"], len(requests)) == (6, 1, 7)
        assert (s["num_completed"], s["num_failed"], s["num_short"]) == (6, 0, 0)
        spans = [(r["sent_at"], r["sent_at"] + r["token_times"][-1]) for r in requests]
        assert max(sum(a <= t < b for a, b in spans) for t, _ in spans) == n
        assert_the_vllm_fields_are_ours(run, data)
        assert (run["vllm"]["request_rate"], run["vllm"]["max_concurrency"]) == ("inf", n)
    text = (tmp_path / "custom.md").read_text()
    assert "a closed loop" in text and "| in flight | sent (+warm-up) |" in text
    assert f"OpenAI-compatible server {cluster.openai_url}." in text


@pytest.mark.timeout(120)
def test_poisson_arrivals_against_an_openai_server_are_measured_as_natively(cluster, tmp_path):
    data = run_bench(cluster, tmp_path, "--rates", "4", "--duration", "2", "--warmup", "1")
    [config] = data["configs"]
    [run] = config["runs"]
    assert run["rate"] == 4 and "concurrency" not in run
    assert_every_request_generated_what_was_asked(run)
    s = run["summary"]
    assert s["num_requests"] + s["num_warmup"] == len(run["requests"])
    assert s["num_completed"] == s["num_requests"] > 0 and s["num_failed"] == s["num_short"] == 0
    assert 0 < s["ttft"]["p50"] <= s["ttft"]["p99"] and 0 < s["tpot"]["p50"] <= s["tpot"]["p99"]
    assert_the_vllm_fields_are_ours(run, data)
    assert (run["vllm"]["request_rate"], run["vllm"]["max_concurrency"]) == (4, None)
    assert data["command"].startswith(f"pdserve bench --target openai:{cluster.openai_url} ")


async def test_the_same_requests_through_the_door_and_natively_generate_the_same_counts(cluster):
    """One result type for both targets: the door's usage count and the native token ids."""
    planned = plan(custom_workload("uniform:4:24", "fixed:6"), 8.0, 0.5, 0, seed=3)
    native = await run_plan(PdserveTarget("native", cluster.router_address), planned, 30)
    door = await run_plan(OpenAITarget("door", cluster.openai_url), planned, 30)
    for a, b in zip(native, door, strict=True):
        assert a.ok and b.ok and a.output_tokens == b.output_tokens == 6
        assert (a.counted_by, b.counted_by) == (TokenCount.TOKEN_IDS, TokenCount.USAGE)
        assert len(a.token_times) == 6 and a.timings is not None and b.timings is None


# -- a server that stops early ---------------------------------------------------------------


async def test_a_server_that_stops_early_is_reported_short_never_as_a_fast_success(cluster):
    """Every token the model can sample is a stop token: the door ends each request after
    its first, with finish reason `stop` and a usage count of 1, as a server that ignored
    `ignore_eos` would end it at EOS."""
    stops = OpenAITarget("door", cluster.openai_url, extra_body={"stop_token_ids": list(VOCAB)})
    requests = closed_plan(custom_workload("fixed:8", f"fixed:{MAX_TOKENS}"), 2, 0, seed=5)
    results = await run_closed(stops, requests, 2, 30, num_requests=4)
    assert len(results) == 4
    for r in results:
        assert r.is_short and not r.ok and r.error == ""
        assert (r.finish_reason, r.counted_by, r.output_tokens) == ("stop", TokenCount.USAGE, 1)
    s = summarize(Concurrency(2), results, SLO(ttft_ms=10_000, tpot_ms=10_000))
    assert (s.num_completed, s.num_short, s.num_failed) == (0, 4, 0)
    assert s.ttft.count == 0 and s.num_output_tokens == 0 and s.slo_attainment == 0
    run = RateRun(Concurrency(2), s, results)
    config = ConfigRun("door", cluster.openai_url, runs=[run], backend="openai")
    sweep = (custom_workload("fixed:8", "fixed:8"), [], 1, 30, 0, 5, SLO(1000, 100))
    result = BenchResult(*sweep, "cmd", MODEL, {}, [config], concurrencies=[2])
    fields = vllm_fields(result, config, run)
    assert (fields["completed"], fields["failed"], fields["request_goodput"]) == (0, 4, 0)


def test_bench_refuses_to_calibrate_on_a_server_that_stops_early(cluster, tmp_path, capsys):
    extra = json.dumps({"stop_token_ids": list(VOCAB)})
    args = bench_args("--target", f"openai:{cluster.openai_url}", *WORKLOAD, "--extra-body", extra)
    args.out = str(tmp_path)
    assert args.run(args) == 1
    err = capsys.readouterr().err
    assert f"1 tokens (counted by usage), asked for {MAX_TOKENS}; finish reason stop" in err


async def test_a_request_the_server_refuses_fails_with_its_message(cluster):
    too_long = plan(custom_workload("fixed:4", "fixed:100000"), 1.0, 0.1, 0, seed=0)[:1]
    [result] = await run_plan(OpenAITarget("door", cluster.openai_url), too_long, 10)
    assert not result.ok and not result.is_short
    assert result.error.startswith("HTTP 400: max_tokens: 100000 plus the 4-token prompt")


async def test_a_server_that_is_not_there_fails_each_request_not_the_run():
    planned = plan(custom_workload("fixed:4", "fixed:4"), 1.0, 0.1, 0, seed=0)[:1]
    [result] = await run_plan(OpenAITarget("none", "http://127.0.0.1:9/v1"), planned, 10)
    assert result.error.startswith("GET http://127.0.0.1:9/v1/models: ") and not result.ok


# -- the SSE parser --------------------------------------------------------------------------


def events_of(pieces) -> list[str]:
    stream = EventStream()
    return [event for piece in pieces for event in stream.feed(piece)]


def test_the_doors_stream_parses_to_its_chunks_then_done(door_bytes):
    events = events_of(door_bytes)
    assert events[-1] == "[DONE]"
    *tokens, usage = [json.loads(e) for e in events[:-1]]
    # a chunk per token, or fewer where the door coalesced what waited for a slow reader
    assert 1 <= len(tokens) <= MAX_TOKENS
    reasons = [chunk["choices"][0]["finish_reason"] for chunk in tokens]
    assert reasons == [None] * (len(tokens) - 1) + ["length"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == MAX_TOKENS


def test_the_doors_stream_cut_anywhere_parses_the_same(door_bytes):
    """Every split point (mid-line, mid-`data:`, between the two newlines of an event's
    end), and a byte at a time."""
    whole = b"".join(door_bytes)
    expected = events_of([whole])
    for cut in range(1, len(whole)):
        assert events_of([whole[:cut], whole[cut:]]) == expected, cut
    assert events_of(whole[i : i + 1] for i in range(len(whole))) == expected


def test_keep_alive_comments_and_crlf_line_ends_change_no_event(door_bytes):
    whole = b"".join(door_bytes)
    expected = events_of([whole])
    with_pings = whole.replace(b"\n\ndata:", b"\n\n: ping\n\n:\ndata:")
    assert events_of([b": keep-alive\n\n", with_pings]) == expected
    for line_end in (b"\r\n", b"\r"):  # cut anywhere: between a `\r` and its `\n` too
        other = whole.replace(b"\n", line_end)
        for cut in range(1, len(other)):
            assert events_of([other[:cut], other[cut:]]) == expected, (line_end, cut)


def test_an_events_data_lines_join_other_fields_are_ignored_and_an_unended_one_is_dropped():
    stream = b'event: x\nid: 3\ndata: {"a":\ndata:1}\nretry: 10\n\ndata\n\ndata: tail'
    assert events_of([stream]) == ['{"a":\n1}', ""]


def test_a_target_is_named_by_its_kind_and_where_it_is():
    door = parse_target("openai:http://127.0.0.1:8000/v1", api_key="k")
    assert isinstance(door, OpenAITarget) and door.base_url == "http://127.0.0.1:8000/v1"
    assert (door.backend, door.api_key, door.takes_ttft_slo) == ("openai", "k", False)
    native = parse_target("pdserve:10.0.0.1:50051")
    assert isinstance(native, PdserveTarget) and native.address == "10.0.0.1:50051"
    for bad in ("vllm:http://x/v1", "openai:", "openai:127.0.0.1:8000", "127.0.0.1:50051"):
        with pytest.raises(ValueError):
            parse_target(bad)
    with pytest.raises(ValueError, match="max_tokens"):
        OpenAITarget("x", "http://x/v1", extra_body={"max_tokens": 3})


def test_a_closed_loops_requests_are_a_rates_kinds_and_lengths_with_prompts_of_their_own():
    workload = custom_workload("uniform:4:64", "uniform:1:32")
    opened = plan(workload, 2.0, 30, 2, seed=4)
    closed = list(itertools.islice(closed_plan(workload, 3, 2, seed=4), len(opened)))
    assert [(len(p.prompt_token_ids), p.max_tokens) for p in closed] == [
        (len(p.prompt_token_ids), p.max_tokens) for p in opened
    ]
    assert [p.warmup for p in closed] == [p.warmup for p in opened]
    pairs = zip(opened, closed, strict=True)
    assert all(p.prompt_token_ids != q.prompt_token_ids for p, q in pairs)
    again = list(itertools.islice(closed_plan(workload, 3, 2, seed=4), len(opened)))
    assert again == closed


def test_a_closed_loop_runs_for_a_duration_or_a_count_not_both():
    target = OpenAITarget("x", "http://127.0.0.1:9/v1")
    for window in ({}, {"duration_s": 1.0, "num_requests": 3}):
        with pytest.raises(ValueError, match="one of them"):
            asyncio.run(run_closed(target, iter(()), 1, 1.0, **window))


def test_a_results_count_is_the_servers_where_it_gave_one():
    result = RequestResult(0, "k", False, 8, 4, 0.0, [0.1, 0.3])
    assert (result.output_tokens, result.is_short, result.ok) == (2, True, False)
    result.num_output_tokens, result.counted_by = 4, TokenCount.USAGE
    assert (result.output_tokens, result.is_short, result.ok) == (4, False, True)
    assert result.tpot == pytest.approx(0.2 / 3) and result.itls == pytest.approx([0.2])


# llama.cpp's llama-server (`/v1/completions`, streamed with include_usage): its last chunk
# has no text, finishes the choice and carries the usage (trimmed: its `timings` and ids).
LLAMA_SERVER_LAST = (
    '{"choices":[{"text":"","index":0,"logprobs":null,"finish_reason":"length"}],'
    '"object":"text_completion","usage":{"completion_tokens":4,"prompt_tokens":4,'
    '"total_tokens":8,"prompt_tokens_details":{"cached_tokens":0}}}'
)
LLAMA_SERVER_TOKEN = (
    '{"choices":[{"text":"\'m","index":0,"logprobs":null,"finish_reason":null}],'
    '"object":"text_completion"}'
)


def test_a_chunk_that_only_finishes_brings_no_token_and_its_usage_counts():
    result = RequestResult(0, "k", False, 4, 4, 0.0, counted_by=TokenCount.CHUNKS)
    assert read_chunk(LLAMA_SERVER_TOKEN, result) == 1 and result.finish_reason == ""
    assert read_chunk(LLAMA_SERVER_LAST, result) == 0
    assert (result.finish_reason, result.num_output_tokens) == ("length", 4)
    assert result.counted_by == TokenCount.USAGE
    # a token whose text is not whole UTF-8 yet (the door sends "") is still a token
    assert read_chunk('{"choices":[{"text":"","finish_reason":null}],"usage":null}', result) == 1
    with pytest.raises(RequestFailed, match="mid-stream"):
        read_chunk('{"error":{"message":"boom"}}', result)
