"""From a config to per-layer decisions, the MindFormers way. Pure: imports no torch.

``layout`` places layers on pipeline stages and interleave chunks, ``normalize`` turns the
recompute and swap keys into "formative" per-chunk counts and pattern dicts, ``megatron``
translates the Megatron dialect, ``plan`` decides per layer, ``patterns`` matches op patterns
against module names and ``report`` prints what ``swapkit plan`` shows.
"""
from swapkit.plan.layout import Layout, build_layout
from swapkit.plan.plan import LayerPlan, Plan, build_plan, check_plan

__all__ = ["LayerPlan", "Layout", "Plan", "build_layout", "build_plan", "check_plan"]
