"""`pdserve certs` and `pdserve up --tls-dir`: a secured cluster on one machine, as a person
tries it: certificates made for every role, mTLS between the processes, TLS and an API
key at the router, and the commands (`generate`, `status`, `bench`) that connect to it.

One `pdserve up` for the module (a prefill and a decode worker), whose routers ask for
API keys: the key file reaches them through $PDSERVE_API_KEY_FILE, and `pdserve up`'s own
calls use $PDSERVE_API_KEY.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509

from pdserve.api.v1 import decode_pb2, decode_pb2_grpc
from pdserve.cli import main
from pdserve.client import Client, PdserveError
from pdserve.cluster.certs import CertDirError, ensure_role_certs, role_files
from pdserve.cluster.load import wait_idle
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.tls_config import Role
from pdserve.router.auth.caller import KeyLimits
from pdserve.router.auth.keys import new_key, write_key_file
from pdserve.rpc.tls import role_of_certificate
from pdserve.state.redis_server import free_port

pytestmark = pytest.mark.cluster

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
START_TIMEOUT_S = 120.0
CALL_TIMEOUT_S = 30.0
ROLES = ("router", "prefill", "decode", "both")


@dataclass
class SecuredUp:
    address: str
    tls_dir: Path
    api_key: str
    output: list[str]  # what `pdserve up` printed until ready
    env: dict[str, str]  # what a shell of the person running it has

    @property
    def ca(self) -> Path:
        return self.tls_dir / "ca.crt"

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca.read_bytes())


def pdserve(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdserve", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def read_until_ready(proc: subprocess.Popen) -> list[str]:
    """Lines of `pdserve up` until the last one it prints once ready (or it ends)."""
    output: list[str] = []
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        output.append(line)
        if not line or "Ctrl-C" in line:
            return output
    return output


@pytest.fixture(scope="module")
def secured(tmp_path_factory, demo_model_dir):
    home = tmp_path_factory.mktemp("up-tls")
    key, entry = new_key("person", KeyLimits())
    write_key_file(home / "keys.json", [entry])
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PDSERVE_API_KEY": key}
    env.pop("REDIS_URL", None)
    port, tls_dir = free_port(), home / "certs"  # missing: `up` makes the set
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve", "up", "--model", str(demo_model_dir)]
        + ["--port", str(port), "--run-dir", str(home / "run"), "--tls-dir", str(tls_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**env, "PDSERVE_API_KEY_FILE": str(home / "keys.json")},
    )
    try:
        output = read_until_ready(proc)
        assert any("Ctrl-C" in line for line in output), "".join(output)
        shell = {k: v for k, v in env.items() if k != "PDSERVE_API_KEY"}
        yield SecuredUp(f"127.0.0.1:{port}", tls_dir, key, output, shell)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_up_makes_a_certificate_per_role_with_private_keys(secured):
    for role in ROLES:
        issued = role_files(secured.tls_dir, Role(role))
        certificate = x509.load_pem_x509_certificate(issued.cert.read_bytes())
        assert role_of_certificate(certificate) == Role(role)
        assert stat.S_IMODE(issued.key.stat().st_mode) == 0o600
    assert stat.S_IMODE((secured.tls_dir / "ca.key").stat().st_mode) == 0o600


def test_up_prints_how_to_connect_over_tls(secured):
    printed = "".join(secured.output)
    assert f"router at {secured.address} (TLS)" in printed
    assert f"tls {secured.ca}" in printed
    assert f"--tls-ca {secured.ca}" in printed


def test_a_client_trusting_the_ca_with_a_key_generates_end_to_end(secured):
    with Client(
        secured.address,
        credentials=secured.credentials(),
        api_key=secured.api_key,
        timeout=CALL_TIMEOUT_S,
    ) as client:
        completion = client.generate("Hello there", GREEDY)
    assert len(completion.token_ids) == GREEDY.max_tokens
    assert completion.finish_reason == "length"


def test_a_plaintext_client_is_refused(secured):
    plaintext = Client(secured.address, api_key=secured.api_key, timeout=5, max_reconnects=0)
    with plaintext as client, pytest.raises(PdserveError) as error:
        client.generate("Hello there", GREEDY)
    assert error.value.code == grpc.StatusCode.UNAVAILABLE


def test_a_tls_client_without_the_key_is_unauthenticated(secured):
    keyless = Client(secured.address, credentials=secured.credentials(), timeout=10)
    with keyless as client, pytest.raises(PdserveError) as error:
        client.generate("Hello there", GREEDY)
    assert error.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_pdserve_generate_with_tls_ca_and_the_key_variable(secured):
    env = {**secured.env, "PDSERVE_API_KEY": secured.api_key}
    flags = ["--router", secured.address, "--tls-ca", str(secured.ca)]
    done = pdserve("generate", "Hi", *flags, "--max-tokens", "4", "--ignore-eos", "--json", env=env)
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["token_ids"]) == 4


def test_pdserve_status_lists_the_workers_through_a_secured_router(secured):
    flags = ["--router", secured.address, "--tls-ca", str(secured.ca)]
    done = pdserve("status", *flags, "--api-key", secured.api_key, "--json", env=secured.env)
    assert done.returncode == 0, done.stderr
    assert sorted(w["role"] for w in json.loads(done.stdout)) == ["decode", "prefill"]


def test_pdserve_bench_measures_a_secured_router(secured, tmp_path):
    env = {**secured.env, "PDSERVE_API_KEY": secured.api_key}
    flags = ["--router", secured.address, "--tls-ca", str(secured.ca)]
    load = ["--prompt-len", "fixed:8", "--output-len", "fixed:3", "--rates", "4"]
    load += ["--duration", "0.5", "--warmup", "1", "--drain", "20", "--out", str(tmp_path)]
    done = pdserve("bench", *flags, *load, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    [record] = tmp_path.glob("*.json")
    [run] = json.loads(record.read_text())["configs"][0]["runs"]
    assert run["requests"] and all(not r["error"] for r in run["requests"])


def test_workers_take_the_router_certificate_and_refuse_a_caller_without_one(secured):
    router_tls = role_files(secured.tls_dir, Role.ROUTER).config
    with Client(
        secured.address, credentials=secured.credentials(), api_key=secured.api_key
    ) as client:
        workers = client.list_workers()
    [decode] = [w for w in workers if w.role == "decode"]
    load = wait_idle(decode.address, "decode", tls=router_tls)  # a load probe over mTLS
    assert load.free_blocks == load.total_blocks
    no_certificate = grpc.secure_channel(decode.address, secured.credentials())
    with no_certificate as channel, pytest.raises(grpc.RpcError) as error:
        decode_pb2_grpc.DecodeStub(channel).GetLoad(decode_pb2.GetLoadRequest(), timeout=5)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE


def test_pdserve_certs_writes_a_set_up_takes_and_refuses_to_write_over_it(tmp_path, capsys):
    out = tmp_path / "certs"
    assert main(["certs", "--out", str(out), "--san", "pdserve.internal"]) == 0
    certs, was_made = ensure_role_certs(out)
    assert not was_made and set(certs) == set(Role)
    names = x509.load_pem_x509_certificate(certs[Role.DECODE].cert.read_bytes()).extensions
    san = names.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost", "pdserve.internal"]
    assert main(["certs", "--out", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err


def test_a_directory_that_is_not_a_whole_set_is_refused_naming_what_is_missing(tmp_path):
    (tmp_path / "ca.crt").write_text("someone's file")
    with pytest.raises(CertDirError, match="missing router.crt"):
        ensure_role_certs(tmp_path)
