"""``swapkit plan CONFIG --budget SIZE`` and ``swapkit train CONFIG --budget SIZE``: the planner's CLI glue.

Note [Measured peak over budget]
The budget constrains the peak of device-resident saved bytes (``peak_device_bytes``, the swap
session's accounting; per stage for a pipeline: each stage has its own budget). The planner only
predicts that peak from its measurement runs; ``swapkit train --budget`` then measures it, and the
two can differ: a swapped storage leaves the device only once its copy is done, so copies that
finish later than in the measurement runs (a busier machine, another link) hold more at once.
When a measured peak is over its budget the run still trained correctly, so, as MindFormers and
Megatron report memory, it is a WARNING naming the stage, both figures and what to do, and a
row of the summary, not a failed run (exit status 0).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from swapkit.config.errors import ConfigError, Problem, Problems
from swapkit.config.loader import apply_overrides
from swapkit.config.yaml_reader import read_yaml_file
from swapkit.config.types import Config
from swapkit.load import validated_config
from swapkit.plan.emit import layer_rows, planned_config, planned_sections, table, to_json
from swapkit.plan.planner import Planned
from swapkit.plan.size import parse_size
from swapkit.planner.run import measure, plan_for_budget
from swapkit.planner.sources import source_from_spec
from swapkit.train.files import atomic_write, raise_problems
from swapkit.train.loop import builtin_layers_problems
from swapkit.train.summary import human_bytes

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
    config = load_budget_input(path, overrides)
    if model is None:  # the built-in model: Note [Layer paths of the built-in model]
        raise_problems(builtin_layers_problems(config, layers), config.source)
    problems = Problems()
    raw = apply_overrides(read_yaml_file(Path(path)), overrides, problems)
    if config.parallel.pipeline_stage > 1 and model is None:  # one plan per stage (swapkit.planner.stages)
        from swapkit.planner.stages import stage_plan_parts

        return BudgetPlan(*stage_plan_parts(config, raw, budget_text, device))
    budget = _single_budget(budget_text)
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


# Note [The sections --budget replaces]
# The planned config is the input with its recompute_config and swap_config replaced by the plan
# (``swapkit.plan.emit.planned_config``); the input's own strategy is never run. So the input is
# validated as ``load_config`` validates it (a mistake there is still an error, and its op patterns,
# which must match a sub-module as plain ``swapkit plan`` checks, add candidate scopes for the
# planner), but its warnings about those two sections are not logged: "layer_swap is inactive ...
# set swap_config.swap: true" told a user to change a section the plan throws away. One WARNING says
# instead, once, which of the sections the input writes are replaced.
REPLACED = ("recompute_config", "swap_config")


def load_budget_input(path: str, overrides: Sequence[str]) -> Config:
    """The input config of a ``--budget`` command, validated, its warnings logged but for the
    sections the plan replaces; one WARNING names those it writes (Note [The sections --budget replaces]).

    Raises:
        ConfigError: as :func:`swapkit.load.load_config`.
    """
    config = validated_config(path, overrides)
    for key in config.no_effect:
        if not key.startswith(REPLACED):
            logger.warning("%s has no effect in PyTorch eager; accepted and ignored", key)
    for message in config.warnings:
        if not message.startswith(REPLACED):
            logger.warning(message)
    raw = apply_overrides(read_yaml_file(Path(path)), overrides, Problems())
    written = [key for key in REPLACED if raw.get(key)]
    if written:
        logger.warning("--budget replaces %s with the plan it chooses: the input's strategy is not run (its active op "
                       "patterns only add scopes for the planner to consider); the planned config shows what "
                       "runs", " and ".join(written))
    return config


def _single_budget(text: str) -> int:
    """``--budget`` of a single-process plan: one size (sizes per stage need a pipeline config).

    Raises:
        ConfigError: not one size.
    """
    if "," in str(text):
        raise ConfigError([Problem("--budget", f"got {text!r}; sizes per stage apply only to a pipeline config "
                                               "(parallel_config.pipeline_stage above 1, built-in model); this "
                                               "one is planned as one process: give one size such as 64MiB")])
    return parse_size(text)


def write(plan: BudgetPlan, out: str | None) -> None:
    """Write the planned YAML to ``out`` (logged), checking first that it loads (its warnings are the
    input config's, logged once when that was loaded)."""
    validated_config(plan.config)
    if out is not None:
        Path(out).write_text(plan.yaml(), encoding="utf-8")
        logger.info("wrote the planned config to %s", out)


def budget_check(plan: BudgetPlan, summary: Mapping[str, Any]) -> dict[str, Any]:
    """``summary`` with ``budget_check`` rows: per stage (one row without a pipeline) the measured
    peak of device-resident saved bytes against its budget and the planner's prediction; a WARNING
    is logged for each row over budget (Note [Measured peak over budget]).

    Args:
        plan: the plan the run trained (its ``document`` holds the budgets and predictions).
        summary: the run's summary (``swapkit.train.summary.summarize``).

    Returns:
        A copy of ``summary``, with ``budget_check`` when a step ran under the plan, or
        ``budget_unmeasured_after`` (the checkpoint's step) when a resume left none to run
        (Note [No step under the plan]).
    """
    if "peak_device_bytes" not in summary:  # no step ran: nothing was measured
        return dict(summary)
    cover = summary.get("figures_steps")
    if cover is not None and not cover["since_resume"]:  # Note [No step under the plan]
        return {**summary, "budget_unmeasured_after": cover["last"]}
    rows = budget_rows(plan.document, summary)
    for row in rows:
        if row["over_budget"]:
            logger.warning(overrun_message(row, rows))
    return {**summary, "budget_check": rows}


def record_budget_check(metrics_out: str | Path | None, summary: Mapping[str, Any]) -> None:
    """Put the checked ``summary`` (:func:`budget_check`) in the run's ``--metrics-out`` file.

    The run wrote the file before its peaks could be checked against the budget; without this the
    check was only printed, and a script reading the file could not tell whether the plan held.
    """
    if metrics_out is None:
        return
    path = Path(metrics_out)
    document = json.loads(path.read_text(encoding="utf-8"))
    document["summary"] = dict(summary)
    text = (json.dumps(document, indent=2) + "\n").encode("utf-8")
    atomic_write(path, lambda file: file.write(text))


# Note [No step under the plan]
# A resume from a checkpoint at the last step runs no step (swapkit.train.checkpoint Note [Nothing to
# run]); the summary's figures are then the checkpoint's steps', which ran before the resume under
# another config, maybe not the plan. Checking them against the budget reported "OVER BUDGET" and
# warned that the plan did not hold, for a plan that never ran. The summary says instead that no
# step ran under the plan.


def budget_rows(document: Mapping[str, Any], summary: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per stage (``stage`` None without a pipeline): budget, predicted and measured peak, over or not."""
    if "stages" not in document:
        return [_row(None, document["budget_bytes"], document["predicted"], summary)]
    measured = {stage["stage"]: stage for stage in summary.get("stages", ())}
    return [_row(stage["stage"], stage["budget_bytes"], stage["predicted"], measured[stage["stage"]])
            for stage in document["stages"] if stage["stage"] in measured]


def _row(stage: int | None, budget: int, predicted: Mapping[str, Any], measured: Mapping[str, Any]) -> dict[str, Any]:
    """``measured``: the run's summary, or its row of the stage."""
    peak = measured["peak_device_bytes"]
    row = {"stage": stage, "budget_bytes": budget, "predicted_peak_bytes": predicted["peak_device_bytes"],
           "measured_peak_bytes": peak, "over_budget": peak > budget}
    if "host_pool_bytes" in predicted and "host_pool_bytes" in measured:
        row.update(predicted_host_pool_bytes=predicted["host_pool_bytes"],
                   measured_host_pool_bytes=measured["host_pool_bytes"])
    return row


def overrun_message(row: Mapping[str, Any], rows: list[Mapping[str, Any]]) -> str:
    """The WARNING for one row over budget: where, the figures, what to do (Note [Measured peak over budget])."""
    where = "the run" if row["stage"] is None else f"stage {row['stage']}"
    measured, budget = row["measured_peak_bytes"], row["budget_bytes"]
    return (f"{where}: the measured peak of device-resident saved bytes, {human_bytes(measured)} ({measured:,} "
            f"bytes), is over --budget {human_bytes(budget)} ({budget:,} bytes) by {100 * (measured / budget - 1):.0f}%"
            f"; the planner predicted {human_bytes(row['predicted_peak_bytes'])}. The run trained correctly but the "
            f"plan did not hold: plan under a lower budget (--budget {lower_budgets(rows)}), or add swap or "
            f"recompute to {where}'s layers (swap_config, recompute_config). Measured peaks exceed predicted ones "
            "when swapped copies finish later than in the planner's measurement runs (a busier machine): a swapped "
            "activation leaves the device only once its copy is done")


def lower_budgets(rows: list[Mapping[str, Any]]) -> str:
    """``--budget`` text that takes each overrun off its own budget (one size per stage for a pipeline)."""
    sizes = [r["budget_bytes"] * r["budget_bytes"] // r["measured_peak_bytes"] if r["over_budget"] else r["budget_bytes"]
             for r in rows]
    return ",".join(str(size) for size in sizes)
