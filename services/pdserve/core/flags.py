"""A process's command line, made from its config dataclass; every flag also an env variable.

Each field is a flag named after it (`max_num_seqs` is `--max-num-seqs`) with the help
text of its metadata; a field holding another config dataclass (the worker's `engine`)
brings that one's fields as flags too. A value comes from the flag when given, else from
`PDSERVE_` and the flag's name in upper snake case (`PDSERVE_MAX_NUM_SEQS`, what a
Kubernetes manifest sets), else the field's default. The dataclass is the one place a
default is written, and its `__post_init__` the one place a value is checked.

Field metadata, as `dataclasses.field(metadata=...)` (the convention of Hugging Face's
HfArgumentParser):
- "help": the help text; every field has one.
- "flag": the flag's name where it is not the field's (`lease_ttl_s` is `--lease-ttl`).
- "choices": the values allowed (an Enum field: its values).
- "metavar": the placeholder --help shows for the value.
- "positional": a positional argument instead of a flag (and no variable).
- "env": variables read after the PDSERVE_ one, in order (`REDIS_URL`).
- "default_help": how --help describes a default made by a factory.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, cast

ENV_PREFIX = "PDSERVE_"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class ConfigError(ValueError):
    """A setting that cannot be used; the message names the flag or variable it came from."""


@dataclass(frozen=True, slots=True)
class Setting:
    """One field of a config as the command line and the environment know it."""

    path: tuple[str, ...]  # attribute names from the top config down: ("engine", "block_size")
    field: dataclasses.Field[Any]
    kind: type  # the value's type with `| None` and `list[...]` taken off
    is_list: bool  # a comma-separated list of `kind`

    @property
    def name(self) -> str:
        return str(self.field.metadata.get("flag", self.field.name.replace("_", "-")))

    @property
    def flag(self) -> str:
        return f"--{self.name}"

    @property
    def dest(self) -> str:
        return ".".join(self.path)

    @property
    def env_names(self) -> tuple[str, ...]:
        own = ENV_PREFIX + self.name.upper().replace("-", "_")
        return (own, *self.field.metadata.get("env", ()))

    @property
    def positional(self) -> bool:
        return bool(self.field.metadata.get("positional", False))

    @property
    def is_flag_switch(self) -> bool:
        return self.kind is bool and not self.is_list

    @property
    def required(self) -> bool:
        no_factory = self.field.default_factory is dataclasses.MISSING
        return self.field.default is dataclasses.MISSING and no_factory

    @property
    def choices(self) -> tuple[str, ...] | None:
        if "choices" in self.field.metadata:
            return tuple(self.field.metadata["choices"])
        if issubclass(self.kind, enum.Enum):
            return tuple(member.value for member in self.kind)
        return None

    def parse(self, text: str) -> object:
        """The value `text` gives this setting; ValueError saying why it is not one."""
        if self.is_list:
            return [self._parse_one(part.strip()) for part in text.split(",") if part.strip()]
        return self._parse_one(text)

    def _parse_one(self, text: str) -> object:
        if self.choices is not None and text not in self.choices:
            raise ValueError(f"{text!r} is not one of {', '.join(self.choices)}")
        if self.kind is bool:
            if text.lower() not in _TRUE + _FALSE:
                raise ValueError(f"{text!r} is not a boolean (true/false, 1/0, yes/no, on/off)")
            return text.lower() in _TRUE
        try:
            return self.kind(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a valid {self.kind.__name__}") from None

    def to_text(self, value: object) -> str:
        """`value` as this setting's flag takes it (the inverse of `parse`)."""
        items = cast("Iterable[object]", value) if self.is_list else [value]
        return ",".join(str(v.value if isinstance(v, enum.Enum) else v) for v in items)

    @property
    def metavar(self) -> str:
        if "metavar" in self.field.metadata:
            return str(self.field.metadata["metavar"])
        if self.choices is not None:
            return "{" + ",".join(self.choices) + "}"
        return self.name.upper().replace("-", "_")

    def help(self) -> str:
        notes = []
        default = self._default_help()
        if self.required and not self.positional:
            notes.append("required")
        elif default is not None:
            notes.append(f"default: {default}")
        if not self.positional:
            notes.append("env " + ", ".join(f"${name}" for name in self.env_names))
        text = f"{self.field.metadata['help']} ({'; '.join(notes)})"
        return text.replace("%", "%%")  # argparse formats help with %

    def _default_help(self) -> str | None:
        if "default_help" in self.field.metadata:
            return str(self.field.metadata["default_help"])
        default = self.field.default
        if default is dataclasses.MISSING or default is None or default == []:
            return None
        if self.is_flag_switch:
            return "on" if default else "off"
        return self.to_text(default)


