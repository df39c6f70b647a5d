"""The baseline ShadowLoader must beat: centralized loading, the way verl's driver does it.

Every rank plans the same batch (so ``metas`` and ``assignment`` equal ShadowLoader's), but at
``materialize()`` rank 0 alone decodes and preprocesses every sample any rank consumes, with
``data.num_decode_workers`` threads, holds the whole batch's pixels, and sends each rank its samples
(pickled ``Materialized``: float32 ``pixel_values`` plus the uint8 frames for the rollout) over the
process group. Nothing is decoded ahead: loading sits on the critical path, as in verl, where it
took 57% of the step. ``materialize()`` is therefore a collective: every rank must call it.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

from titanrl.data.media import MediaError
from titanrl.data.preprocess import MediaSettings, decode_media
from titanrl.data.shadow.comm import Comm
from titanrl.data.shadow.materializer import assemble_sample
from titanrl.data.shadow.metadata import MetadataTable, SampleMeta, classify_media_error
from titanrl.data.shadow.plan import AssignFn, ProxyLoader, assign_balanced, check_assignment
from titanrl.data.shadow.types import BadSample, Materialized, StepData, bad_from_meta, raise_or_keep

STATE_VERSION = 1


def prepare_centrally(
    position: int, meta: SampleMeta, manifest_dir: str, settings: MediaSettings
) -> Materialized | BadSample:
    if meta.problem is not None:
        return bad_from_meta(position, meta)
    try:
        media = decode_media(meta.record, manifest_dir, settings)
    except MediaError as error:
        return BadSample(position, meta.index, meta.sample_id, classify_media_error(error), str(error))
    return assemble_sample(position, meta, media, settings)


class CentralizedLoader:
    def __init__(
        self,
        table: MetadataTable,
        settings: MediaSettings,
        comm: Comm,
        *,
        global_batch_size: int,
        seed: int,
        assign: AssignFn | None = None,
        num_decode_workers: int = 1,
        on_bad_sample: str = "skip",
    ) -> None:
        self.table = table
        self.settings = settings
        self.comm = comm
        self.rank, self.world = comm.rank, comm.world
        self.assign = assign or assign_balanced
        self.on_bad_sample = on_bad_sample
        self.proxy = ProxyLoader(table, global_batch_size, seed)
        self._pool = (concurrent.futures.ThreadPoolExecutor(max_workers=num_decode_workers,
                                                            thread_name_prefix="central-decode")
                      if comm.rank == 0 and num_decode_workers > 0 else None)
        self.stats: dict[str, float] = {"steps": 0, "wait_s": 0.0, "decode_s": 0.0, "send_s": 0.0, "samples": 0}

    def next_step(self) -> StepData:
        step, metas, _ = self.proxy.next_batch()
        assignment = check_assignment(self.assign(metas, self.world), len(metas), self.world)
        self.stats["steps"] += 1
        return StepData(step, metas, assignment, self.rank, _materialize=lambda: self._materialize(metas, assignment))

    def _decode_batch(
        self, metas: list[SampleMeta], assignment: list[list[int]]
    ) -> dict[int, Materialized | BadSample]:
        wanted = sorted({p for positions in assignment for p in positions})
        manifest_dir = str(self.table.manifest_path.parent)
        if self._pool is None:
            results = [prepare_centrally(p, metas[p], manifest_dir, self.settings) for p in wanted]
        else:
            results = list(
                self._pool.map(lambda p: prepare_centrally(p, metas[p], manifest_dir, self.settings), wanted)
            )
        self.stats["samples"] += len(wanted)
        return dict(zip(wanted, results))

    def _materialize(self, metas: list[SampleMeta], assignment: list[list[int]]) -> list[Materialized | BadSample]:
        t0 = time.perf_counter()
        per_rank = None
        if self.rank == 0:
            decoded = self._decode_batch(metas, assignment)
            per_rank = [[decoded[p] for p in positions] for positions in assignment]
        t1 = time.perf_counter()
        mine: list[Materialized | BadSample] = self.comm.scatter(per_rank)
        t2 = time.perf_counter()
        self.stats["decode_s"] += t1 - t0
        self.stats["send_s"] += t2 - t1
        self.stats["wait_s"] += t2 - t0
        raise_or_keep(mine, self.on_bad_sample, str(self.table.manifest_path))
        return mine

    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "proxy": self.proxy.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unknown loader state version {state.get('version')!r}")
        self.proxy.load_state_dict(state["proxy"])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> "CentralizedLoader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
