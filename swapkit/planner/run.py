"""``plan_for_budget``: measure the configured model's step, measure the link, choose a plan.

This is the torch side of ``swapkit plan CONFIG --budget SIZE``; the choice itself is pure
(:mod:`swapkit.plan.planner`) and so is the YAML it becomes (:mod:`swapkit.plan.emit`).
"""
from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from swapkit.config.errors import ConfigError, Problem
from swapkit.config.types import Config
from swapkit.engine import make_engine
from swapkit.plan.plan import build_plan
from swapkit.plan.planner import Planned, Planner, plan_budget, select_candidates, useful_scopes
from swapkit.plan.simulate import Links
from swapkit.plan.trace import KEEP, RECOMPUTE, SELECT, Trace
from swapkit.planner.link import measure_link
from swapkit.planner.measure import (PROBE, Tracer, build_trace, candidate_scopes, mode_config, release_lag,
                                     scale_segments, to_segments, tracing_factor)
from swapkit.planner.steps import BuiltinSteps, ModelSource, ModelSteps
from swapkit.runtime.resolve import with_num_layers
from swapkit.train.loop import resolve_device

logger = logging.getLogger(__name__)
LAG_SAFETY = 2.0  # the planner assumes copies may be seen finished twice as late as the probe saw


@dataclass(frozen=True)
class Measured:
    """What the planner measured: the step in both modes, the link, the candidate scopes."""

    trace: Trace
    links: Links
    scopes: list[list[str]]
    device: str


def measure(config: Config, device: str | None = None, steps: int = 3, warmup: int = 1,
            model: ModelSource | None = None, select: bool = True) -> Measured:
    """Measure ``steps`` training steps (after ``warmup``) of the configured built-in model, or of
    ``model``, kept and fully recomputed (``swapkit.planner.measure.Note [Measuring in two modes]``),
    the link, and a swap probe; with ``select`` also the two children of a layer that own the most
    bytes select-recomputed, one run each.

    With ``gradient_accumulation_steps`` above 1 each measured step is one micro-batch (each is its
    own swap step, so the peak is per micro-batch) and the predicted step time counts every one.

    Raises:
        ConfigError: ``parallel_config.pipeline_stage`` is not 1, or the device is unavailable.
    """
    _check_single_stage(config)
    where = resolve_device(config, device)
    if model is not None:
        config = with_num_layers(model.factory(), config, model.layers)
    patterns = _config_patterns(config)

    def run(mode: str) -> tuple:
        return _measure_mode(mode_config(config, mode), where, patterns, steps, warmup, model)

    runs, scope_seconds, scopes = {}, {}, []
    runs[KEEP], scope_seconds, scopes, _ = run(KEEP)
    runs[RECOMPUTE], *_ = run(RECOMPUTE)
    micro = config.train.gradient_accumulation_steps
    keep_only = build_trace(config.model.num_layers, runs, scope_seconds)
    for scope in select_candidates(keep_only, scopes[0], config.runtime.min_offload_bytes) if select else ():
        runs[SELECT + scope], *_ = run(SELECT + scope)
    trace = build_trace(config.model.num_layers, runs, scope_seconds, micro)
    links = _measure_links(config, where, trace, run(PROBE)[3])
    useful = [useful_scopes(trace, i, scopes[i], config.runtime.min_offload_bytes) for i in range(len(scopes))]
    return Measured(trace, links, useful, str(where))


def _check_single_stage(config: Config) -> None:
    """Per-stage budgets are not planned: a pipeline stage holds several micro-batches in flight
    (1F1B), which the measured single-process step does not show."""
    if config.parallel.pipeline_stage != 1:
        raise ConfigError([Problem("parallel_config.pipeline_stage",
                                   f"got {config.parallel.pipeline_stage}; the budget planner plans one stage "
                                   "(pipeline_stage: 1) only, per-stage budgets are not supported yet: plan "
                                   "without --budget, or plan a single-stage config and copy its sections")],
                          config.source)


