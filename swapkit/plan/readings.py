"""The two readings of a recompute list: per-stage counts (swap off) or layer indices (swap on).

MindFormers gives ``recompute: [2, 1]`` two meanings: with ``swap_config.swap: false`` it counts
layers per pipeline stage, with ``swap: true`` it lists global layer indices. swapkit keeps those
semantics; when a ``--set swap_config.swap=...`` flips the file's setting, the warning below shows
what the same list selects under both readings. Pure: no torch.
"""
from __future__ import annotations

from dataclasses import replace

from swapkit.config.errors import ConfigError
from swapkit.config.types import Config, MindFormersRecompute
from swapkit.plan.plan import build_plan

LIST_KEYS = ("recompute", "select_recompute", "select_comm_recompute")


def flip_warnings(config: Config, file_swap: bool) -> list[str]:
    """Warnings for each recompute list whose meaning changed because ``swap`` differs from the file's."""
    rc = config.recompute
    if file_swap == config.swap.swap or not isinstance(rc, MindFormersRecompute) or config.model.num_layers is None:
        return []
    written = {key: getattr(rc, key) for key in LIST_KEYS if isinstance(getattr(rc, key), (list, dict))}
    if not written:
        return []
    readings = {mode: _selected(replace(config, swap=replace(config.swap, swap=mode))) for mode in (False, True)}
    now, before = ("on", "off") if config.swap.swap else ("off", "on")
    return [f"swap_config.swap is {now} (the file says {before}), which changes what recompute_config.{key}: "
            f"{value!r} means: with swap off, per-stage counts selecting {readings[False].get(key, 'nothing valid')}; "
            f"with swap on, global layer indices selecting {readings[True].get(key, 'nothing valid')}; "
            f"now in effect: swap {now}"
            for key, value in written.items()]


def _selected(config: Config) -> dict[str, str]:
    """key -> the layers it selects under this config's swap setting (empty if the reading is invalid)."""
    try:
        plan = build_plan(config)
    except ConfigError:
        return {}
    full = [layer.layer for layer in plan.layers if layer.full]
    out = {"recompute": f"layers {full}"}
    for key, attr in (("select_recompute", "select"), ("select_comm_recompute", "comm")):
        picks = {p: [layer.layer for layer in plan.layers if p in getattr(layer, attr)]
                 for p in getattr(plan.formative, key)}
        out[key] = ", ".join(f"{p} on layers {layers}" for p, layers in picks.items()) or "nothing"
    return out
