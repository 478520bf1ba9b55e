"""``swapkit plan CONFIG --budget SIZE`` for a pipeline config: one plan per stage, one YAML.

Each stage's layers (``Plan.stage_layers``) are measured in one process on the built-in model's
stage chunk (the chunk a rank of ``swapkit train`` builds), one micro-batch per measured step;
the stage's peak is the micro-batch's replayed in the schedule's order
(``swapkit.plan.stages`` Note [Stage peak model]). The plans are written as one config with
global layer indices.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from swapkit.config.errors import ConfigError, Problem
from swapkit.config.types import Config, MindFormersRecompute, ParallelConfig, SwapConfig
from swapkit.distributed.pipeline import build_stage_chunks, micro_batch_problems, micro_batches, schedule_name
from swapkit.plan.emit import decision_width, layer_rows, planned_config, planned_sections, row_cells, table_head
from swapkit.plan.plan import build_plan
from swapkit.plan.planner import BudgetError, Choice, Planned, plan_budget
from swapkit.plan.size import parse_size
from swapkit.plan.stages import SCHEDULES, StageBudgetError, StagePlanner, StageSchedule
from swapkit.planner.progress import announce, emulated_latency
from swapkit.planner.quiet import stage_setting_warnings
from swapkit.planner.run import Measured, measure, storage_sizes
from swapkit.planner.steps import ModelSource
from swapkit.train.budget import BUILTIN_FIX, builtin_sizes, check_step_memory
from swapkit.train.loop import resolve_device
from swapkit.train.model import lm_loss

logger = logging.getLogger(__name__)
@dataclass(frozen=True)
class StagePlanned:
    """One stage's plan: its global layer ids, measurement, budget and choice."""

    stage: int
    layers: tuple[int, ...]
    measured: Measured
    budget: int
    planned: Planned


def stage_budgets(text: str, stages: int) -> list[int]:
    """``--budget 200MiB`` (every stage) or ``--budget 200MiB,150MiB`` (one per stage), in bytes.

    Raises:
        ConfigError: a bad size, or a count other than 1 or ``stages``.
    """
    parts = [part.strip() for part in str(text).split(",")]
    if len(parts) > 1 and not all(parts):  # parse_size('') said only "got ''"
        raise ConfigError([Problem("--budget", f"got {text!r}, with an empty size between its commas; give one size "
                                               "for every stage (200MiB) or one per stage (200MiB,150MiB)")])
    sizes = [parse_size(part) for part in parts]
    if len(sizes) not in (1, stages):
        raise ConfigError([Problem("--budget", f"got {len(sizes)} sizes ({text!r}) for parallel_config.pipeline_stage:"
                                               f" {stages}; give one size for every stage or one per stage")])
    return sizes * stages if len(sizes) == 1 else sizes


def schedule_of(config: Config) -> StageSchedule:
    """The config's schedule as the replay needs it (stage filled in per stage).

    Raises:
        ConfigError: an interleaved layout or schedule (not replayed per stage), or a ``micro_batch_num``
            the schedule refuses (swapkit.distributed.pipeline Note [Micro-batch counts per schedule]).
    """
    name = schedule_name(config)
    if name not in SCHEDULES or config.model.pp_interleave_num != 1:
        raise ConfigError([Problem("parallel_config.pipeline_schedule",
                                   f"got {name!r} (pp_interleave_num {config.model.pp_interleave_num}); the budget "
                                   f"planner replays {' and '.join(SCHEDULES)} with one chunk per stage: set "
                                   "pipeline_schedule to 1f1b and pp_interleave_num to 1, or plan without --budget")],
                          config.source)
    problems = micro_batch_problems(config)  # a replay of a schedule torch would not run
    if problems:
        raise ConfigError(problems, config.source)
    return StageSchedule(name, config.parallel.pipeline_stage, 0, micro_batches(config),
                         config.runtime.skip_tail_offload)


