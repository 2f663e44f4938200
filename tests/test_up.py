"""`pdserve up` as a person runs it: starts, answers, and leaves nothing behind on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from procs import descendants_of

from pdserve.api.v1 import router_pb2, router_pb2_grpc
from pdserve.state.redis_server import free_port

pytestmark = pytest.mark.cluster


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def test_up_serves_a_generate_and_sigterm_leaves_nothing_behind(demo_model_dir, tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("REDIS_URL", None)  # its own private Redis, stopped with it
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve",
            "up",
            "--model",
            str(demo_model_dir),
            "--port",
            str(port),
            "--run-dir",
            str(tmp_path / "run"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        output = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            output.append(line)
            if "ready" in line and "router at" in line or not line:
                break
        assert any("router at" in line for line in output), "".join(output)
        while "Ctrl-C" not in line and line:  # what it prints once ready
            line = proc.stdout.readline()
            output.append(line)
        served = [line.split() for line in output if line.startswith("metrics ")]
        assert sorted(role for _, role, _ in served) == ["decode", "prefill", "router"]
        assert all(url.startswith("http://127.0.0.1:") for _, _, url in served)
        [router_metrics] = [url for _, role, url in served if role == "router"]
        with urllib.request.urlopen(router_metrics, timeout=10) as response:
            assert b"pdserve:" in response.read()
        descendants = descendants_of(proc.pid)
        assert len(descendants) >= 4  # redis, prefill, decode, router
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            request = router_pb2.GenerateRequest(text="Hello there", stream=False)
            request.sampling.max_tokens = 8
            request.sampling.ignore_eos = True
            [response] = list(stub.Generate(request, timeout=60))
        assert len(response.token_ids) == 8
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        time.sleep(0.2)
        assert [pid for pid in descendants if os.path.exists(f"/proc/{pid}")] == []
        assert port_is_free(port)
        assert (tmp_path / "run" / "router.log").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def read_until(proc: subprocess.Popen, needle: str, output: list[str], timeout_s: float) -> str:
    """The first line holding `needle` (every line read goes to `output`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        output.append(line)
        if needle in line:
            return line
    raise AssertionError(f"no line with {needle!r}; the output:\n{''.join(output)}")


def generate_eight(port: int, timeout_s: float) -> list[int]:
    """A greedy 8-token generate, retried until it works or `timeout_s` passed."""
    deadline = time.monotonic() + timeout_s
    request = router_pb2.GenerateRequest(text="Hello there", stream=False)
    request.sampling.max_tokens = 8
    request.sampling.ignore_eos = True
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        while True:
            try:
                [response] = list(stub.Generate(request, timeout=20))
                return list(response.token_ids)
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)


def test_up_restarts_a_killed_worker_and_a_killed_redis_on_their_ports(demo_model_dir, tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    env.pop("REDIS_URL", None)
    command = [sys.executable, "-m", "pdserve", "up", "--model", str(demo_model_dir)]
    proc = subprocess.Popen(
        [*command, "--port", str(port), "--run-dir", str(tmp_path / "run")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    output: list[str] = []
    try:
        read_until(proc, "Ctrl-C", output, 120)
        before = generate_eight(port, 10)
        pids = {cmdline(pid): pid for pid in descendants_of(proc.pid)}
        [decode_pid] = [pid for line, pid in pids.items() if " serve " in line and "decode" in line]
        [redis_pid] = [pid for line, pid in pids.items() if "redis-server" in line]

        os.kill(decode_pid, signal.SIGKILL)
        died = read_until(proc, "decode-1 died", output, 10)
        assert "killed by SIGKILL" in died
        back = read_until(proc, "decode-1 is back", output, 30)
        assert float(back.split("(")[-1].split()[0]) < 30  # seconds after it died
        assert generate_eight(port, 30) == before

        os.kill(redis_pid, signal.SIGKILL)
        assert "killed by SIGKILL" in read_until(proc, "redis died", output, 10)
        read_until(proc, "redis is back", output, 30)
        assert generate_eight(port, 30) == before  # workers registered again in the new Redis
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
