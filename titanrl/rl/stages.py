"""The model stages of an RL step (old / reference log-probs, policy update) over stage plans.

:class:`StageRunner` is what the trainer calls. Per step it all-gathers the trajectories'
metadata once (``titanrl.rl.units``). A stage then goes one way, each step a module that reads only its inputs:
1. plan - the units and the plan every rank computes identically (``titanrl.parallel.stage_plan``: where every
   token range runs, in which waves, and whether ranks synchronise per wave or once per minibatch), then who
   encodes which frames (``titanrl.parallel.vision_plan``);
2. move - the pieces and pixels to the ranks that compute them (``titanrl.rl.exchange``);
3. assemble - each rank's model inputs from what arrived (``titanrl.rl.assemble``);
4. compute - the model, here; log-probs return to their homes through the exchange.
It also measures what the plans did (``parallel/*``, ``balance/*``, ``vision/*``).

Synchronisation (``StagePlan.sync``):
- ``wave`` (native, lb_micro): every rank runs every wave, one exchange per wave; a rank with nothing
  in a wave runs a zero-weight dummy, so FSDP's per-layer collectives match.
- ``minibatch`` (lb_mini): one exchange for the whole stage, parameters gathered once and gradients
  reduced once (``titanrl.parallel.odc.minibatch_sync``); each rank runs only its own waves. A rank
  whose last wave holds a sharded group (or that has none) reduces in a trailing dummy, so no
  all-to-all ever waits behind a gradient reduction.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from titanrl.console import say
from titanrl.distributed import all_gather_objects
from titanrl.models.qwen2_5_vl.args import Qwen2_5_VLArgs
from titanrl.parallel.cost_model import CostModel
from titanrl.parallel.odc import minibatch_sync, odc_sync, reshard_root_after
from titanrl.parallel.odc_comm import attached
from titanrl.parallel.stage_plan import BalanceStrategy, StageMethod, StagePlan, plan_stage, rank_sums, top_degree
from titanrl.parallel.ulysses import UlyssesLayout, layout_builder
from titanrl.rl.batch import Trajectory, dummy_pack
from titanrl.rl.slice_loading import StepSlices
from titanrl.rl.timing import Busy, BusyClock
from titanrl.models.packed import VisionRows
from titanrl.parallel.vision_plan import (VisionBalancing, frame_runs, item_shapes, plan_stage_vision,
                                          run_frames)
from titanrl.parallel.vision_route import RouteCounter
from titanrl.rl.assemble import Assembly, VisionPass, WaveInputs, assemble_wave, vision_pass
from titanrl.rl.exchange import TrajectoryExchange
from titanrl.rl.units import (StageUnit, TrajectoryMeta, gather_metadata, media_owners, responses_split,
                             stage_units)


_ATTENTION = CostModel.attention_only()  # attention_coef 1, no linear term: a unit's attention feature


def build_cost_model(args: Qwen2_5_VLArgs, kind: str) -> CostModel:
    """The balancers' per-sequence cost for this model (``balance.cost_model``): ``flops`` = the
    forward + backward FLOPs of this model's shape (attention quadratic in the length, linear
    layers and LM head linear, vision tower per patch); ``tokens`` = the token count (for the vision tower its
    patches: a tower with no cost would give vision balancing nothing to balance, and it put every unit on one
    rank)."""
    if kind == "tokens":
        return CostModel(attention_coef=0.0, linear_coef=1.0, vision_linear_coef=1.0, vision_attention_coef=0.0,
                         flops_per_second=1.0, units="tokens")
    if kind != "flops":
        raise ValueError(f"unknown balance.cost_model {kind!r}")
    return CostModel.for_model(args)


@dataclass
class StepStats:
    plan_seconds: float = 0.0
    degree_max: int = 1
    sharded_sequences: int = 0
    split_responses: int = 0
    over_budget: int = 0
    planned_peak: float = 0.0
    planned_mean: float = 0.0
    planned_rank_cost: np.ndarray | float = 0.0  # each rank's planned cost over the step's stages
    # per rank (attention, linear) features of the work behind busy_seconds (forward-only stages count 1/3):
    # the rows balance.calibrate fits the cost model to
    features: np.ndarray | float = 0.0
    exchange_bytes: int = 0
    busy_seconds: Busy = field(default_factory=Busy)  # log-prob + update stages
    update_busy_seconds: Busy = field(default_factory=Busy)
    # busy seconds of each update synchronisation unit (a wave under wave sync, a minibatch under
    # minibatch sync), in order: the same units on every rank
    update_units: list[Busy] = field(default_factory=list)
    update_planned_peak: float = 0.0
    update_planned_mean: float = 0.0
    waves: int = 0
    microbatches: int = 0  # update microbatches this rank ran (dummies included), over the step
    reducing_microbatches: int = 0  # of those, the ones whose backward reduced gradients
    minibatches: int = 0
    layouts: list[UlyssesLayout] = field(default_factory=list)
    vision_seconds: Busy = field(default_factory=Busy)  # vision-tower forward time (busy clock), every stage
    # language-model tokens of the update forwards: computed (a shared prompt once per unit) and
    # represented (every trajectory whole); the same on every rank
    tokens_computed: int = 0
    tokens_represented: int = 0


@dataclass
class VisionStats:
    """What a step's vision work was planned as and moved (this rank's view; sums over waves)."""

    planned_peak: float = 0.0  # per wave the busiest rank's vision cost
    planned_mean: float = 0.0
    pixel_bytes: int = 0  # pixels this rank sent to other ranks
    route: RouteCounter = field(default_factory=RouteCounter)
    frames_encoded: int = 0  # images and video temporal patches this rank's vision tower encoded
    frames_used: int = 0  # per stage call, the distinct ones its tokens use (the same on every rank)


@dataclass
class VisionTable:
    """A stage's vision rows on this rank (the output of its :class:`VisionPass`): ``live`` holds the graph back to
    the vision tower (and the embedding route); microbatches read ``leaf``, a detached copy whose ``.grad`` gathers
    their gradients, and the reducing microbatch reads ``live`` and adds :meth:`surrogate`, so one backward takes
    every microbatch's gradient through the tower: d/d live of ``surrogate`` is ``leaf.grad``."""

    live: torch.Tensor
    leaf: torch.Tensor

    def rows(self, live: bool) -> VisionRows:
        """What a microbatch reads: ``live`` (no gradient, or the reducing microbatch) or the detached ``leaf``."""
        return VisionRows(self.live if live else self.leaf)

    def surrogate(self) -> torch.Tensor:
        grad = self.leaf.grad
        return (self.live * (grad if grad is not None else torch.zeros_like(self.live))).sum()


