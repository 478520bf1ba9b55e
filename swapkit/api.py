"""``swapkit.apply``: bind a plan to a model, install recompute wrappers and the swap session."""
from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from torch import nn

from swapkit.runtime.binding import BindError, bind, container_label, module_tree
from swapkit.config.errors import ConfigError, Problem
from swapkit.config.types import Config
from swapkit.load import load_config
from swapkit.plan.plan import Plan, build_plan
from swapkit.runtime.recompute import Recompute
from swapkit.plan.report import layer_lines, unmatched, unmatched_errors
from swapkit.plan.presets import preset_for_model_type
from swapkit.runtime.resolve import model_type, resolve_plan
from swapkit.runtime.scope import ScopeTracker
from swapkit.runtime.detach import applied, carries_swapkit, mark, shallow_copy_message
from swapkit.runtime.native import native_module
from swapkit.runtime.session import SwapSession
from swapkit.runtime.stage_binding import as_chunks, bind_stage, check_layout_across_ranks
from swapkit.runtime.stage_session import StageSession

logger = logging.getLogger(__name__)


def apply(model: nn.Module | Sequence[nn.Module], config: Config | Plan | Mapping[str, Any] | str | Path,
          layers: str | Sequence[str] | None = None, stage: int | None = None) -> SwapSession:
    """Apply the config's recompute and swap strategy to ``model``.

    Args:
        model: the model; its layer container must hold ``num_layers`` layers (when the config gives
            none, they are counted). A transformers model gets its family's preset
            (:mod:`swapkit.plan.presets`) unless ``model_config.preset`` names one. With ``stage``:
            the stage's chunk module, or a list of its ``pp_interleave_num`` chunk modules, each
            holding exactly that chunk's layers (``Plan.stage_layers(stage)``).
        config: a :class:`Config`, a :class:`Plan`, a dict in the YAML layout, or a YAML path.
        layers: dotted path of the layer container (``"layers"``, ``"model.layers"``,
            ``"transformer.h"``), or a list of containers numbered globally in the order given
            (``["encoder.block", "decoder.block"]``, ``swapkit.runtime.binding.Note [Several layer
            containers]``); ``None`` uses ``model_config.layers_path`` or auto-detects the one
            container of repeated layers (an error lists the candidates when there are several).
        stage: the pipeline stage these modules are (``0 .. pipeline_stage - 1``); ``None``: the
            whole model in one process. A stage session is a
            :class:`~swapkit.runtime.stage_session.StageSession`: one micro-step per chunk forward,
            one ``with session:`` around ``schedule.step(...)`` per optimizer step.

    Returns:
        A :class:`SwapSession`; use ``with session:`` around the forward (backward inside or
        after the block), read ``session.stats``, and call ``session.remove()`` to undo.

    Raises:
        ConfigError: the config is invalid.
        TypeError: ``config`` is ``None``.
        BindError: the model does not fit the plan, or an op pattern matches no sub-module in any
            layer (the message suggests the closest real names).

    Example:
        >>> session = swapkit.apply(model, {"model": {"model_config": {"num_layers": 2}},
        ...                                 "swap_config": {"swap": True}})  # doctest: +SKIP
        >>> with session:  # doctest: +SKIP
        ...     model(tokens).sum().backward()
    """
    if stage is None and not isinstance(model, nn.Module):
        raise _not_a_model(model)
    if config is None:  # load_config's "the config is empty" asks for num_layers, which apply counts itself
        raise TypeError("swapkit.apply: config is None; pass a config dict (for example {'swap_config': {'swap': "
                        "True}}; {} applies nothing and only accounts), a YAML path, a Config or a Plan")
    loaded = None if isinstance(config, Plan) else as_config(config)
    if loaded is None:
        plan = config
    else:  # a stage holds some of the layers: nothing to count them from
        plan = resolve_plan(model, loaded, layers) if stage is None else _stage_plan(loaded)
    chunks = [model] if stage is None else as_chunks(model, plan, stage)
    for chunk in chunks:
        marker = applied(chunk)
        if marker is not None:
            raise BindError(shallow_copy_message(chunk, marker) or f"swapkit is already applied to this "
                            f"{type(chunk).__name__}; call remove() on its SwapSession before applying another config")
    binding = bind(model, plan, layers) if stage is None else bind_stage(chunks, plan, layers, stage)
    _refuse_shared_layers(binding, type(chunks[0]).__name__)
    _check_native(plan, SwapSession if stage is None else StageSession)  # before anything changes the model
    if stage is not None:
        check_layout_across_ranks(plan.layout, stage)  # Note [Stage layouts agree across ranks]
    _log(plan, binding, type(chunks[0]).__name__, _unused_preset(chunks[0], plan) if loaded is None else None)
    recompute = Recompute(binding, plan.use_reentrant, recompute_outputs=plan.dialect == "mindformers")
    recompute.apply()
    tracker = ScopeTracker()
    tracker.install(binding)
    if stage is None:
        session = SwapSession(model, binding, plan, tracker, recompute)
    else:
        micro_batch_num = loaded.parallel.micro_batch_num if loaded is not None else None
        session = StageSession(chunks, stage, binding.model, binding, plan, tracker, recompute,
                               micro_batch_num=micro_batch_num)
    for chunk in chunks:  # set last: swapkit.runtime.detach Note [Copies and pickles of a model ...]
        mark(chunk, session)
    return session