def plan_stages(config: Config, budget_text: str, device: str | None = None,
                measured: list[Measured] | None = None) -> list[StagePlanned]:
    """Measure (unless given) and plan every stage of a pipeline config under its budget.

    Raises:
        ConfigError: a bad ``--budget`` or a schedule the planner does not replay.
        StageBudgetError: a stage's budget is below its smallest reachable peak.
    """
    schedule = schedule_of(config)
    budgets = stage_budgets(budget_text, config.parallel.pipeline_stage)
    measured = measured or measure_stages(config, device)
    found = []
    for stage, (budget, one) in enumerate(zip(budgets, measured)):
        planner = StagePlanner(one.trace, one.links, one.scopes, config.runtime.min_offload_bytes,
                               dataclasses.replace(schedule, stage=stage), one.host(config.runtime))
        try:
            planned = plan_budget(planner, budget)
        except BudgetError as err:
            raise StageBudgetError(stage, budget, err.reachable, err.baseline, err.host_cap, err.uncapped) from None
        found.append(StagePlanned(stage, tuple(build_plan(config).stage_layers(stage)[0]), one, budget, planned))
    return found


def measure_stages(config: Config, device: str | None = None, steps: int = 3, warmup: int = 1) -> list[Measured]:
    """Each stage's layers measured in this process, one micro-batch per step (module docstring). What
    concerns the user's config (an emulated slow link, swap settings that leave nothing to swap) is said
    once, not once per stage's measurement.

    Raises:
        ConfigError: a schedule the planner does not replay.
    """
    schedule_of(config)
    plan, stages = build_plan(config), config.parallel.pipeline_stage
    announce(emulated_latency(config.runtime, resolve_device(config, device).type), stages)
    measured = [measure(measuring_config(config, len(plan.stage_layers(stage)[0])), device, steps, warmup,
                        model=stage_source(config, stage), config_notes=False) for stage in range(stages)]
    for message in stage_setting_warnings(config.runtime, [storage_sizes(one.trace) for one in measured]):
        logger.warning(message)
    return measured


def measuring_config(config: Config, num_layers: int) -> Config:
    """A single-process config over one stage's layers (local indices), the user's strategy dropped
    (the measurement runs set their own), saving with the Python hooks a stage has (``native_save`` off:
    swapkit.runtime.native Note [The native save path])."""
    model = dataclasses.replace(config.model, num_layers=num_layers, offset=0, pp_interleave_num=1)
    return dataclasses.replace(config, model=model, parallel=ParallelConfig(), recompute=MindFormersRecompute(),
                               swap=SwapConfig(), runtime=dataclasses.replace(config.runtime, native_save=False))


class _SendGrad(torch.autograd.Function):
    """The stage's output handed on: a scalar whose backward is a fixed gradient (what the next stage
    sends back), saving nothing (the next stage's work is not this stage's)."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor) -> torch.Tensor:
        ctx.shape, ctx.dtype = output.shape, output.dtype
        return output.new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return torch.full(ctx.shape, 1e-3, dtype=ctx.dtype, device=grad.device) * grad


def stage_source(config: Config, stage: int) -> ModelSource:
    """Stage ``stage``'s chunk as a :class:`ModelSource`: one micro-batch (``train.batch_size`` rows)
    in; out, on the last stage the loss (its saves are not the stage's: the schedule computes it
    outside the chunk, so they are kept out of the session), else the output handed on."""
    model_cfg, seed = config.model, config.train.seed
    plan = build_plan(config)
    first, last = stage == 0, stage == config.parallel.pipeline_stage - 1
    shape = (config.train.batch_size, model_cfg.seq_length)
    micro = micro_batches(config)

    def factory() -> nn.Module:
        return build_stage_chunks(model_cfg, plan, stage, seed)[0]

    def batch(number: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed + number)
        tokens = torch.randint(model_cfg.vocab_size, (micro * shape[0], shape[1] + 1), generator=gen)
        hidden = torch.randn(*shape, model_cfg.hidden_size, generator=gen)
        # a micro-batch of swapkit train's step batch: a view of the whole step's input storage
        inputs = tokens[:, :-1].contiguous()[:shape[0]]
        return {"x": inputs if first else hidden, "y": tokens[:shape[0], 1:]}

    def loss(chunk: nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
        x = data["x"] if first else data["x"].detach().requires_grad_(True)  # a received activation
        output = chunk(x)
        if not last:
            return _SendGrad.apply(output)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            return lm_loss(output, data["y"])

    return ModelSource(factory, batch, loss, "layers", _stage_memory(config, stage, len(plan.stage_layers(stage)[0])))


def _stage_memory(config: Config, stage: int, num_layers: int) -> Callable[[torch.device, int], None]:
    """The memory check of stage ``stage``'s chunk (``swapkit.train.budget`` Note [Memory estimate]):
    an upper bound, the embedding and the head counted on every stage."""
    sizes, what = builtin_sizes(measuring_config(config, num_layers)), f"stage {stage}'s chunk of the built-in model"
    return lambda device, copies: check_step_memory(sizes, device, what, BUILTIN_FIX, config.source, copies)


def global_choices(stages: list[StagePlanned], num_layers: int) -> tuple[Choice, ...]:
    """Every stage's choices at their global layer indices."""
    choices: list[Choice | None] = [None] * num_layers
    for one in stages:
        for local, layer in enumerate(one.layers):
            choices[layer] = one.planned.choices[local]
    assert all(c is not None for c in choices), "every layer belongs to exactly one stage"
    return tuple(choices)


