"""``swapkit plan CONFIG --budget SIZE`` and ``swapkit train CONFIG --budget SIZE``: the planner's CLI glue."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import yaml

from swapkit.config.errors import Problems
from swapkit.config.loader import apply_overrides
from swapkit.config.yaml_reader import read_yaml_file
from swapkit.load import load_config
from swapkit.plan.emit import layer_rows, planned_config, planned_sections, table, to_json
from swapkit.plan.planner import Planned
from swapkit.plan.size import parse_size
from swapkit.planner.run import measure, plan_for_budget
from swapkit.planner.sources import source_from_spec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BudgetPlan:
    """A finished budget plan: the config to write, the report, the JSON document."""

    config: dict[str, Any]
    planned: Planned
    report: str
    document: dict[str, Any]

    def yaml(self) -> str:
        return yaml.safe_dump(self.config, sort_keys=False)


def budget_plan(path: str, overrides: Sequence[str], budget_text: str, device: str | None = None,
                model: str | None = None, layers: str | None = None) -> BudgetPlan:
    """Measure the configured model (the built-in one, or ``--model hf:...``), plan under the
    budget, build the planned config.

    With ``parallel_config.pipeline_stage`` above 1 every stage is planned under its own budget
    (``--budget SIZE`` or one size per stage, comma-separated: :mod:`swapkit.planner.stages`).

    Raises:
        ConfigError: a bad config or ``--budget``.
        BudgetError: the budget (a stage's: ``StageBudgetError``) is below the smallest reachable peak.
    """
    config = load_config(path, overrides)
    problems = Problems()
    raw = apply_overrides(read_yaml_file(Path(path)), overrides, problems)
    if config.parallel.pipeline_stage > 1 and model is None:  # one plan per stage (swapkit.planner.stages)
        from swapkit.planner.stages import stage_plan_parts

        return BudgetPlan(*stage_plan_parts(config, raw, budget_text, device))
    budget = parse_size(budget_text)
    source = source_from_spec(model, config, layers) if model is not None else None
    measured = measure(config, device, model=source)
    logger.info("measured on %s: link d2h %.2f GB/s + %.1f us, h2d %.2f GB/s + %.1f us", measured.device,
                measured.links.d2h.bytes_per_s / 1e9, measured.links.d2h.latency_s * 1e6,
                measured.links.h2d.bytes_per_s / 1e9, measured.links.h2d.latency_s * 1e6)
    planned = plan_for_budget(config, budget, measured, model=source)
    rows = layer_rows(measured.trace, planned, config.runtime.min_offload_bytes)
    use_reentrant = bool(getattr(config.recompute, "use_reentrant", False))
    document = to_json(planned_sections(planned.choices, use_reentrant), rows, planned, budget)
    return BudgetPlan(planned_config(raw, planned.choices, use_reentrant), planned, table(rows, planned), document)


def write(plan: BudgetPlan, out: str | None) -> None:
    """Write the planned YAML to ``out`` (logged), checking first that it loads."""
    load_config(plan.config)
    if out is not None:
        Path(out).write_text(plan.yaml(), encoding="utf-8")
        logger.info("wrote the planned config to %s", out)
