"""Dataset schemas: how one row of a titanrl, verl, EasyR1 or column-mapped dataset becomes a sample.

- titanrl: ``prompt``, ``answer``, ``media`` [{path, kind}], ``source``, optional ``answer_choices``, ``system``;
- verl: ``prompt`` (a chat list), ``reward_model.ground_truth``, ``images``, ``videos``, ``data_source``;
- easyr1: ``problem``, ``answer``, ``images``, ``videos`` (source: the file name);
- columns: ``data.prompt_key``, ``data.answer_key``, ``data.image_key``, ``data.video_key``, and
  ``data.system_prompt`` for rows without a system message (source: a ``source`` column or the file name);
- chat: ``messages`` (an optional system message, one user message, optionally the answer as a final assistant
  message) whose content parts carry the media inline (``{"type": "image", "image": path | data URI | bytes}``,
  ``{"type": "image_url", "image_url": {"url": ...}}``, ``{"type": "video", "video": path}``: Qwen2.5-VL's own
  examples), or bare ``{"type": "image"}`` parts / ``<image>`` in the text filled in order from ``images`` /
  ``videos`` columns (TRL's and LLaMA-Factory's layout); the answer from ``answer``, ``solution`` or
  ``ground_truth`` (else the final assistant message); source: ``source``, ``data_source`` or the file name.

A prompt is a string with ``<image>`` / ``<video>`` placeholders, or a chat list
(``[{"role": "system"|"user", "content": str | [parts]}]``, parts ``{"type": "text", "text": ...}``,
``{"type": "image"}``, ``{"type": "video"}``); its placeholders must match the media one for one, in
order per kind. An image is a path (relative to the data file, or absolute; ``file://`` allowed), raw
bytes, a base64 ``data:`` URI, or ``{"bytes": ..., "path": ...}`` (Hugging Face's Image feature, verl's
entries; bytes win when both are set). A video is a path (or ``{"path"|"video": path}``). The id is the
row's ``id`` when it has one, else ``<file stem>-<row>``.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from titanrl.data.manifest import (PLACEHOLDER_BY_KIND, conversation_placeholders, history_problem,
                                   prompt_placeholders)
from titanrl.data.tables import DatasetError, Row

FORMATS: tuple[str, ...] = ("titanrl", "verl", "easyr1", "columns", "chat")


class BadRow(DatasetError):
    """One row that cannot become a sample; the message names the file, row and key."""


@dataclass(frozen=True)
class ColumnMap:
    """The columns of a ``columns`` dataset (DataConfig's prompt_key, answer_key, ...)."""

    prompt_key: str = "prompt"
    answer_key: str = "answer"
    image_key: str = "images"
    video_key: str = "videos"
    system_prompt: str = ""


@dataclass
class MediaRef:
    kind: str  # "image" | "video"
    key: str  # where it came from in the row, for errors: "images[0]"
    path: Path | None = None  # a file (absolute)
    data: bytes | None = None  # embedded bytes
    frames: list["MediaRef"] | None = None  # a video given as its frames (images, in display order)
    fps: float | None = None  # the rate those frames were taken at (None: media.FRAME_LIST_FPS)


@dataclass
class Draft:
    """A row read into SampleRecord's fields, its media not yet written anywhere."""

    id: str
    source: str
    prompt: str
    media: list[MediaRef]
    answer: str
    answer_choices: list[str] = field(default_factory=list)
    system: str | None = None
    history: list[dict[str, str]] = field(default_factory=list)  # the conversation before the prompt


def detect_format(row: Row) -> str:
    """The schema of a row by its keys (used by data.format = "auto" on a dataset's first row)."""
    keys = set(row.data)
    if {"prompt", "media", "answer"} <= keys:
        return "titanrl"
    if "reward_model" in keys and "prompt" in keys:
        return "verl"
    if {"problem", "answer"} <= keys:
        return "easyr1"
    if "messages" in keys:
        return "chat"
    raise BadRow(
        f"{row.where}cannot tell the dataset format from its keys {sorted(keys)}: titanrl has prompt/media/answer, "
        "verl prompt/reward_model, EasyR1 problem/answer, chat messages; set data.format = 'columns' with "
        "data.prompt_key, data.answer_key, data.image_key and data.video_key"
    )


def parse_row(row: Row, fmt: str, columns: ColumnMap = ColumnMap()) -> Draft:
    if fmt == "titanrl":
        return _titanrl(row)
    if fmt == "verl":
        reward_model = _get(row, "reward_model", dict)
        answer = _typed(row, "reward_model.ground_truth", reward_model.get("ground_truth", _MISSING), str)
        source = row.data.get("data_source") or row.file.stem
        return _assemble(row, "prompt", answer, "images", "videos", str(source), None)
    if fmt == "easyr1":
        answer = _get(row, "answer", str)
        return _assemble(row, "problem", answer, "images", "videos", row.file.stem, None)
    if fmt == "chat":
        return _chat(row)
    if fmt == "columns":
        answer = _get(row, columns.answer_key, str)
        source = row.data.get("source") or row.file.stem
        return _assemble(row, columns.prompt_key, answer, columns.image_key, columns.video_key, str(source),
                         columns.system_prompt or None)
    raise ValueError(f"unknown format {fmt!r}, expected one of {list(FORMATS)}")


_MISSING = object()


def _typed(row: Row, key: str, value: Any, kind: type) -> Any:
    if value is _MISSING:
        raise BadRow(f"{row.where}missing key {key!r}")
    if not isinstance(value, kind):
        raise BadRow(f"{row.where}key {key!r} must be a {kind.__name__}, got {type(value).__name__} {value!r:.60}")
    return value


def _get(row: Row, key: str, kind: type) -> Any:
    return _typed(row, key, row.data.get(key, _MISSING), kind)


def _row_id(row: Row) -> str:
    value = row.data.get("id")
    if isinstance(value, (str, int)) and not isinstance(value, bool) and str(value):
        return str(value)
    return f"{row.file.stem}-{row.index}"


def _titanrl(row: Row) -> Draft:
    media = []
    for i, raw in enumerate(_get(row, "media", list)):
        key = f"media[{i}]"
        if not (isinstance(raw, dict) and isinstance(raw.get("path"), str) and raw.get("kind") in ("image", "video")):
            raise BadRow(f"{row.where}key {key!r} must be {{'path': str, 'kind': 'image'|'video'}}, got {raw!r:.80}")
        media.append(MediaRef(raw["kind"], key, path=_resolve(row, key, raw["path"])))
    choices = row.data.get("answer_choices") or []
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise BadRow(f"{row.where}key 'answer_choices' must be a list of strings")
    system = row.data.get("system")
    if system is not None and not isinstance(system, str):
        raise BadRow(f"{row.where}key 'system' must be a str, got {type(system).__name__}")
    prompt = _get(row, "prompt", str)
    history = row.data.get("history") or []
    problem = history_problem(history)
    if problem:
        raise BadRow(f"{row.where}{problem}")
    history = [{"role": m["role"], "content": m["content"]} for m in history]
    draft = Draft(_row_id(row), str(row.data.get("source") or row.file.stem), prompt, media, _get(row, "answer", str),
                  list(choices), system, history)
    _check_placeholders(row, "history' and 'prompt" if history else "prompt",
                        conversation_placeholders(history, prompt), [m.kind for m in media])
    return draft


def _assemble(row: Row, prompt_key: str, answer: str, image_key: str, video_key: str, source: str,
              default_system: str | None) -> Draft:
    prompt, system, history = prompt_text(row, prompt_key, row.data.get(prompt_key, _MISSING))
    images = [_image(row, f"{image_key}[{i}]", v) for i, v in enumerate(_media_list(row, image_key))]
    videos = [_video(row, f"{video_key}[{i}]", v) for i, v in enumerate(_media_list(row, video_key))]
    kinds = [m[1:-1] for m in conversation_placeholders(history, prompt)]
    counts = {"image": kinds.count("image"), "video": kinds.count("video")}
    for kind, refs, key in (("image", images, image_key), ("video", videos, video_key)):
        if counts[kind] != len(refs):
            raise BadRow(
                f"{row.where}key {prompt_key!r} has {counts[kind]} {PLACEHOLDER_BY_KIND[kind]} placeholder(s) but "
                f"key {key!r} has {len(refs)} {kind}(s)"
            )
    queues = {"image": iter(images), "video": iter(videos)}
    media = [next(queues[k]) for k in kinds]  # placeholder order
    return Draft(_row_id(row), source, prompt, media, answer, [], system if system is not None else default_system,
                 history)


def _check_placeholders(row: Row, key: str, found: list[str], kinds: list[str]) -> None:
    expected = [PLACEHOLDER_BY_KIND[k] for k in kinds]
    if found != expected:
        raise BadRow(f"{row.where}key {key!r} has placeholders {found} but the media are {expected}")


def prompt_text(row: Row, key: str, value: Any) -> tuple[str, str | None, list[dict[str, str]]]:
    """A string prompt as is; a chat list as (the last user message with placeholders, the system message, the
    conversation before that message: user and assistant messages alternating)."""
    if value is _MISSING:
        raise BadRow(f"{row.where}missing key {key!r}")
    if isinstance(value, str):
        return value, None, []
    if not isinstance(value, list):
        raise BadRow(f"{row.where}key {key!r} must be a str or a list of chat messages, got {type(value).__name__}")
    turns: list[dict[str, str]] = []
    system: str | None = None
    for i, message in enumerate(value):
        where = f"{key}[{i}]"
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise BadRow(f"{row.where}key {where!r} must be a chat message {{'role': ..., 'content': ...}}")
        text = _content_text(row, f"{where}.content", message["content"])
        expected = "user" if len(turns) % 2 == 0 else "assistant"
        if message["role"] == "system" and system is None and not turns:
            system = text
        elif message["role"] == expected:
            if expected == "assistant" and prompt_placeholders(text):
                raise BadRow(f"{row.where}key {where!r}: an assistant message holds no image or video")
            turns.append({"role": expected, "content": text})
        else:
            raise BadRow(f"{row.where}key {where!r}: role {message['role']!r} not supported here (a prompt is an "
                         f"optional system message, then user and assistant messages in turn, ending with a user "
                         f"one; {expected!r} expected here)")
    if not turns:
        raise BadRow(f"{row.where}key {key!r} has no user message")
    if turns[-1]["role"] != "user":
        raise BadRow(f"{row.where}key {key!r} ends with an assistant message: the prompt is the last user message")
    return turns[-1]["content"], system, turns[:-1]


def _content_text(row: Row, key: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRow(f"{row.where}key {key!r} must be a str or a list of parts, got {type(content).__name__}")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            out.append(part["text"])
        elif kind in ("image", "image_url"):
            out.append("<image>")
        elif kind in ("video", "video_url"):
            out.append("<video>")
        else:
            raise BadRow(f"{row.where}key '{key}[{j}]' must be a text, image or video part, got {part!r:.80}")
    return "".join(out)


def _media_list(row: Row, key: str) -> list[Any]:
    value = row.data.get(key)
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


_DATA_URI = re.compile(r"^data:[\w.+/-]*;base64,", re.IGNORECASE)


def _resolve(row: Row, key: str, text: str) -> Path:
    if text.startswith("file://"):
        text = text[len("file://"):]
    path = Path(text).expanduser()
    path = path if path.is_absolute() else row.file.parent / path
    if not path.is_file():
        raise BadRow(f"{row.where}key {key!r} names a missing file {str(path)!r}")
    return path.resolve()


def _data_uri(row: Row, key: str, text: str) -> bytes | None:
    """The bytes of a base64 ``data:`` URI; None when ``text`` is not one (a path)."""
    match = _DATA_URI.match(text)
    if not match:
        return None
    try:
        return base64.b64decode(text[match.end():], validate=True)
    except (binascii.Error, ValueError):
        raise BadRow(f"{row.where}key {key!r} is a data URI with invalid base64") from None


def _image(row: Row, key: str, value: Any) -> MediaRef:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return MediaRef("image", key, data=bytes(value))
    if isinstance(value, str):
        data = _data_uri(row, key, value)
        return MediaRef("image", key, data=data) if data is not None else MediaRef("image", key,
                                                                                    path=_resolve(row, key, value))
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            return _image(row, key, value["bytes"])
        for name in ("path", "image"):
            if value.get(name):
                return _image(row, key, value[name])
    raise BadRow(f"{row.where}key {key!r} must be a path, bytes, a data URI or {{'bytes', 'path'}}, got {value!r:.80}")


# qwen-vl-utils' per-item sampling and resizing keys (a message part's or a media dict's): titanrl samples and resizes
# every item by the run's data.fps / data.max_frames / data.min_pixels / data.max_pixels, so a row setting its own
# is refused by name rather than silently sampled otherwise. (A frame list's "fps" is the rate of its frames: kept.)
_IMAGE_OPTIONS = ("min_pixels", "max_pixels", "resized_height", "resized_width")
_VIDEO_OPTIONS = _IMAGE_OPTIONS + ("total_pixels", "fps", "sample_fps", "nframes", "min_frames", "max_frames",
                                   "video_start", "video_end")


def _refuse_options(row: Row, key: str, item: Any, kind: str, allowed: tuple[str, ...] = ()) -> None:
    if not isinstance(item, dict):
        return
    found = [k for k in (_VIDEO_OPTIONS if kind == "video" else _IMAGE_OPTIONS) if k in item and k not in allowed]
    if found:
        raise BadRow(f"{row.where}key {key!r} sets {', '.join(repr(k) for k in found)} for this {kind} alone; titanrl "
                     f"samples and resizes every {kind} by the run's data.fps / data.max_frames / data.min_pixels / "
                     "data.max_pixels (no per-sample settings): drop the key(s), or set those for the run")


def _video(row: Row, key: str, value: Any, fps: Any = None) -> MediaRef:
    """A video file (a path, its bytes, a data URI or {'bytes', 'path'}), or a video given as the list of its frames
    (each a path, bytes, a data URI or {'bytes', 'path'}) taken at ``fps`` frames per second (a dict's 'fps' key;
    default media.FRAME_LIST_FPS)."""
    if isinstance(value, dict):
        inner = value["bytes"] if value.get("bytes") is not None else value.get("path") or value.get("video")
        _refuse_options(row, key, value, "video", allowed=("fps",) if isinstance(inner, (list, tuple)) else ())
        fps, value = value.get("fps", fps), inner
    if isinstance(value, (bytes, bytearray, memoryview)):  # the file's bytes (HF's Video feature: bytes win)
        return MediaRef("video", key, data=bytes(value))
    if isinstance(value, str):
        data = _data_uri(row, key, value)
        return MediaRef("video", key, data=data) if data is not None else MediaRef("video", key,
                                                                                    path=_resolve(row, key, value))
    if isinstance(value, (list, tuple)) and value:
        if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0):
            raise BadRow(f"{row.where}key {key!r}: the frames' fps must be a positive number, got {fps!r:.40}")
        frames = [_image(row, f"{key}[{j}]", frame) for j, frame in enumerate(value)]
        return MediaRef("video", key, frames=frames, fps=None if fps is None else float(fps))
    raise BadRow(f"{row.where}key {key!r} must be a video (path, bytes, data URI) or a non-empty list of frames, "
                 f"got {value!r:.80}")


# ------------------------------------------------------------------------------------------------------ chat

_ANSWER_KEYS = ("answer", "solution", "ground_truth")


def _chat(row: Row) -> Draft:
    messages = _get(row, "messages", list)
    system: str | None = None
    turns: list[tuple[int, str, Any]] = []  # (index, role, content): user and assistant alternating
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise BadRow(f"{row.where}key {where!r} must be a chat message {{'role': ..., 'content': ...}}")
        role = message["role"]
        expected = "user" if len(turns) % 2 == 0 else "assistant"
        if role == "system" and system is None and not turns:
            system = _content_text(row, f"{where}.content", message["content"])
        elif role == expected:
            turns.append((i, role, message["content"]))
        else:
            raise BadRow(f"{row.where}key {where!r}: role {role!r} not supported here (a prompt is an optional "
                         f"system message, then user and assistant messages in turn, ending with a user one, and "
                         f"optionally the answer as a final assistant message; {expected!r} expected here)")
    if not turns:
        raise BadRow(f"{row.where}key 'messages' has no user message")
    assistant = None
    if turns[-1][1] == "assistant":  # the answer
        assistant = _content_text(row, f"messages[{turns[-1][0]}].content", turns[-1][2])
        turns = turns[:-1]
    history, slots = [], []
    for i, role, content in turns:
        key = f"messages[{i}].content"
        if role == "user":
            text, found = _chat_content(row, key, content)
            slots += found
        else:
            text = _content_text(row, key, content)
            if prompt_placeholders(text):
                raise BadRow(f"{row.where}key {key!r}: an assistant message holds no image or video")
        history.append({"role": role, "content": text})
    prompt = history.pop()["content"]
    key = f"messages[{turns[-1][0]}].content" if not history else "messages"
    columns = {"image": [_image(row, f"images[{i}]", v) for i, v in enumerate(_media_list(row, "images"))],
               "video": [_video(row, f"videos[{i}]", v) for i, v in enumerate(_media_list(row, "videos"))]}
    for kind, refs in columns.items():
        bare = sum(1 for k, ref in slots if k == kind and ref is None)
        if bare != len(refs):
            inline = sum(1 for k, ref in slots if k == kind and ref is not None)
            raise BadRow(f"{row.where}key {key!r} has {bare} {kind} part(s) without the {kind} itself "
                         f"({inline} inline) but key '{kind}s' has {len(refs)} {kind}(s)")
    queues = {kind: iter(refs) for kind, refs in columns.items()}
    media = [ref if ref is not None else next(queues[kind]) for kind, ref in slots]
    answer = next((row.data[k] for k in _ANSWER_KEYS if row.data.get(k) is not None), assistant)
    if answer is None:
        raise BadRow(f"{row.where}no answer: expected a key {' / '.join(repr(k) for k in _ANSWER_KEYS)} or a final "
                     "assistant message")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise BadRow(f"{row.where}the answer must be a string or a number, got {type(answer).__name__} {answer!r:.60}")
    source = row.data.get("source") or row.data.get("data_source") or row.file.stem
    return Draft(_row_id(row), str(source), prompt, media, str(answer), [], system, history)


def _chat_content(row: Row, key: str, content: Any) -> tuple[str, list[tuple[str, MediaRef | None]]]:
    """A user message's text with placeholders, and per placeholder (in order) its kind and its media when the
    part carries it (None: it comes from the row's images / videos column)."""
    if isinstance(content, str):
        return content, [(m[1:-1], None) for m in prompt_placeholders(content)]
    if not isinstance(content, list):
        raise BadRow(f"{row.where}key {key!r} must be a str or a list of parts, got {type(content).__name__}")
    text: list[str] = []
    slots: list[tuple[str, MediaRef | None]] = []
    for j, part in enumerate(content):
        where = f"{key}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            text.append(part["text"])
            slots.extend((m[1:-1], None) for m in prompt_placeholders(part["text"]))
        elif kind in ("image", "image_url"):
            value = part.get("image") if kind == "image" else part.get("image_url")
            _refuse_options(row, where, part, "image")
            if isinstance(value, dict):  # {"url": ...} (OpenAI's image_url part)
                value = value.get("url")
            text.append("<image>")
            slots.append(("image", _image(row, where, value) if value is not None else None))
        elif kind in ("video", "video_url"):
            value = part.get("video") if kind == "video" else part.get("video_url")
            _refuse_options(row, where, part, "video", allowed=("fps",) if isinstance(value, (list, tuple)) else ())
            if isinstance(value, dict) and value.get("url"):  # {"url": ...} (OpenAI's form); else _video's dict
                value = value["url"]
            text.append("<video>")
            # a list: the video's frames (qwen-vl-utils' form), at the part's "fps"
            slots.append(("video", _video(row, where, value, part.get("fps")) if value is not None else None))
        else:
            raise BadRow(f"{row.where}key {where!r} must be a text, image or video part, got {part!r:.80}")
    return "".join(text), slots
