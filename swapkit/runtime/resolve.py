"""From a model and a config to a plan: count the layers, pick the model preset.

``model.model_config.num_layers`` may be left out when there is a model: the bound layer container
says how many layers there are (and when it is written, binding checks that they agree). The
preset comes from ``model.model_config.preset`` or, for a transformers model, from its
``config.model_type`` (read as plain attributes: the core never imports transformers).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

from torch import nn

from swapkit.config.errors import BindError, Problems
from swapkit.config.swap_entries import check_swap_layers
from swapkit.config.types import Config
from swapkit.plan.plan import Plan, build_plan
from swapkit.plan.presets import PRESETS, Preset, preset_for_model_type
from swapkit.runtime.binding import container_label, find_containers

logger = logging.getLogger(__name__)


def resolve_plan(model: nn.Module, config: Config, layers: str | Sequence[str] | None = None) -> Plan:
    """The plan for this model: layer count inferred if not given, scope names through its preset.

    Raises:
        ConfigError: the config does not fit (e.g. a swap entry names a layer the model lacks).
        BindError: no layer container could be found to count.
    """
    config = with_num_layers(model, config, layers)
    return build_plan(config, detect_preset(model, config))


def with_num_layers(model: nn.Module, config: Config, layers: str | Sequence[str] | None = None) -> Config:
    """``config`` with ``num_layers`` counted from the model's layer containers when it is not written.

    Raises:
        BindError: no container is found, or the containers hold no layer (Note [An empty layer container]).
        ConfigError: a swap entry names a layer the model lacks.
    """
    if config.model.num_layers is not None:
        return config
    found = find_containers(model, layers, config.model.layers_path)
    count = sum(len(container) for _, container in found)
    if count == 0:
        raise BindError(_empty_message(type(model).__name__, [path for path, _ in found]))
    logger.info("model.model_config.num_layers not given: %s holds %d layers",
                container_label(type(model).__name__, " + ".join(path for path, _ in found)), count)
    problems = Problems()
    check_swap_layers(config.swap, count, problems)
    problems.raise_if_any(config.source)
    return replace(config, model=replace(config.model, num_layers=count))


# Note [An empty layer container]
# A layer count written in the config is at least 1, and binding checks the container against it. A
# count taken from the model is not checked by either: an empty container (a factory that built no
# blocks, a transformers config with num_hidden_layers: 0, --layers naming the wrong, empty list)
# gave a plan of 0 layers, so every recompute and swap setting silently did nothing. It is an error.
def _empty_message(model_name: str, paths: list[str]) -> str:
    where = " + ".join(container_label(model_name, path) for path in paths)
    return (f"{where} holds no layers, so nothing could be swapped or recomputed; name the container that holds "
            "the model's layers (layers= in swapkit.apply, --layers, or model.model_config.layers_path), or build "
            "the model with at least one layer")


def model_type(model: nn.Module) -> str | None:
    """A transformers model's ``config.model_type`` (``"llama"``, ...), else ``None``."""
    value = getattr(getattr(model, "config", None), "model_type", None)
    return value if isinstance(value, str) else None


def detect_preset(model: nn.Module, config: Config) -> Preset | None:
    """The preset for ``model``, logged; ``None`` when the config names one (it wins) or none fits."""
    if config.model.preset is not None:
        logger.info("model preset %s (model.model_config.preset)", config.model.preset)
        return None
    kind = model_type(model)
    preset = preset_for_model_type(kind) if kind else None
    if preset is not None:
        logger.info("model preset %s, auto-detected from %s.config.model_type %r", preset.name,
                    type(model).__name__, kind)
    elif kind:
        logger.info("no swapkit preset for model_type %r: op patterns are used as written (presets: %s; set "
                    "model.model_config.preset to use one)", kind, ", ".join(p.name for p in PRESETS))
    return preset
