"""ShadowLoader: plan from metadata on every rank, decode on per-node Ray preprocessors, fetch ahead.

Per step t, every rank (identically, without communication):

1. takes the global batch of metadata from the :class:`ProxyLoader` (torchdata nodes, seeded);
2. splits it with ``assign`` and routes each sample to a preprocessor (least-loaded, node-local);
3. sends the decode tasks it is the first consumer of to their preprocessors (each task once);
4. starts a background fetch of its own samples (``mine``): map the frames, patchify.

Steps t+1 .. t+``prefetch_batches`` are planned and started when step t is handed out, so their
decode and transfer run while step t computes; ``materialize()`` then just returns. When a rank
moves on to step t+1 it releases step t's samples, and a preprocessor drops a sample once every
consumer has released it.

With ``hold_steps`` = h > 1 a rank keeps its samples of the last h steps handed out (an asynchronous run: the
training ranks fetch frames of a step the rollout ranks handed out up to h - 1 steps before).

``state_dict()`` counts only steps handed out by ``next_step()``; ``load_state_dict`` drops the
planned-ahead steps and replans from the restored position (or keeps them, when the state is the
position the loader is already at).
"""

from __future__ import annotations

import collections
import concurrent.futures
import time
from typing import Any, Sequence

from titanrl.data.preprocess import MediaSettings
from titanrl.data.shadow.comm import Comm
from titanrl.data.shadow.metadata import MetadataTable
from titanrl.data.shadow.materializer import Materializer, StepPlan
from titanrl.data.shadow.placeholder import PixelPlaceholder
from titanrl.data.shadow.plan import (
    AssignFn,
    ProxyLoader,
    assign_balanced,
    check_assignment,
    consumers_of,
    route_samples,
)
from titanrl.data.shadow.preprocessor import DecodeTask
from titanrl.data.shadow.ray_runtime import RaySession, shutdown
from titanrl.data.shadow.types import BadSample, DataUnavailableError, Materialized, StepData, raise_or_keep

STATE_VERSION = 1


