"""``swapkit.apply``: bind a plan to a model, install recompute wrappers and the swap session."""
from __future__ import annotations

import logging
from pathlib import Path
from dataclasses import replace
from typing import Any, Mapping, Sequence

from torch import nn

from swapkit.runtime.binding import BindError, bind, module_tree
from swapkit.config.types import Config
from swapkit.load import load_config
from swapkit.plan.plan import Plan, build_plan
from swapkit.runtime.recompute import Recompute
from swapkit.plan.report import layer_lines, unmatched
from swapkit.runtime.scope import ScopeTracker
from swapkit.runtime.session import AppliedMarker, SwapSession
from swapkit.runtime.stage_binding import as_chunks, bind_stage
from swapkit.runtime.stage_session import StageSession

logger = logging.getLogger(__name__)
APPLIED = "_swapkit_applied"


def apply(model: nn.Module | Sequence[nn.Module], config: Config | Plan | Mapping[str, Any] | str | Path,
          layers: str | None = None, stage: int | None = None) -> SwapSession:
    """Apply the config's recompute and swap strategy to ``model``.

    Args:
        model: the model; its layer container must hold ``num_layers`` layers. With ``stage``: the
            stage's chunk module, or a list of its ``pp_interleave_num`` chunk modules, each holding
            exactly that chunk's layers (``Plan.stage_layers(stage)``).
        config: a :class:`Config`, a :class:`Plan`, a dict in the YAML layout, or a YAML path.
        layers: dotted path of the layer container (``"layers"``, ``"model.layers"``,
            ``"transformer.h"``); ``None`` uses ``model_config.layers_path`` or auto-detects.
        stage: the pipeline stage these modules are (``0 .. pipeline_stage - 1``); ``None``: the
            whole model in one process. A stage session is a
            :class:`~swapkit.runtime.stage_session.StageSession`: one micro-step per chunk forward,
            one ``with session:`` around ``schedule.step(...)`` per optimizer step.

    Returns:
        A :class:`SwapSession`; use ``with session:`` around the forward (backward inside or
        after the block), read ``session.stats``, and call ``session.remove()`` to undo.

    Raises:
        ConfigError: the config is invalid.
        BindError: the model does not fit the plan.

    Example:
        >>> session = swapkit.apply(model, {"model": {"model_config": {"num_layers": 2}},
        ...                                 "swap_config": {"swap": True}})  # doctest: +SKIP
        >>> with session:  # doctest: +SKIP
        ...     model(tokens).sum().backward()
    """
    plan = as_plan(config)
    if stage is None and not isinstance(model, nn.Module):
        raise BindError(f"got {type(model).__name__} of chunk modules without stage=; pass stage=<pipeline stage> "
                        "for a pipeline stage's chunks, or one nn.Module")
    chunks = [model] if stage is None else as_chunks(model, plan, stage)
    for chunk in chunks:
        if getattr(chunk, APPLIED, None) is not None:
            raise BindError(f"swapkit is already applied to this {type(chunk).__name__}; call remove() on its "
                            "SwapSession before applying another config")
    binding = bind(model, plan, layers) if stage is None else bind_stage(chunks, plan, layers, stage)
    _log(plan, binding)
    recompute = Recompute(binding, plan.use_reentrant, recompute_outputs=plan.dialect == "mindformers")
    recompute.apply()
    tracker = ScopeTracker()
    tracker.install(binding)
    if stage is None:
        session = SwapSession(model, binding, plan, tracker, recompute)
    else:
        session = StageSession(chunks, stage, binding.model, binding, plan, tracker, recompute)
    for chunk in chunks:
        object.__setattr__(chunk, APPLIED, AppliedMarker(session))  # a plain attribute: no module, parameter or buffer
    return session


def as_plan(config: Config | Plan | Mapping[str, Any] | str | Path) -> Plan:
    if isinstance(config, Plan):
        return config
    if not isinstance(config, Config):
        config = load_config(config)
    return build_plan(config)


def _log(plan: Plan, binding: Any) -> None:
    for line in plan.log_lines():
        logger.info(line)
    for layer in binding.layers:
        for level, message in layer_lines(plan, layer.plan, layer.scopes):
            logger.log(logging.getLevelName(level), message)
    bound = replace(plan, layers=tuple(layer.plan for layer in binding.layers))  # a stage binds some layers
    for message in unmatched(bound, [module_tree(layer.module) for layer in binding.layers]):
        logger.warning(message)
