"""Settings that load but recompute nothing, found on the resolved plan: one WARNING each. Pure: no torch."""
from __future__ import annotations

from typing import Any

from swapkit.config.errors import join, join_key, show
from swapkit.config.types import MindFormersRecompute
from swapkit.plan import patterns
from swapkit.plan.layout import Layout


def selects(spec: Any, layer: int, layout: Layout, swap_mode: bool) -> bool:
    """Does a normalized spec pick ``layer``? Grids count from the start of each chunk."""
    if swap_mode:
        return spec is True or (not isinstance(spec, bool) and layer in spec)
    chunk, stage = layout.interleave_ids[layer], layout.pp_ids[layer]
    return layout.positions[layer] < spec[chunk][stage]


# Note [Excludes that remove nothing]
# MindFormers removes a select pattern that an exclude pattern names (same number of dot-separated
# parts, each fullmatching the other's) and says nothing when an exclude names none, as when it is
# misspelt, names a pattern of the other select key, or names one that recomputes nothing anyway
# (its counts select no layer, or every layer it selects is fully recomputed: full wins). Each such
# exclude does nothing, so each gets a WARNING naming it and the patterns that do recompute. An
# exclude written as ``true`` or counts names no pattern at all: excludes have no default patterns
# (DESIGN §2). ``use_reentrant: true`` where nothing is recomputed is the same kind of setting.
def idle_excludes(rc: MindFormersRecompute, written: dict[str, Any], layers: tuple, layout: Layout,
                  swap_mode: bool) -> list[str]:
    """Note [Excludes that remove nothing]"""
    out = []
    for kind in ("select_recompute", "select_comm_recompute"):
        path, chosen, excludes = f"recompute_config.{kind}_exclude", written[kind], written[f"{kind}_exclude"]
        if getattr(rc, f"{kind}_exclude") is not False and not excludes:
            out.append(f"{path}: {show(getattr(rc, f'{kind}_exclude'))} names no pattern (an exclude has no default "
                       "patterns): it does nothing; list the patterns to exclude, or remove it")
        active = [p for p, spec in chosen.items()
                  if any(not layer.full and selects(spec, layer.layer, layout, swap_mode) for layer in layers)]
        for key in excludes:
            if not any(patterns.same_scope(key, p) for p in active):
                what = (f"the patterns that do: {', '.join(active)}" if active
                        else f"{kind} recomputes no layer that is not fully recomputed")
                out.append(f"{path}: {show(key)} removes no {kind} pattern that recomputes a layer ({what}): it does "
                           f"nothing. An exclude removes each {kind} pattern with as many dot-separated parts, each "
                           "part fullmatching the other's; fix the pattern, or remove it")
    return out


# Note [Select patterns that recompute nothing]
# A select_recompute / select_comm_recompute pattern written in the config (a key of a dict or a name of a
# list; not a default pattern, which `false` or counts of 0 turn off on purpose) may recompute no layer:
# its counts or indices select none, or full recompute wins on every layer it selects (MindFormers files
# often set `recompute: true` beside a select dict, and MindFormers says nothing). Each such pattern gets a
# WARNING naming it. A pattern an exclude removed is logged as removed instead, and swap-mode indices past
# the model are warned about by swap_mode_warnings (swapkit.plan.normalize).
def idle_selects(rc: MindFormersRecompute, formative: Any, layers: tuple, layout: Layout,
                 swap_mode: bool) -> list[str]:
    """Note [Select patterns that recompute nothing]"""
    out = []
    for kind in ("select_recompute", "select_comm_recompute"):
        for pattern, path, written in _written_patterns(getattr(rc, kind), f"recompute_config.{kind}"):
            spec = getattr(formative, kind).get(pattern)
            if spec is None:  # an exclude removed it
                continue
            picked = [layer.layer for layer in layers if selects(spec, layer.layer, layout, swap_mode)]
            if not picked and not (swap_mode and spec is not True and spec):  # all past the model: warned already
                what = "layer indices" if swap_mode else "counts"
                out.append(f"{path}: its {what} {show(written)} select no layer: it recomputes nothing; give the "
                           "layers to recompute, or remove the pattern")
            elif picked and all(layers[i].full for i in picked):
                out.append(f"{path}: every layer it selects {show(picked)} is fully recomputed, and full recompute "
                           "wins: it recomputes nothing; take those layers out of recompute where this op alone "
                           "should be recomputed, or remove the pattern")
    return out


def _written_patterns(value: Any, path: str) -> list[tuple[str, str, Any]]:
    """(pattern, key path, value written for it) of each pattern a select value names explicitly."""
    if isinstance(value, dict):
        return [(key, join_key(path, key), counts) for key, counts in value.items()]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return [(key, join(path, index), True) for index, key in enumerate(value)]
    return []
