"""The budget planner's torch side: measure a step and the link, then plan (``swapkit plan --budget``)."""
from __future__ import annotations

from swapkit.planner.run import Measured, measure, plan_for_budget

__all__ = ["Measured", "measure", "plan_for_budget"]