def stage_rows(stages: list[StagePlanned], min_offload_bytes: int) -> list[dict[str, Any]]:
    """The per-layer rows of every stage, with global layer ids and the stage."""
    rows = []
    for one in stages:
        for row in layer_rows(one.measured.trace, one.planned, min_offload_bytes):
            rows.append({"stage": one.stage, **row, "layer": one.layers[row["layer"]]})
    return rows


def stage_table(rows: list[dict[str, Any]], stages: list[StagePlanned]) -> str:
    """The per-layer report with the stage, and each stage's predicted totals, as text."""
    width = decision_width(rows)
    lines = [f"{'stage':<6} {table_head(rows)}"] + [f"{row['stage']:<6} {row_cells(row, width)}" for row in rows]
    for one in stages:
        p, b = one.planned.predicted, one.planned.baseline
        lines.append(f"stage {one.stage} predicted: peak_device_bytes {p.peak_device_bytes} (budget {one.budget}, "
                     f"keep all: {b.peak_device_bytes}), busy {p.step_seconds * 1e3:.1f} ms per step (keep all: "
                     f"{b.step_seconds * 1e3:.1f} ms; pipeline bubbles not included), moved "
                     f"{p.moved_bytes_per_step} bytes/step, host pool {p.host_pool_bytes} bytes"
                     + (f" ({p.host_cap_bytes} swapped bytes kept on the device by runtime.max_host_bytes)"
                        if p.host_cap_bytes else ""))
    return "\n".join(lines)


def stage_document(stages: list[StagePlanned], choices: tuple[Choice, ...], rows: list[dict[str, Any]],
                   use_reentrant: bool) -> dict[str, Any]:
    """``--json``: the plan, the rows, and per stage its budget, prediction and baseline; the top-level
    ``predicted`` is the largest stage peak, the longest busy time and the bytes all stages move."""
    per_stage = [{"stage": one.stage, "layers": list(one.layers), "budget_bytes": one.budget,
                  "predicted": one.planned.predicted.to_json(), "baseline": one.planned.baseline.to_json()}
                 for one in stages]
    predicted = {"peak_device_bytes": max(s["predicted"]["peak_device_bytes"] for s in per_stage),
                 "step_seconds": max(s["predicted"]["step_seconds"] for s in per_stage),
                 "moved_bytes_per_step": sum(s["predicted"]["moved_bytes_per_step"] for s in per_stage)}
    return {"budget_bytes": [one.budget for one in stages], "plan": planned_sections(choices, use_reentrant),
            "layers": rows, "predicted": predicted, "stages": per_stage}


def stage_plan_parts(config: Config, raw: dict[str, Any], budget_text: str, device: str | None = None,
                     measured: list[Measured] | None = None) -> tuple[dict[str, Any], Planned, str, dict[str, Any]]:
    """``(planned config, the stage with the highest predicted peak's Planned over global choices,
    report, JSON document)`` for ``swapkit.planner.command.BudgetPlan``."""
    stages = plan_stages(config, budget_text, device, measured)
    choices = global_choices(stages, config.model.num_layers)
    use_reentrant = bool(getattr(config.recompute, "use_reentrant", False))
    rows = stage_rows(stages, config.runtime.min_offload_bytes)
    worst = max(stages, key=lambda one: one.planned.predicted.peak_device_bytes).planned
    planned = Planned(choices, worst.predicted, worst.baseline)
    return (planned_config(raw, choices, use_reentrant), planned, stage_table(rows, stages),
            stage_document(stages, choices, rows, use_reentrant))