def _check_native(plan: Plan, session_type: type[SwapSession]) -> None:
    """``runtime.native_save``: build the C++ hooks now, so that a missing compiler fails here rather than at
    the first step, and before the model carries any hook (no session is returned to remove them); on a
    pipeline stage say that it does nothing (swapkit.runtime.native Note [The native save path])."""
    if not plan.runtime.native_save:
        return
    if not session_type.native_supported:
        logger.warning("swapkit: runtime.native_save: true has no effect on a pipeline stage, which every rank "
                       "of a multi-process swapkit train runs (data-parallel ranks too): its saves open micro-steps, "
                       "which only the Python hooks handle (Note [The native save path] in swapkit.runtime.native); "
                       "set it to false for stages and multi-process runs")
        return
    native_module()


def _refuse_shared_layers(binding: Any, owner: str) -> None:
    """A bound layer that already carries another session's hooks belongs to another model too (swapkit.runtime.detach
    Note [Copies and pickles of a model swapkit was applied to]): hooking it again would swap and recompute twice."""
    for layer in binding.layers:
        if carries_swapkit(layer.module):
            raise BindError(f"layer {layer.index} of this {owner} already carries the hooks of another swapkit session: "
                            "another model shares it (a shallow copy.copy of this model or the model this one was "
                            "copied from, or a module that contains it or is part of it) and swapkit is applied to "
                            "that model; call remove() on that model's SwapSession first, or copy models with "
                            "copy.deepcopy")


def _stage_plan(config: Config) -> Plan:
    """The whole model's plan for one stage's chunks, which hold only some layers: nothing to count
    ``num_layers`` from, so it must be written (the generic message would say to pass the model)."""
    if config.model.num_layers is None:
        raise ConfigError([Problem("model.model_config.num_layers", "missing; with stage=, swapkit.apply binds "
                                   "one pipeline stage's chunks and cannot count the whole model's layers from "
                                   "them: write the whole model's layer count")], config.source)
    return build_plan(config)


def _not_a_model(model: Any) -> BindError:
    chunks = isinstance(model, (list, tuple)) and model and all(isinstance(m, nn.Module) for m in model)
    if chunks:
        return BindError(f"got {type(model).__name__} of chunk modules without stage=; pass stage=<pipeline stage> "
                         "for a pipeline stage's chunks, or one nn.Module")
    return BindError(f"model: got {type(model).__name__}; expected the nn.Module to apply swapkit to, as "
                     "swapkit.apply(model, config)")


def as_config(config: Config | Mapping[str, Any] | str | Path) -> Config:
    return config if isinstance(config, Config) else load_config(config)


def _log(plan: Plan, binding: Any, owner: str, hint: str | None = None) -> None:
    """Log the plan as MindFormers does; a pattern that binds nowhere is an error, not a log line.

    ``owner`` names the class holding the layer container: the model's, or a pipeline stage's chunk's;
    ``hint`` ends that error (Note [A Plan is applied as built]).
    """
    bound = replace(plan, layers=tuple(layer.plan for layer in binding.layers))  # a stage binds some layers
    trees = [module_tree(layer.module) for layer in binding.layers]
    errors = unmatched_errors(bound, trees, container_label(owner, binding.layers_path))
    if errors:
        raise BindError("the config names op scopes this model does not have:\n  - " + "\n  - ".join(errors)
                        + (f"\n{hint}" if hint else ""))
    for line in plan.log_lines() + list(plan.notes):
        logger.info(line)
    for message in plan.warnings:
        logger.warning(message)
    for layer in binding.layers:
        for level, message in layer_lines(plan, layer.plan, layer.scopes):
            logger.log(logging.getLevelName(level), message)
    for message in unmatched(bound, trees):
        logger.warning(message)


# Note [A Plan is applied as built]
# ``swapkit.apply(model, config)`` detects a transformers model's preset and builds the plan with it, so
# MindFormers names (``attention``, the default ``.*\.flash_attention``) bind to the family's modules. A
# ``Plan`` is already built: ``build_plan`` knows no model, so unless ``model_config.preset`` named one its
# patterns are the config's names, and the same config that applies as a dict failed as a Plan with a
# bare "matches no sub-module". The error then says why and what to pass instead.
def _unused_preset(model: nn.Module, plan: Plan) -> str | None:
    kind = model_type(model)
    preset = preset_for_model_type(kind) if kind and plan.preset is None else None
    if preset is None:
        return None
    return (f"This Plan was built without a model preset, so its MindFormers / Megatron names were not translated "
            f"to {type(model).__name__}'s modules: pass the Config (or its dict or YAML path) to swapkit.apply, "
            f"which detects the {preset.name} preset from config.model_type, or set model.model_config.preset: "
            f"{preset.name} before build_plan")
