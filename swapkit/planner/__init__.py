"""The budget planner's torch side: measure a step and the link, then plan (``swapkit plan --budget``)."""
from __future__ import annotations

from swapkit.planner.run import Measured, measure, plan_for_budget
from swapkit.planner.steps import ModelSource, ModelSteps

__all__ = ["Measured", "ModelSource", "ModelSteps", "measure", "plan_for_budget"]
