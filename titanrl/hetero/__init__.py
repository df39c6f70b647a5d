"""HetRL-style scheduling of RL steps on heterogeneous devices and networks (docs/hetrl.md).

- :mod:`~titanrl.hetero.cluster`: the devices and links (``cluster.toml`` or a ``python -m titanrl.profile`` JSON);
- :mod:`~titanrl.hetero.cost`: the cost model (stage and step seconds of a plan, memory feasibility, calibration);
- :mod:`~titanrl.hetero.search`: the scheduler (nested successive halving over task and device groupings, a genetic
  algorithm with two-level swaps below) and its baselines.

``python -m titanrl.schedule`` turns a search's plan into a titanrl config. The search functions live in
``titanrl.hetero.search`` (``search.search``, ``search.ga_only`` ...): not re-exported here, where ``search`` names
the module.
"""

from titanrl.hetero.cluster import Cluster, ClusterError, Device, cluster_from_profile, load_cluster
from titanrl.hetero.cost import (
    Coefficients,
    Estimate,
    GroupPlan,
    HetCostModel,
    ModelShape,
    Plan,
    PlanError,
    Workload,
    fit,
    predict_stage_times,
    workload_from_config,
)
from titanrl.hetero.search import SearchResult, SearchSpace

__all__ = [
    "Cluster",
    "ClusterError",
    "Coefficients",
    "Device",
    "Estimate",
    "GroupPlan",
    "HetCostModel",
    "ModelShape",
    "Plan",
    "PlanError",
    "SearchResult",
    "SearchSpace",
    "Workload",
    "cluster_from_profile",
    "fit",
    "load_cluster",
    "predict_stage_times",
    "workload_from_config",
]
