"""The Python client and the client commands against a real router, worker and Redis."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import subprocess
import sys
import time

import grpc
import pytest
from procs import router_process, worker_process

from pdserve.api.v1 import router_pb2
from pdserve.cli import build_parser
from pdserve.client import AsyncClient, Client, Completion, PdserveError
from pdserve.commands import generate, status
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.llm_engine import LLMEngine
from pdserve.rpc.wire.client import request_info_from_proto

pytestmark = pytest.mark.cluster

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
GREEDY_FLAGS = ("--temperature", "0", "--max-tokens", str(GREEDY.max_tokens), "--ignore-eos")
PROMPT = "The client streams what the router sends"
BAD_TOP_P = SamplingParams(top_p=2.0)
WORKERS_TIMEOUT_S = 15
CALL_TIMEOUT_S = 20
PROCESS_TIMEOUT_S = 60
COLOCATE_BELOW_TOKENS = 4096  # longer than any prompt here
NUM_KV_BLOCKS = 256  # plenty for these requests, and quick to allocate


@pytest.fixture(scope="module")
def cluster(demo_model_dir, redis_url, tmp_path_factory):
    """One "both" worker in the Redis registry and one router over it.

    The router runs every request whole on that worker (--colocate-below): with no other
    worker, a KV hand-off could only go from the worker to itself.
    """
    logs = tmp_path_factory.mktemp("client-logs")
    colocate = ("--colocate-below", str(COLOCATE_BELOW_TOKENS))
    worker_args = ("--redis-url", redis_url, "--num-kv-blocks", str(NUM_KV_BLOCKS))
    with (
        worker_process("both", demo_model_dir, *worker_args, log_dir=logs) as worker,
        router_process(demo_model_dir, redis_url, *colocate, log_dir=logs) as (router, _),
    ):
        _wait_until_routed(router, worker.address)
        yield {"router": router, "worker": worker.address, "redis_url": redis_url}


def _wait_until_routed(router: str, worker: str) -> None:
    # the router learns of workers from registry heartbeats: poll, there is no event to await
    deadline = time.monotonic() + WORKERS_TIMEOUT_S
    with Client(router) as client:
        while worker not in {w.address for w in client.list_workers()}:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the router never listed worker {worker}")
            time.sleep(0.1)


@pytest.fixture(scope="module")
def expected(demo_model_dir):
    [output] = LLMEngine.from_pretrained(demo_model_dir).generate([PROMPT], GREEDY)
    return output


@pytest.fixture
def client(cluster):
    with Client(cluster["router"], timeout=CALL_TIMEOUT_S) as client:
        yield client


def run_command(capsys, *argv: str) -> tuple[int, str, str]:
    """`pdserve ARGV` in this process: (exit code, stdout, stderr)."""
    parser = argparse.ArgumentParser(prog="pdserve")
    subcommands = parser.add_subparsers()
    generate.add_parser(subcommands)
    status.add_parser(subcommands)
    args = parser.parse_args(argv)
    code = args.run(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def as_printed(text: str) -> str:
    """The text as `pdserve generate` leaves it on stdout: ending its last line."""
    return text if text.endswith("\n") else text + "\n"


def wired(*commands: str) -> bool:
    """Whether `pdserve` (cli.py) registers these subcommands."""
    parser = build_parser()
    [subcommands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return all(command in subcommands.choices for command in commands)


def run_pdserve(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdserve", *argv],
        capture_output=True,
        text=True,
        timeout=PROCESS_TIMEOUT_S,
    )


# -- the client -----------------------------------------------------------------------------


def test_generate_returns_the_engines_completion(client, expected):
    completion = client.generate(PROMPT, GREEDY)
    assert completion.token_ids == expected.token_ids
    assert completion.text == expected.text
    assert completion.finish_reason == "length"
    assert completion.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert completion.usage.completion_tokens == GREEDY.max_tokens
    assert completion.timings["total_ms"] >= completion.timings["ttft_ms"] > 0


def test_stream_chunks_join_to_the_engines_completion(client, expected):
    chunks = list(client.stream(expected.prompt_token_ids, GREEDY))
    offsets = [c.offset for c in chunks]
    assert offsets == [sum(len(c.token_ids) for c in chunks[:i]) for i in range(len(chunks))]
    assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    completion = Completion.from_chunks(chunks)
    assert completion.token_ids == expected.token_ids
    assert completion.text == expected.text
    assert completion.finish_reason == "length"


async def test_async_generate_and_stream_match_the_engine(cluster, expected):
    async with AsyncClient(cluster["router"], timeout=CALL_TIMEOUT_S) as client:
        completion = await client.generate(PROMPT, GREEDY)
        chunks = [chunk async for chunk in client.stream(PROMPT, GREEDY)]
        tokens = await client.tokenize(PROMPT)
        info = await client.get_request(completion.request_id)
    assert completion.token_ids == expected.token_ids
    assert Completion.from_chunks(chunks).token_ids == expected.token_ids
    assert "".join(c.text for c in chunks) == expected.text
    assert tokens == expected.prompt_token_ids
    assert info.status == "finished" and info.usage.completion_tokens == GREEDY.max_tokens


def test_leaving_a_stream_early_cancels_the_request(client):
    # long enough to outlast the cancel on a loaded machine: 200 tokens of the tiny
    # model took 0.29 s once, and ran to their end before it arrived
    long = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)
    for chunk in client.stream(PROMPT, long, request_id="client-leaves-early"):
        assert chunk.token_ids
        break
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while (info := client.get_request("client-leaves-early")).status != "cancelled":
        assert info.status != "finished", "the request ran to its end"
        assert time.monotonic() < deadline, f"still {info.status}"
        time.sleep(0.05)


def test_a_blocking_client_serves_several_threads_at_once(client, expected):
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        completions = list(pool.map(lambda _: client.generate(PROMPT, GREEDY), range(4)))
    assert [c.token_ids for c in completions] == [expected.token_ids] * 4


def test_a_closed_client_refuses_calls(cluster):
    client = Client(cluster["router"])
    client.close()
    client.close()  # idempotent
    with pytest.raises(RuntimeError):
        client.model_info()


def test_request_bookkeeping_calls(client, expected):
    completion = client.generate(PROMPT, GREEDY, request_id="client-bookkeeping")
    assert completion.request_id == "client-bookkeeping"
    info = client.get_request("client-bookkeeping")
    assert (info.status, info.finish_reason) == ("finished", "length")
    assert client.cancel("client-bookkeeping") is False  # it had already ended
    assert client.detokenize(expected.token_ids) == expected.text
    model = client.model_info()
    assert model.vocab_size > max(expected.token_ids) and model.max_model_len > 0


def test_resume_from_an_offset_returns_the_rest(client, expected):
    client.generate(PROMPT, GREEDY, request_id="client-resume")
    tail = client.generate(PROMPT, GREEDY, request_id="client-resume", resume_from=5)
    assert tail.token_ids == expected.token_ids[5:]


def test_invalid_request_raises_pdserve_error_naming_the_field(client):
    with pytest.raises(PdserveError) as caught:
        client.generate(PROMPT, BAD_TOP_P)
    error = caught.value
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    [(field, description)] = error.field_violations
    assert field == "sampling.top_p" and "2.0" in description
    assert error.retry_after is None


def test_streaming_errors_are_pdserve_errors_too(client):
    with pytest.raises(PdserveError) as caught:
        list(client.stream(PROMPT, BAD_TOP_P))
    assert caught.value.field_violations[0][0] == "sampling.top_p"


async def test_async_errors_are_pdserve_errors(cluster):
    async with AsyncClient(cluster["router"]) as client:
        with pytest.raises(PdserveError) as caught:
            await client.get_request("no-such-request")
    assert caught.value.code == grpc.StatusCode.NOT_FOUND


def test_an_unreachable_router_is_a_pdserve_error():
    with Client("127.0.0.1:1", timeout=5) as client, pytest.raises(PdserveError) as caught:
        client.model_info()
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE


# -- the commands ---------------------------------------------------------------------------


def test_generate_command_streams_the_text_and_reports_on_stderr(cluster, expected, capsys):
    code, out, err = run_command(
        capsys, "generate", PROMPT, "--router", cluster["router"], *GREEDY_FLAGS
    )
    assert code == 0
    assert out == as_printed(expected.text)
    assert "finish: length" in err and "ttft:" in err and "tokens/s" in err


def test_generate_command_json(cluster, expected, capsys):
    code, out, _ = run_command(
        capsys, "generate", PROMPT, "--router", cluster["router"], *GREEDY_FLAGS, "--json"
    )
    assert code == 0
    result = json.loads(out)
    assert result["text"] == expected.text and result["token_ids"] == expected.token_ids
    assert result["finish_reason"] == "length"
    assert result["usage"]["completion_tokens"] == GREEDY.max_tokens
    assert result["timings"]["ttft_ms"] > 0 and result["ttft_ms"] > 0
    assert "tokens_per_s" in result


def test_generate_command_error_is_one_line_and_exit_code_1(cluster, capsys):
    code, out, err = run_command(
        capsys, "generate", PROMPT, "--router", cluster["router"], "--top-p", "2", "--json"
    )
    assert code == 1 and out == ""
    assert err.count("\n") == 1
    assert "INVALID_ARGUMENT" in err and "sampling.top_p" in err


def test_status_from_the_registry_lists_the_worker(cluster, capsys):
    code, out, _ = run_command(capsys, "status", "--redis-url", cluster["redis_url"])
    assert code == 0
    header, *rows = out.splitlines()
    assert header.split()[:3] == ["ROLE", "WORKER", "ADDRESS"]
    [row] = [r for r in rows if cluster["worker"] in r]
    assert row.split()[0] == "both" and "healthy" in row.split()
    # the suite pins float32 (tests/conftest.py): the column says what the worker computes in
    assert row.split()[header.split().index("DTYPE") - 1] == "float32"  # "KV FREE/TOTAL" is 3 words


def test_status_from_the_router_json(cluster, capsys):
    code, out, _ = run_command(capsys, "status", "--router", cluster["router"], "--json")
    assert code == 0
    [worker] = [w for w in json.loads(out) if w["address"] == cluster["worker"]]
    assert worker["role"] == "both" and worker["healthy"]
    assert 0 < worker["free_blocks"] <= worker["total_blocks"]
    assert worker["dtype"] == "float32"
    assert worker["heartbeat_age_s"] < WORKERS_TIMEOUT_S


@pytest.mark.skipif(not wired("generate", "status"), reason="cli.py does not register them yet")
def test_the_commands_as_processes(cluster, expected):
    generated = run_pdserve("generate", PROMPT, "--router", cluster["router"], *GREEDY_FLAGS)
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout == as_printed(expected.text) and "finish: length" in generated.stderr
    listed = run_pdserve("status", "--redis-url", cluster["redis_url"], "--json")
    assert listed.returncode == 0, listed.stderr
    assert cluster["worker"] in {w["address"] for w in json.loads(listed.stdout)}
    failed = run_pdserve("generate", PROMPT, "--router", cluster["router"], "--top-p", "2")
    assert failed.returncode == 1 and "Traceback" not in failed.stderr
    assert "sampling.top_p" in failed.stderr


def test_request_info_carries_the_trace_id():
    """GetRequest's trace id reaches the caller (it finds the request's trace by it)."""
    message = router_pb2.RequestInfo(request_id="r", status="finished", trace_id="ab" * 16)
    assert request_info_from_proto(message).trace_id == "ab" * 16
    assert request_info_from_proto(router_pb2.RequestInfo(request_id="r")).trace_id == ""