@cache
def settings(config_cls: type) -> tuple[Setting, ...]:
    """Every setting of `config_cls`, nested configs' included, in field order."""
    found = tuple(_settings(config_cls, ()))
    names = [s.name for s in found]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise TypeError(f"{config_cls.__name__}: two fields make the flag(s) {duplicates}")
    return found


def _settings(config_cls: type, prefix: tuple[str, ...]) -> Iterator[Setting]:
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        if not f.init:
            continue
        kind, is_list = _value_type(hints[f.name])
        if dataclasses.is_dataclass(kind):
            yield from _settings(kind, (*prefix, f.name))
            continue
        if "help" not in f.metadata:
            raise TypeError(f"{config_cls.__name__}.{f.name} has no help text (metadata)")
        yield Setting((*prefix, f.name), f, kind, is_list)


def _value_type(hint: Any) -> tuple[type, bool]:
    """(the type of one value, whether a list): `int | None` -> (int, False)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        [hint] = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    if typing.get_origin(hint) is list:
        return typing.get_args(hint)[0], True
    return hint, False


def add_flags(parser: argparse.ArgumentParser, config_cls: type) -> None:
    """Add a flag (or positional argument) with help text for every setting of `config_cls`.

    A flag left out leaves no attribute in the parsed namespace, so that
    `config_from_args` can tell it from one given with the default's value.
    """
    for s in settings(config_cls):
        if s.positional:
            parser.add_argument(s.dest, type=_argparse_type(s), metavar=s.metavar, help=s.help())
        elif s.is_flag_switch:
            parser.add_argument(
                s.flag,
                dest=s.dest,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=s.help(),
            )
        else:
            parser.add_argument(
                s.flag,
                dest=s.dest,
                type=_argparse_type(s),
                default=argparse.SUPPRESS,
                metavar=s.metavar,
                help=s.help(),
            )


def _argparse_type(s: Setting) -> Callable[[str], object]:
    def parse(text: str) -> object:
        try:
            return s.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def config_from_args(
    config_cls: type, args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> Any:
    """The `config_cls` that the flags in `args`, then the environment, then the defaults give.

    Raises ConfigError naming the variable of a value that does not parse, the flag of a
    required setting given nowhere, and the variables read when the config refuses a value.
    An empty variable counts as unset (as a manifest's `value: ""` means).
    """
    environ = os.environ if environ is None else environ
    values: dict[tuple[str, ...], object] = {}
    from_env: list[str] = []
    for s in settings(config_cls):
        if hasattr(args, s.dest):
            values[s.path] = getattr(args, s.dest)
            continue
        name = next((n for n in s.env_names if environ.get(n, "") and not s.positional), None)
        if name is not None:
            try:
                values[s.path] = s.parse(environ[name])
            except ValueError as exc:
                raise ConfigError(f"${name}={environ[name]!r}: {exc}") from None
            from_env.append(f"${name}")
        elif s.required:
            raise ConfigError(f"{s.flag} (or ${s.env_names[0]}) is required")
    try:
        return _build(config_cls, (), values)
    except ValueError as exc:
        read = f" (read from the environment: {', '.join(from_env)})" if from_env else ""
        raise ConfigError(f"{exc}{read}") from exc


def _build(
    config_cls: type, prefix: tuple[str, ...], values: Mapping[tuple[str, ...], object]
) -> Any:
    hints = typing.get_type_hints(config_cls)
    kwargs = {}
    for f in dataclasses.fields(config_cls):
        path = (*prefix, f.name)
        kind, _ = _value_type(hints[f.name]) if f.init else (None, False)
        if f.init and dataclasses.is_dataclass(kind):
            kwargs[f.name] = _build(kind, path, values)
        elif path in values:
            kwargs[f.name] = values[path]
    return config_cls(**kwargs)


def to_args(config_cls: type, **values: object) -> list[str]:
    """The arguments that give a child process these settings, by field name (nested
    configs' fields by their own names): `to_args(WorkerConfig, role="decode", port=0)`
    is `["decode", "--port", "0"]`. A None value is left out (the child's default)."""
    by_field = {s.field.name: s for s in settings(config_cls)}
    unknown = sorted(set(values) - set(by_field))
    if unknown:
        raise TypeError(f"{config_cls.__name__} has no setting(s) {unknown}")
    positional: list[str] = []
    flags: list[str] = []
    for s in settings(config_cls):
        value = values.get(s.field.name)
        if value is None:
            continue
        if s.positional:
            positional.append(s.to_text(value))
        elif s.is_flag_switch:
            flags.append(s.flag if value else f"--no-{s.name}")
        else:
            flags += [s.flag, s.to_text(value)]
    return positional + flags


def flag_names(config_cls: type) -> Sequence[str]:
    """Every flag of `config_cls` (`--block-size`, ...), positional arguments left out."""
    return [s.flag for s in settings(config_cls) if not s.positional]
