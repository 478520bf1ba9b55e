"""The Megatron recompute dialect (seeds 000 and 002): per-layer translation into the plan.

The keys are read and checked by :mod:`swapkit.config.megatron`.

Note [Megatron units are per model chunk]
Megatron checkpoints inside each ``TransformerBlock``, and with virtual pipeline stages every
interleave chunk of a stage is its own block. So ``block`` N recomputes the first N layers of each
chunk (each stage when ``pp_interleave_num`` is 1) and ``uniform`` N groups never span two chunks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from swapkit.config.types import MegatronRecompute
from swapkit.plan.layout import Layout


@dataclass(frozen=True)
class MegatronLayer:
    """What the Megatron settings decide for one layer."""

    full: bool
    unit: tuple[int, int] | None
    select: tuple[str, ...]


def megatron_layers(rc: MegatronRecompute, layout: Layout) -> list[MegatronLayer]:
    """Per-layer decisions; see Note [Megatron units are per model chunk]."""
    layers = [MegatronLayer(False, None, _select_patterns(rc))] * layout.num_layers
    if rc.recompute_granularity != "full":
        return layers
    n = rc.recompute_num_layers
    for chunk in range(layout.pp_interleave_num):
        for stage in range(layout.pipeline_stage):
            members = layout.chunk_layers(chunk, stage)
            if rc.recompute_method == "block":
                for i in members[:n]:
                    layers[i] = MegatronLayer(True, (i, i), ())
            else:
                for start in members[::n]:
                    last = min(start + n, members.stop) - 1
                    for i in range(start, last + 1):
                        layers[i] = MegatronLayer(True, (start, last), ())
    return layers


def _select_patterns(rc: MegatronRecompute) -> tuple[str, ...]:
    if rc.recompute_granularity != "selective":
        return ()
    found: list[str] = []
    for module in rc.recompute_modules or ():
        found += [p for p in rc.module_scopes[module] if p not in found]
    return tuple(found)


def megatron_formative(rc: MegatronRecompute, layout: Layout, layers: list[MegatronLayer]) -> dict[str, Any]:
    """The MindFormers-shaped view of a Megatron strategy (per-chunk counts, select patterns)."""
    grid = [[0] * layout.pipeline_stage for _ in range(layout.pp_interleave_num)]
    for i, layer in enumerate(layers):
        grid[layout.interleave_ids[i]][layout.pp_ids[i]] += int(layer.full)
    select = {p: layout.layer_list for p in _select_patterns(rc)}
    return {"layer_recompute": tuple(tuple(row) for row in grid), "select_recompute": select,
            "select_comm_recompute": {}, "select_recompute_exclude": {}, "select_comm_recompute_exclude": {}}


def describe(rc: MegatronRecompute) -> str:
    parts = [f"granularity={rc.recompute_granularity}"]
    if rc.recompute_granularity == "full":
        parts += [f"method={rc.recompute_method}", f"num_layers={rc.recompute_num_layers}"]
    if rc.recompute_granularity == "selective":
        parts.append(f"modules={list(rc.recompute_modules or ())}")
    return "Megatron recompute: " + ", ".join(parts)