class ShadowLoader:
    def __init__(
        self,
        table: MetadataTable,
        settings: MediaSettings,
        session: RaySession,
        comm: Comm,
        *,
        global_batch_size: int,
        seed: int,
        assign: AssignFn | None = None,
        prefetch_batches: int = 2,
        on_bad_sample: str = "skip",
        fetch_timeout_s: float = 300.0,
        hold_steps: int = 1,
    ) -> None:
        self.table = table
        self.settings = settings
        self.session = session
        self.comm = comm
        self.rank, self.world = comm.rank, comm.world
        self.assign = assign or assign_balanced
        self.prefetch_batches = prefetch_batches
        self.on_bad_sample = on_bad_sample
        self.proxy = ProxyLoader(table, global_batch_size, seed)
        self.materializer = Materializer(
            session.handles, settings, fetch_timeout_s=fetch_timeout_s, rank=self.rank,
            hosts=[session.host_of_node(p.node_id) for p in session.preprocessors],
            here=session.host_of_node(session.node_id))
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="shadow-fetch")
        self._plans: collections.OrderedDict[int, StepPlan] = collections.OrderedDict()
        self._held: collections.deque[StepPlan] = collections.deque()  # handed out, not yet released
        self.hold_steps = max(1, hold_steps)
        self._closed = False
        self.stats: dict[str, float] = {"steps": 0, "wait_s": 0.0, "plan_s": 0.0}

    # ------------------------------------------------------------------------------ planning

    def _plan_next(self) -> StepPlan:
        t0 = time.perf_counter()
        step, metas, state = self.proxy.next_batch()
        assignment = check_assignment(self.assign(metas, self.world), len(metas), self.world)
        consumers = consumers_of(assignment, len(metas))
        routes = route_samples(metas, consumers, [p.node_id for p in self.session.preprocessors],
                               self.session.rank_nodes)
        tasks = {
            pos: DecodeTask(f"{step}:{pos}:{metas[pos].sample_id}", step, metas[pos].record, len(route.consumers))
            for pos, route in enumerate(routes) if route is not None
        }
        plan = StepPlan(step, metas, assignment, routes, tasks, state)
        self._submit(plan)
        self.stats["plan_s"] += time.perf_counter() - t0
        return plan

    def _submit(self, plan: StepPlan) -> None:
        # Each task is sent once, by its first consumer; a restarted or evicting preprocessor
        # re-decodes on the consumers' fetches anyway, so a lost submission costs time, not data.
        by_preprocessor: dict[int, list[DecodeTask]] = collections.defaultdict(list)
        for pos, task in plan.tasks.items():
            route = plan.routes[pos]
            assert route is not None
            if route.consumers[0] == self.rank:
                by_preprocessor[route.preprocessor].append(task)
        for i, tasks in sorted(by_preprocessor.items()):
            self.session.handles[i].prefetch.remote(tasks)
        mine = plan.assignment[self.rank]
        if mine:
            plan.future = self._executor.submit(self.materializer.fetch_samples, plan, mine)

    def _fill(self, ahead: int) -> None:
        while len(self._plans) < ahead:
            plan = self._plan_next()
            self._plans[plan.step] = plan

    def _release(self, plan: StepPlan) -> list[Any]:
        """Tell the preprocessors this rank is done with the plan's samples; returns the call refs."""
        if plan.released:
            return []
        plan.released = True
        if plan.future is not None:
            plan.future.cancel()
        by_preprocessor: dict[int, list[str]] = collections.defaultdict(list)
        for pos in plan.assignment[self.rank]:
            route = plan.routes[pos]
            if route is not None:
                by_preprocessor[route.preprocessor].append(plan.tasks[pos].key)
        refs = []
        for i, keys in by_preprocessor.items():
            try:
                refs.append(self.session.handles[i].release.remote(keys))
            except Exception:
                pass  # a dead preprocessor holds nothing to release
        return refs

    # ------------------------------------------------------------------------------ public API

    def next_step(self) -> StepData:
        """The next step's global batch; its decode was started ``prefetch_batches`` steps ago."""
        if self._closed:
            raise RuntimeError("ShadowLoader is closed")
        while len(self._held) >= self.hold_steps:
            self._release(self._held.popleft())
        self._fill(1)
        _, plan = self._plans.popitem(last=False)
        self._held.append(plan)
        self._fill(self.prefetch_batches)  # steps t+1 .. t+prefetch_batches decode while t computes
        self.stats["steps"] += 1
        return StepData(plan.step, plan.metas, plan.assignment, self.rank, fetch_counts=plan.counts,
                        _materialize=lambda: self._materialize(plan),
                        _fetch_slices=lambda phs, stats=None: self._fetch_slices(plan, phs, stats),
                        resume_state={"version": STATE_VERSION, "proxy": plan.state})

    def _materialize(self, plan: StepPlan) -> list[Materialized | BadSample]:
        t0 = time.perf_counter()
        if plan.future is None:
            results: list[Materialized | BadSample] = []
        else:
            try:
                results = plan.future.result(timeout=self.materializer.fetch_timeout_s + 5.0)
            except concurrent.futures.TimeoutError:
                raise DataUnavailableError(f"step {plan.step}: rank {self.rank}'s fetch did not finish") from None
        self.stats["wait_s"] += time.perf_counter() - t0
        raise_or_keep(results, self.on_bad_sample, str(self.table.manifest_path))
        return results

    def _fetch_slices(self, plan: StepPlan, placeholders: Sequence[PixelPlaceholder], stats=None):
        return self.materializer.fetch_slices(plan, placeholders, stats)

    def state_dict(self) -> dict[str, Any]:
        first = next(iter(self._plans.values()), None)
        proxy_state = first.state if first is not None else self.proxy.state_dict()
        return {"version": STATE_VERSION, "proxy": proxy_state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unknown loader state version {state.get('version')!r}")
        if self._plans and next(iter(self._plans.values())).state == state["proxy"]:
            return  # already positioned there: keep the decodes in flight
        for plan in self._plans.values():
            self._release(plan)
        self._plans.clear()
        self.proxy.load_state_dict(state["proxy"])

    def preprocessor_stats(self) -> list[dict[str, float]]:
        import ray

        return ray.get([h.get_stats.remote() for h in self.session.handles], timeout=30)

    def close(self, *, collective: bool = True) -> None:
        """Stops fetches, releases samples, tears Ray down. Collective (every rank must call it) unless
        ``collective=False``: after a failure, when the other ranks may be anywhere, nothing waits for them."""
        if self._closed:
            return
        self._closed = True
        import ray

        self._executor.shutdown(wait=False, cancel_futures=True)
        plans = list(self._plans.values()) + list(self._held)
        running = [p.future for p in plans if p.future is not None and not p.future.done()]
        concurrent.futures.wait(running, timeout=10.0)  # bounded: a stuck fetch must not block tear-down
        refs = [ref for plan in plans for ref in self._release(plan)]
        try:
            ray.get(refs, timeout=5.0)
        except Exception:
            pass
        shutdown(self.session, self.comm, collective=collective)

    def __enter__(self) -> "ShadowLoader":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.close(collective=exc_type is None)
