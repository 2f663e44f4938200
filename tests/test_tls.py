"""TLS settings, credentials and roles, unit by unit: the flags' checks, a certificate's
role, the role table, and servers and channels taking rotated files from disk.

Servers here are grpc.aio servers in this process on loopback with certificates of a CA
made for the module (tests/tls_certs.py).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from tls_certs import ClusterCA

from pdserve.core.flags import ConfigError, config_from_args
from pdserve.core.listen import check_bind
from pdserve.core.tls_config import Role, TlsConfig
from pdserve.engine.config import EngineConfig
from pdserve.router.config import RouterConfig
from pdserve.rpc import roles, tls
from pdserve.rpc.roles import RoleCheck, allowed_roles
from pdserve.worker.config import WorkerConfig

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    return ClusterCA(tmp_path_factory.mktemp("ca"))


# -- the settings ----------------------------------------------------------------------------


def test_tls_is_off_without_files_and_on_with_all_three(ca):
    issued = ca.issue("decode-0", "decode")
    assert not TlsConfig().enabled
    assert issued.config.enabled


def test_a_certificate_without_its_key_and_ca_names_the_missing_flags(ca):
    issued = ca.issue("decode-1", "decode")
    with pytest.raises(ValueError) as error:
        TlsConfig(tls_cert=str(issued.cert))
    message = str(error.value)
    assert "--tls-key ($PDSERVE_TLS_KEY) and --tls-ca ($PDSERVE_TLS_CA) not given" in message


def test_a_missing_file_is_refused_naming_its_flag(ca, tmp_path):
    issued = ca.issue("decode-2", "decode")
    with pytest.raises(ValueError, match=r"--tls-ca: no file at '.*nowhere.pem'"):
        TlsConfig(str(issued.cert), str(issued.key), str(tmp_path / "nowhere.pem"))


def test_the_tls_variables_configure_a_worker(ca, demo_model_dir):
    issued = ca.issue("prefill-env", "prefill")
    environ = {
        "PDSERVE_MODEL": str(demo_model_dir),
        "PDSERVE_TLS_CERT": str(issued.cert),
        "PDSERVE_TLS_KEY": str(issued.key),
        "PDSERVE_TLS_CA": str(issued.ca),
    }
    config = config_from_args(WorkerConfig, argparse.Namespace(role="prefill"), environ)
    assert config.tls == issued.config


def test_a_half_configured_router_names_the_flag_and_the_variable_it_read(ca, demo_model_dir):
    issued = ca.issue("router-env", "router")
    environ = {"PDSERVE_TLS_CERT": str(issued.cert)}
    args = argparse.Namespace(model=str(demo_model_dir), redis_url="redis://x")
    with pytest.raises(
        ConfigError, match=r"--tls-key.*read from the environment: \$PDSERVE_TLS_CERT"
    ):
        config_from_args(RouterConfig, args, environ)


def test_a_plaintext_server_beyond_loopback_needs_insecure_but_a_tls_one_does_not():
    with pytest.raises(ValueError, match="--insecure"):
        check_bind("0.0.0.0", insecure=False)
    check_bind("0.0.0.0", insecure=False, tls=True)
    check_bind("0.0.0.0", insecure=True)


def test_a_tls_worker_binds_beyond_loopback_without_insecure(ca, demo_model_dir):
    issued = ca.issue("decode-bind", "decode")
    engine = EngineConfig(model=str(demo_model_dir))
    config = WorkerConfig(role="decode", engine=engine, host="0.0.0.0", tls=issued.config)
    assert config.tls.enabled and not config.insecure


def test_a_prefill_worker_has_no_kv_port(demo_model_dir):
    engine = EngineConfig(model=str(demo_model_dir))
    with pytest.raises(ValueError, match="kv_port: a prefill worker serves no KV"):
        WorkerConfig(role="prefill", engine=engine, kv_port=0)


# -- a certificate's role ----------------------------------------------------------------------


@pytest.mark.parametrize("role", list(Role))
def test_a_certificate_role_is_its_subject_ou(ca, role):
    issued = ca.issue(f"role-{role.value}", role.value)
    assert tls.role_of_pem(issued.cert.read_bytes()) is role


def test_a_certificate_without_a_role_ou_has_no_role(ca):
    assert tls.role_of_pem(ca.issue("no-ou", None).cert.read_bytes()) is None
    assert tls.role_of_pem(ca.issue("other-ou", "operators").cert.read_bytes()) is None


def test_a_key_that_is_not_the_certificates_is_refused_naming_the_flag(ca, tmp_path):
    one, other = (
        ca.issue("one", "decode", into=tmp_path),
        ca.issue("other", "decode", into=tmp_path),
    )
    mixed = TlsConfig(str(one.cert), str(other.key), str(one.ca))
    with pytest.raises(tls.TlsFileError, match="--tls-key .* is not the key of --tls-cert"):
        tls.load_material(mixed)


# -- who may call what -------------------------------------------------------------------------


def test_the_kv_plane_takes_only_prefill_and_colocated_peers():
    for method in ("Handshake", "PushKV", "CommitKV", "RenewLease"):
        assert allowed_roles(f"/pdserve.v1.KVTransfer/{method}") == {Role.PREFILL, Role.BOTH}


def test_admit_relay_and_prefill_take_only_the_router():
    for method in (
        "/pdserve.v1.Decode/Admit",
        "/pdserve.v1.Decode/Relay",
        "/pdserve.v1.Prefill/Prefill",
    ):
        assert allowed_roles(method) == {Role.ROUTER}


def test_release_takes_the_router_and_the_kv_senders():
    assert allowed_roles("/pdserve.v1.Decode/Release") == {Role.ROUTER, Role.PREFILL, Role.BOTH}


def test_a_method_the_table_does_not_name_is_for_nobody():
    assert allowed_roles("/pdserve.v1.Router/Generate") == frozenset()


# -- servers and channels on loopback ------------------------------------------------------------


@contextlib.asynccontextmanager
async def health_server(credentials, interceptors=()):
    """A grpc.aio server with the standard health service alone; yields its address."""
    server = grpc.aio.server(interceptors=list(interceptors))
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


async def check_health(address: str, channel_tls: tls.ChannelTls) -> int:
    async with channel_tls.aio_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
    return reply.status


def rotating_files(ca: ClusterCA, directory, name: str, role: str):
    """Files laid out as a Kubernetes Secret volume: tls.crt -> ..data/tls.crt, where
    ..data is a symlink that a rotation swaps to a new directory at once."""
    issued = ca.issue(name, role, into=directory / "v0")
    for link, target in (("tls.crt", issued.cert.name), ("tls.key", issued.key.name)):
        os.symlink(f"..data/{target}", directory / link)
    os.symlink("v0", directory / "..data")
    return TlsConfig(str(directory / "tls.crt"), str(directory / "tls.key"), str(ca.ca_path))


def rotate(ca: ClusterCA, directory, name: str, role: str, version: int) -> None:
    """Write a new certificate under the same names and swap ..data to it."""
    ca.issue(name, role, into=directory / f"v{version}")
    os.symlink(f"v{version}", directory / "..data.new")
    os.replace(directory / "..data.new", directory / "..data")


async def test_a_server_presents_the_rotated_certificate_on_new_connections(ca, tmp_path):
    config = rotating_files(ca, tmp_path, "server", "decode")
    client = tls.ChannelTls(ca.issue("router", "router").config)
    async with health_server(tls.server_credentials(config)) as address:
        assert await tls.server_role(address, client) is Role.DECODE
        rotate(ca, tmp_path, "server", "both", version=1)
        assert await tls.server_role(address, client) is Role.BOTH
        assert await check_health(address, client) == health_pb2.HealthCheckResponse.SERVING


async def test_a_half_written_rotation_keeps_the_last_good_pair(ca, tmp_path):
    issued = ca.issue("server", "decode", into=tmp_path)
    client = tls.ChannelTls(ca.issue("router", "router").config)
    async with health_server(tls.server_credentials(issued.config)) as address:
        ca.issue("elsewhere", "both", into=tmp_path / "new")
        os.replace(tmp_path / "new" / "elsewhere.crt", issued.cert)  # the key not yet
        assert await tls.server_role(address, client) is Role.DECODE


async def test_a_channel_source_moves_to_rotated_client_files(ca, tmp_path):
    config = rotating_files(ca, tmp_path, "client", "router")
    source = tls.ChannelTls(config, check_interval_s=0.0)
    before = source.generation
    rotate(ca, tmp_path, "client", "router", version=1)
    assert source.generation == before + 1
    server = ca.issue("server", "decode", into=tmp_path / "server")
    async with health_server(tls.server_credentials(server.config)) as address:
        assert await check_health(address, source) == health_pb2.HealthCheckResponse.SERVING


async def test_a_call_without_a_client_certificate_is_unauthenticated(ca):
    # a port that does not demand a certificate at the handshake still gets none past the table
    server = ca.issue("server", "decode")
    credentials = tls.server_credentials(server.config, require_client_cert=False)
    async with health_server(credentials, [RoleCheck()]) as address:
        root_only = grpc.ssl_channel_credentials(root_certificates=server.ca.read_bytes())
        async with grpc.aio.secure_channel(address, root_only) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "needs a client certificate" in error.value.details()


async def test_a_certificate_of_no_role_is_denied_naming_the_roles_needed(ca):
    server = ca.issue("server", "decode")
    table = {"grpc.health.v1.Health": roles.ROUTER}
    async with health_server(tls.server_credentials(server.config), [RoleCheck(table)]) as address:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await check_health(address, tls.ChannelTls(ca.issue("anon", None).config))
    assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "is for router certificates; the caller's role (Subject OU) is none" in (
        error.value.details()
    )


async def test_a_server_signed_by_another_ca_is_not_trusted(ca, tmp_path):
    stranger = ClusterCA(tmp_path / "stranger").issue("server", "decode")
    client = tls.ChannelTls(ca.issue("router", "router").config)
    async with health_server(tls.server_credentials(stranger.config)) as address:
        with pytest.raises(tls.PreconditionError, match="no mTLS handshake with it succeeded"):
            await tls.check_server_role(address, {Role.DECODE}, client, field="target.address")


async def test_a_server_name_stands_in_for_the_host_dialled(ca, tmp_path):
    # a pod's certificate names the Service, not the pod IP its peers dial
    server = ca.issue("server", "decode", into=tmp_path, dns_names=("pdserve.internal",))
    router = ca.issue("router", "router", into=tmp_path)
    named = TlsConfig(str(router.cert), str(router.key), str(router.ca), "pdserve.internal")
    async with health_server(tls.server_credentials(server.config)) as address:
        with pytest.raises(tls.PreconditionError, match="no mTLS handshake"):
            await tls.check_server_role(
                address, {Role.DECODE}, tls.ChannelTls(router.config), field="a"
            )
        assert await tls.server_role(address, tls.ChannelTls(named)) is Role.DECODE
        assert (
            await check_health(address, tls.ChannelTls(named))
            == health_pb2.HealthCheckResponse.SERVING
        )


def test_a_worker_whose_key_is_not_its_certificates_exits_naming_the_flag(
    ca, tmp_path, demo_model_dir
):
    one, other = ca.issue("one", "decode", into=tmp_path), ca.issue("two", "decode", into=tmp_path)
    args = ["--tls-cert", str(one.cert), "--tls-key", str(other.key), "--tls-ca", str(one.ca)]
    command = [sys.executable, "-m", "pdserve", "serve", "decode", "--model", str(demo_model_dir)]
    done = subprocess.run([*command, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert f"--tls-key {str(other.key)!r} is not the key of --tls-cert" in done.stderr
    assert "Traceback" not in done.stderr