def _measure_links(config: Config, where: torch.device, trace: Trace, copies: list) -> Links:
    """The engine's links, and the release lag the probe run saw (Note [Release lag])."""
    engine = make_engine(config.runtime, where)
    try:
        links = measure_link(engine, _largest_storage(trace))
    finally:
        engine.close()
    lag = max(release_lag(c, links) for c, _ in copies)
    return dataclasses.replace(links, release_lag_s=LAG_SAFETY * lag)


def plan_for_budget(config: Config, budget: int, measured: Measured | None = None,
                    device: str | None = None, model: ModelSource | None = None) -> Planned:
    """Measure (unless given) and choose a plan whose predicted peak fits ``budget`` bytes.

    Raises:
        BudgetError: the budget is below the smallest reachable peak.
    """
    measured = measured or measure(config, device, model=model)
    planner = Planner(measured.trace, measured.links, measured.scopes, config.runtime.min_offload_bytes)
    return plan_budget(planner, budget)


def _measure_mode(config: Config, device: torch.device, patterns: list[tuple[str, ...]], steps: int,
                  warmup: int, model: ModelSource | None) -> tuple[tuple, dict, list[list[str]], list]:
    """Alternate traced and untraced steps; scale the traced times to the untraced step time
    (``swapkit.planner.measure`` Note [Tracing overhead])."""
    run = BuiltinSteps(config, device) if model is None else ModelSteps(config, model, device)
    layers = [bound.module for bound in run.session.binding.layers]
    scopes = [candidate_scopes(layer, patterns[i]) for i, layer in enumerate(layers)]
    samples: dict[str, list] = {"segments": [], "orders": [], "others": [], "copies": [], "traced": [], "plain": []}
    scope_seconds: dict[tuple[int, str], list[float]] = {}
    try:
        for number in range(warmup + steps):
            tracer = _traced_step(run, layers, scopes, 2 * number + 1, samples if number >= warmup else None)
            for key, values in tracer.scope_seconds.items():
                scope_seconds.setdefault(key, []).extend(values)
            start = time.perf_counter()
            run.step(2 * number + 2)
            if number >= warmup:
                samples["plain"].append(time.perf_counter() - start)
    finally:
        run.close()
    factor = tracing_factor(samples["traced"], samples["plain"])
    seconds = {key: statistics.median(values) * factor for key, values in scope_seconds.items()}
    segments = [scale_segments(step, factor) for step in samples["segments"]]
    other = statistics.median(samples["others"]) * factor
    return (segments, samples["orders"][-1], other), seconds, scopes, samples["copies"]


def _traced_step(run: Any, layers: list, scopes: list[list[str]], number: int, samples: dict | None) -> Tracer:
    tracer = Tracer(layers, scopes, run.device)
    run.session.observer = tracer
    try:
        start = time.perf_counter()
        run.step(number)
        end = time.perf_counter()
    finally:
        tracer.remove()
        run.session.observer = None
    if samples is not None:
        step, order = to_segments(tracer.saves, tracer.events, tracer.start, len(layers), tracer.bounds)
        samples["segments"].append(step)
        samples["orders"].append(order)
        samples["others"].append(_other_seconds(tracer, end, len(layers)))
        samples["copies"].append((tracer.copy_times(), tracer.saves[-1][4] if tracer.saves else end))
        samples["traced"].append(end - start)
    return tracer


def _other_seconds(tracer: Tracer, end: float, num_layers: int) -> float:
    """The step's time outside the events' attributed time (Note [Backward time follows the event])."""
    last_save = tracer.saves[-1][4] if tracer.saves else tracer.start
    forward_end = max(last_save, tracer.bounds.get(num_layers - 1, last_save))  # the last layer's end
    backward = [at for _, _, at in tracer.events if at >= last_save]  # deaths in forward are no backward
    if not backward:
        return end - forward_end
    return max(backward[0] - forward_end, 0.0) + (end - backward[-1])


def _config_patterns(config: Config) -> list[tuple[str, ...]]:
    """Per layer, the op patterns the config names (swapped or recomputed scopes)."""
    plan = build_plan(config)
    return [tuple(p for p, _ in layer.op_swap) + layer.select + layer.comm for layer in plan.layers]


def _largest_storage(trace: Trace) -> int:
    sizes = [save.nbytes for segment in trace.modes[KEEP].values() for save in segment.forward]
    return max(sizes, default=1 << 20)
