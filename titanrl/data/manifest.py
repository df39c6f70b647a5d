"""The dataset manifest: one JSON object per line (JSONL), one line per sample.

A line looks like::

    {"id": "geo3k-00003", "source": "geo3k",
     "prompt": "<image>\\nWhat colour is the square? ...",
     "media": [{"path": "media/geo3k-00003.png", "kind": "image"}],
     "answer": "red", "answer_choices": ["red", "green", "blue", "yellow"]}

Media paths are relative to the manifest's directory so a dataset folder can be moved or copied to
another machine as a whole; an absolute path is used as is (manifests that ``titanrl.data.sources``
writes for other formats point at the user's files that way). An optional ``"system"`` key holds the
sample's system message, an optional ``"history"`` the conversation before the prompt (``[{"role": "user" |
"assistant", "content": str}, ...]``, alternating, from a user message to an assistant one; the prompt is the user
message after it; media placeholders in the users' messages count before the prompt's). ``source`` is any
non-empty name (the synthetic sets use ``SOURCES``). The prompt holds one placeholder per media entry, in order:
``<image>`` for an image and ``<video>`` for a video; the prompt builder expands them into Qwen's vision tokens.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal

MediaKind = Literal["image", "video"]
MEDIA_KINDS: tuple[str, ...] = ("image", "video")
SOURCES: tuple[str, ...] = ("geo3k", "nextqa", "longvila")
PLACEHOLDER_BY_KIND: dict[str, str] = {"image": "<image>", "video": "<video>"}
_PLACEHOLDER_RE = re.compile(r"<image>|<video>")

_RECORD_KEYS: tuple[str, ...] = ("id", "source", "prompt", "media", "answer", "answer_choices")
_MEDIA_KEYS: tuple[str, ...] = ("path", "kind")


class ManifestError(ValueError):
    """A manifest line that cannot be used; the message names the file, line, sample id and key."""


@dataclass(frozen=True)
class MediaEntry:
    path: str  # relative to the manifest's directory
    kind: MediaKind


@dataclass(frozen=True)
class SampleRecord:
    id: str
    source: str
    prompt: str
    media: list[MediaEntry]
    answer: str
    answer_choices: list[str] = field(default_factory=list)
    system: str | None = None  # the sample's system message; None = the encoder's default
    # the conversation before the prompt: {"role": "user" | "assistant", "content": text with placeholders}, ...
    history: list[dict[str, str]] = field(default_factory=list)

    def to_json_dict(self) -> dict[str, Any]:
        out = {
            "id": self.id,
            "source": self.source,
            "prompt": self.prompt,
            "media": [{"path": m.path, "kind": m.kind} for m in self.media],
            "answer": self.answer,
            "answer_choices": list(self.answer_choices),
        }
        if self.system is not None:
            out["system"] = self.system
        if self.history:
            out["history"] = [{"role": m["role"], "content": m["content"]} for m in self.history]
        return out


def conversation_placeholders(history: Iterable[dict[str, str]], prompt: str) -> list[str]:
    """The media placeholders of a conversation in order: its earlier user messages', then the prompt's."""
    return [p for m in history if m["role"] == "user" for p in prompt_placeholders(m["content"])] + \
        prompt_placeholders(prompt)


def history_problem(history: Any) -> str | None:
    """Why ``history`` is not a conversation before a prompt, as a phrase about key 'history' (None: it is):
    alternating user and assistant text messages from a user one to an assistant one, images and videos only in the
    users'."""
    if not isinstance(history, list):
        return f"key 'history' must be a list of chat messages, got {type(history).__name__}"
    for i, m in enumerate(history):
        role = "user" if i % 2 == 0 else "assistant"
        if not (isinstance(m, dict) and m.get("role") == role and isinstance(m.get("content"), str)):
            return (f"key 'history[{i}]' must be {{'role': {role!r}, 'content': str}} (user and assistant turns "
                    f"alternate), got {m!r:.80}")
        if role == "assistant" and prompt_placeholders(m["content"]):
            return f"key 'history[{i}]': an assistant message holds no media placeholder"
    if len(history) % 2:
        return "key 'history' must end with an assistant message (the prompt is the user message after it)"
    return None


def prompt_placeholders(prompt: str) -> list[str]:
    """The media placeholders in a prompt, in order (``"<image>"`` / ``"<video>"``)."""
    return _PLACEHOLDER_RE.findall(prompt)


