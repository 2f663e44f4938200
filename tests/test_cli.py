"""The `pdserve` command line: made from each process's config, every flag documented and
also read from its PDSERVE_* variable (a flag beats its variable, which beats the default)."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import pytest

from pdserve import __version__
from pdserve.cli import build_parser, main
from pdserve.cluster.processes import router_args, worker_args
from pdserve.core.flags import ConfigError, config_from_args, flag_names, settings
from pdserve.engine.config import EngineConfig
from pdserve.router.config import DiscoveryKind, RouterConfig
from pdserve.worker.config import WorkerConfig

pytestmark = pytest.mark.cluster

MODEL = "/models/tiny"  # never read: building a config does not open the model
REDIS = "redis://127.0.0.1:1"
ROUTER = ["router", "--model", MODEL, "--redis-url", REDIS]
SERVE = ["serve", "decode", "--model", MODEL]


def subparser(name: str) -> argparse.ArgumentParser:
    [subcommands] = [
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    ]
    return subcommands.choices[name]


def router_config(argv: list[str], environ: dict[str, str] | None = None) -> RouterConfig:
    return config_from_args(RouterConfig, build_parser().parse_args(argv), environ or {})


def worker_config(argv: list[str], environ: dict[str, str] | None = None) -> WorkerConfig:
    return config_from_args(WorkerConfig, build_parser().parse_args(argv), environ or {})


def test_version_flag():
    out = subprocess.run(
        [sys.executable, "-m", "pdserve", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == f"pdserve {__version__}"
    assert __version__ == "0.1.0"


# -- help -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("command", "config"), [("router", RouterConfig), ("serve", WorkerConfig)])
def test_help_describes_every_flag_and_its_variable(command, config):
    out = subprocess.run(
        [sys.executable, "-m", "pdserve", command, "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for flag in flag_names(config):
        assert flag in out
    for action in subparser(command)._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{command} {action.option_strings or action.dest} has no help"
        if action.option_strings:
            variable = "PDSERVE_" + action.option_strings[0][2:].upper().replace("-", "_")
            assert variable in action.help


def test_serve_keeps_the_flags_users_know():
    known = {
        "--model",
        "--host",
        "--port",
        "--device",
        "--dtype",
        "--threads",
        "--block-size",
        "--num-kv-blocks",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--lease-ttl",
        "--kv-streams",
        "--grace",
        "--redis-url",
        "--advertise-host",
    }
    assert known <= set(flag_names(WorkerConfig))


def test_the_router_takes_its_lease_ttl_in_seconds_like_the_worker():
    assert router_config([*ROUTER, "--lease-ttl", "2.5"]).lease_ttl_s == 2.5
    assert worker_config([*SERVE, "--lease-ttl", "2.5"]).lease_ttl_s == 2.5
    with pytest.raises(SystemExit):
        build_parser().parse_args([*ROUTER, "--lease-ttl-ms", "2500"])


def test_device_defaults_to_auto_in_the_config_and_the_command_line_and_resolves_at_start():
    [device] = [f for f in dataclasses.fields(EngineConfig) if f.name == "device"]
    assert device.default == "auto"
    assert "default: auto" in subparser("serve").format_help()
    assert worker_config(SERVE).engine.device in ("cpu", "cuda")


def test_a_worker_default_is_written_once_in_its_engine_config():
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert not engine_fields & {f.name for f in dataclasses.fields(WorkerConfig)}
    config = worker_config(SERVE)
    assert config.engine == EngineConfig(model=MODEL)


# -- where a value comes from -------------------------------------------------------------


def test_a_flag_beats_its_variable_which_beats_the_default():
    assert router_config(ROUTER).max_inflight == 256
    assert router_config(ROUTER, {"PDSERVE_MAX_INFLIGHT": "7"}).max_inflight == 7
    flagged = router_config([*ROUTER, "--max-inflight", "9"], {"PDSERVE_MAX_INFLIGHT": "7"})
    assert flagged.max_inflight == 9


def test_engine_settings_come_from_variables_too():
    environ = {
        "PDSERVE_BLOCK_SIZE": "32",
        "PDSERVE_ENABLE_PREFIX_CACHING": "false",
        "PDSERVE_LEASE_TTL": "4.5",
    }
    config = worker_config(SERVE, environ)
    assert config.engine.block_size == 32
    assert config.engine.enable_prefix_caching is False
    assert config.lease_ttl_s == 4.5
    assert worker_config([*SERVE, "--block-size", "8"], environ).engine.block_size == 8


def test_the_redis_url_comes_from_the_flag_then_pdserve_redis_url_then_redis_url():
    bare = ["router", "--model", MODEL]
    assert router_config(bare, {"REDIS_URL": "redis://a"}).redis_url == "redis://a"
    both = {"REDIS_URL": "redis://a", "PDSERVE_REDIS_URL": "redis://b"}
    assert router_config(bare, both).redis_url == "redis://b"
    assert router_config([*bare, "--redis-url", "redis://c"], both).redis_url == "redis://c"


def test_a_list_and_an_enum_parse_from_a_variable():
    environ = {"PDSERVE_DISCOVERY": "static", "PDSERVE_BOTH": "a:1, b:2"}
    config = router_config(ROUTER, environ)
    assert config.discovery is DiscoveryKind.STATIC
    assert config.both == ["a:1", "b:2"]


def test_an_empty_variable_counts_as_unset():
    assert router_config(ROUTER, {"PDSERVE_MAX_INFLIGHT": ""}).max_inflight == 256


# -- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("PDSERVE_BLOCK_SIZE", "sixteen"),
        ("PDSERVE_ENABLE_PREFIX_CACHING", "maybe"),
        ("PDSERVE_DTYPE", "float8"),
        ("PDSERVE_MAX_NUM_SEQS", "0"),  # parses, but the config refuses it
    ],
)
def test_a_bad_variable_is_an_error_naming_it(variable, value):
    with pytest.raises(ConfigError, match=variable):
        worker_config(SERVE, {variable: value})


def test_pdserve_serve_with_a_bad_variable_exits_with_a_usage_error(monkeypatch, capsys):
    monkeypatch.setenv("PDSERVE_BLOCK_SIZE", "sixteen")
    assert main(SERVE) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve serve:") and "PDSERVE_BLOCK_SIZE='sixteen'" in err


def test_a_missing_required_setting_names_its_flag_and_variable():
    with pytest.raises(ConfigError, match=r"--redis-url \(or \$PDSERVE_REDIS_URL\) is required"):
        router_config(["router", "--model", MODEL])


def test_a_bad_flag_value_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([*SERVE, "--block-size", "sixteen"])
    assert "--block-size: 'sixteen' is not a valid int" in capsys.readouterr().err


def test_the_configs_refuse_values_they_cannot_run_with():
    with pytest.raises(ConfigError, match="lease_ttl_s must be > 0"):
        router_config([*ROUTER, "--lease-ttl", "0"])
    with pytest.raises(ConfigError, match="static discovery needs"):
        router_config([*ROUTER, "--discovery", "static"])
    with pytest.raises(ValueError, match="threads must be >= 1"):
        WorkerConfig(role="prefill", engine=EngineConfig(model=MODEL), threads=0)


# -- launching children ---------------------------------------------------------------------


def test_a_childs_arguments_give_back_the_settings_they_were_made_from():
    args = worker_args(
        "decode", MODEL, port=0, threads=1, block_size=32, enable_prefix_caching=False
    )
    config = worker_config(args)
    assert (config.role, config.port, config.threads) == ("decode", 0, 1)
    assert config.engine.block_size == 32 and not config.engine.enable_prefix_caching
    router = router_config(
        router_args(MODEL, REDIS, discovery=DiscoveryKind.STATIC, both=["a:1", "b:2"])
    )
    assert router.discovery is DiscoveryKind.STATIC and router.both == ["a:1", "b:2"]


def test_extra_arguments_come_last_and_win():
    args = worker_args("prefill", MODEL, ["--threads", "3"], threads=1)
    assert args[-2:] == ["--threads", "3"]
    assert worker_config(args).threads == 3


def test_a_setting_the_config_does_not_have_is_refused():
    with pytest.raises(TypeError, match="no setting"):
        worker_args("prefill", MODEL, lease_ttl_ms=5)


# -- one home for commands ------------------------------------------------------------------


def test_every_subcommand_lives_in_pdserve_commands():
    [subcommands] = [
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    ]
    assert set(subcommands.choices) == {
        "demo-model",
        "serve",
        "router",
        "up",
        "generate",
        "status",
        "bench",
        "keys",
        "plan",
        "planner",
        "certs",
    }

    def runs(parser: argparse.ArgumentParser):
        """The `run` of a command, or of each action of one that has actions (`keys`)."""
        nested = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not nested:
            return [parser.get_default("run")]
        return [run for action in nested[0].choices.values() for run in runs(action)]

    for name, run in [(n, r) for n, p in subcommands.choices.items() for r in runs(p)]:
        module = run.__module__
        assert module == "pdserve.commands" or module.startswith("pdserve.commands."), (
            name,
            module,
        )


def test_every_config_field_is_a_setting():
    for config in (RouterConfig, WorkerConfig):
        paths = {s.path for s in settings(config)}
        top = {f.name for f in dataclasses.fields(config) if f.name != "engine"}
        assert top <= {path[0] for path in paths}
    engine = {s.path[1] for s in settings(WorkerConfig) if s.path[0] == "engine"}
    assert engine == {f.name for f in dataclasses.fields(EngineConfig)}


# -- connecting to a secured router: generate, status --router, bench --router --------------

CONNECTING = {
    "generate": ["generate", "Hello"],
    "status": ["status", "--router", "127.0.0.1:1"],
    "bench": ["bench", "--router", "127.0.0.1:1"],
}


@pytest.fixture
def ca_file(tmp_path):
    from pdserve.cluster.certs import ClusterCA

    return ClusterCA(tmp_path / "ca").ca_path


@pytest.mark.parametrize("command", sorted(CONNECTING))
def test_the_router_commands_take_a_ca_and_an_api_key(command, ca_file, monkeypatch):
    from pdserve.commands.connection import connection_from_args

    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    argv = [*CONNECTING[command], "--tls-ca", str(ca_file), "--api-key", "pds_flag"]
    connection = connection_from_args(build_parser().parse_args(argv))
    assert connection.credentials is not None
    assert connection.client_kwargs["api_key"] == "pds_flag"
    plaintext = connection_from_args(build_parser().parse_args(CONNECTING[command]))
    assert plaintext.client_kwargs == {"credentials": None, "api_key": None}


def test_the_api_key_and_ca_come_from_their_variables_and_a_flag_beats_its_variable(
    ca_file, monkeypatch
):
    from pdserve.commands.connection import connection_from_args

    monkeypatch.setenv("PDSERVE_API_KEY", "pds_variable")
    monkeypatch.setenv("PDSERVE_TLS_CA", str(ca_file))
    from_variables = connection_from_args(build_parser().parse_args(CONNECTING["status"]))
    assert from_variables.api_key == "pds_variable" and from_variables.credentials is not None
    argv = [*CONNECTING["status"], "--api-key", "pds_flag"]
    assert connection_from_args(build_parser().parse_args(argv)).api_key == "pds_flag"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
        (["--tls-cert", "c.pem", "--tls-key", "k.pem"], "--tls-cert needs --tls-ca"),
        (["--tls-ca", "/no/such/ca.crt"], "--tls-ca '/no/such/ca.crt': No such file"),
    ],
)
def test_connection_flags_that_cannot_be_used_exit_with_a_usage_error_naming_them(
    flags, message, capsys, monkeypatch
):
    for variable in ("PDSERVE_TLS_CA", "PDSERVE_TLS_CERT", "PDSERVE_TLS_KEY"):
        monkeypatch.delenv(variable, raising=False)
    assert main([*CONNECTING["generate"], *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve generate:") and message in err


def test_up_takes_a_tls_dir_and_certs_its_options():
    up = build_parser().parse_args(["up", "--tls-dir", "/tmp/certs"])
    assert up.tls_dir == "/tmp/certs"
    certs = build_parser().parse_args(["certs", "--out", "d", "--san", "a", "--san", "10.0.0.7"])
    assert (certs.out, certs.san, certs.days, certs.force) == ("d", ["a", "10.0.0.7"], 90, False)


def test_pdserve_certs_refuses_a_directory_that_is_not_empty(tmp_path, capsys):
    (tmp_path / "someone.txt").write_text("theirs")
    assert main(["certs", "--out", str(tmp_path)]) == 2
    assert "is not empty (--force writes over it)" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["someone.txt"]
