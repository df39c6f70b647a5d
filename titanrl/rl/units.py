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
from dataclasses import dataclass, replace
from typing import NamedTuple, Sequence

import numpy as np

from titanrl.distributed import all_gather_objects
from titanrl.models.qwen2_5_vl.args import Qwen2_5_VLArgs
from titanrl.models.vision_grid import VisionGrid


@dataclass(frozen=True)
class MediaItem:
    """One image or video of a trajectory: its grid, first placeholder token and first pixel row (in the
    trajectory's pixels: the prompt's, then its observations'), and whose it is: ``owner`` the prompt's group (the
    ``n`` responses of a prompt share its media: one encoding) or, for an observation's image in a multi-turn
    trajectory, the trajectory's own key (:func:`turn_owner`, < 0); ``index`` its place among the owner's items."""

    grid: VisionGrid
    token_start: int
    row_start: int
    merge: int
    owner: int = 0
    index: int = 0

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
    # multi-turn: the response's spans [a, b) of tokens the policy generated (the only scored ones); None: all
    generated: tuple[tuple[int, int], ...] | None = None
    truncated: bool = False  # the engine cut it at rollout.max_new_tokens (its last turn, multi-turn)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.response_len

    @property
    def scored_len(self) -> int:
        """Scored (generated) response tokens."""
        return self.response_len if self.generated is None else sum(b - a for a, b in self.generated)


class Scored(NamedTuple):
    """The log-probs computed from a range of a unit's stream, response by response: the stream
    position each is computed at, the stream index of the token it scores, and which response
    (index into ``StageUnit.trajs``) and token of that response it is."""

    positions: np.ndarray
    targets: np.ndarray
    response: np.ndarray
    token: np.ndarray


@functools.lru_cache(maxsize=1 << 16)
def _scored(prompt_len: int, response_lens: tuple[int, ...], start: int, end: int,
            generated: tuple[tuple[tuple[int, int], ...] | None, ...] | None = None) -> Scored:
    positions, targets, response, token = [], [], [], []
    offset = prompt_len
    for k, r in enumerate(response_lens):
        spans = generated[k] if generated is not None else None
        toks = np.arange(r) if spans is None else np.concatenate(
            [np.arange(a, b) for a, b in spans] or [np.zeros(0, np.int64)]).astype(np.int64)
        pos = offset - 1 + toks
        pos[toks == 0] = prompt_len - 1  # every response's first token is predicted by the prompt's last
        inside = (pos >= start) & (pos < end)
        keep = toks[inside]
        positions.append(pos[inside])
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
    media: tuple[MediaItem, ...]  # the prompt's, then each response's observation images, at their stream tokens
    name: str
    generated: tuple[tuple[tuple[int, int], ...] | None, ...] | None = None  # per response (multi-turn)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + sum(self.response_lens)

    @property
    def scored_lens(self) -> tuple[int, ...]:
        """Scored (generated) tokens of each response."""
        if self.generated is None:
            return self.response_lens
        return tuple(r if g is None else sum(b - a for a, b in g) for r, g in zip(self.response_lens, self.generated))

    @property
    def segments(self) -> tuple[int, ...]:
        """Shared-prefix segments of the stream (``PackedBatch.segments``)."""
        return (self.prompt_len, *self.response_lens)

    def response_start(self, k: int) -> int:
        return self.prompt_len + sum(self.response_lens[:k])

    def scored(self, start: int, end: int) -> Scored:
        """The log-probs computed from stream positions ``[start, end)``."""
        return _scored(self.prompt_len, self.response_lens, start, end, self.generated)


