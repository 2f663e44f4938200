"""Log lines: readable text by default, one JSON object a line with `--log-format json`,
filtered by `--log-level`; one line per finished request, at warning level when it failed.
"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import warnings

import pytest
from opentelemetry import trace

from pdserve.cli import build_parser
from pdserve.client import Client, SamplingParams
from pdserve.cluster.local import ClusterShape, LocalCluster
from pdserve.cluster.processes import router_args, worker_args
from pdserve.core.flags import ConfigError, config_from_args
from pdserve.core.phase import RequestPhase
from pdserve.router.config import RouterConfig
from pdserve.telemetry import logs
from pdserve.telemetry.logs import LogConfig, LogFormat, LogLevel
from pdserve.telemetry.summary import RequestSummary
from pdserve.worker.config import WorkerConfig

pytestmark = pytest.mark.cluster

ROUTER = ["router", "--model", "/models/tiny", "--redis-url", "redis://127.0.0.1:1"]
SERVE = ["serve", "decode", "--model", "/models/tiny"]
JSON = LogConfig(log_format=LogFormat.JSON)
T0 = 1000.0  # a monotonic time: the summaries' times are offsets from it
FINISHED = RequestSummary(
    request_id="req-1",
    trace_id="4bf92f3577b34da6a3ce929d0e0e4736",
    model="tiny",
    outcome=RequestPhase.FINISHED,
    finish_reason="length",
    error="",
    prefill_worker="prefill-a",
    decode_worker="decode-b",
    prompt_tokens=12,
    completion_tokens=5,
    cached_prompt_tokens=4,
    num_attempts=1,
    received_at=T0,
    admitted_at=T0 + 0.010,
    first_token_at=T0 + 0.040,
    finished_at=T0 + 0.080,
)
FAILED = RequestSummary(
    request_id="req-2",
    trace_id="",
    model="tiny",
    outcome=RequestPhase.FAILED,
    finish_reason="",
    error="UnavailableError: no decode worker has room",
    prefill_worker="",
    decode_worker="",
    prompt_tokens=12,
    completion_tokens=0,
    cached_prompt_tokens=0,
    num_attempts=3,
    received_at=T0,
    admitted_at=0.0,
    first_token_at=0.0,
    finished_at=T0 + 0.5,
)


@pytest.fixture
def stream():
    """What this process logs, configured into a buffer; the root logger restored after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    buffer = io.StringIO()
    yield buffer
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.captureWarnings(False)


def lines(buffer: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buffer.getvalue().splitlines()]


def configure(buffer: io.StringIO, config: LogConfig = JSON) -> None:
    logs.configure(config, role="decode", process_id="w-1", stream=buffer)


# -- the JSON lines ------------------------------------------------------------------------


def test_a_json_line_is_one_object_naming_the_process_with_the_calls_fields(stream):
    configure(stream)

    logging.getLogger("pdserve.worker.leases").info(
        "lease %s expired", "L1", extra={"lease_id": "L1", "num_blocks": 3}
    )

    [line] = lines(stream)
    assert line["level"] == "info"
    assert line["logger"] == "pdserve.worker.leases"
    assert (line["role"], line["process"]) == ("decode", "w-1")
    assert line["message"] == "lease L1 expired"
    assert (line["lease_id"], line["num_blocks"]) == ("L1", 3)
    assert line["time"].endswith("+00:00") and "T" in line["time"]


def test_an_exception_is_a_string_field_of_its_one_line(stream):
    configure(stream)

    try:
        raise ValueError("bad chunk")
    except ValueError:
        logging.getLogger("pdserve.kv").exception("push failed")

    [line] = lines(stream)  # the traceback's newlines stay inside the JSON string
    assert line["level"] == "error"
    assert line["message"] == "push failed"
    assert (
        line["exception"].startswith("Traceback") and "ValueError: bad chunk" in line["exception"]
    )


