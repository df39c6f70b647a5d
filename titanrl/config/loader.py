"""Build a JobConfig: dataclass defaults <- TOML file <- command-line overrides, then validate.

Command line grammar (everything is checked against the schema, nothing is guessed):
  --config PATH | --config=PATH       TOML file to start from (default: the built-in defaults)
  --section.key=value | --section.key value
  --a.b.c=value                       nested sections
  --optimizer.betas=[0.9,0.95]        lists: TOML array syntax, or [a,b] / a,b
  --compile.enable | --compile.enable=false | --compile.enable false | --no-compile.enable
  --lr_scheduler.decay_steps=none     Optional fields take none/null
  --rl.global-batch-size=8            dashes in keys mean underscores
  --print-config                      print the resolved TOML and exit 0
  --help | -h                         list every key with type, value and doc, and exit 0
Later overrides win over earlier ones.
"""

from __future__ import annotations

import os
import sys
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from titanrl.config.coerce import Mismatch, from_cli, from_toml
from titanrl.config.errors import ConfigError
from titanrl.config.job_config import JobConfig
from titanrl.config.schema import (
    FieldSpec,
    fields_of,
    lookup,
    normalize_key,
    optional_inner,
    table_list_of,
    type_label,
    unknown_key_error,
)
from titanrl.config.serialize import config_to_toml

ConfigT = TypeVar("ConfigT")

CONFIG_FLAG = "--config"
PRINT_CONFIG_FLAG = "--print-config"
HELP_FLAGS = ("--help", "-h")
_BOOL_WORDS = {"true", "false", "1", "0", "yes", "no", "on", "off"}


@dataclass
class CommandLine:
    """argv split into what it asks for; the overrides are still raw tokens."""

    config_path: str | None = None
    overrides: list[str] = field(default_factory=list)
    show_help: bool = False
    print_config: bool = False


def split_command_line(argv: Sequence[str]) -> CommandLine:
    """Pull --config/--help/--print-config out of argv; every other token is an override."""
    cmd = CommandLine()
    tokens = list(argv)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token == CONFIG_FLAG:
            if i + 1 >= len(tokens) or tokens[i + 1].startswith("--"):
                raise ConfigError("--config expects a path to a TOML file")
            cmd.config_path = tokens[i + 1]
            i += 1
        elif token.startswith(CONFIG_FLAG + "="):
            cmd.config_path = token.split("=", 1)[1]
        elif token in HELP_FLAGS:
            cmd.show_help = True
        elif token == PRINT_CONFIG_FLAG:
            cmd.print_config = True
        else:
            cmd.overrides.append(token)
        i += 1
    return cmd


def parse_args(argv: Sequence[str], *, root: type[ConfigT] = JobConfig) -> ConfigT:
    """The validated config that ``argv`` asks for (see the module doc for the grammar).

    Like argparse, ``--help`` and ``--print-config`` print to stdout and raise SystemExit(0).
    User mistakes raise ConfigError; print ``str(err)`` and exit 2.
    """
    cmd = split_command_line(argv)
    if cmd.show_help:
        from titanrl.config.help import format_help  # only needed here

        cfg = load_config(cmd.config_path, cmd.overrides, validate=False, root=root)
        print(format_help(cfg, config_path=cmd.config_path))
        raise SystemExit(0)
    cfg = load_config(cmd.config_path, cmd.overrides, root=root)
    if cmd.print_config:
        print(config_to_toml(cfg), end="")
        raise SystemExit(0)
    return cfg


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Sequence[str] = (),
    *,
    validate: bool = True,
    root: type[ConfigT] = JobConfig,
) -> ConfigT:
    """Defaults, then the TOML file at ``path`` (None = defaults only), then ``overrides``.

    ``overrides`` are command-line tokens (``"--rollout.n=8"``, ``"--rollout.n", "8"``); the
    ``--`` may be left out in the ``key=value`` form (``"rollout.n=8"``).
    """
    cfg = root()
    if path is not None:
        apply_table(cfg, load_toml(path), source=str(path))
    apply_overrides(cfg, overrides)
    if validate and hasattr(cfg, "validate"):
        cfg.validate()
    return cfg


def config_from_dict(
    data: dict[str, Any], *, source: str = "<dict>", root: type[ConfigT] = JobConfig
) -> ConfigT:
    """Rebuild a config from ``config_to_dict`` output (e.g. from a checkpoint); not validated."""
    cfg = root()
    apply_table(cfg, data, source=source)
    return cfg


def load_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    file = Path(path).expanduser()
    try:
        with file.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err.strerror or err}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path} is not valid TOML: {err}") from None


def apply_table(cfg: Any, table: dict[str, Any], *, source: str) -> None:
    """Set every key of a (nested) TOML table on ``cfg``; unknown keys and wrong types raise."""
    _apply_table(cfg, type(cfg), table, [], source)