def responses_split(plan, units: Sequence["StageUnit"]) -> int:
    """Responses whose scored tokens a stage plan (``StagePlan``) spreads over more than one rank (Ulysses slices
    of their unit; with a shared prefix a response's first token is scored at the prompt's end)."""
    count, seen = 0, set()
    for w, wave in enumerate(plan.waves):
        for rank_wave in wave.ranks:
            for step in rank_wave.sharded:
                if (w, step.ranks, step.seqs) in seen:  # every member lists its group
                    continue
                seen.add((w, step.ranks, step.seqs))
                for seq, per_member in zip(step.seqs, step.slices):
                    holders = np.zeros(len(units[seq].trajs), dtype=np.int64)
                    for a, b in per_member:
                        holders[np.unique(units[seq].scored(a, b).response)] += 1
                    count += int((holders > 1).sum())
    return count


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
        lens = tuple(metas[i].response_len for i in members)
        if all(metas[i].generated is None for i in members):
            return StageUnit(tuple(members), m.home, m.group, m.prompt_len, lens, m.media, m.name)
        # multi-turn: the prompt's media once, then each response's observation images where the stream has them
        media = [it for it in m.media if it.token_start < m.prompt_len]
        shift = 0
        for i, r in zip(members, lens):
            media += [replace(it, token_start=it.token_start + shift) for it in metas[i].media
                      if it.token_start >= m.prompt_len]
            shift += r
        return StageUnit(tuple(members), m.home, m.group, m.prompt_len, lens, tuple(media), m.name,
                         tuple(metas[i].generated for i in members))

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


def media_items(grids: Sequence[VisionGrid], ids: np.ndarray, args: Qwen2_5_VLArgs,
                owners: Sequence[tuple[int, int]] | None = None) -> tuple[MediaItem, ...]:
    """The items of ``grids`` whose placeholders are in ``ids`` (in order); ``owners``: each one's (owner, index),
    by default (0, its position)."""
    vision = np.flatnonzero((ids == args.image_token_id) | (ids == args.video_token_id))
    merge = args.vision.spatial_merge_size
    items, token, row = [], 0, 0
    for k, g in enumerate(grids):
        start = int(vision[token])
        owner, index = owners[k] if owners is not None else (0, k)
        items.append(MediaItem(g, start, row, merge, owner, index))
        token += g.num_tokens(merge)
        row += g.num_patches
    return tuple(items)


def turn_owner(group: int, response_index: int) -> int:
    """The key that owns a multi-turn trajectory's observation images (< 0: never a prompt group)."""
    return -(1 + group * 4096 + response_index)


def generated_spans(mask: np.ndarray) -> tuple[tuple[int, int], ...]:
    """The runs [a, b) of True in a response's ``generated`` mask: its turns' sampled tokens."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return tuple((int(a), int(b)) for a, b in zip(edges[::2], edges[1::2]))


def gather_metadata(trajs: Sequence, rank: int, args: Qwen2_5_VLArgs, group=None) -> list[TrajectoryMeta]:
    """Every trajectory of the step on every rank (of ``group``: ``rank`` counts in it), sorted by (group,
    index): the same list on any number of ranks. Media descriptions are built once per prompt (a multi-turn
    trajectory's, with its observations' images, once per trajectory)."""
    items_of: dict[int, tuple[MediaItem, ...]] = {}
    mine = []
    for i, t in enumerate(trajs):
        g = int(t.group)
        if t.turn_grids:
            prompt = len(t.prompt.grids)
            owners = [(g, k) for k in range(prompt)] + [(turn_owner(g, t.response_index), prompt + k)
                                                         for k in range(len(t.turn_grids))]
            items = media_items(t.grids, np.concatenate([t.prompt.prompt_ids, t.response_ids]), args, owners)
        else:
            key = id(t.prompt)
            if key not in items_of:
                items_of[key] = media_items(t.prompt.grids, t.prompt.prompt_ids, args,
                                            [(g, k) for k in range(len(t.prompt.grids))])
            items = items_of[key]
        generated = None if t.generated is None or t.generated.all() else generated_spans(t.generated)
        mine.append(TrajectoryMeta(rank, i, g, len(t.prompt.prompt_ids), t.num_response_tokens,
                                   float(t.advantage), items, str(t.prompt.record.id), generated,
                                   t.finish_reason == "length"))
    every = [m for part in all_gather_objects(mine, group=group) for m in part]
    return sorted(every, key=lambda m: (m.group, m.home, m.index))


def media_owners(metas: Sequence[TrajectoryMeta]) -> dict[int, TrajectoryMeta]:
    """Owner key -> a trajectory that holds the owner's media (every item at its ``index`` in ``media``, pixels in
    its pixels): a prompt group's any member, a multi-turn trajectory's own key that trajectory."""
    out: dict[int, TrajectoryMeta] = {}
    for m in metas:
        out[m.group] = m
        for item in m.media:
            if item.owner < 0:
                out[item.owner] = m
    return out