def test_a_line_written_inside_a_span_names_its_trace_and_span(stream):
    configure(stream)
    span = trace.NonRecordingSpan(
        trace.SpanContext(
            trace_id=0x4BF92F3577B34DA6A3CE929D0E0E4736,
            span_id=0x00F067AA0BA902B7,
            is_remote=False,
            trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED),
        )
    )
    log = logging.getLogger("pdserve.router.session")

    with trace.use_span(span):
        log.info("inside")
    log.info("outside")

    inside, outside = lines(stream)
    assert inside["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert inside["span_id"] == "00f067aa0ba902b7"
    assert "trace_id" not in outside and "span_id" not in outside


def test_a_field_json_has_no_type_for_is_written_as_its_text(stream):
    configure(stream)

    logging.getLogger("pdserve").info("phase", extra={"phase": RequestPhase.DECODING, "at": {1}})

    [line] = lines(stream)
    assert (line["phase"], line["at"]) == ("decoding", "{1}")


def test_a_python_warning_is_a_json_line_too(stream):
    configure(stream)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("old flag", DeprecationWarning, stacklevel=1)

    # only ours: any other warning raised meanwhile is a line too (in the full suite one
    # was, and the test saw two lines)
    [line] = [line for line in lines(stream) if "old flag" in line["message"]]
    assert (line["logger"], line["level"]) == ("py.warnings", "warning")


def test_text_lines_are_for_a_terminal_naming_the_process(stream):
    configure(stream, LogConfig())

    logging.getLogger("pdserve.router.session").info("attempt %d failed", 1, extra={"k": "v"})

    [line] = stream.getvalue().splitlines()
    assert line.endswith(" decode[w-1] INFO pdserve.router.session: attempt 1 failed")


@pytest.mark.parametrize(
    ("level", "written"),
    [
        (LogLevel.DEBUG, ["debug", "info", "warning", "error"]),
        (LogLevel.INFO, ["info", "warning", "error"]),
        (LogLevel.WARNING, ["warning", "error"]),
        (LogLevel.ERROR, ["error"]),
    ],
)
def test_the_level_leaves_out_less_severe_lines(stream, level, written):
    configure(stream, LogConfig(log_format=LogFormat.JSON, log_level=level))

    log = logging.getLogger("pdserve.test")
    for name in ("debug", "info", "warning", "error"):
        getattr(log, name)(name)

    assert [line["message"] for line in lines(stream)] == written


# -- the line of a finished request ---------------------------------------------------------


def test_a_finished_request_is_one_info_line_with_ids_workers_tokens_and_timings(stream):
    configure(stream)

    logs.request_finished(FINISHED)

    [line] = lines(stream)
    assert (line["level"], line["logger"]) == ("info", logs.REQUEST_LOGGER)
    assert line["request_id"] == "req-1"
    assert line["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert (line["outcome"], line["finish_reason"], line["error"]) == ("finished", "length", "")
    assert (line["prefill_worker"], line["decode_worker"]) == ("prefill-a", "decode-b")
    assert (line["prompt_tokens"], line["cached_prompt_tokens"]) == (12, 4)
    assert (line["completion_tokens"], line["num_attempts"]) == (5, 1)
    assert line["time_to_first_token_s"] == pytest.approx(0.040)
    assert line["queue_time_s"] == pytest.approx(0.010)
    assert line["prefill_time_s"] == pytest.approx(0.030)
    assert line["decode_time_s"] == pytest.approx(0.040)
    assert line["time_per_output_token_s"] == pytest.approx(0.010)
    assert line["e2e_latency_s"] == pytest.approx(0.080)


def test_a_failed_request_is_one_warning_line_with_its_error(stream):
    configure(stream)

    logs.request_finished(FAILED)

    [line] = lines(stream)
    assert line["level"] == "warning"
    assert (line["request_id"], line["outcome"]) == ("req-2", "failed")
    assert line["error"] == "UnavailableError: no decode worker has room"
    assert line["num_attempts"] == 3
    assert line["time_to_first_token_s"] == 0.0  # no first token came
    assert line["e2e_latency_s"] == pytest.approx(0.5)


def test_a_request_line_in_text_is_one_readable_line(stream):
    configure(stream, LogConfig())

    logs.request_finished(FINISHED)
    logs.request_finished(FAILED)

    finished, failed = stream.getvalue().splitlines()
    assert " INFO pdserve.requests: request req-1 finished (length): 12 prompt tokens " in finished
    assert "ttft 40.0 ms, tpot 10.0 ms, e2e 80.0 ms" in finished
    assert "prefill prefill-a, decode decode-b; 1 attempt; trace 4bf92f35" in finished
    assert " WARNING pdserve.requests: request req-2 failed (UnavailableError: no decode" in failed
    assert "3 attempts" in failed and "trace" not in failed


def test_request_lines_can_be_left_out_by_level(stream):
    configure(stream, LogConfig(log_format=LogFormat.JSON, log_level=LogLevel.WARNING))

    logs.request_finished(FINISHED)
    logs.request_finished(FAILED)

    assert [line["request_id"] for line in lines(stream)] == ["req-2"]


# -- the settings, through the real command line -------------------------------------------


@pytest.mark.parametrize("command", ["router", "serve"])
def test_help_shows_both_flags_with_their_variables(command):
    out = subprocess.run(
        [sys.executable, "-m", "pdserve", command, "--help"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "COLUMNS": "200"},
    ).stdout
    assert "--log-format {text,json}" in out and "$PDSERVE_LOG_FORMAT" in out
    assert "--log-level {debug,info,warning,error}" in out and "$PDSERVE_LOG_LEVEL" in out


@pytest.mark.parametrize(("argv", "config_cls"), [(ROUTER, RouterConfig), (SERVE, WorkerConfig)])
def test_a_log_flag_beats_its_variable_which_beats_the_default(argv, config_cls):
    def parse(extra: list[str], environ: dict[str, str]) -> LogConfig:
        args = build_parser().parse_args([*argv, *extra])
        return config_from_args(config_cls, args, environ).log

    assert parse([], {}) == LogConfig(LogFormat.TEXT, LogLevel.INFO)
    environ = {"PDSERVE_LOG_FORMAT": "json", "PDSERVE_LOG_LEVEL": "debug"}
    assert parse([], environ) == LogConfig(LogFormat.JSON, LogLevel.DEBUG)
    flagged = parse(["--log-format", "text", "--log-level", "error"], environ)
    assert flagged == LogConfig(LogFormat.TEXT, LogLevel.ERROR)


def test_the_log_config_takes_plain_strings_and_refuses_unknown_ones():
    assert LogConfig("json", "debug") == LogConfig(LogFormat.JSON, LogLevel.DEBUG)
    with pytest.raises(ValueError, match="'loud' is not a valid LogLevel"):
        LogConfig(log_level="loud")


def test_a_bad_log_variable_is_an_error_naming_it():
    args = build_parser().parse_args(ROUTER)
    with pytest.raises(ConfigError, match=r"\$PDSERVE_LOG_LEVEL='loud'"):
        config_from_args(RouterConfig, args, {"PDSERVE_LOG_LEVEL": "loud"})


def test_a_childs_arguments_carry_the_log_settings():
    args = worker_args("decode", "/m", log_format=LogFormat.JSON, log_level=LogLevel.DEBUG)
    assert args[args.index("--log-format") + 1] == "json"
    assert args[args.index("--log-level") + 1] == "debug"
    args = router_args("/m", "redis://x", log_format="json")
    assert args[args.index("--log-format") + 1] == "json"


# -- a real cluster --------------------------------------------------------------------------


def test_a_cluster_started_with_the_variable_logs_json_and_one_line_per_request(
    demo_model_dir, redis_url, tmp_path, monkeypatch
):
    # as `PDSERVE_LOG_FORMAT=json pdserve up`: every child inherits the variable
    monkeypatch.setenv("PDSERVE_LOG_FORMAT", "json")
    shape = ClusterShape(prefill=1, decode=1)
    with (
        LocalCluster(str(demo_model_dir), shape, tmp_path, redis=redis_url) as cluster,
        Client(cluster.router_address, timeout=60) as client,
    ):
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        completion = client.generate("Hello there", params)
    # stopped: every process has drained (and logged that) and closed its log

    written = {path.stem: path.read_text().splitlines() for path in tmp_path.glob("*.log")}
    assert sorted(written) == ["decode-1", "prefill-0", "router"]
    for name, text_lines in written.items():
        parsed = [json.loads(line) for line in text_lines]  # every line, of every process
        assert parsed, f"{name} logged nothing"
        assert {line["role"] for line in parsed} == {name.split("-")[0]}
    [request] = [json.loads(line) for line in written["router"] if logs.REQUEST_LOGGER in line]
    assert request["request_id"] == completion.request_id
    assert (request["outcome"], request["finish_reason"]) == ("finished", "length")
    assert (request["prompt_tokens"], request["completion_tokens"]) == (
        completion.usage.prompt_tokens,
        4,
    )
    assert request["decode_worker"] and request["prefill_worker"]
    assert 0 < request["time_to_first_token_s"] <= request["e2e_latency_s"]
