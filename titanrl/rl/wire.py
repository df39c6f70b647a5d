"""The wire format of the trajectory exchange: what travels for a piece and a frame run, built at home.

For a piece (a token range of a unit's stream): token ids, mrope positions (computed at home on the whole
trajectory, so a slice keeps its positions), the next-token targets of its scored positions (the target of a
slice's last token is the first token of the next slice), and the stage's per-token inputs (old / reference
log-probs). For a frame run without slice-aware loading: its float32 patch rows. Both sides derive every shape
from the plan and the metadata (``piece_specs``, ``run_spec``), so buffers move without a size handshake.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from titanrl.models.qwen2_5_vl.args import Qwen2_5_VLArgs
from titanrl.models.qwen2_5_vl.positions import mrope_position_ids
from titanrl.parallel.stage_plan import Piece
from titanrl.parallel.vision_plan import FrameRun
from titanrl.rl.units import StageUnit, TrajectoryMeta


class TrajectoryTokens:
    """Whole-trajectory token arrays built at home once per step: ids, mrope positions."""

    def __init__(self, args: Qwen2_5_VLArgs) -> None:
        self.args = args
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def get(self, traj) -> tuple[np.ndarray, np.ndarray]:
        key = id(traj)
        if key not in self._cache:
            ids = np.concatenate([traj.prompt.prompt_ids, traj.response_ids]).astype(np.int64)
            v = self.args.vision
            pos = mrope_position_ids(ids, traj.prompt.grids, image_token_id=self.args.image_token_id,
                                     video_token_id=self.args.video_token_id, spatial_merge_size=v.spatial_merge_size,
                                     tokens_per_second=v.tokens_per_second)
            self._cache[key] = (ids, pos)
        return self._cache[key]



def piece_specs(p: Piece, u: StageUnit, fields: Sequence[str]) -> list[tuple[tuple[int, ...], np.dtype]]:
    n = p.num_tokens
    k = len(u.scored(p.start, p.end).positions)
    specs = [((n,), np.dtype(np.int64)), ((3, n), np.dtype(np.int64)), ((k,), np.dtype(np.int64))]
    return specs + [((k,), np.dtype(np.float32)) for _ in fields]


def run_spec(run: FrameRun, metas_by_group: dict[int, TrajectoryMeta], patch_dim: int):
    item = metas_by_group[run.group].media[run.item]
    return ((run.f1 - run.f0) * item.patches_per_frame, patch_dim), np.dtype(np.float32)


class HomeSide:
    """The arrays this rank sends for the units and runs whose home it is (``trajs``: its trajectories;
    ``metas[i].index`` indexes them)."""

    def __init__(self, args: Qwen2_5_VLArgs, trajs: Sequence, metas: Sequence[TrajectoryMeta]) -> None:
        self.trajs = trajs
        self.metas = metas
        self.tokens = TrajectoryTokens(args)
        self._streams: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self.by_group = {m.group: m for m in metas}

    def traj(self, u: StageUnit, k: int):
        return self.trajs[self.metas[u.trajs[k]].index]

    def stream(self, u: StageUnit) -> tuple[np.ndarray, np.ndarray]:
        """A unit's token ids and mrope positions: the prompt, then each response with the positions
        it has in its own trajectory (each continues from the prompt)."""
        if len(u.trajs) == 1:
            return self.tokens.get(self.traj(u, 0))
        key = ("unit", u.trajs)
        if key not in self._streams:
            parts = [self.tokens.get(self.traj(u, k)) for k in range(len(u.trajs))]
            p = u.prompt_len
            self._streams[key] = (np.concatenate([parts[0][0][:p]] + [ids[p:] for ids, _ in parts]),
                                  np.concatenate([parts[0][1][:, :p]] + [pos[:, p:] for _, pos in parts], axis=1))
        return self._streams[key]

    def piece_arrays(self, p: Piece, u: StageUnit, fields: Sequence[str]) -> list[np.ndarray]:
        ids, pos = self.stream(u)
        sc = u.scored(p.start, p.end)
        out = [ids[p.start:p.end], pos[:, p.start:p.end], ids[sc.targets]]
        for f in fields:
            values = np.empty(len(sc.positions), dtype=np.float32)
            for k in np.unique(sc.response):
                sel = sc.response == k
                values[sel] = np.asarray(getattr(self.traj(u, int(k)), f), dtype=np.float32)[sc.token[sel]]
            out.append(values)
        return out

    def run_pixels(self, run: FrameRun) -> np.ndarray | None:
        """The run's patch rows from the home's prompt (None: the prompt came without pixels - a disaggregated
        placement with slice-aware loading - and the encoder fetches them)."""
        m = self.by_group[run.group]
        item = m.media[run.item]
        pixels = self.trajs[m.index].prompt.pixel_values
        if pixels is None:
            return None
        lo = item.row_start + run.f0 * item.patches_per_frame
        return pixels[lo:lo + (run.f1 - run.f0) * item.patches_per_frame]
