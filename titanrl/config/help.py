"""The ``--help`` listing: every key with its type, current value and doc."""

from __future__ import annotations

from typing import Any

from titanrl.config.schema import fields_of, section_doc, table_list_of, type_label
from titanrl.config.serialize import format_value

USAGE = (
    "usage: python -m titanrl.config [--config FILE.toml] [--section.key=VALUE ...] "
    "[--print-config] [--help]"
)


def format_help(cfg: Any, *, config_path: str | None = None) -> str:
    """Usage plus one entry per key; values are those of ``cfg`` (file + overrides applied)."""
    origin = config_path if config_path else "the built-in defaults"
    lines = [
        USAGE,
        "",
        "Overrides: --section.key=VALUE or --section.key VALUE; booleans also --key / --no-key;",
        "lists as [a,b] or a,b; optional keys take 'none'. Later overrides win.",
        f"Values shown are from {origin}, with any overrides on the command line applied.",
    ]
    _section_help(cfg, [], lines)
    return "\n".join(lines) + "\n"


def _section_help(obj: Any, path: list[str], lines: list[str]) -> None:
    specs = fields_of(type(obj))
    if path:
        doc = section_doc(type(obj))
        lines += ["", f"[{'.'.join(path)}]" + (f"  {doc}" if doc else "")]
    for spec in specs.values():
        if spec.is_section:
            continue
        value = getattr(obj, spec.name)
        element = table_list_of(spec.type)
        if element is not None:  # [[a.b]] tables: their count here, each entry's keys and docs below
            dotted = ".".join([*path, spec.name])
            lines.append(f"  {dotted}: {type_label(spec.type)} = {len(value)} table(s)")
            if spec.doc:
                lines += [f"      {line}" for line in spec.doc.splitlines()]
            for i, entry in enumerate(value):
                shown = ", ".join(f"{k}={format_value(v)}" for k, v in
                                  ((n, getattr(entry, n)) for n in fields_of(element)) if v is not None)
                lines.append(f"      [[{dotted}]] #{i}: {shown}")
            for name, sub in fields_of(element).items():
                lines.append(f"      {name}: {type_label(sub.type)}" + (f" - {sub.doc.splitlines()[0]}" if sub.doc else ""))
            continue
        shown = "none" if value is None else format_value(value)
        lines.append(f"  --{'.'.join([*path, spec.name])}: {type_label(spec.type)} = {shown}")
        if spec.doc:
            lines += [f"      {line}" for line in spec.doc.splitlines()]
    for spec in specs.values():
        if spec.is_section:
            _section_help(getattr(obj, spec.name), [*path, spec.name], lines)
