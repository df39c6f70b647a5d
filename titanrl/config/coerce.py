"""Turn TOML values and command-line strings into values of a field's declared type.

Values are parsed against the declared type, never guessed: ``--job.name=1e3`` stays the string
"1e3", and ``--optimizer.lr=fast`` is an error. The two entry points differ only in their input:
TOML values already carry a type (so a quoted ``lr = "1e-4"`` is rejected, with a hint), command
line values are always strings.
"""

from __future__ import annotations

import math
import tomllib
import typing
from typing import Any, Literal

from titanrl.config.schema import optional_inner

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}
_NONE = {"none", "null"}
# Integers above this are not exactly representable as floats, so "1e30" is refused for an int.
_MAX_EXACT_FLOAT_INT = 2**53


class Mismatch(Exception):
    """A value does not fit the type; ``detail`` says why when the type name alone is not enough."""

    def __init__(self, detail: str = ""):
        super().__init__(detail)
        self.detail = detail


def from_toml(value: Any, tp: Any) -> Any:
    """A value read by tomllib (or from a plain dict) converted to ``tp``; raises Mismatch."""
    inner = optional_inner(tp)
    if inner is not None:
        return None if value is None else from_toml(value, inner)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise Mismatch()
    if tp is int:
        if isinstance(value, bool):
            raise Mismatch()
        if isinstance(value, int):
            return value
        if isinstance(value, float):
            return _integral_float(value)
        raise Mismatch()
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return _finite(float(value))
        raise Mismatch()
    if tp is str:
        if isinstance(value, str):
            return value
        raise Mismatch()
    if typing.get_origin(tp) is Literal:
        if isinstance(value, str) and value in typing.get_args(tp):
            return value
        raise Mismatch()
    if typing.get_origin(tp) is list:
        if not isinstance(value, (list, tuple)):
            raise Mismatch()
        (element,) = typing.get_args(tp)
        return [_element(from_toml, item, element) for item in value]
    raise TypeError(f"unsupported config field type {tp!r}")


def from_cli(text: str, tp: Any) -> Any:
    """A command-line string converted to ``tp``; raises Mismatch."""
    inner = optional_inner(tp)
    if inner is not None:
        return None if text.strip().lower() in _NONE else from_cli(text, inner)
    if tp is bool:
        word = text.strip().lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
        raise Mismatch()
    if tp is int:
        return _parse_int(text)
    if tp is float:
        try:
            return _finite(float(text))
        except ValueError:
            raise Mismatch() from None
    if tp is str:
        return text  # verbatim: the shell already removed any quotes
    if typing.get_origin(tp) is Literal:
        if text in typing.get_args(tp):
            return text
        raise Mismatch()
    if typing.get_origin(tp) is list:
        (element,) = typing.get_args(tp)
        return _parse_list(text, element)
    raise TypeError(f"unsupported config field type {tp!r}")


def _parse_list(text: str, element: Any) -> list[Any]:
    """``[0.9,0.95]``, ``["a", "b,c"]`` (TOML array syntax), ``[a,b]``, ``a,b`` or empty."""
    stripped = text.strip()
    toml_error = None
    if stripped.startswith("["):
        try:
            items = tomllib.loads(f"v = {stripped}")["v"]
            return [_element(from_toml, item, element) for item in items]
        except tomllib.TOMLDecodeError as error:
            toml_error = error
        except Mismatch:
            pass
        # Not TOML (``[model,loss]``) or TOML of other types (``[1,2]`` for list[str]): read it as comma-separated
        # words instead
        if not stripped.endswith("]"):
            raise Mismatch("unbalanced '['")
        stripped = stripped[1:-1].strip()
    if not stripped:
        return []
    words = [item.strip() for item in stripped.split(",")]
    if toml_error is not None and any(w[:1] in ('"', "'") for w in words):
        # quoted strings TOML refused (a control character, a bad escape): never the quotes as part of a value
        raise Mismatch(f"a quoted list that is not a TOML array ({toml_error}); escape control characters as "
                       "\\uXXXX")
    return [_element(from_cli, w, element) for w in words]


def _element(convert, item: Any, element: Any) -> Any:
    try:
        return convert(item, element)
    except Mismatch:
        raise Mismatch(f"element {item!r} is not {_a(element)}") from None


def _a(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    name = tp.__name__
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def _parse_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        pass
    try:  # "4e9" for byte counts; only when the float is an exact integer
        return _integral_float(float(text))
    except ValueError:
        raise Mismatch() from None


def _integral_float(value: float) -> int:
    if math.isfinite(value) and value.is_integer() and abs(value) <= _MAX_EXACT_FLOAT_INT:
        return int(value)
    raise Mismatch("not a whole number")


def _finite(value: float) -> float:
    # nan/inf are refused: nan would break config equality (and the round trip), and no field
    # has a meaning for infinity (0 is the "off" value where one is needed).
    if math.isfinite(value):
        return value
    raise Mismatch("not a finite number")
