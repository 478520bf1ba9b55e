"""Binding a plan to one pipeline stage: the stage's chunk modules, each holding its chunk's layers.

The plan is the whole model's plan. A stage owns ``V`` chunks (``Plan.stage_layers``); chunk ``v``
of the stage holds, at the same dotted path, exactly the global layers ``stage_layers(s)[v]`` in
order. Every :class:`~swapkit.runtime.binding.BoundLayer` keeps its *global* index, so decisions,
log lines, scope labels and stats read as they do for the single-process model.

Note [Stage layouts agree across ranks]
Each rank builds its plan from its own config, so nothing stops two ranks from laying out the model
differently (another ``offset``, a ``--set`` on one rank only): each stage's chunks then hold the
layers of a different partition, some layer sits on two stages or on none, and training runs on a
model nobody configured. When ``torch.distributed`` is initialized, :func:`check_layout_across_ranks`
compares the layout with the first one applied in the process group, through one ``compare_set``
on the group's store: the first rank to apply writes its layout, every later one reads it back,
and a rank whose layout differs raises. It is a store operation, not a collective, so a rank that
never applies swapkit (or applies it later) is never waited for; of two mismatched ranks the later
one raises. Swap and recompute settings may differ per rank (a stage applies only its own layers'
decisions), so only the layout is compared.
"""
from __future__ import annotations

import json
import logging
from typing import Sequence

import torch.distributed as dist
from torch import nn

from swapkit.config.errors import ConfigError, Problem
from swapkit.plan.layout import OFFSET_PATH, Layout, as_lists
from swapkit.plan.plan import Plan
from swapkit.plan.report import resolve_layer
from swapkit.runtime.binding import (
    Binding, BindError, BoundLayer, check_shared, container_label, find_layers, module_tree,
)

logger = logging.getLogger(__name__)


def as_chunks(modules: nn.Module | list[nn.Module] | tuple[nn.Module, ...], plan: Plan, stage: int) -> list[nn.Module]:
    """The chunk modules of ``stage`` as a list, checked against the plan's interleave count.

    Raises:
        BindError: not modules, or not one module per interleave chunk.
    """
    chunks = [modules] if isinstance(modules, nn.Module) else list(modules)
    expected = plan.stage_layers(stage)
    if not all(isinstance(m, nn.Module) for m in chunks):
        raise BindError(f"stage {stage}: expected an nn.Module or a list of nn.Module chunks, got "
                        f"{[type(m).__name__ for m in chunks]}")
    if len(chunks) != len(expected):
        raise BindError(f"stage {stage}: got {len(chunks)} chunk module(s) but the config has "
                        f"model.model_config.pp_interleave_num: {len(expected)}; pass one module per chunk "
                        f"(global layers {expected})")
    return chunks


def bind_stage(chunks: list[nn.Module], plan: Plan, layers_path: str | Sequence[str] | None, stage: int) -> Binding:
    """Bind the plan's layers of pipeline stage ``stage`` to its chunk modules (global layer ids).

    Raises:
        BindError: several layer containers were given, a chunk's layer container is missing or
            does not hold that chunk's layers, or a uniform recompute unit holds a module found at
            several positions (Note [One module at several layer positions] in swapkit.runtime.binding).
    """
    bound: list[BoundLayer] = []
    path = _one_path(layers_path if layers_path is not None else plan.layers_path, stage)
    for v, (chunk, ids) in enumerate(zip(chunks, plan.stage_layers(stage))):
        path, container = find_layers(chunk, path)
        layers = list(container)
        if len(layers) != len(ids):
            raise BindError(f"stage {stage} chunk {v} (torch pipeline stage {v * plan.layout.pipeline_stage + stage})"
                            f": {container_label(type(chunk).__name__, path)} holds {len(layers)} layers but this "
                            "chunk owns "
                            f"global layers {ids} ({len(ids)} layers) under the config's layout; build the chunk "
                            "with exactly those layers, in order")
        bound += [BoundLayer(i, layer, plan.layers[i], resolve_layer(plan.layers[i], module_tree(layer)))
                  for i, layer in zip(ids, layers)]
    check_shared(f"pipeline stage {stage}", bound)
    return Binding(nn.ModuleList(chunks), (path,), bound)


def _one_path(layers_path: str | Sequence[str] | None, stage: int) -> str | None:
    """A chunk has one layer container: a list of one path is that path, a longer list is an error."""
    if layers_path is None or isinstance(layers_path, str):
        return layers_path
    paths = list(layers_path)
    if len(paths) != 1 or not isinstance(paths[0], str):
        raise BindError(f"layers={paths!r} (or model.model_config.layers_path) with stage={stage}: each pipeline "
                        "chunk is bound through one layer container; pass one dotted path (layers='layers'), the "
                        "same in every chunk")
    return paths[0]


LAYOUT_KEY = "swapkit/stage_layout"
_LAYOUT_KEYS = (("num_layers", "model.model_config.num_layers"), ("pipeline_stage", "parallel_config.pipeline_stage"),
                ("pp_interleave_num", "model.model_config.pp_interleave_num"), ("layer_list", OFFSET_PATH))


def check_layout_across_ranks(layout: Layout, stage: int) -> None:
    """Note [Stage layouts agree across ranks]; nothing to compare without an initialized process group.

    Raises:
        ConfigError: the first rank that applied swapkit in this process group laid the model out differently.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    rank = dist.get_rank()
    mine = {"rank": rank, "stage": stage, "num_layers": layout.num_layers, "pipeline_stage": layout.pipeline_stage,
            "pp_interleave_num": layout.pp_interleave_num, "layer_list": as_lists(layout.layer_list)}
    default_store = getattr(dist.distributed_c10d, "_get_default_store", None)  # private, present since torch 1.x
    try:
        first = json.loads(default_store().compare_set(LAYOUT_KEY, "", json.dumps(mine)))
    except (TypeError, RuntimeError, NotImplementedError):  # no such function, or a store without compare_set
        logger.debug("swapkit: this process group's store cannot compare stage layouts; not checked")
        return
    differing = [path for key, path in _LAYOUT_KEYS if first[key] != mine[key]]
    if differing:
        raise ConfigError([Problem(differing[0], (
            f"rank {rank} lays out the model as num_layers per stage {mine['layer_list']} (stage {stage} of "
            f"{layout.pipeline_stage}), but rank {first['rank']} applied swapkit with {first['layer_list']} "
            f"(num_layers {first['num_layers']}, pipeline_stage {first['pipeline_stage']}, pp_interleave_num "
            f"{first['pp_interleave_num']}); the stages would not partition the model. Give every rank the same "
            "model.model_config (num_layers, offset, pp_interleave_num) and parallel_config.pipeline_stage"))])
