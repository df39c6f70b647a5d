"""Config -> plain dict / TOML text / file. The inverse of loader.py: what is written reloads equal.

A small writer of our own because the standard library only reads TOML, and our values are a
closed set (bool, int, float, str, flat lists, nested tables), so a dependency is not worth it.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import Any

from titanrl.config.schema import fields_of, section_doc, table_list_of

_BASIC_ESCAPES = {
    '"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r",
}


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """Nested plain dict of every field (None kept, lists copied); JSON- and TOML-friendly."""
    result = {}
    for name, spec in fields_of(type(cfg)).items():
        value = getattr(cfg, name)
        if spec.is_section:
            result[name] = config_to_dict(value)
        elif table_list_of(spec.type) is not None:
            result[name] = [config_to_dict(v) for v in value]
        elif isinstance(value, list):
            result[name] = list(value)
        else:
            result[name] = value
    return result


def config_to_toml(cfg: Any, *, with_docs: bool = True) -> str:
    """Human-readable TOML of the fully resolved config; ``with_docs`` adds each field's doc."""
    lines: list[str] = []
    _write_table(cfg, [], lines, with_docs)
    return "\n".join(lines).strip("\n") + "\n"


def save_resolved(cfg: Any, path: str | os.PathLike[str]) -> Path:
    """Write ``config_to_toml(cfg)`` to ``path`` (parents created, atomic replace); returns it."""
    target = Path(path).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write-then-rename so a crash (or a reader on another rank) never sees half a file.
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(config_to_toml(cfg))
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _write_table(obj: Any, path: list[str], lines: list[str], with_docs: bool) -> None:
    specs = fields_of(type(obj))
    arrays = [s for s in specs.values() if table_list_of(s.type) is not None]
    values = [s for s in specs.values() if not s.is_section and s not in arrays]
    if path and (values or arrays or with_docs):
        lines.append("")
        if with_docs and section_doc(type(obj)):
            lines.append(f"# {section_doc(type(obj))}")
        lines.append(f"[{'.'.join(path)}]")
    for spec in values:
        value = getattr(obj, spec.name)
        if with_docs and spec.doc:
            lines += [f"# {line}" for line in spec.doc.splitlines()]
        if value is None:  # TOML has no null: leave it out; reloading gives the None default back
            if with_docs:
                lines.append(f"# {spec.name} = none (unset)")
            continue
        lines.append(f"{spec.name} = {format_value(value)}")
    for spec in arrays:  # after the table's plain keys: [[a.b]] opens a new table
        entries = getattr(obj, spec.name)
        if with_docs and spec.doc:
            lines += [f"# {line}" for line in spec.doc.splitlines()]
        if not entries:
            lines.append(f"{spec.name} = []")
        for entry in entries:
            lines += ["", f"[[{'.'.join([*path, spec.name])}]]"]
            for sub in fields_of(type(entry)).values():
                value = getattr(entry, sub.name)
                if value is not None:
                    lines.append(f"{sub.name} = {format_value(value)}")
    for spec in specs.values():
        if spec.is_section:
            _write_table(getattr(obj, spec.name), [*path, spec.name], lines, with_docs)


def format_value(value: Any) -> str:
    """One value as a TOML literal."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        # Underscores make byte counts readable (268_435_456); tomllib reads them back.
        return f"{value:_}" if abs(value) >= 100_000 else str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"cannot write non-finite float {value!r} as a config value")
        return repr(value)  # shortest form that reads back to the same float
    if isinstance(value, str):
        return _basic_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} value {value!r} as TOML")


def _basic_string(text: str) -> str:
    out = []
    for ch in text:
        if ch in _BASIC_ESCAPES:
            out.append(_BASIC_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:  # TOML forbids raw control characters
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'
