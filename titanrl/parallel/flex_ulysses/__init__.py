"""FlexUlysses: per-sequence adaptive Ulysses sharding (FlexRL sec. 3, appendix A).

Pure planning, no GPU: every rank computes the identical plan from the batch metadata.

- :func:`plan_shards` -- the placement heuristic (Algorithms 2 and 3) -> :class:`ShardPlan`
- :func:`plan_bucketing`, :func:`plan_fixed_sp` -- the paper's baselines, same type
- :func:`plan_vision` -- vision-tower balancing of images / frame slices -> :class:`VisionPlan`
- :func:`admissible_groups` -- the nested power-of-two device groups (DeviceMesh submeshes)
- :func:`check_deadlock_free` / :func:`simulate` -- cyclic-wait check of the per-rank collectives
"""

from titanrl.parallel.cost_model import CostModel
from titanrl.parallel.flex_ulysses.baselines import plan_bucketing, plan_fixed_sp
from titanrl.parallel.flex_ulysses.groups import admissible_groups, degree_levels, is_admissible
from titanrl.parallel.flex_ulysses.plan import RankSchedule, ScheduleStep, SequenceGroup, ShardPlan
from titanrl.parallel.flex_ulysses.planner import plan_shards
from titanrl.parallel.flex_ulysses.schedule import (
    Collective,
    DeadlockError,
    SimulationResult,
    check_deadlock_free,
    check_queues,
    collective_queues,
    simulate,
)
from titanrl.parallel.flex_ulysses.vision import VisionPlan, VisionUnit, plan_vision

__all__ = [
    "Collective",
    "CostModel",
    "DeadlockError",
    "RankSchedule",
    "ScheduleStep",
    "SequenceGroup",
    "ShardPlan",
    "SimulationResult",
    "VisionPlan",
    "VisionUnit",
    "admissible_groups",
    "check_deadlock_free",
    "check_queues",
    "collective_queues",
    "degree_levels",
    "is_admissible",
    "plan_bucketing",
    "plan_fixed_sp",
    "plan_shards",
    "plan_vision",
    "simulate",
]
