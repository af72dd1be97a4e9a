"""Dynamic context parallelism: a per-global-batch plan that gives each packed sample the CP size
it needs and minimizes the modeled step time (scheduler and cost model, pure Python), and the
registry of aligned CP groups the plan refers to."""

from cpkit.dynamic.cost import CostModel, ModelDims, default_cost_model, load_calibration
from cpkit.dynamic.plan import CPGroupAssignment, Microbatch, Plan, PlanStats
from cpkit.dynamic.registry import GroupRegistry, aligned_blocks, build_group_registry
from cpkit.dynamic.scheduler import (
    DEFAULT_BALANCE_TOLERANCE,
    aligned_roots,
    cp_size_for,
    largest_group_size,
    schedule,
)
from cpkit.dynamic.workload import QuadraticWorkload, default_workload, workload_for_model

__all__ = [
    "CPGroupAssignment",
    "CostModel",
    "ModelDims",
    "default_cost_model",
    "load_calibration",
    "DEFAULT_BALANCE_TOLERANCE",
    "GroupRegistry",
    "Microbatch",
    "Plan",
    "PlanStats",
    "QuadraticWorkload",
    "aligned_blocks",
    "aligned_roots",
    "build_group_registry",
    "cp_size_for",
    "default_workload",
    "largest_group_size",
    "schedule",
    "workload_for_model",
]
