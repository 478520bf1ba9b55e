"""``plan_for_budget``: measure the configured model's step, measure the link, choose a plan.

This is the torch side of ``swapkit plan CONFIG --budget SIZE``; the choice itself is pure
(:mod:`swapkit.plan.planner`) and so is the YAML it becomes (:mod:`swapkit.plan.emit`).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from swapkit.api import as_config
from swapkit.config.errors import ConfigError, Problem
from swapkit.config.types import Config, RuntimeConfig
from swapkit.engine import make_engine
from swapkit.engine.slabs import SlabLedger
from swapkit.plan.plan import build_plan
from swapkit.plan.hostpool import HostModel
from swapkit.plan.planner import Planned, Planner, plan_budget, select_candidates, useful_scopes
from swapkit.plan.simulate import Links, simulate
from swapkit.plan.trace import KEEP, RECOMPUTE, SELECT, Trace, compose
from swapkit.planner.link import measure_link
from swapkit.planner.measure import PROBE, PROBE_DISTANCE, Tracer, mode_config, release_lag
from swapkit.planner.progress import announce, emulated_latency, link_seconds
from swapkit.planner.quiet import held_warnings, setting_warnings
from swapkit.planner.segments import build_trace, to_segments
from swapkit.planner.sampling import measure_modes
from swapkit.planner.steps import ModelSource
from swapkit.runtime.resolve import with_num_layers
from swapkit.train.budget import BUILTIN_FIX, builtin_sizes, check_step_memory
from swapkit.train.files import raise_problems
from swapkit.train.loop import engine_problems, resolve_device

# Note [Copy overhead]
# Swapping costs the compute thread time the link does not show: issuing each copy and the
# session's bookkeeping for a swapped storage; on the thread engine also the worker's memcpy on a
# core and its interpreter-lock hand-offs. On the 4-layer benchmark model with copies that cost
# microseconds, swap plans ran 10-22% slower than the replay said while kept and recomputed ones
# matched. The probe run (every layer swapped, distance 1) is measured side by side with the keep
# run, so the difference of their median step times, less the waits the replay predicts for the
# probe, is what its copies cost; divided by its copies it becomes a per-copy charge on the compute
# timeline (``swapkit.plan.simulate`` Note [Cost model]). Wrong where the cost depends on the size
# of the copy (memcpy bandwidth) rather than on the count.

logger = logging.getLogger(__name__)
LAG_SAFETY = 2.0  # the planner assumes copies may be seen finished twice as late as the probe saw
FIRST_MODES = (KEEP, RECOMPUTE, PROBE)  # measured first; then up to SELECT_RUNS op scopes select-recomputed
SELECT_RUNS = 2


@dataclass(frozen=True)
class Measured:
    """What the planner measured: the step in both modes, the link, the candidate scopes, and the
    engine's host granule (its pool's slab sizes are multiples of it)."""

    trace: Trace
    links: Links
    scopes: list[list[str]]
    device: str
    host_granule: int = 1

    def host(self, runtime: RuntimeConfig) -> HostModel:
        """The session's host pool under ``runtime`` as the replay follows it: ``max_host_bytes``,
        ``offload_batch_bytes`` and the pool's own placement (``swapkit.plan.hostpool`` Note [The host
        pool in the replay])."""
        return HostModel(runtime.max_host_bytes, runtime.offload_batch_bytes,
                         functools.partial(SlabLedger, granule=self.host_granule), runtime.skip_tail_offload)


def measure(config: Config | Mapping[str, Any] | str | Path, device: str | None = None, steps: int = 3,
            warmup: int = 1, model: ModelSource | None = None, select: bool = True, *,
            config_notes: bool = True) -> Measured:
    """Measure ``steps`` training steps (after ``warmup``) of the configured built-in model, or of
    ``model``, kept and fully recomputed (``swapkit.planner.measure.Note [Measuring in two modes]``),
    the link, and a swap probe; with ``select`` also the two children of a layer that own the most
    bytes select-recomputed, one run each.

    With ``gradient_accumulation_steps`` above 1 each measured step is one micro-batch (each is its
    own swap step, so the peak is per micro-batch) and the predicted step time counts every one.

    Args:
        config: a ``Config``, or what :func:`swapkit.load_config` takes (a dict in the YAML layout, a path).
        config_notes: log what concerns the user's config (the slow-link notice of
            ``swapkit.planner.progress``, :func:`~swapkit.planner.quiet.setting_warnings`); ``False`` where
            the caller says them once for several measurements (a pipeline's stages).

    Raises:
        ConfigError: ``parallel_config.pipeline_stage`` is not 1, the device is unavailable or does not
            suit ``runtime.engine``, or the runs cannot fit in its memory (``swapkit.train.budget``
            Note [Memory estimate]).
        ValueError: ``steps`` below 1, ``warmup`` below 0, or a ``device`` other than cpu or cuda.
    """
    config = as_config(config)
    _check_arguments(device, steps, warmup)
    _check_single_stage(config)
    where = resolve_device(config, device)
    raise_problems(engine_problems(config, where), config.source)  # as swapkit train: exit 2, not a failed run
    _check_memory(config, where, model, len(FIRST_MODES) + (SELECT_RUNS if select else 0))
    if model is not None:
        config = with_num_layers(model.factory(), config, model.layers)
    patterns = _config_patterns(config)

    def later(tracer: Tracer, scopes: list[list[str]]) -> dict[str, Config]:
        picked = select_candidates(_warm_trace(tracer, config.model.num_layers), scopes[0],
                                   config.runtime.min_offload_bytes, SELECT_RUNS) if select else []
        return {SELECT + scope: mode_config(config, SELECT + scope) for scope in picked}

    first = {mode: mode_config(config, mode) for mode in FIRST_MODES}
    # the link's sleeps after the rounds, said up front (swapkit.planner.progress Note [An emulated link ...])
    latency = emulated_latency(config.runtime, where.type)
    if config_notes:
        announce(latency)
    slow = link_seconds(latency)
    with held_warnings(logger):  # swapkit.planner.quiet Note [Warnings about the measurement runs]
        results = measure_modes(first, later, where, patterns, steps, warmup, model, slow)
    runs = {mode: result[0] for mode, result in results.items() if mode != PROBE}
    _, scope_seconds, scopes, _, keep_step = results[KEEP]
    trace = build_trace(config.model.num_layers, runs, scope_seconds, config.train.gradient_accumulation_steps)
    links, granule = _measure_links(config, where, trace, results[PROBE][3])
    links = dataclasses.replace(links, copy_overhead_s=copy_overhead(trace, links, keep_step, results[PROBE][4],
                                                                     config.runtime.min_offload_bytes))
    if config_notes:
        for message in setting_warnings(config.runtime, storage_sizes(trace)):
            logger.warning(message)
    useful = [useful_scopes(trace, i, scopes[i], config.runtime.min_offload_bytes) for i in range(len(scopes))]
    return Measured(trace, links, useful, str(where), granule)


def _check_arguments(device: str | None, steps: int, warmup: int) -> None:
    """:func:`measure`'s own arguments (``steps=0`` measured nothing and failed taking a median of nothing)."""
    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"measure(device={device!r}): expected 'cpu', 'cuda' or None (train.device)")
    for name, value, least in (("steps", steps, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"measure({name}={value!r}): expected a whole number >= {least}")


def _check_single_stage(config: Config) -> None:
    """One measured step is one process's: a pipeline config is planned per stage on the built-in
    model's stage chunks (:mod:`swapkit.planner.stages`), not here."""
    if config.parallel.pipeline_stage != 1:
        raise ConfigError([Problem("parallel_config.pipeline_stage",
                                   f"got {config.parallel.pipeline_stage}; a pipeline config is planned per stage "
                                   "on the built-in model only (swapkit.planner.stages builds its stage chunks): "
                                   "drop --model, or set it to 1, or plan without --budget")],
                          config.source)


def _check_memory(config: Config, where: torch.device, model: ModelSource | None, runs: int) -> None:
    """Before any weights are built: the measurement runs fit in memory (``swapkit.train.budget``
    Note [Memory estimate]). On CPU all ``runs`` are held side by side (``swapkit.planner.sampling``
    Note [Measuring modes side by side]); on a GPU they run one after another. A user's factory without
    an estimate is not checked."""
    copies = runs if where.type == "cpu" else 1
    if model is None:
        build_plan(config)  # the built-in model needs num_layers: a missing one is a ConfigError here
        check_step_memory(builtin_sizes(config), where, "the built-in model", BUILTIN_FIX, config.source, copies)
    elif model.check_memory is not None:
        model.check_memory(where, copies)


def _measure_links(config: Config, where: torch.device, trace: Trace, copies: list) -> tuple[Links, int]:
    """The engine's links, the release lag the probe run saw (Note [Release lag]), and the engine's
    host granule."""
    engine = make_engine(config.runtime, where)
    try:
        links = measure_link(engine, _largest_storage(trace))
        granule = engine.host_granule
    finally:
        engine.close()
    lag = max(release_lag(c, links) for c, _ in copies)
    return dataclasses.replace(links, release_lag_s=LAG_SAFETY * lag), granule


def copy_overhead(trace: Trace, links: Links, keep_step: float, probe_step: float, min_offload_bytes: int) -> float:
    """Note [Copy overhead]: the probe's measured slowdown over the keep run beyond what the replay
    predicts for it (its exposed waits), per copy it made; never negative."""
    step = compose(trace)
    keep = simulate(step, lambda layer, scope: None, links, min_offload_bytes)
    probe = simulate(step, lambda layer, scope: None if layer is None else PROBE_DISTANCE, links, min_offload_bytes)
    if not probe.copies:
        return 0.0
    slowdown = (probe_step - keep_step) - (probe.step_seconds - keep.step_seconds)
    return max(slowdown, 0.0) / probe.copies


def plan_for_budget(config: Config, budget: int, measured: Measured | None = None,
                    device: str | None = None, model: ModelSource | None = None) -> Planned:
    """Measure (unless given) and choose a plan whose predicted peak fits ``budget`` bytes.

    Raises:
        BudgetError: the budget is below the smallest reachable peak.
    """
    measured = measured or measure(config, device, model=model)
    planner = Planner(measured.trace, measured.links, measured.scopes, config.runtime.min_offload_bytes,
                      host=measured.host(config.runtime))
    return plan_budget(planner, budget)


def _warm_trace(tracer: Tracer, num_layers: int) -> Trace:
    """The keep run's warm-up step as a trace (bytes only: what picks the select-recompute scopes)."""
    segments, order = to_segments(tracer.saves, tracer.events, tracer.start, num_layers, tracer.bounds)
    return Trace(num_layers, {KEEP: segments}, tuple(order), {KEEP: 0.0})


def _config_patterns(config: Config) -> list[tuple[str, ...]]:
    """Per layer, the op patterns the config names (swapped or recomputed scopes)."""
    plan = build_plan(config)
    return [tuple(p for p, _ in layer.op_swap) + layer.select + layer.comm for layer in plan.layers]


def storage_sizes(trace: Trace) -> list[int]:
    """The size of every storage the keep run saved (the session's records)."""
    return [save.nbytes for segment in trace.modes[KEEP].values() for save in segment.forward if save.storage]


def _largest_storage(trace: Trace) -> int:
    return max(storage_sizes(trace), default=1 << 20)
