"""``swapkit.apply``: bind a plan to a model, install recompute wrappers and the swap session."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping

from torch import nn

from swapkit.runtime.binding import BindError, bind, module_tree
from swapkit.config.types import Config
from swapkit.load import load_config
from swapkit.plan.plan import Plan
from swapkit.runtime.recompute import Recompute
from swapkit.plan.report import layer_lines, unmatched, unmatched_errors
from swapkit.runtime.resolve import resolve_plan
from swapkit.runtime.scope import ScopeTracker
from swapkit.runtime.session import SwapSession

logger = logging.getLogger(__name__)
APPLIED = "_swapkit_applied"


def apply(model: nn.Module, config: Config | Plan | Mapping[str, Any] | str | Path,
          layers: str | None = None) -> SwapSession:
    """Apply the config's recompute and swap strategy to ``model``.

    Args:
        model: the model; its layer container must hold ``num_layers`` layers (when the config gives
            none, they are counted). A transformers model gets its family's preset
            (:mod:`swapkit.plan.presets`) unless ``model_config.preset`` names one.
        config: a :class:`Config`, a :class:`Plan`, a dict in the YAML layout, or a YAML path.
        layers: dotted path of the layer container (``"layers"``, ``"model.layers"``,
            ``"transformer.h"``); ``None`` uses ``model_config.layers_path`` or auto-detects.

    Returns:
        A :class:`SwapSession`; use ``with session:`` around the forward (backward inside or
        after the block), read ``session.stats``, and call ``session.remove()`` to undo.

    Raises:
        ConfigError: the config is invalid.
        BindError: the model does not fit the plan, or an op pattern matches no sub-module in any
            layer (the message suggests the closest real names).

    Example:
        >>> session = swapkit.apply(model, {"model": {"model_config": {"num_layers": 2}},
        ...                                 "swap_config": {"swap": True}})  # doctest: +SKIP
        >>> with session:  # doctest: +SKIP
        ...     model(tokens).sum().backward()
    """
    if getattr(model, APPLIED, None) is not None:
        raise BindError(f"swapkit is already applied to this {type(model).__name__}; call remove() on its "
                        "SwapSession before applying another config")
    plan = config if isinstance(config, Plan) else resolve_plan(model, as_config(config), layers)
    binding = bind(model, plan, layers)
    _log(plan, binding)
    recompute = Recompute(binding, plan.use_reentrant, recompute_outputs=plan.dialect == "mindformers")
    recompute.apply()
    tracker = ScopeTracker()
    tracker.install(binding)
    session = SwapSession(model, binding, plan, tracker, recompute)
    object.__setattr__(model, APPLIED, True)  # a plain attribute: no module, parameter or buffer
    return session


def as_config(config: Config | Mapping[str, Any] | str | Path) -> Config:
    return config if isinstance(config, Config) else load_config(config)


def _log(plan: Plan, binding: Any) -> None:
    """Log the plan as MindFormers does; a pattern that binds nowhere is an error, not a log line."""
    trees = [module_tree(layer.module) for layer in binding.layers]
    errors = unmatched_errors(plan, trees, f"{type(binding.model).__name__}.{binding.layers_path}")
    if errors:
        raise BindError("the config names op scopes this model does not have:\n  - " + "\n  - ".join(errors))
    for line in plan.log_lines() + list(plan.notes):
        logger.info(line)
    for message in plan.warnings:
        logger.warning(message)
    for layer in binding.layers:
        for level, message in layer_lines(plan, layer.plan, layer.scopes):
            logger.log(logging.getLevelName(level), message)
    for message in unmatched(plan, trees):
        logger.warning(message)