def validate_record(record: SampleRecord, *, where: str = "") -> None:
    """Check one record's internal consistency; raise ManifestError with `where` as the prefix."""
    prefix = f"{where}sample {record.id!r}: "
    if not record.id:
        raise ManifestError(f"{where}key 'id' is empty")
    if not record.source:
        raise ManifestError(f"{prefix}key 'source' is empty")
    for i, entry in enumerate(record.media):
        if entry.kind not in MEDIA_KINDS:
            raise ManifestError(
                f"{prefix}key 'media[{i}].kind' is {entry.kind!r}, expected one of {list(MEDIA_KINDS)}"
            )
        if not entry.path:
            raise ManifestError(f"{prefix}key 'media[{i}].path' is empty")
    problem = history_problem(record.history) if record.history else None
    if problem:
        raise ManifestError(f"{prefix}{problem}")
    placeholders = conversation_placeholders(record.history, record.prompt)
    expected = [PLACEHOLDER_BY_KIND[m.kind] for m in record.media]
    keys = "'history' and 'prompt'" if record.history else "'prompt'"
    if len(placeholders) != len(expected):
        raise ManifestError(
            f"{prefix}key {keys} {'have' if record.history else 'has'} {len(placeholders)} media placeholder(s) but "
            f"'media' has {len(expected)} entr{'y' if len(expected) == 1 else 'ies'}"
        )
    if placeholders != expected:
        raise ManifestError(
            f"{prefix}key {keys} placeholders {placeholders} do not match the media kinds {expected} in order"
        )
    if record.answer_choices and record.answer not in record.answer_choices:
        raise ManifestError(
            f"{prefix}key 'answer' is {record.answer!r}, not one of 'answer_choices' {record.answer_choices}"
        )


def write_manifest(records: Iterable[SampleRecord], path: str | Path) -> Path:
    """Validate and write `records` as UTF-8 JSONL; keys keep a fixed order so equal records give equal bytes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    seen_ids: set[str] = set()
    for index, record in enumerate(records):
        validate_record(record, where=f"record {index}: ")
        if record.id in seen_ids:
            raise ManifestError(f"record {index}: key 'id' {record.id!r} is a duplicate")
        seen_ids.add(record.id)
        lines.append(json.dumps(record.to_json_dict(), ensure_ascii=False))
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _require(obj: dict[str, Any], key: str, kind: type, where: str) -> Any:
    if key not in obj:
        raise ManifestError(f"{where}missing key {key!r}")
    value = obj[key]
    if not isinstance(value, kind):
        raise ManifestError(f"{where}key {key!r} must be a {kind.__name__}, got {type(value).__name__}")
    return value


def parse_record(obj: Any, *, where: str = "") -> SampleRecord:
    """Build a SampleRecord from one decoded JSON object, with errors naming the sample id and key."""
    if not isinstance(obj, dict):
        raise ManifestError(f"{where}expected a JSON object, got {type(obj).__name__}")
    sample_id = obj.get("id")
    if isinstance(sample_id, str):
        where = f"{where}sample {sample_id!r}: "
    for key in _RECORD_KEYS:
        if key not in obj:
            raise ManifestError(f"{where}missing key {key!r}")
    _require(obj, "id", str, where)
    source = _require(obj, "source", str, where)
    prompt = _require(obj, "prompt", str, where)
    answer = _require(obj, "answer", str, where)
    raw_media = _require(obj, "media", list, where)
    raw_choices = _require(obj, "answer_choices", list, where)
    media = []
    for i, raw in enumerate(raw_media):
        item_where = f"{where}media[{i}]: "
        if not isinstance(raw, dict):
            raise ManifestError(f"{item_where}expected a JSON object, got {type(raw).__name__}")
        for key in _MEDIA_KEYS:
            if key not in raw:
                raise ManifestError(f"{item_where}missing key {key!r}")
        path = _require(raw, "path", str, item_where)
        media.append(MediaEntry(path=path, kind=_require(raw, "kind", str, item_where)))
    if not all(isinstance(c, str) for c in raw_choices):
        raise ManifestError(f"{where}key 'answer_choices' must be a list of strings")
    system = obj.get("system")
    if system is not None and not isinstance(system, str):
        raise ManifestError(f"{where}key 'system' must be a str, got {type(system).__name__}")
    history = obj.get("history") or []
    problem = history_problem(history)
    if problem:
        raise ManifestError(f"{where}{problem}")
    return SampleRecord(
        id=obj["id"], source=source, prompt=prompt, media=media, answer=answer, answer_choices=list(raw_choices),
        system=system, history=[{"role": m["role"], "content": m["content"]} for m in history],
    )


def read_manifest(path: str | Path, *, check_files: bool = False) -> list[SampleRecord]:
    """Read and validate a JSONL manifest. With `check_files`, every media file must exist."""
    path = Path(path)
    if not path.is_file():
        raise ManifestError(f"manifest {str(path)!r} does not exist")
    root = path.parent
    records: list[SampleRecord] = []
    seen_ids: dict[str, int] = {}
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue  # tolerate blank lines (e.g. a trailing newline added by an editor)
            where = f"{path}:{line_number}: "
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as error:
                raise ManifestError(f"{where}invalid JSON ({error.msg} at column {error.colno})") from None
            record = parse_record(obj, where=where)
            validate_record(record, where=where)
            if record.id in seen_ids:
                raise ManifestError(
                    f"{where}key 'id' {record.id!r} duplicates the id on line {seen_ids[record.id]}"
                )
            seen_ids[record.id] = line_number
            if check_files:
                for i, entry in enumerate(record.media):
                    if not (root / entry.path).is_file():
                        raise ManifestError(
                            f"{where}sample {record.id!r}: key 'media[{i}].path' names a missing file "
                            f"{str(root / entry.path)!r}"
                        )
            records.append(record)
    return records


def media_path(manifest_path: str | Path, entry: MediaEntry) -> Path:
    """The absolute-or-cwd-relative path of a media entry (relative entries are relative to the manifest dir;
    an absolute entry stays as it is)."""
    return Path(manifest_path).parent / entry.path
