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
    }
    for name, parser in subcommands.choices.items():
        run = parser.get_default("run")
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
