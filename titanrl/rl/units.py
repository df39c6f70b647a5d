"""Stage units and the step's trajectory metadata: what a stage plan places.

- :func:`gather_metadata` all-gathers :class:`TrajectoryMeta` (lengths, home, GRPO group, advantage, vision grids;
  never pixels) after scoring; every rank sorts it the same way.
- The unit a plan places is a :class:`StageUnit`: one trajectory, or with shared-prefix packing a prompt once
  followed by responses that share it (``titanrl.models.attention`` keeps siblings apart). A piece of a plan is a
  token range of a unit's stream; a scored position may predict several tokens (the prompt's last token predicts
  every response's first): :class:`Scored`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from titanrl.distributed import all_gather_objects
from titanrl.models.qwen2_5_vl.args import Qwen2_5_VLArgs
from titanrl.models.vision_grid import VisionGrid


@dataclass(frozen=True)
class MediaItem:
    """One image or video of a prompt: its grid, first placeholder token and first pixel row."""

    grid: VisionGrid
    token_start: int
    row_start: int
    merge: int

    @property
    def tokens_per_frame(self) -> int:
        return (self.grid.h // self.merge) * (self.grid.w // self.merge)

    @property
    def patches_per_frame(self) -> int:
        return self.grid.h * self.grid.w

    @property
    def token_end(self) -> int:
        return self.token_start + self.grid.t * self.tokens_per_frame

    def frames(self, start: int, end: int) -> tuple[int, int] | None:
        """Temporal patches ``[f0, f1)`` whose tokens meet the token range ``[start, end)``."""
        a, b = max(start, self.token_start), min(end, self.token_end)
        if a >= b:
            return None
        tpf = self.tokens_per_frame
        return (a - self.token_start) // tpf, (b - 1 - self.token_start) // tpf + 1


@dataclass(frozen=True)
class TrajectoryMeta:
    home: int
    index: int  # position in the home rank's trajectory list
    group: int  # global batch position of the prompt (GRPO group, minibatch key)
    prompt_len: int
    response_len: int
    advantage: float
    media: tuple[MediaItem, ...]
    name: str  # sample id, for messages

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.response_len


class Scored(NamedTuple):
    """The log-probs computed from a range of a unit's stream, response by response: the stream
    position each is computed at, the stream index of the token it scores, and which response
    (index into ``StageUnit.trajs``) and token of that response it is."""

    positions: np.ndarray
    targets: np.ndarray
    response: np.ndarray
    token: np.ndarray


@functools.lru_cache(maxsize=1 << 16)
def _scored(prompt_len: int, response_lens: tuple[int, ...], start: int, end: int) -> Scored:
    positions, targets, response, token = [], [], [], []
    offset = prompt_len
    for k, r in enumerate(response_lens):
        pos = np.arange(offset - 1, offset + r - 1)
        if r:
            pos[0] = prompt_len - 1  # every response's first token is predicted by the prompt's last
        keep = np.flatnonzero((pos >= start) & (pos < end))
        positions.append(pos[keep])
        targets.append(offset + keep)
        response.append(np.full(keep.size, k))
        token.append(keep)
        offset += r
    out = Scored(*(np.concatenate(x).astype(np.int64) for x in (positions, targets, response, token)))
    for a in out:
        a.setflags(write=False)  # shared by every caller through the cache
    return out


@dataclass(frozen=True)
class StageUnit:
    """What a stage plan places: a prompt followed by the responses in ``trajs`` (indices into the
    step's metadata; one trajectory, or with shared-prefix packing a sub-group of a GRPO group,
    all from one home), computed as one stream of ``prompt_len + sum(response_lens)`` tokens."""

    trajs: tuple[int, ...]
    home: int
    group: int
    prompt_len: int
    response_lens: tuple[int, ...]
    media: tuple[MediaItem, ...]
    name: str

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + sum(self.response_lens)

    @property
    def segments(self) -> tuple[int, ...]:
        """Shared-prefix segments of the stream (``PackedBatch.segments``)."""
        return (self.prompt_len, *self.response_lens)

    def response_start(self, k: int) -> int:
        return self.prompt_len + sum(self.response_lens[:k])

    def scored(self, start: int, end: int) -> Scored:
        """The log-probs computed from stream positions ``[start, end)``."""
        return _scored(self.prompt_len, self.response_lens, start, end)


def split_responses(prompt_len: int, response_lens: Sequence[int], max_tokens: int | None) -> list[list[int]]:
    """Responses of one prompt in consecutive sub-groups, each with the prompt within ``max_tokens``
    (a response that cannot fit even alone is a sub-group of its own): as few as possible, and of
    near-equal size so no sub-group is a straggler. Each extra sub-group recomputes the prompt."""
    n, total = len(response_lens), sum(response_lens)
    if max_tokens is None or prompt_len + total <= max_tokens or n <= 1:
        return [list(range(n))]
    cum = np.cumsum(response_lens)
    count = min(n, math.ceil(total / max(max_tokens - prompt_len, 1)))
    while True:
        cuts, prev = [], 0
        for k in range(1, count):  # cut nearest to k/count of the tokens, leaving room for the rest
            lo, hi = prev + 1, n - (count - k)
            cut = lo + int(np.argmin(np.abs(cum[lo - 1:hi] - k * total / count)))
            cuts.append(cut)
            prev = cut
        chunks = [list(range(a, b)) for a, b in zip([0, *cuts], [*cuts, n])]
        if count >= n or all(prompt_len + sum(response_lens[i] for i in c) <= max_tokens for c in chunks):
            return chunks
        count += 1


def stage_units(metas: Sequence[TrajectoryMeta], ids: Sequence[int], *, shared_prefix: bool,
                max_tokens: int | None = None) -> list[StageUnit]:
    """The units of a stage over the trajectories ``ids`` (indices into ``metas``), in order: each
    trajectory alone, or (``shared_prefix``) each prompt once per home with its responses, split
    by :func:`split_responses` at ``max_tokens``."""
    def unit(members: Sequence[int]) -> StageUnit:
        m = metas[members[0]]
        return StageUnit(tuple(members), m.home, m.group, m.prompt_len,
                         tuple(metas[i].response_len for i in members), m.media, m.name)

    if not shared_prefix:
        return [unit([i]) for i in ids]
    groups: dict[tuple[int, int], list[int]] = {}
    for i in ids:
        groups.setdefault((metas[i].group, metas[i].home), []).append(i)
    out = []
    for members in groups.values():
        lens = [metas[i].response_len for i in members]
        out += [unit([members[k] for k in chunk])
                for chunk in split_responses(metas[members[0]].prompt_len, lens, max_tokens)]
    return out


def media_items(grids: Sequence[VisionGrid], prompt_ids: np.ndarray, args: Qwen2_5_VLArgs) -> tuple[MediaItem, ...]:
    vision = np.flatnonzero((prompt_ids == args.image_token_id) | (prompt_ids == args.video_token_id))
    merge = args.vision.spatial_merge_size
    items, token, row = [], 0, 0
    for g in grids:
        start = int(vision[token])
        items.append(MediaItem(g, start, row, merge))
        token += g.num_tokens(merge)
        row += g.num_patches
    return tuple(items)


def gather_metadata(trajs: Sequence, rank: int, args: Qwen2_5_VLArgs, group=None) -> list[TrajectoryMeta]:
    """Every trajectory of the step on every rank (of ``group``: ``rank`` counts in it), sorted by (group,
    index): the same list on any number of ranks. Media descriptions are built once per prompt."""
    items_of: dict[int, tuple[MediaItem, ...]] = {}
    mine = []
    for i, t in enumerate(trajs):
        key = id(t.prompt)
        if key not in items_of:
            items_of[key] = media_items(t.prompt.grids, t.prompt.prompt_ids, args)
        mine.append(TrajectoryMeta(rank, i, int(t.group), len(t.prompt.prompt_ids), t.num_response_tokens,
                                   float(t.advantage), items_of[key], str(t.prompt.record.id)))
    every = [m for part in all_gather_objects(mine, group=group) for m in part]
    return sorted(every, key=lambda m: (m.group, m.home, m.index))
