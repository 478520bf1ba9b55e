"""The two readings of a recompute list: per-stage counts (swap off) or layer indices (swap on).

Note [Two readings of a recompute list]
MindFormers gives ``recompute: [2, 1]`` two meanings: with ``swap_config.swap: false`` it counts
layers per pipeline stage, with ``swap: true`` it lists global layer indices. swapkit keeps those
semantics, and warns, showing what the same list selects under both readings, whenever the meaning
may not be the one the list was written for:
- a ``--set swap_config.swap=...`` flips the file's setting (:func:`flip_warnings`);
- a resume flips the setting the checkpoint's run used (:func:`flip_warnings` with that origin);
- the file itself turns swap on over lists shaped like per-stage counts: a repeated value, or at
  most ``pipeline_stage`` non-negative values one of which is past the last layer
  (:func:`count_shaped_warnings`). The opposite direction, swap off
  over a list of indices longer than ``pipeline_stage``, is an error whose fix names swap mode
  (:mod:`swapkit.plan.normalize`).
Pure: no torch.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from swapkit.config.errors import ConfigError
from swapkit.config.types import Config, MindFormersRecompute
from swapkit.plan.plan import build_plan

LIST_KEYS = ("recompute", "select_recompute", "select_comm_recompute")


def flip_warnings(config: Config, other_swap: bool, origin: str = "the file says {before}") -> list[str]:
    """Warnings for each recompute list whose meaning changed because ``swap`` differs from ``other_swap``.

    Args:
        config: the config in effect.
        other_swap: the ``swap_config.swap`` the lists were written under (the file's, a checkpoint's run's).
        origin: where ``other_swap`` comes from, formatted with ``before`` ("on"/"off").
    """
    if other_swap == config.swap.swap:
        return []
    written = _written_lists(config)
    if not written:
        return []
    now, before = ("on", "off") if config.swap.swap else ("off", "on")
    readings = _both_readings(config)
    return [f"swap_config.swap is {now} ({origin.format(before=before)}), which changes what "
            f"recompute_config.{key}: {value!r} means: {_show(readings, key)}; now in effect: swap {now}"
            for key, value in written.items()]


def count_shaped_warnings(config: Config) -> list[str]:
    """Swap on over a list that reads like per-stage counts: a repeated value, or non-negative values, no
    more than ``pipeline_stage`` of them, one past the last layer."""
    if not config.swap.swap:
        return []
    reasons = {key: _count_reason(value, config.model.num_layers, config.parallel.pipeline_stage)
               for key, value in _written_lists(config).items()}
    shaped = {key: reason for key, reason in reasons.items() if reason}
    if not shaped:
        return []
    readings = _both_readings(config)
    written = _written_lists(config)
    return [f"recompute_config.{key}: {written[key]!r} reads like per-stage counts ({reason}), but "
            f"swap_config.swap is on, so MindFormers reads it as global layer indices: {_show(readings, key)}. "
            f"If you meant counts, set swap_config.swap: false"
            + ("; if you meant indices, list each layer once" if reason == REPEATED else "")
            for key, reason in shaped.items()]


REPEATED = "a repeated value"


def _count_reason(value: Any, num_layers: int, stages: int) -> str | None:
    for values in _int_lists(value):
        if len(set(values)) < len(values):
            return REPEATED
        if min(values) >= 0 and len(values) <= stages and max(values) >= num_layers:
            return f"{max(values)} is past the last layer, {num_layers - 1}"
    return None


def _written_lists(config: Config) -> dict[str, Any]:
    rc = config.recompute
    if not isinstance(rc, MindFormersRecompute) or config.model.num_layers is None:
        return {}
    return {key: getattr(rc, key) for key in LIST_KEYS if _int_lists(getattr(rc, key))}


def _int_lists(value: Any) -> list[list[int]]:
    """The integer lists a recompute value holds: itself, or each value of a ``select_*`` dict."""
    candidates = list(value.values()) if isinstance(value, dict) else [value]
    return [list(v) for v in candidates if isinstance(v, (list, tuple)) and v
            and all(isinstance(i, int) and not isinstance(i, bool) for i in v)]


def _both_readings(config: Config) -> dict[bool, dict[str, str]]:
    return {mode: _selected(replace(config, swap=replace(config.swap, swap=mode))) for mode in (False, True)}


def _show(readings: dict[bool, dict[str, str]], key: str) -> str:
    invalid = "nothing (the list is not valid in this reading)"
    return (f"with swap off, per-stage counts selecting {readings[False].get(key, invalid)}; "
            f"with swap on, global layer indices selecting {readings[True].get(key, invalid)}")


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
