"""What keys a config dataclass has: resolved types, field docstrings, dotted-key lookup.

Generic over the root dataclass so the loader and tests can use any schema that follows the rules
in job_config.py; nothing here knows about JobConfig's sections.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

from titanrl.config.errors import ConfigError


@dataclass(frozen=True)
class FieldSpec:
    """One field of a config dataclass."""

    name: str
    type: Any  # resolved annotation (typing objects, not strings)
    doc: str  # the field's docstring, "" if it has none
    is_section: bool  # a nested config dataclass (TOML table) rather than a value


def is_config_class(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


@functools.cache
def fields_of(cls: type) -> dict[str, FieldSpec]:
    """Public fields of ``cls`` in declaration order; types are checked against the schema rules."""
    hints = typing.get_type_hints(cls)
    docs = _field_docstrings(cls)
    specs = {}
    for f in dataclasses.fields(cls):
        if f.name.startswith("_"):
            continue
        tp = hints[f.name]
        _check_supported(tp, f"{cls.__name__}.{f.name}")
        specs[f.name] = FieldSpec(f.name, tp, docs.get(f.name, ""), is_config_class(tp))
    return specs


def _check_supported(tp: Any, where: str) -> None:
    """Schema bugs are TypeErrors at first use, not confusing ConfigErrors for users later."""
    inner = optional_inner(tp)
    if inner is not None:
        if optional_inner(inner) is not None or is_config_class(inner):
            raise TypeError(f"{where}: unsupported Optional type {tp!r}")
        tp = inner
    if is_config_class(tp) or tp in (bool, int, float, str):
        return
    if typing.get_origin(tp) is Literal:
        if not all(isinstance(a, str) for a in typing.get_args(tp)):
            raise TypeError(f"{where}: Literal values must be strings, got {tp!r}")
        return
    if typing.get_origin(tp) is list:
        (element,) = typing.get_args(tp)
        if element in (bool, int, float, str) or typing.get_origin(element) is Literal:
            return
        if is_config_class(element):  # an array of tables ([[section.key]]), set in TOML files only
            for name, sub in fields_of(element).items():
                if sub.is_section or table_list_of(sub.type) is not None:
                    raise TypeError(f"{where}.{name}: tables inside an array of tables are not supported")
            return
    raise TypeError(f"{where}: unsupported config field type {tp!r}")


def table_list_of(tp: Any) -> type | None:
    """The element class of ``list[<config dataclass>]`` (a TOML array of tables), else None."""
    if typing.get_origin(tp) is list:
        (element,) = typing.get_args(tp)
        if is_config_class(element):
            return element
    return None


def optional_inner(tp: Any) -> Any | None:
    """X for ``X | None`` / ``Optional[X]``; None for any other type."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if len(args) == 2 and type(None) in args:
            return args[0] if args[1] is type(None) else args[1]
        raise TypeError(f"unsupported union type {tp!r}: only X | None is allowed")
    return None


def _field_docstrings(cls: type) -> dict[str, str]:
    """The string literal right under each field, as torchtitan writes them (and IDEs show)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (frozen app, REPL): help just has no docs
        return {}
    class_def = ast.parse(source).body[0]
    docs = {}
    body = getattr(class_def, "body", [])
    for node, following in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(following.value.value)
    return docs


def section_doc(cls: type) -> str:
    """First line of a section class docstring, without the leading '[name]' tag."""
    doc = inspect.getdoc(cls) or ""
    first = doc.splitlines()[0] if doc else ""
    if first.startswith("[") and "]" in first:
        first = first.split("]", 1)[1].strip()
    return first


def normalize_key(part: str) -> str:
    """``--rl.global-batch-size`` means ``rl.global_batch_size``."""
    return part.replace("-", "_")


def lookup(root: type, dotted: str, source: str) -> tuple[list[str], FieldSpec]:
    """Resolve ``"a.b.c"`` under ``root`` to (path, spec); an unknown part raises ConfigError."""
    path = [normalize_key(p) for p in dotted.split(".")]
    cls = root
    for depth, part in enumerate(path):
        specs = fields_of(cls)
        if part not in specs:
            raise unknown_key_error(root, path[: depth + 1], source)
        spec = specs[part]
        if depth == len(path) - 1:
            return path, spec
        if not spec.is_section:
            raise ConfigError(
                f"'{'.'.join(path[: depth + 1])}' is a {type_label(spec.type)} value, not a "
                f"section, so '{dotted}' does not exist (from {source})"
            )
        cls = spec.type
    raise AssertionError("unreachable")


def unknown_key_error(root: type, path: list[str], source: str) -> ConfigError:
    """Names the bad key, the closest valid one, and every valid key at that level."""
    parent = _resolve_section(root, path[:-1])
    specs = fields_of(parent)
    name = path[-1]
    at_root = len(path) == 1
    kind = "section" if at_root and all(s.is_section for s in specs.values()) else "key"
    where = "sections" if kind == "section" else f"keys in [{'.'.join(path[:-1])}]"
    if at_root and kind == "key":
        where = "top-level keys"
    guess = _closest(name, list(specs))
    if guess is not None:
        suggestion = ".".join([*path[:-1], guess])
    else:  # maybe the key is in another section (rl.temperature -> rollout.temperature)
        elsewhere = [k for k in all_keys(root) if k.rsplit(".", 1)[-1] == name]
        suggestion = elsewhere[0] if elsewhere else None
    hint = f"; did you mean '{suggestion}'?" if suggestion else "."
    return ConfigError(
        f"unknown {kind} '{'.'.join(path)}' (from {source}){hint} "
        f"Valid {where}: {', '.join(specs)}"
    )


def _closest(name: str, candidates: list[str]) -> str | None:
    matches = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return matches[0] if matches else None


def _resolve_section(root: type, path: list[str]) -> type:
    cls = root
    for part in path:  # "nodes[2]": an entry of an array of tables
        tp = fields_of(cls)[part.split("[", 1)[0]].type
        cls = table_list_of(tp) or tp
    return cls


def all_keys(root: type, prefix: str = "") -> list[str]:
    """Every leaf key under ``root`` as a dotted name, in declaration order."""
    keys = []
    for name, spec in fields_of(root).items():
        dotted = f"{prefix}{name}"
        keys += all_keys(spec.type, f"{dotted}.") if spec.is_section else [dotted]
    return keys


def type_label(tp: Any) -> str:
    """A type's name in messages and --help: float, list[int], one of 'a', 'b', int or none."""
    inner = optional_inner(tp)
    if inner is not None:
        return f"{type_label(inner)} or none"
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        (element,) = typing.get_args(tp)
        if is_config_class(element):
            return "array of tables (TOML file only)"
        return f"list[{type_label(element)}]"
    return getattr(tp, "__name__", repr(tp))
