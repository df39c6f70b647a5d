"""From a manifest prompt to the token ids the trainer sees and the text vLLM sees.

The manifest prompt carries ``<image>`` / ``<video>`` placeholders. Both sides render it with
the checkpoint's own chat template (one ``<|vision_start|><|image_pad|><|vision_end|>`` per
item). vLLM receives that text and expands each pad itself; the trainer tokenizes the same
text and expands each pad to the item's token count from its grid. Pads are special tokens,
so expansion after tokenization equals tokenizing the expanded text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from titanrl.models.vision_grid import VisionGrid

_PLACEHOLDER = re.compile(r"<(image|video)>")


def _parts(text: str) -> list[dict[str, Any]]:
    """A placeholder text as chat-template content parts, in order."""
    content: list[dict[str, Any]] = []
    pos = 0
    for m in _PLACEHOLDER.finditer(text):
        if m.start() > pos:
            content.append({"type": "text", "text": text[pos : m.start()]})
        content.append({"type": m.group(1)})
        pos = m.end()
    if pos < len(text):
        content.append({"type": "text", "text": text[pos:]})
    return content


def chat_messages(prompt: str, system: str | None = None,
                  history: Sequence[dict[str, str]] = ()) -> list[dict[str, Any]]:
    """The chat messages of a sample: its system message, the conversation before the prompt
    (``SampleRecord.history``), then the prompt as a user message, placeholders split into content parts."""
    messages: list[dict[str, Any]] = []
    if system is not None:
        messages.append({"role": "system", "content": system})
    for m in history:
        messages.append({"role": m["role"], "content": _parts(m["content"]) if m["role"] == "user"
                         else [{"type": "text", "text": m["content"]}]})
    messages.append({"role": "user", "content": _parts(prompt)})
    return messages


@dataclass
class PromptEncoder:
    """Renders and tokenizes prompts for one checkpoint (tokenizer + chat template)."""

    tokenizer: Any
    image_token_id: int
    video_token_id: int
    spatial_merge_size: int = 2
    system: str | None = None

    @classmethod
    def from_pretrained(cls, path: str | Path, system: str | None = None) -> "PromptEncoder":
        import json

        from transformers import AutoTokenizer

        cfg = json.loads((Path(path) / "config.json").read_text())
        merge = (cfg.get("vision_config") or {}).get("spatial_merge_size", 2)
        tok = AutoTokenizer.from_pretrained(str(path))
        return cls(tok, cfg["image_token_id"], cfg["video_token_id"], merge, system)

    def render(self, prompt: str, system: str | None = None, history: Sequence[dict[str, str]] = ()) -> str:
        """The chat-formatted text (one pad per media item) — what vLLM is given. ``system``: the
        sample's system message (``SampleRecord.system``); None = the encoder's ``system``. ``history``: the
        conversation before the prompt (``SampleRecord.history``)."""
        return self.tokenizer.apply_chat_template(
            chat_messages(prompt, self.system if system is None else system, history), tokenize=False,
            add_generation_prompt=True,
        )

    def encode(self, prompt: str, grids: Sequence[VisionGrid], system: str | None = None,
               history: Sequence[dict[str, str]] = ()) -> np.ndarray:
        """Token ids with every image/video pad expanded to its grid's token count (the history's media first)."""
        ids = self.tokenizer(self.render(prompt, system, history), add_special_tokens=False)["input_ids"]
        return self.expand(ids, grids)

    def expand(self, token_ids: Sequence[int], grids: Sequence[VisionGrid]) -> np.ndarray:
        out: list[int] = []
        grid_iter = iter(grids)
        for t in token_ids:
            if t == self.image_token_id or t == self.video_token_id:
                grid = next(grid_iter, None)
                if grid is None:
                    raise ValueError(f"prompt has more media placeholders than media items ({len(grids)})")
                kind_id = self.video_token_id if grid.is_video else self.image_token_id
                if kind_id != t:
                    raise ValueError("media placeholder kinds and media items disagree in order")
                out.extend([t] * grid.num_tokens(self.spatial_merge_size))
            else:
                out.append(t)
        if next(grid_iter, None) is not None:
            raise ValueError(f"prompt has fewer media placeholders than media items ({len(grids)})")
        return np.asarray(out, dtype=np.int64)

    def observation_text(self, text: str | None, num_images: int, last_token: str) -> str:
        """A multi-turn observation as the chat template writes it after an assistant turn that ended with
        ``last_token`` (its end-of-turn token, already in the response): the rest of that turn's ending, a user
        message with ``num_images`` image placeholders and then ``text``, and the next assistant header. Taken as
        the difference between the template's rendering of a conversation with and without the message, so any
        checkpoint's template writes it."""
        base = [{"role": "user", "content": [{"type": "text", "text": "x"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "y"}]}]
        content: list[dict[str, Any]] = [{"type": "image"} for _ in range(num_images)]
        if text:
            content.append({"type": "text", "text": text})
        before = self.tokenizer.apply_chat_template(base, tokenize=False)
        after = self.tokenizer.apply_chat_template(base + [{"role": "user", "content": content}], tokenize=False,
                                                   add_generation_prompt=True)
        if not after.startswith(before):
            raise ValueError("the chat template renders an earlier turn differently once a user message follows it; "
                             "multi-turn rollouts need a template that appends turns")
        ending = before[before.rindex("y") + 1:]  # what closes the assistant turn
        if ending.startswith(last_token):
            ending = ending[len(last_token):]
        return ending + after[len(before):]

    def encode_text(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)
