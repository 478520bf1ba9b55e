"""``swapkit.apply``: bind a plan to a model, install recompute wrappers and the swap session."""
from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Mapping

from torch import nn

from swapkit.runtime.binding import BindError, bind, module_tree
from swapkit.config.types import Config
from swapkit.load import load_config
from swapkit.plan.plan import Plan, build_plan
from swapkit.runtime.recompute import Recompute
from swapkit.plan.report import layer_lines, unmatched
from swapkit.runtime.scope import ScopeTracker
from swapkit.runtime.session import AppliedMarker, SwapSession

logger = logging.getLogger(__name__)
APPLIED = "_swapkit_applied"


def apply(model: nn.Module, config: Config | Plan | Mapping[str, Any] | str | Path,
          layers: str | Sequence[str] | None = None) -> SwapSession:
    """Apply the config's recompute and swap strategy to ``model``.

    Args:
        model: the model; its layer container must hold ``num_layers`` layers.
        config: a :class:`Config`, a :class:`Plan`, a dict in the YAML layout, or a YAML path.
        layers: dotted path of the layer container (``"layers"``, ``"model.layers"``,
            ``"transformer.h"``), or a list of containers numbered globally in the order given
            (``["encoder.block", "decoder.block"]``, ``swapkit.runtime.binding.Note [Several layer
            containers]``); ``None`` uses ``model_config.layers_path`` or auto-detects the one
            container of repeated layers (an error lists the candidates when there are several).

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
    if getattr(model, APPLIED, None) is not None:
        raise BindError(f"swapkit is already applied to this {type(model).__name__}; call remove() on its "
                        "SwapSession before applying another config")
    plan = as_plan(config)
    binding = bind(model, plan, layers)
    _log(plan, binding)
    recompute = Recompute(binding, plan.use_reentrant, recompute_outputs=plan.dialect == "mindformers")
    recompute.apply()
    tracker = ScopeTracker()
    tracker.install(binding)
    session = SwapSession(model, binding, plan, tracker, recompute)
    object.__setattr__(model, APPLIED, AppliedMarker(session))  # a plain attribute: no module, parameter or buffer
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
    for message in unmatched(plan, [module_tree(layer.module) for layer in binding.layers]):
        logger.warning(message)
