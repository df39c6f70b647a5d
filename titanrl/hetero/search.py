"""The HetRL scheduler (HetRL sec. 3.2 / 3.4, Algorithm 1) and the baselines its evaluation compares with.

Five levels, as in the paper:

1. **task grouping**: a partition of the workload's tasks into groups that share devices. Tasks that read the
   same weights stay together (``old_logprobs`` with ``update``, ``values`` with ``critic_update``), so the units
   partitioned are rollout, reference, actor, critic (GRPO: 5 groupings, PPO: 15). ``SearchSpace.groupings =
   "titanrl"`` keeps the two titanrl runs: everything colocated (synchronous only), or the rollout apart.
2. **coarse device grouping**: how many devices each task group gets (counts in steps of ``count_step``) and,
   for the arms tried first, which whole device types it gets (:meth:`_Searcher.device_groupings`).
3. **medium device assignment**: which devices each group gets (the GA swaps devices across groups).
4. **intra-model parallelism**: per group the TP degree of the generation engines (``tp_choices`` dividing the
   group), the Ulysses degree (powers of two up to ``max_ulysses`` dividing the group and the heads) and the FSDP
   degree (powers of two dividing the group, or the whole group), under the memory constraint.
5. **fine device assignment**: the order of a group's devices, which decides its TP engines, Ulysses units and
   FSDP blocks (the GA swaps devices within a group).

:func:`search` runs nested successive halving over levels 1 and 2 (Algorithm 1: task groupings are the outer
arms, device groupings the inner ones; each round halves the arms and doubles the budget of the survivors; a
task grouping keeps the better half of its device groupings for its next round; an arm's loss is the best step
time found in it) and, per (task grouping, device grouping) arm, a steady-state genetic algorithm carried across
rounds: its first individuals use heuristic device orders (whole device types as the arm deals them; the fastest
devices to the groups with the most work per device; the most memory bandwidth per FLOP to generation; the
cluster's order), then random orders at host granularity, each with the next memory-feasible parallelism
combination (the lightest first: least FSDP, Ulysses, TP); offspring are a tournament winner mutated by one or two
of a swap across groups (level 3), a swap within a group (level 5) - runs of 1, 2, 4 .. aligned devices, so a
host's devices can move together - or a new parallelism degree (level 4), and replace the worst when better (and
not equal to a member's cost: an equivalent plan would only cost the population its diversity).

The budget ``B`` counts plans priced by the cost model. Memory checks (repairing an individual's parallelism,
enumerating the feasible combinations) are not counted: they price no step. Each arm's first-round share is at
least ``_MIN_ARM_EVALS`` evaluations, which caps how many device groupings a task grouping starts with; what the
floors of Algorithm 1 leave over goes to the best arm, so every method spends exactly ``B``.

Baselines (HetRL sec. 5.3): :func:`ga_only` ("HetRL (simple)": no successive halving, one population over random
task and device groupings, swaps only within a group and parallelism mutations, as Yuan et al.'s GA),
:func:`random_search`, and :func:`verl_like_plan` (every task on every device, even split, speed-oblivious; its
parallelism degrees are the best the cost model finds for that layout, the best a verl user could configure by
hand). :func:`best_homogeneous_plan` is the best colocated plan on one device type; :func:`all_plans` enumerates
a small cluster's whole space (tests).

Everything is deterministic given ``seed``.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from titanrl.hetero.cluster import Cluster
from titanrl.hetero.cost import (
    MODEL_TASKS,
    TASKS,
    Coefficients,
    Estimate,
    GroupPlan,
    HetCostModel,
    Plan,
    Workload,
)

_UNIT_OF = {"rollout": "rollout", "reference": "reference", "old_logprobs": "actor", "update": "actor",
            "values": "critic", "critic_update": "critic"}
_MIN_ARM_EVALS = 2  # fewest evaluations a device grouping gets in its first round


@dataclass(frozen=True)
class SearchSpace:
    """What plans a search may produce (module doc)."""

    groupings: str = "all"  # "all" | "titanrl"
    tp_choices: tuple[int, ...] = (1, 2, 4, 8)
    max_ulysses: int = 8
    fsdp: str = "any"  # "any": powers of two dividing the group, and the group | "full": the whole group
    count_step: int = 0  # device-count granularity at level 2 (0: max(1, devices // 16))
    population: int = 8
    speed_aware: bool = True  # plans split work by device speed (False: evenly, HetRL's load-balancing ablation)

    def __post_init__(self) -> None:
        if self.groupings not in ("all", "titanrl"):
            raise ValueError(f"SearchSpace.groupings must be 'all' or 'titanrl', got {self.groupings!r}")
        if self.fsdp not in ("any", "full"):
            raise ValueError(f"SearchSpace.fsdp must be 'any' or 'full', got {self.fsdp!r}")
        if not self.tp_choices or 1 not in self.tp_choices:
            raise ValueError(f"SearchSpace.tp_choices must include 1, got {self.tp_choices}")
        if self.max_ulysses < 1 or self.population < 2:
            raise ValueError("SearchSpace.max_ulysses must be >= 1 and population >= 2")


@dataclass(frozen=True)
class SearchResult:
    """The best plan found (None when nothing fit), its predicted step seconds and estimate, the best-so-far step
    seconds after every evaluation (``history``), evaluations spent and wall seconds."""

    plan: Plan | None
    step_s: float
    estimate: Estimate | None
    history: tuple[float, ...]
    evaluations: int
    wall_s: float
    method: str
    # the plans the search is never worse than, priced in the same space: (name, step seconds); ``chosen`` names
    # the one returned when it beat what the search found ("search": its own)
    baselines: tuple[tuple[str, float], ...] = ()
    chosen: str = "search"


# ------------------------------------------------------------------------------------------------ levels 1-2

def task_groupings(workload: Workload, space: SearchSpace = SearchSpace()) -> list[tuple[tuple[str, ...], ...]]:
    """Level 1: the task groupings of ``workload`` in ``space`` (the group holding the rollout first)."""
    tasks = workload.tasks
    units = list(dict.fromkeys(_UNIT_OF[t] for t in tasks))
    if space.groupings == "titanrl":  # titanrl runs asynchronously only disaggregated
        partitions = [[["rollout"], [u for u in units if u != "rollout"]]]
        if workload.mode == "sync":
            partitions.insert(0, [units])
    else:
        partitions = list(_set_partitions(units))
    out = []
    for part in partitions:
        groups = [tuple(t for t in tasks if _UNIT_OF[t] in block) for block in part]
        groups.sort(key=lambda g: ("rollout" not in g, TASKS.index(g[0])))
        out.append(tuple(groups))
    return out


def _set_partitions(items: list[str]) -> Iterator[list[list[str]]]:
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _set_partitions(rest):
        yield [[first], *part]
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1:]]


def device_counts(devices: int, groups: int, step: int = 1) -> list[tuple[int, ...]]:
    """Level 2: every split of ``devices`` into ``groups`` positive counts that are multiples of ``step`` (what
    ``step`` leaves over goes to the first group)."""
    units = devices // step
    spare = devices - units * step
    out = []
    for cuts in itertools.combinations(range(1, units), groups - 1):
        parts = [b - a for a, b in zip((0, *cuts), (*cuts, units))]
        counts = [p * step for p in parts]
        counts[0] += spare
        out.append(tuple(counts))
    return out


# ------------------------------------------------------------------------------------------------ individuals

@dataclass
class _Arm:
    """One (task grouping, device counts) pair: its parallelism options and the GA population searching it."""

    grouping: tuple[tuple[str, ...], ...]
    counts: tuple[int, ...]
    options: list[tuple[list[int], list[int], list[int]]]  # per group: tp, ulysses, fsdp choices
    best: float = math.inf
    evaluations: int = 0
    seen: set = field(default_factory=set)
    feasible: list | None = None  # memory-feasible parallelism combinations (level 4), shuffled
    next_par: int = 0
    orders: list | None = None  # heuristic device orders, tried first
    seed: tuple[int, ...] | None = None  # level 2: the group of each device type, when whole types were dealt
    next_order: int = 0
    speed_aware: bool = True

    @property
    def bounds(self) -> list[tuple[int, int]]:
        out, start = [], 0
        for c in self.counts:
            out.append((start, start + c))
            start += c
        return out


@dataclass
class _Individual:
    arm: _Arm
    order: list[int]
    par: list[tuple[int, int, int]]
    cost: float = math.inf

    def plan(self) -> Plan:
        groups = []
        for tasks, (a, b), (tp, p, f) in zip(self.arm.grouping, self.arm.bounds, self.par):
            groups.append(GroupPlan(tasks, tuple(self.order[a:b]), tp, p, f))
        return Plan(tuple(groups), speed_aware=self.arm.speed_aware)

    def copy(self) -> "_Individual":
        return _Individual(self.arm, list(self.order), list(self.par), self.cost)


class _Searcher:
    """The state every method shares: the cost model, the budget, the best-so-far history."""

    def __init__(self, cluster: Cluster, workload: Workload, space: SearchSpace, seed: int, budget: int,
                 model: HetCostModel | None, coefficients: Coefficients | None) -> None:
        if budget < 1:
            raise ValueError(f"budget must be >= 1, got {budget}")
        self.cluster, self.workload, self.space, self.budget = cluster, workload, space, budget
        self.model = model or HetCostModel(cluster, workload, coefficients)
        self.rng = random.Random(seed)
        self.devices = list(range(len(cluster)))
        self.step = space.count_step or max(1, len(cluster) // 16)
        self.klass = [(d.host, d.type) for d in cluster.devices]
        self.history: list[float] = []
        self.best: tuple[float, _Individual | None] = (math.inf, None)
        self.started = time.perf_counter()

    @property
    def left(self) -> int:
        return self.budget - len(self.history)

    # -- arms

    def arm(self, grouping: tuple[tuple[str, ...], ...], counts: tuple[int, ...],
            seed: tuple[int, ...] | None = None) -> _Arm:
        heads = self.workload.model.heads
        options = [parallel_options(tasks, n, self.space, heads) for tasks, n in zip(grouping, counts)]
        return _Arm(grouping, counts, options, seed=seed, speed_aware=self.space.speed_aware)

    def groupings_and_counts(self) -> list[tuple[tuple[tuple[str, ...], ...], list[tuple[int, ...]]]]:
        out = []
        for grouping in task_groupings(self.workload, self.space):
            counts = device_counts(len(self.devices), len(grouping), self.step)
            if counts:
                out.append((grouping, counts))
        if not out:
            raise ValueError(f"no task grouping fits {len(self.devices)} device(s)")
        return out

    def device_groupings(self, grouping: tuple[tuple[str, ...], ...], counts: list[tuple[int, ...]]
                         ) -> list[tuple[tuple[int, ...], tuple[int, ...] | None]]:
        """Level 2 arms of a task grouping, most promising first: ``(counts, seed)``. Whole device types given to
        groups (``seed``: the group of each type of :attr:`Cluster.types`) come first, ordered by how near their
        counts are to a split by estimated work (square root of the work for synchronous steps, where stages take
        turns; proportional when the rollout overlaps), interleaved with the plain counts nearest to that split;
        then the other counts in a seeded random order."""
        overlap = self.workload.mode == "async" and grouping[0] == ("rollout",)
        work = [sum(self.model.task_work(t) for t in tasks) for tasks in grouping]
        weights = [w if overlap else math.sqrt(w) for w in work]
        target = [len(self.devices) * w / sum(weights) for w in weights]

        def distance(c: tuple[int, ...]) -> tuple:
            return sum(abs(a - b) for a, b in zip(c, target)), c

        types = self.cluster.types
        per_type = [len(self.cluster.of_type(t)) for t in types]
        k = len(grouping)
        typed = []
        for assign in itertools.product(range(k), repeat=len(types)):
            if len(types) > 1 and k > 1 and set(assign) == set(range(k)):
                typed.append((tuple(sum(n for n, g in zip(per_type, assign) if g == i) for i in range(k)), assign))
        typed.sort(key=lambda arm: (distance(arm[0]), arm[1]))
        plain = sorted((c for c in counts if c not in {t[0] for t in typed}), key=distance)
        head = [*typed[:1], *[(c, None) for c in plain[:1]], *typed[1:]]
        rest = [(c, None) for c in plain[1:]]
        return head + self.rng.sample(rest, len(rest))

    # -- individuals

    def new_individual(self, arm: _Arm, heuristic: bool = False) -> _Individual:
        """Level 3-5 initialisation: the arm's next heuristic device order while ``heuristic`` and any are left
        (:meth:`_heuristic_orders`), else a random one; the next of the arm's memory-feasible parallelism
        combinations (enumerated once: HetRL enumerates level 4)."""
        if heuristic and arm.next_order < len(self._heuristic_orders(arm)):
            order = list(self._heuristic_orders(arm)[arm.next_order])
            arm.next_order += 1
        else:
            order = self.random_order()
        if arm.feasible is None:
            arm.feasible = self._feasible_par(arm, order)
        if arm.feasible:
            par = list(arm.feasible[arm.next_par % len(arm.feasible)])
            arm.next_par += 1
        else:
            par = [(self.rng.choice(tp), self.rng.choice(p), self.rng.choice(f)) for tp, p, f in arm.options]
        ind = _Individual(arm, order, par)
        self._repair(ind)
        return ind

    def random_order(self) -> list[int]:
        """A random device order that keeps each host's devices together (hosts shuffled, and the devices within
        each): the random level-3 assignment, at host granularity, which the swaps then refine."""
        hosts: dict[str, list[int]] = {}
        for d in self.cluster.devices:
            hosts.setdefault(d.host, []).append(d.id)
        blocks = list(hosts.values())
        self.rng.shuffle(blocks)
        order = []
        for block in blocks:
            order += self.rng.sample(block, len(block))
        return order

    def _heuristic_orders(self, arm: _Arm) -> list[tuple[int, ...]]:
        """Device orders worth trying first: the fastest devices to the groups with the most work per device; the
        devices with the most memory bandwidth per FLOP to generation, the others to the models; the cluster's own
        order. Each group's devices region by region, host by host."""
        if arm.orders is None:
            devs = self.cluster.devices
            local = lambda d: (devs[d].region, devs[d].host, d)  # noqa: E731
            work = [sum(self.model.task_work(t) for t in tasks) for tasks in arm.grouping]
            by_need = sorted(range(len(arm.counts)), key=lambda g: (-work[g] / arm.counts[g], g))
            fastest = sorted(self.devices, key=lambda d: (-devs[d].tflops, local(d)))
            orders = []
            if arm.seed is not None:
                types = self.cluster.types
                orders.append(tuple(d for g in range(len(arm.counts)) for d in sorted(
                    (d for d in self.devices if arm.seed[types.index(devs[d].type)] == g), key=local)))
            orders.append(self._fill(arm, by_need, fastest))
            gen_first = sorted(range(len(arm.counts)), key=lambda g: ("rollout" not in arm.grouping[g], g))
            memory_bound = sorted(self.devices, key=lambda d: (-devs[d].hbm_gbps / devs[d].tflops, local(d)))
            orders.append(self._fill(arm, gen_first, memory_bound))
            orders.append(self._fill(arm, list(range(len(arm.counts))), sorted(self.devices, key=local)))
            arm.orders = list(dict.fromkeys(orders))
        return arm.orders

    def _fill(self, arm: _Arm, groups: list[int], devices: list[int]) -> tuple[int, ...]:
        """Hand ``devices`` out in order to ``groups`` in order, then lay the groups out in the arm's order."""
        devs = self.cluster.devices
        taken: dict[int, list[int]] = {}
        start = 0
        for g in groups:
            taken[g] = sorted(devices[start:start + arm.counts[g]], key=lambda d: (devs[d].region, devs[d].host, d))
            start += arm.counts[g]
        return tuple(d for g in range(len(arm.counts)) for d in taken[g])

    def _feasible_par(self, arm: _Arm, order: list[int]) -> list[tuple[tuple[int, int, int], ...]]:
        """Parallelism combinations (one per group) that fit in memory on ``order``'s groups: first the lightest
        (per group the smallest FSDP, then Ulysses, then TP degree that fits: the least communication), then the
        others shuffled."""
        per_group = []
        for tasks, (a, b), options in zip(arm.grouping, arm.bounds, arm.options):
            devices = tuple(order[a:b])
            fits = [combo for combo in itertools.product(*options)
                    if self.model.group_problem(GroupPlan(tasks, devices, *combo)) is None]
            per_group.append(sorted(fits, key=lambda c: (c[2], c[1], c[0])))
        if not all(per_group):
            return []
        lightest = tuple(fits[0] for fits in per_group)
        size = math.prod(len(fits) for fits in per_group)
        if size <= 4096:
            rest = [c for c in itertools.product(*per_group) if c != lightest]
        else:
            rest = list({tuple(self.rng.choice(fits) for fits in per_group) for _ in range(4096)} - {lightest})
            rest.sort()
        self.rng.shuffle(rest)
        return [lightest, *rest]

    def _repair(self, ind: _Individual) -> None:
        """Redraw a group's parallelism until it fits in memory (free: no step time is priced)."""
        for i, (tp_opts, p_opts, f_opts) in enumerate(ind.arm.options):
            a, b = ind.arm.bounds[i]
            tasks = ind.arm.grouping[i]
            devices = tuple(ind.order[a:b])
            if self.model.group_problem(GroupPlan(tasks, devices, *ind.par[i])) is None:
                continue
            combos = list(itertools.product(tp_opts, p_opts, f_opts))
            self.rng.shuffle(combos)
            for combo in combos:
                if self.model.group_problem(GroupPlan(tasks, devices, *combo)) is None:
                    ind.par[i] = combo
                    break

    def signature(self, ind: _Individual) -> tuple:
        return (ind.arm.grouping, ind.arm.counts, tuple(self.klass[d] for d in ind.order), tuple(ind.par))

    def mutate(self, parent: _Individual, cross: bool) -> _Individual:
        """An offspring: one or two of a swap across groups (level 3, when ``cross``), a swap within a group
        (level 5) or a new parallelism degree (level 4); a few tries for one the arm has not seen."""
        child = parent.copy()
        for _ in range(10):
            child = parent.copy()
            for _ in range(1 + (self.rng.random() < 0.5)):
                ops = ["within", "par"] + (["cross", "cross"] if cross and len(child.arm.counts) > 1 else [])
                getattr(self, f"_{self.rng.choice(ops)}")(child)
            if self.signature(child) not in child.arm.seen:
                break
        return child

    def _cross(self, ind: _Individual) -> None:
        """Level-3 swap: exchange devices between two task groups (a run of 1, 2, 4 .. aligned positions, so a
        host's devices can move together)."""
        bounds = ind.arm.bounds
        g, h = self.rng.sample(range(len(bounds)), 2)
        self._swap_runs(ind, bounds[g], bounds[h], same_group=False)

    def _within(self, ind: _Individual) -> None:
        """Level-5 swap: exchange two runs of devices inside one group (its engines, Ulysses units, FSDP blocks)."""
        bounds = [b for b in ind.arm.bounds if b[1] - b[0] > 1]
        if not bounds:
            return self._par(ind)
        a = self.rng.choice(bounds)
        self._swap_runs(ind, a, a, same_group=True)

    def _swap_runs(self, ind: _Individual, a: tuple[int, int], b: tuple[int, int], same_group: bool) -> None:
        limit = min(a[1] - a[0], b[1] - b[0]) // (2 if same_group else 1)
        length = self.rng.choice(_powers_of_two(max(1, limit)))
        for _ in range(10):
            i = a[0] + length * self.rng.randrange((a[1] - a[0]) // length)
            j = b[0] + length * self.rng.randrange((b[1] - b[0]) // length)
            if same_group and i == j:
                continue
            run_i, run_j = ind.order[i:i + length], ind.order[j:j + length]
            if [self.klass[d] for d in run_i] != [self.klass[d] for d in run_j]:
                ind.order[i:i + length], ind.order[j:j + length] = run_j, run_i
                return

    def _par(self, ind: _Individual) -> None:
        g = self.rng.randrange(len(ind.par))
        choices = [(k, opts) for k, opts in enumerate(ind.arm.options[g]) if len(opts) > 1]
        if not choices:
            return
        k, opts = self.rng.choice(choices)
        values = list(ind.par[g])
        values[k] = self.rng.choice([o for o in opts if o != values[k]])
        ind.par[g] = tuple(values)

    # -- evaluation

    def evaluate(self, ind: _Individual) -> float:
        ind.cost = self.model.evaluate(ind.plan()).step_s
        ind.arm.seen.add(self.signature(ind))
        ind.arm.evaluations += 1
        ind.arm.best = min(ind.arm.best, ind.cost)
        if ind.cost < self.best[0]:
            self.best = (ind.cost, ind)
        self.history.append(self.best[0])
        return ind.cost

    def ga_step(self, population: list[_Individual], arm: _Arm | None, cross: bool) -> None:
        """One evaluation: the next initial individual while the population is short, else an offspring of a
        tournament winner that replaces the worst when better."""
        if arm is not None and len(population) < self.space.population:
            ind = self.new_individual(arm, heuristic=True)
            self.evaluate(ind)
            population.append(ind)
            return
        a, b = self.rng.sample(population, 2) if len(population) > 1 else (population[0], population[0])
        parent = a if a.cost <= b.cost else b
        child = self.mutate(parent, cross)
        self.evaluate(child)
        worst = max(range(len(population)), key=lambda i: (population[i].cost, i))
        # a child no better than the worst, or as good as a member (an equivalent plan), would only cost diversity
        if child.cost < population[worst].cost and all(child.cost != p.cost for p in population):
            population[worst] = child

    def result(self, method: str, baselines: Sequence[tuple[str, Plan, float]] = ()) -> SearchResult:
        """The best plan priced: the search's own, or a baseline that beats it (``baselines``)."""
        cost, ind = self.best
        plan = ind.plan() if ind is not None else None
        chosen = "search"
        for name, baseline, seconds in baselines:
            if seconds < cost:
                cost, plan, chosen = seconds, baseline, name
        estimate = self.model.evaluate(plan) if plan is not None else None
        return SearchResult(plan, cost, estimate, tuple(self.history), len(self.history),
                            time.perf_counter() - self.started, method,
                            tuple((name, seconds) for name, _, seconds in baselines), chosen)


def parallel_options(tasks: tuple[str, ...], devices: int, space: SearchSpace, heads: int
                     ) -> tuple[list[int], list[int], list[int]]:
    """Level 4: the TP, Ulysses and FSDP degrees ``space`` allows a group of ``tasks`` on ``devices`` devices."""
    models = any(t in MODEL_TASKS for t in tasks)
    tp = [t for t in space.tp_choices if devices % t == 0] if "rollout" in tasks else [1]
    if not models:
        return tp, [1], [1]
    ulysses = [p for p in _powers_of_two(space.max_ulysses) if devices % p == 0 and heads % p == 0]
    fsdp = [devices] if space.fsdp == "full" else sorted({f for f in _powers_of_two(devices) if devices % f == 0}
                                                        | {devices})
    return tp, ulysses, fsdp


def _powers_of_two(limit: int) -> list[int]:
    out, p = [], 1
    while p <= limit:
        out.append(p)
        p *= 2
    return out


def _log2ceil(n: int) -> int:
    return max(1, math.ceil(math.log2(n))) if n > 1 else 1


def _best_half(arms: list, loss) -> list:
    ranked = sorted(range(len(arms)), key=lambda i: (loss(arms[i]), i))
    keep = sorted(ranked[:max(1, math.ceil(len(arms) / 2))])
    return [arms[i] for i in keep]


# ------------------------------------------------------------------------------------------------ methods

def search(cluster: Cluster, workload: Workload, *, budget: int = 2000, seed: int = 0,
           space: SearchSpace = SearchSpace(), model: HetCostModel | None = None,
           coefficients: Coefficients | None = None) -> SearchResult:
    """HetRL's search: nested successive halving over task and device groupings, a GA with two-level swaps per
    arm (module doc). ``budget`` plans are priced."""
    s = _Searcher(cluster, workload, space, seed, budget, model, coefficients)
    tgs = s.groupings_and_counts()
    rounds = _log2ceil(len(tgs))
    b0 = budget // (len(tgs) * rounds)
    arms: dict[int, list[_Arm]] = {}
    for i, (grouping, counts) in enumerate(tgs):
        candidates = s.device_groupings(grouping, counts)
        sizes = sorted({*_powers_of_two(len(candidates)), len(candidates)})
        k = max([n for n in sizes if b0 // (n * _log2ceil(n)) >= _MIN_ARM_EVALS], default=1)
        arms[i] = [s.arm(grouping, c, seed) for c, seed in candidates[:k]]
    populations: dict[int, list[_Individual]] = {}

    def run_arm(arm: _Arm, evals: int) -> None:
        pop = populations.setdefault(id(arm), [])
        for _ in range(min(evals, s.left)):
            s.ga_step(pop, arm, cross=True)

    alive = list(range(len(tgs)))
    for _ in range(rounds):
        b_m = budget // (len(alive) * rounds)
        for i in alive:
            gg = list(arms[i])
            inner = _log2ceil(len(gg))
            for _ in range(inner):
                b_mn = b_m // (len(gg) * inner)
                for arm in gg:
                    run_arm(arm, b_mn)
                gg = _best_half(gg, lambda a: a.best)
            arms[i] = _best_half(arms[i], lambda a: a.best)
        alive = _best_half(alive, lambda i: min(a.best for a in arms[i]))
    # what the floors left over: the best arm's GA
    every = [a for i in arms for a in arms[i]]
    best_arm = min(every, key=lambda a: (a.best, every.index(a)))
    run_arm(best_arm, s.left)
    return s.result("hetrl", baselines(cluster, workload, model=s.model, space=space))


def ga_only(cluster: Cluster, workload: Workload, *, budget: int = 2000, seed: int = 0,
            space: SearchSpace = SearchSpace(), model: HetCostModel | None = None,
            coefficients: Coefficients | None = None) -> SearchResult:
    """"HetRL (simple)": one GA population over random task and device groupings, no successive halving; swaps
    only within a group (no device moves between models) and parallelism mutations."""
    s = _Searcher(cluster, workload, space, seed, budget, model, coefficients)
    tgs = s.groupings_and_counts()
    population: list[_Individual] = []
    arms: dict[tuple, _Arm] = {}
    size = 2 * space.population
    while s.left and len(population) < size:
        grouping, counts = s.rng.choice(tgs)
        key = (grouping, s.rng.choice(counts))
        fresh = key not in arms
        arm = arms.setdefault(key, s.arm(*key))
        ind = s.new_individual(arm, heuristic=fresh)  # initialised as search() initialises an arm
        s.evaluate(ind)
        population.append(ind)
    while s.left:
        s.ga_step(population, None, cross=False)
    return s.result("ga_only")


def random_search(cluster: Cluster, workload: Workload, *, budget: int = 2000, seed: int = 0,
                  space: SearchSpace = SearchSpace(), model: HetCostModel | None = None,
                  coefficients: Coefficients | None = None) -> SearchResult:
    """Random plans: a random task grouping, device counts, device order and (memory-repaired) parallelism each."""
    s = _Searcher(cluster, workload, space, seed, budget, model, coefficients)
    tgs = s.groupings_and_counts()
    while s.left:
        grouping, counts = s.rng.choice(tgs)
        s.evaluate(s.new_individual(s.arm(grouping, s.rng.choice(counts))))
    return s.result("random")


def _best_parallelism(model: HetCostModel, groups: Sequence[tuple[tuple[str, ...], tuple[int, ...]]],
                      space: SearchSpace, speed_aware: bool) -> tuple[Plan, float]:
    """The best plan over every parallelism choice of fixed task groups on fixed devices (priced by ``model``;
    not counted against any budget)."""
    heads = model.workload.model.heads
    options = [parallel_options(tasks, len(devices), space, heads) for tasks, devices in groups]
    best: tuple[float, Plan | None] = (math.inf, None)
    fallback = None
    for combo in itertools.product(*(itertools.product(*o) for o in options)):
        plan = Plan(tuple(GroupPlan(tasks, devices, *par) for (tasks, devices), par in zip(groups, combo)),
                    speed_aware=speed_aware)
        fallback = fallback or plan
        cost = model.evaluate(plan).step_s
        if cost < best[0]:
            best = (cost, plan)
    return (best[1] or fallback), best[0]


def verl_like_plan(cluster: Cluster, workload: Workload, *, model: HetCostModel | None = None,
                   space: SearchSpace = SearchSpace(), devices: Sequence[int] | None = None) -> Plan:
    """verl's layout: every task colocated on every device in id order, work split evenly (speed-oblivious). In
    asynchronous mode the rollout takes the first half of the devices (verl's one-step off-policy recipe), the
    rest hold the models. Its TP / Ulysses / FSDP degrees are the best the cost model finds for that layout."""
    model = model or HetCostModel(cluster, workload)
    ids = tuple(devices if devices is not None else range(len(cluster)))
    tasks = workload.tasks
    if workload.mode == "async" and len(ids) > 1:
        half = len(ids) // 2
        groups = [(("rollout",), ids[:half]), (tuple(t for t in tasks if t != "rollout"), ids[half:])]
    else:
        groups = [(tasks, ids)]
    return _best_parallelism(model, groups, space, speed_aware=False)[0]


def baselines(cluster: Cluster, workload: Workload, *, model: HetCostModel | None = None,
              space: SearchSpace = SearchSpace()) -> list[tuple[str, Plan, float]]:
    """The plans a search must never lose to, each at its best parallelism in ``space`` (priced, not budgeted):
    every task on every device; every task on the devices of one type only (each type, when there are several);
    verl's layout (``verl_like_plan``). Asynchronous, "every task together" is the rollout on the first half of the
    devices and the models on the rest (an asynchronous step needs them apart). (name, plan, step seconds)."""
    model = model or HetCostModel(cluster, workload)
    tasks = workload.tasks

    def layout(ids: tuple[int, ...]) -> list | None:
        if workload.mode != "async":
            return [(tasks, ids)]
        if len(ids) < 2:
            return None
        half = len(ids) // 2
        return [(("rollout",), ids[:half]), (tuple(t for t in tasks if t != "rollout"), ids[half:])]

    sets = [("every device", tuple(range(len(cluster))))]
    if len(cluster.types) > 1:
        sets += [(f"the {t} devices only", tuple(cluster.of_type(t))) for t in cluster.types]
    out = []
    for name, ids in sets:
        groups = layout(ids)
        if groups is not None:
            plan, seconds = _best_parallelism(model, groups, space, speed_aware=space.speed_aware)
            out.append((f"{'colocated' if workload.mode != 'async' else 'rollout | models'} on {name}", plan,
                        seconds))
    verl = verl_like_plan(cluster, workload, model=model, space=space)
    out.append(("verl-like (every device, even split, speed-oblivious)", verl, model.step_time(verl)))
    return out


def best_homogeneous_plan(cluster: Cluster, workload: Workload, *, model: HetCostModel | None = None,
                          space: SearchSpace = SearchSpace(), device_type: str | None = None
                          ) -> tuple[Plan | None, float, str]:
    """The best colocated plan on the devices of one type only (``device_type``, else the best type): (plan, step
    seconds, type); ``inf`` when no such plan fits in memory. Every parallelism choice is priced (not budgeted)."""
    model = model or HetCostModel(cluster, workload)
    best: tuple[Plan | None, float, str] = (None, math.inf, "")
    for device_type in [device_type] if device_type else cluster.types:
        ids = cluster.of_type(device_type)
        plan, cost = _best_parallelism(model, [(workload.tasks, ids)], space, speed_aware=True)
        if cost < best[1]:
            best = (plan, cost, device_type)
    return best


def all_plans(cluster: Cluster, workload: Workload, space: SearchSpace = SearchSpace()) -> Iterator[Plan]:
    """Every plan of ``space`` on ``cluster`` up to interchangeable devices (same host and type): exponential in the
    number of devices, for checking a search on small clusters. Device counts use ``count_step`` (0: 1)."""
    n = len(cluster)
    klass = [(d.host, d.type) for d in cluster.devices]
    orders = {}
    for perm in itertools.permutations(range(n)):
        orders.setdefault(tuple(klass[d] for d in perm), perm)
    for grouping in task_groupings(workload, space):
        for counts in device_counts(n, len(grouping), space.count_step or 1):
            options = [parallel_options(tasks, c, space, workload.model.heads) for tasks, c in zip(grouping, counts)]
            bounds = list(itertools.accumulate(counts, initial=0))
            for perm in orders.values():
                for combo in itertools.product(*(itertools.product(*o) for o in options)):
                    yield Plan(tuple(GroupPlan(tasks, tuple(perm[a:b]), *par) for tasks, a, b, par
                                     in zip(grouping, bounds, bounds[1:], combo)))