def _apply_table(
    obj: Any, root: type, table: dict[str, Any], prefix: list[str], source: str
) -> None:
    specs = fields_of(type(obj))
    for raw_key, value in table.items():
        key = normalize_key(raw_key)
        path = [*prefix, key]
        dotted = ".".join(path)
        if key not in specs:
            raise unknown_key_error(root, path, source)
        spec = specs[key]
        if spec.is_section:
            if not isinstance(value, dict):
                raise ConfigError(
                    f"'{dotted}' is a section: write it as a [{dotted}] table, "
                    f"got {_show(value)} (from {source})"
                )
            _apply_table(getattr(obj, key), root, value, path, source)
            continue
        element = table_list_of(spec.type)
        if element is not None:
            if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
                raise ConfigError(f"'{dotted}' is an array of tables: write each entry as a [[{dotted}]] table "
                                  f"(or '{key} = []'), got {_show(value)} (from {source})")
            items = []
            for i, entry in enumerate(value):
                item = element()
                _apply_table(item, root, entry, [*path[:-1], f"{key}[{i}]"], source)
                items.append(item)
            setattr(obj, key, items)
            continue
        try:
            converted = from_toml(value, spec.type)
        except Mismatch as err:
            raise _type_error(dotted, spec, value, source, err, from_file=True) from None
        setattr(obj, key, converted)


def apply_overrides(cfg: Any, overrides: Sequence[str]) -> None:
    """Apply command-line override tokens to ``cfg`` in order."""
    root = type(cfg)
    tokens = list(overrides)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token.startswith("--"):
            body = token[2:]
        elif "=" in token and not token.startswith("-"):
            body = token
        else:
            raise ConfigError(
                f"unexpected argument {token!r}: overrides look like --section.key=value"
            )
        key, eq, text = body.partition("=")
        if not key:
            raise ConfigError(
                f"unexpected argument {token!r}: overrides look like --section.key=value"
            )
        raw: str | None = text if eq else None
        negated = False
        if raw is None and key.startswith("no-") and _is_known_key(root, key[3:]):
            if not _is_bool(lookup(root, key[3:], token)[1].type):
                raise ConfigError(f"{token}: the --no- form is only for boolean keys")
            key, negated = key[3:], True
        source = f"--{key}"
        path, spec = lookup(root, key, source)
        if spec.is_section:
            raise ConfigError(
                f"'{key}' is a section, not a value: set its keys, e.g. --{key}."
                f"{next(iter(fields_of(spec.type)))}=... "
                f"Valid keys in [{key}]: {', '.join(fields_of(spec.type))}"
            )
        if table_list_of(spec.type) is not None:
            raise ConfigError(f"{'.'.join(path)} is an array of tables: set it in the TOML file as [[{'.'.join(path)}]] "
                              "tables, not on the command line")
        if negated:
            raw = "false"
        elif raw is None and _is_bool(spec.type):
            # A bare flag means true; "--compile.enable false" also works.
            follows = tokens[i + 1] if i + 1 < len(tokens) else None
            if follows is not None and follows.strip().lower() in _BOOL_WORDS:
                raw = follows
                i += 1
            else:
                raw = "true"
        elif raw is None:
            if i + 1 >= len(tokens) or tokens[i + 1].startswith("--"):
                raise ConfigError(
                    f"{'.'.join(path)} expects {type_label(spec.type)}, got no value "
                    f"(from {source}); "
                    f"write --{key}=VALUE or --{key} VALUE"
                )
            raw = tokens[i + 1]
            i += 1
        try:
            value = from_cli(raw, spec.type)
        except Mismatch as err:
            raise _type_error(".".join(path), spec, raw, source, err, from_file=False) from None
        _set_path(cfg, path, value)
        i += 1


def _is_bool(tp: Any) -> bool:
    return tp is bool


def _is_known_key(root: type, dotted: str) -> bool:
    try:
        return not lookup(root, dotted, "")[1].is_section
    except ConfigError:
        return False


def _set_path(cfg: Any, path: list[str], value: Any) -> None:
    obj = cfg
    for part in path[:-1]:
        obj = getattr(obj, part)
    setattr(obj, path[-1], value)


def _type_error(
    dotted: str, spec: FieldSpec, value: Any, source: str, err: Mismatch, *, from_file: bool
) -> ConfigError:
    detail = f"; {err.detail}" if err.detail else ""
    scalar = optional_inner(spec.type) or spec.type
    if from_file and isinstance(value, str) and scalar in (bool, int, float):
        try:  # lr = "1e-4": right text, wrong TOML type
            from_cli(value, spec.type)
            detail += "; it is a quoted string in the TOML file, write it without quotes"
        except Mismatch:
            pass
    return ConfigError(
        f"{dotted} expects {type_label(spec.type)}, got {_show(value)} (from {source}){detail}"
    )


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a table"
    return repr(value)


def parse_args_or_exit(argv: Sequence[str] | None = None) -> JobConfig:
    """``parse_args`` for entry points: a ConfigError is printed (no traceback, once per host: ``console.refuse``)
    and exits 2."""
    try:
        return parse_args(sys.argv[1:] if argv is None else argv)
    except ConfigError as err:
        from titanrl.console import refuse

        raise SystemExit(refuse(str(err))) from None