class StageRunner:
    def __init__(self, *, args: Qwen2_5_VLArgs, rank: int, world: int, device: torch.device, dtype: torch.dtype,
                 method: StageMethod, max_tokens: int, cost_model: CostModel, strategy: BalanceStrategy | None = None,
                 p_max: int = 1, degree: int = 1, groups: dict | None = None, attn_backend: str = "sdpa",
                 overlap: bool = True, reshard_after_forward: bool = True,
                 vision: VisionBalancing | None = None, shared_prefix: bool = False, process_group=None,
                 speeds: Sequence[float] | None = None, busy_clock: str = "cpu", calibrate: bool = False) -> None:
        self.args = args
        # the ranks holding the models (``rank`` / ``world`` count in it); None: every rank of the job
        self.process_group = process_group
        self.rank = rank
        self.world = world
        self.device = device
        self.dtype = dtype
        self.method = method
        # odc plans as lb_mini (one synchronisation per minibatch) and runs its stages on on-demand communication
        self.odc = strategy == "odc"
        self.strategy = "lb_mini" if self.odc else strategy
        self.max_tokens = max_tokens
        self.cost_model = cost_model
        self.p_max = p_max
        self.degree = degree
        self.groups = groups or {}
        self.attn_backend = attn_backend
        self.overlap = overlap
        self.reshard_after_forward = reshard_after_forward
        self.vision = vision or VisionBalancing(enabled=False, cost_model=cost_model)
        self.shared_prefix = shared_prefix
        # relative speed of each rank of the group (balance.rank_speeds); None: all equal
        self.speeds = tuple(float(x) for x in speeds) if speeds is not None and len(set(speeds)) > 1 else None
        self.clock = BusyClock(device, kind=busy_clock)
        # balance.calibrate: the cost model refitted to the measured busy seconds of the last steps
        self.calibrate = calibrate
        self._fit_rows: deque[tuple[float, float, float]] = deque(maxlen=8 * world)
        self._steps_seen = 0
        self._timed_vision: set[int] = set()
        self.metas: list[TrajectoryMeta] = []
        self.exchange: TrajectoryExchange | None = None
        self.assembly: Assembly | None = None
        self.vision_stats = VisionStats()
        self._plans: dict[tuple[int, ...], tuple[list[StageUnit], StagePlan]] = {}
        self._warned: set[str] = set()
        self.stats = StepStats()

    # ------------------------------------------------------------------ step set-up

    def begin_step(self, trajs: Sequence[Trajectory], slices: StepSlices | None = None) -> None:
        """After rewards: every rank learns every trajectory's metadata (one all-gather). With
        ``slices`` every rank fetches the frames it encodes itself (slice-aware loading)."""
        self.metas = gather_metadata(trajs, self.rank, self.args, group=self.process_group)
        self.exchange = TrajectoryExchange(self.args, self.rank, self.world, self.device, trajs, self.metas,
                                           slices=slices, group=self.process_group)
        self.vision_stats = VisionStats()
        self.assembly = Assembly(self.rank, self.device, self.dtype, self.metas, media_owners(self.metas),
                                 item_shapes(self.metas), self.vision.group, self.vision_stats.route)
        self._plans = {}
        self.stats = StepStats()

    def all_ids(self) -> list[int]:
        return list(range(len(self.metas)))

    def minibatch_ids(self, m: int, minibatches: int, *, truncated: bool = True) -> list[int]:
        """Minibatch ``m``: the prompts at global positions ``p % minibatches == m`` with all their
        responses, the same composition on any number of ranks; ``truncated=False``: without the responses the
        engine cut at its token limit (rl.mask_truncated)."""
        return [i for i, meta in enumerate(self.metas)
                if meta.group % minibatches == m and (truncated or not meta.truncated)]

    def units(self, ids: Sequence[int]) -> list[StageUnit]:
        """The units a stage over trajectories ``ids`` places: with shared-prefix packing a prompt
        once per home with its responses, in sub-groups no larger than a rank can take (``max_tokens``
        times the highest Ulysses degree) and, without sequence parallelism, than an even share of the
        stage per rank (a larger unit would leave the others idle; its sub-groups each recompute the
        prompt, counted in ``train/tokens_computed``)."""
        top = top_degree(self.method, self.world, self.p_max, self.degree)
        cap = top * self.max_tokens
        if top == 1 and self.strategy != "native":
            groups: dict[tuple[int, int], int] = {}
            for i in ids:
                m = self.metas[i]
                groups[(m.group, m.home)] = groups.get((m.group, m.home), m.prompt_len) + m.response_len
            total = sum(groups.values())  # ranks of unequal speed: the fastest rank's share
            even = total * max(self.speeds) / sum(self.speeds) if self.speeds else total / self.world
            cap = min(cap, max(math.ceil(even), 1))
        return stage_units(self.metas, ids, shared_prefix=self.shared_prefix, max_tokens=cap)

    def plan(self, ids: Sequence[int]) -> tuple[list[StageUnit], StagePlan]:
        key = tuple(ids)
        if key not in self._plans:
            units = self.units(ids)
            costs = [float(self.cost_model.prefix_compute(u.prompt_len, u.response_lens)) for u in units]
            plan = plan_stage([u.num_tokens for u in units], [u.home for u in units], self.world,
                              method=self.method, strategy=self.strategy, max_tokens=self.max_tokens,
                              cost_model=self.cost_model, p_max=self.p_max, degree=self.degree, costs=costs,
                              speeds=self.speeds)
            self._plans[key] = (units, plan)
            s = self.stats
            s.plan_seconds += plan.plan_seconds
            for i in plan.over_budget:
                u = units[i]
                if u.name not in self._warned and self.rank == 0:
                    say(f"[titanrl] sample {u.name!r}: a stage unit of {u.num_tokens} tokens (prompt and "
                        f"{len(u.trajs)} response(s)) is over balance.max_tokens_per_microbatch={self.max_tokens} "
                        f"on one rank even split as far as parallelism.ulysses={self.method!r} allows; it runs "
                        "alone, over the budget (counted in parallel/over_budget)")
                self._warned.add(u.name)
            s.degree_max = max(s.degree_max, plan.degree_max)
            if len(ids) == len(self.metas):  # the whole step's plan (the log-prob stages)
                s.over_budget = len(plan.over_budget)
                s.sharded_sequences = plan.sharded_sequences
                s.split_responses = responses_split(plan, units) if plan.sharded_sequences else 0
        return self._plans[key]

    # ------------------------------------------------------------------ waves

    def inputs(self, plan: StagePlan, units: Sequence[StageUnit], waves: Sequence[int], *, table: bool,
               fields: Sequence[str] = (), temperature: float = 1.0, return_entropy: bool = False,
               layout_builder=None, collective: bool = True) -> tuple[list[WaveInputs], VisionPass | None]:
        """This rank's inputs of each of ``waves`` of a stage placed by ``plan``: who encodes what
        (``plan_stage_vision``), one move, then assembly. Each wave encodes what its tokens use; with ``table`` (every
        rank passes the same) the rank's whole share of ``waves`` is encoded at once instead, before them: the
        returned :class:`VisionPass`, whose rows the waves' batches index (each image or frame once per rank whatever
        the balancer did with the responses that read it, and with vision balancing one embedding route for all
        the waves). ``collective`` False: no piece crosses ranks (every rank agrees), so the move may skip its
        all-to-all."""
        vision = plan_stage_vision(plan, units, waves, world=self.world, shapes=self.assembly.shapes,
                                   vision=self.vision, table=table)
        v = self.vision_stats
        for costs in vision.costs:
            v.planned_peak += max(costs)
            v.planned_mean += float(np.mean(costs))
        v.frames_encoded += sum(run_frames(vision.encode[g][self.rank]) for g in range(len(vision.groups)))
        delivered = self.exchange.move(plan, units, vision, fields=fields, collective=collective)
        v.pixel_bytes += delivered.pixel_bytes
        kw = dict(temperature=temperature, return_entropy=return_entropy, layout_builder=layout_builder)
        out, vpass = [], None
        for g, ws in enumerate(vision.groups):
            encode = vision.encode[g][self.rank]
            if table:
                needs = vision.needs[g][self.rank]
                out += [assemble_wave(self.assembly, plan, w, units, delivered, fields, table=needs, **kw) for w in ws]
                vpass = vision_pass(self.assembly, encode, needs, vision.plan(g), delivered, g)
            else:
                out += [assemble_wave(self.assembly, plan, w, units, delivered, fields, encode=encode,
                                      vplan=vision.plan(g), g=g, **kw) for w in ws]
        if out:
            out[0].bytes_sent = delivered.bytes_sent
        return out, vpass

    def _inputs(self, plan: StagePlan, units: Sequence[StageUnit], fields: Sequence[str], *, temperature: float,
                return_entropy: bool):
        """(iterator of (wave, inputs) of every wave this rank runs, the stage's vision pass or None): one move per
        wave under wave sync, each wave encoding its own media; one for the whole stage under minibatch sync, with
        one vision pass before the waves (each image or frame once per rank, one embedding route)."""
        s = self.stats
        build = layout_builder(self.groups, rank=self.rank, lengths=[u.num_tokens for u in units],
                               backend=self.attn_backend, device=self.device, overlap=self.overlap,
                               segments=[u.segments for u in units] if self.shared_prefix else None)
        peak, mean = plan.times_at(self.speeds)
        s.planned_peak += peak
        s.planned_mean += mean
        s.planned_rank_cost = s.planned_rank_cost + plan.rank_costs()
        s.waves += len(plan.waves)
        kw = dict(fields=fields, temperature=temperature, return_entropy=return_entropy, layout_builder=build,
                  collective=plan.moves_data())
        mine = set(plan.rank_waves(self.rank))
        everyone = [p for w in range(len(plan.waves)) for r in range(self.world) for p in plan.pieces(w, r)]
        self.vision_stats.frames_used += run_frames(frame_runs(everyone, units))

        def keep(waves, inputs_list):
            for w, inputs in zip(waves, inputs_list):
                s.exchange_bytes += inputs.bytes_sent
                if w not in mine:
                    continue
                if inputs.batch is not None and isinstance(inputs.batch.attention_layout, UlyssesLayout):
                    s.layouts.append(inputs.batch.attention_layout)
                yield w, inputs

        if plan.sync == "minibatch":
            waves = list(range(len(plan.waves)))
            inputs_list, vpass = self.inputs(plan, units, waves, table=True, **kw)
            return keep(waves, inputs_list), vpass
        return (pair for w in range(len(plan.waves))
                for pair in keep([w], self.inputs(plan, units, [w], table=False, **kw)[0])), None

    def _vision_table(self, model, vpass: VisionPass | None, train: bool) -> VisionTable | None:
        """Run the stage's vision pass (every rank, before its waves)."""
        if vpass is None:
            return None
        live = model(vpass.batch, vision_only=True).hidden
        return VisionTable(live, live.detach().requires_grad_(train and live.requires_grad))

    def _time_vision(self, model) -> None:
        """Count the vision tower's forward time (``vision/balance_measured``) of ``model``."""
        if id(model) in self._timed_vision:
            return
        self._timed_vision.add(id(model))
        start: list = []
        model.vision.register_forward_pre_hook(lambda *_: start.append(self.clock.mark()))

        def done(*_):
            self.stats.vision_seconds.add(start.pop(), self.clock.mark())

        model.vision.register_forward_hook(done)

    def _sync(self, model, plan: StagePlan, *, train: bool):
        if plan.sync == "minibatch" and self.odc:
            return odc_sync(model, train=train)
        if plan.sync == "minibatch":
            return minibatch_sync(model, train=train, reshard_after_forward=self.reshard_after_forward)
        return nullcontext(lambda: None) if train else reshard_root_after(model)

    def _dummy(self, model, backward: bool, inputs: WaveInputs | None = None,
               table: VisionTable | None = None, reducing: bool = False) -> None:
        """A zero-weight forward (and backward) of a two-token pack, for a rank with nothing in a wave or whose
        last microbatch must reduce. With the stage's vision ``table`` it reads the table (no vision tower of its
        own: the tower's backward, and its FSDP reduction, must run once, through the table); when ``reducing`` its
        backward takes the table's gathered gradients through the tower (``table.surrogate``)."""
        dummy = dummy_pack(self.args, self.device, self.dtype)
        if inputs is not None and inputs.vision_route is not None:
            dummy.batch.vision_route = inputs.vision_route  # the wave's embedding route is a collective
        if table is not None:
            dummy.batch.vision_embeds = table.rows(live=reducing or not backward)
            dummy.batch.vision_token_index = torch.zeros(0, dtype=torch.int64, device=self.device)
        out = model(dummy.batch, dummy.targets)
        if backward:
            # zero weight, but every parameter (output projection or value head included) is touched, so FSDP
            # reduce-scatters the same gradient buckets on every rank
            loss = (out.logprobs if out.logprobs is not None else out.values).sum() * 0.0
            (loss + table.surrogate() if reducing and table is not None else loss).backward()

    @torch.no_grad()
    def logprobs(self, model, attr: str, *, temperature: float, ids: Sequence[int] | None = None,
                 output: str = "logprobs") -> None:
        """``traj.<attr>`` of every home trajectory among ``ids`` (default: all; the same on every
        rank): the model's log-probs of its response (``output="values"``: a critic's values at the same
        positions, the state before each response token)."""
        ids = self.all_ids() if ids is None else list(ids)
        if not ids:
            return
        units, plan = self.plan(ids)
        self.stats.features = self.stats.features + self._features(plan, units) / 3.0  # forward only
        self._time_vision(model)
        self.exchange.begin_results(attr, ids)
        done: list[tuple[int, WaveInputs, torch.Tensor]] = []
        with self._sync(model, plan, train=False):
            waves, vpass = self._inputs(plan, units, (), temperature=temperature, return_entropy=False)
            t0 = self.clock.mark()
            table = self._vision_table(model, vpass, train=False)
            self.stats.busy_seconds.add(t0, self.clock.mark())
            for w, inputs in waves:
                t0 = self.clock.mark()
                if table is not None and inputs.batch is not None:
                    inputs.batch.vision_embeds = table.rows(live=True)
                if inputs.batch is None:
                    self._dummy(model, backward=False, inputs=inputs, table=table)
                    logp = torch.zeros(0)
                else:
                    logp = getattr(model(inputs.batch, inputs.targets), output)
                self.stats.busy_seconds.add(t0, self.clock.mark())
                done.append((w, inputs, logp))
                if plan.sync == "wave":  # results home per wave; under minibatch sync once, below
                    self.stats.exchange_bytes += self.exchange.return_logprobs(
                        plan, units, done, attr, waves=[w], collective=plan.moves_data())
                    done = []
        if plan.sync == "minibatch":
            self.stats.exchange_bytes += self.exchange.return_logprobs(
                plan, units, done, attr, waves=range(len(plan.waves)), collective=plan.moves_data())

    def train_minibatch(self, model, ids: Sequence[int], fields: Sequence[str], loss_fn, *, temperature: float,
                        account: bool = True):
        """Forward + backward of every wave of one minibatch; ``loss_fn(out, inputs, global_tokens,
        global_seqs)`` returns the policy-loss output whose ``.loss`` is this rank's contribution
        to the minibatch mean. Returns the outputs (detached terms are read by the caller).
        ``account=False`` (a second model trained on the same minibatches: PPO's critic): its busy time counts,
        but the update's ``train/tokens_*`` and ``balance/*`` statistics stay the policy update's."""
        metas = [self.metas[i] for i in ids]
        global_tokens = float(max(sum(m.scored_len for m in metas), 1))
        global_seqs = float(max(len(metas), 1))
        units, plan = self.plan(ids)
        self.stats.features = self.stats.features + self._features(plan, units)  # busy_seconds counts it either way
        self._time_vision(model)
        s = self.stats if account else type(self.stats)()
        s.minibatches += 1
        s.tokens_computed += sum(u.num_tokens for u in units)
        s.tokens_represented += sum(m.num_tokens for m in metas)
        peak, mean = plan.times_at(self.speeds)
        s.update_planned_peak += peak
        s.update_planned_mean += mean
        s.planned_rank_cost = s.planned_rank_cost + plan.rank_costs()
        results = []
        t0 = self.clock.mark()
        unit_seconds: list[Busy] = []
        comm = attached(model) if self.odc else None
        barriers = comm.barriers if comm is not None else 0
        with self._sync(model, plan, train=True) as last:
            mine = plan.rank_waves(self.rank)
            # under minibatch sync the rank's final microbatch reduces; it must hold no sharded group
            trailing_dummy = plan.sync == "minibatch" and (not mine or bool(plan.waves[mine[-1]].ranks[self.rank].sharded))
            waves, vpass = self._inputs(plan, units, fields, temperature=temperature, return_entropy=True)
            # minibatch sync: the vision pass ran once; microbatches read its rows detached and the last one
            # takes their gradients back through it (table.surrogate), so the tower's backward, its route and
            # its gradient reduction run once, in the reducing microbatch
            table = self._vision_table(model, vpass, train=True)
            for w, inputs in waves:
                reducing = plan.sync == "minibatch" and w == mine[-1] and not trailing_dummy
                if reducing:
                    last()
                s.microbatches += 1
                t_wave = self.clock.mark()
                if inputs.batch is None:
                    self._dummy(model, backward=True, inputs=inputs, table=table, reducing=reducing)
                else:
                    if table is not None:
                        inputs.batch.vision_embeds = table.rows(live=reducing)
                    out = model(inputs.batch, inputs.targets)
                    res = loss_fn(out, inputs, global_tokens, global_seqs)
                    (res.loss + table.surrogate() if reducing and table is not None else res.loss).backward()
                    results.append(res)
                unit_seconds.append(Busy())
                unit_seconds[-1].add(t_wave, self.clock.mark())
            if trailing_dummy:
                last()
                s.microbatches += 1
                self._dummy(model, backward=True, table=table, reducing=True)
        # synchronisations: odc counts its barriers; lb_mini reduces in one microbatch; the others in every wave
        comm = attached(model) if self.odc else None  # built by the stage's entry if it was not yet
        s.reducing_microbatches += (comm.barriers - barriers if comm is not None else
                                    1 if plan.sync == "minibatch" else len(plan.waves))
        t1 = self.clock.mark()
        self.stats.busy_seconds.add(t0, t1)
        s.update_busy_seconds.add(t0, t1)
        # ranks wait for each other at every wave under wave sync, only at the minibatch's end otherwise
        if plan.sync == "wave":
            s.update_units += unit_seconds
        else:
            s.update_units.append(Busy())
            s.update_units[-1].add(t0, t1)
        return results

    def _features(self, plan: StagePlan, units: Sequence[StageUnit]) -> np.ndarray:
        """[rank, (attention, linear)]: what the cost model's two LLM coefficients multiply on every rank."""
        attention = [float(_ATTENTION.prefix_compute(u.prompt_len, u.response_lens)) for u in units]
        # ranks of unequal speed: each term over the speed it runs at (a Ulysses group's slowest member's), so the
        # features are in time and fit the measured seconds as they are
        return np.stack([rank_sums(plan, attention, self.speeds),
                         rank_sums(plan, [u.num_tokens for u in units], self.speeds)], axis=1)

    def _calibration(self, busy: np.ndarray) -> dict[str, float]:
        """balance.calibrate: the step's predicted (by the model that planned it, once fitted) and measured
        busiest-rank seconds of the log-prob and update stages, then a refit on the last 8 steps' rows (CostModel.fit,
        non-negative least squares; on ranks of unequal speed each feature over the speed it ran at). Every rank fits
        the same rows, and all take rank 0's coefficients, so the plans stay identical everywhere."""
        s, out = self.stats, {}
        features = np.broadcast_to(np.asarray(s.features, dtype=np.float64), (self.world, 2))  # in time (above)
        if self.cost_model.units == "seconds":
            predicted = features @ np.array([self.cost_model.attention_coef, self.cost_model.linear_coef])
            out["cost/predicted_s"] = float(predicted.max())
            out["cost/measured_s"] = float(busy.max())
            worked = busy > 0
            out["cost/error"] = float(np.mean(np.abs(predicted[worked] - busy[worked]) / busy[worked])) if worked.any() else 0.0
        self._steps_seen += 1
        for r in range(self.world if self._steps_seen > 1 else 0):  # the first step's times include warm-up
            if features[r].any() and busy[r] > 0:
                self._fit_rows.append((float(features[r, 0]), float(features[r, 1]), float(busy[r])))
        if len(self._fit_rows) >= 4:
            rows = np.asarray(self._fit_rows)
            try:
                fitted = CostModel.fit(rows[:, 0], rows[:, 1], rows[:, 2], base=self.cost_model)
                coef = (fitted.attention_coef, fitted.linear_coef)
            except ValueError:  # nothing positive to fit yet: keep the model
                coef = None
            coef = all_gather_objects(coef, group=self.process_group)[0]
            if coef is not None:
                self.cost_model = dataclasses.replace(
                    self.cost_model, attention_coef=coef[0], linear_coef=coef[1], flops_per_second=1.0, units="seconds")
                out["cost/attention_coef"], out["cost/linear_coef"] = coef
        return out

    # ------------------------------------------------------------------ metrics

    def metrics(self) -> dict[str, float]:
        """The ``parallel/*`` and ``balance/*`` metrics of the step (collective: every rank calls it)."""
        s = self.stats
        a2a = sum(layout.comm.total for layout in s.layouts)
        v = self.vision_stats if self.exchange is not None else None
        vision_bytes = 0 if v is None else v.pixel_bytes + v.route.forward_bytes + v.route.backward_bytes
        sl = self.exchange.slices.stats if self.exchange is not None and self.exchange.slices is not None else None
        loaded = (0, 0, 0, 0) if sl is None else (sl.frames_fetched, sl.bytes_fetched, sl.frames_decoded,
                                                  sl.frames_local)
        every = all_gather_objects((s.busy_seconds.seconds(), a2a, s.exchange_bytes,
                                    [u.seconds() for u in s.update_units], s.microbatches, s.vision_seconds.seconds(),
                                    vision_bytes, loaded, 0 if v is None else v.frames_encoded),
                                   group=self.process_group)
        frames_used = 0 if v is None else v.frames_used
        loaded_sum = np.asarray([e[7] for e in every], dtype=np.float64).sum(axis=0)
        vision_busy = np.asarray([e[5] for e in every], dtype=np.float64)
        busy = np.asarray([e[0] for e in every], dtype=np.float64)
        units = np.asarray([e[3] for e in every], dtype=np.float64)  # [rank, synchronisation unit]
        micro = [e[4] for e in every]
        unit_peak = float(units.max(axis=0).sum()) if units.size else 0.0
        calibration = self._calibration(busy) if self.calibrate else {}
        return {
            **calibration,
            "parallel/degree_max": float(s.degree_max),
            "parallel/sharded_sequences": float(s.sharded_sequences),
            "parallel/split_responses": float(s.split_responses),
            "parallel/a2a_bytes": float(sum(e[1] for e in every)),
            "parallel/exchange_bytes": float(sum(e[2] for e in every)),
            "parallel/plan_ms": 1000.0 * s.plan_seconds,
            "parallel/waves": float(s.waves),
            "parallel/over_budget": float(s.over_budget),
            "parallel/balance_planned": s.planned_peak / s.planned_mean if s.planned_mean > 0 else 1.0,
            "parallel/balance_measured": float(busy.max() / busy.mean()) if busy.mean() > 0 else 1.0,
            # idle share of the update: per synchronisation unit the ranks wait for the busiest one
            "balance/bubble_measured": 1.0 - float(units.mean(axis=0).sum()) / unit_peak if unit_peak > 0 else 0.0,
            "balance/bubble_planned": (1.0 - s.update_planned_mean / s.update_planned_peak
                                       if s.update_planned_peak > 0 else 0.0),
            "balance/microbatches_min": float(min(micro)),
            "balance/microbatches_max": float(max(micro)),
            "balance/syncs_per_minibatch": s.reducing_microbatches / max(s.minibatches, 1),
            # vision tower: planned = per wave the busiest rank's vision cost over the mean;
            # measured = the busiest rank's vision-tower forward time over the mean (busy clock)
            "vision/balance_planned": (v.planned_peak / v.planned_mean if v is not None and v.planned_mean > 0
                                       else 1.0),
            "vision/balance_measured": (float(vision_busy.max() / vision_busy.mean()) if vision_busy.mean() > 0
                                        else 1.0),
            "vision/bytes_moved": float(sum(e[6] for e in every)),
            # images and video temporal patches encoded over all ranks and stages / those the stages' tokens use:
            # 1.0 = each encoded once per stage (and minibatch); more = re-encoded (per wave, per rank)
            "vision/encode_repeats": float(sum(e[8] for e in every)) / frames_used if frames_used else 1.0,
            # slice-aware loading: what encoders fetched from the preprocessors (uint8 frames), what
            # the preprocessors decoded for it (0 while the samples are cached from the homes' fetch),
            # and the frames of runs encoded where their prompt was generated
            "vision/frames_fetched": float(loaded_sum[0]),
            "vision/bytes_fetched": float(loaded_sum[1]),
            "vision/frames_decoded": float(loaded_sum[2]),
            "vision/frames_local": float(loaded_sum[3]),
            "train/tokens_computed": float(s.tokens_computed),
            "train/tokens_represented": float(s.tokens_represented),
            # ranks of unequal speed: each rank's share of the step's planned cost (to compare with its speed)
            **({f"balance/planned_share/rank{r}": float(c / max(np.sum(s.planned_rank_cost), 1e-30))
                for r, c in enumerate(np.broadcast_to(s.planned_rank_cost, (self.world,)))} if self.speeds else {}),
        }
