"""MindFormers normalization: user-written recompute/swap values -> the "formative" strategy.

Count values (DESIGN §3) become ``[V][P]`` grids where a count ``n`` in chunk ``(v, s)`` selects
the first ``n`` layers of that chunk. With ``swap_config.swap: true`` the recompute keys are
stage-agnostic instead: ``True`` or lists of global layer indices. Pure: no torch, no model.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Mapping

from swapkit.config import fields as F
from swapkit.plan import patterns
from swapkit.config.types import MindFormersRecompute, SwapConfig, SwapEntry
from swapkit.config.errors import Problems, join, join_key
from swapkit.plan.layout import Grid, Layout
from swapkit.config.swap_entries import layer_indices

DEFAULT_SELECT = (r"feed_forward\.mul", r"feed_forward\.w1\.activation\.silu")
DEFAULT_COMM = (r".*\.norm",)
DEFAULT_SWAP_OP = r".*\.flash_attention"
SWAP_MODE_FIX = "with swap_config.swap: true, recompute settings take true/false or global layer indices like [0, 3]"

#: A normalized count value: a [V][P] grid, or (swap mode) True / a tuple of global layer indices.
Spec = Any


@dataclass(frozen=True)
class SwapRule:
    """One normalized swap item: prefetch distance and ``True`` (all layers) or layer indices."""

    backward_prefetch: int
    layers: bool | tuple[int, ...]

    def covers(self, layer: int) -> bool:
        return self.layers is True or layer in self._layer_set

    @cached_property
    def _layer_set(self) -> frozenset[int]:
        """A set, so a long ``layers`` list is not scanned once per layer of the model."""
        return frozenset(self.layers) if not isinstance(self.layers, bool) else frozenset()

    def as_dict(self) -> dict:
        layers = self.layers if self.layers is True else list(self.layers or ())
        return {"backward_prefetch": self.backward_prefetch, "layers": layers}


@dataclass(frozen=True)
class Formative:
    """The normalized strategy, as MindFormers logs it ("Formative ...")."""

    layer_recompute: Spec
    select_recompute: Mapping[str, Spec]
    select_comm_recompute: Mapping[str, Spec]
    select_recompute_exclude: Mapping[str, Spec]
    select_comm_recompute_exclude: Mapping[str, Spec]
    layer_swap: tuple[SwapRule, ...]
    op_swap: Mapping[str, tuple[SwapRule, ...]]
    #: MindFormers' line for each select pattern an exclude removed (Note [Logging what an exclude removed])
    removed: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {
            "layer_recompute": _plain(self.layer_recompute),
            "select_recompute": _plain(self.select_recompute),
            "select_comm_recompute": _plain(self.select_comm_recompute),
            "select_recompute_exclude": _plain(self.select_recompute_exclude),
            "select_comm_recompute_exclude": _plain(self.select_comm_recompute_exclude),
            "layer_swap": [rule.as_dict() for rule in self.layer_swap],
            "op_swap": {op: [rule.as_dict() for rule in rules] for op, rules in self.op_swap.items()},
        }

    def log_lines(self, swap_on: bool) -> list[str]:
        data = self.to_json()
        lines = list(self.removed) + [f"Formative layer_recompute: {data['layer_recompute']}"]
        lines += [f"Formative {key}: {data[key]}" for key in (
            "select_recompute", "select_comm_recompute", "select_recompute_exclude", "select_comm_recompute_exclude")]
        if swap_on:
            lines += [f"Formative layer swap: {data['layer_swap']}", f"Formative op swap: {data['op_swap']}"]
        return lines


def _plain(value: Any) -> Any:
    """Grids and index tuples as lists, so logs and JSON read like MindFormers' ``tolist()``."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


# ---------------------------------------------------------------- count values (stage mode)

#: The fix for a too-long exclude list in swap mode, where the swap-mode fix (turn swap on) does not apply.
EXCLUDE_SWAP_FIX = ("an exclude keeps per-stage counts with swap_config.swap: true (only recompute, select_recompute "
                    "and select_comm_recompute take layer indices) and removes its pattern from every layer whatever "
                    "its counts: write true")


def normalize_counts(value: Any, layout: Layout, path: str, problems: Problems,
                     long_fix: str | None = None) -> Grid | None:
    """One count value -> ``[V][P]`` grid of "first n layers of the chunk" counts; ``long_fix`` replaces the
    fix for a per-stage list longer than ``pipeline_stage`` (which names swap mode)."""
    if isinstance(value, bool):
        return layout.layer_list if value else layout.zeros()
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, str) for v in value):
            return layout.layer_list  # a list of op names as a count means "all layers"
        if all(F.is_int(v) or isinstance(v, bool) for v in value):
            return _deal_per_stage(value, layout, path, problems, long_fix)
        if all(isinstance(v, (list, tuple, bool)) for v in value):
            return _per_chunk(value, layout, path, problems)
    problems.bad(path, value, f"true/false, a list of per-stage counts (at most {layout.pipeline_stage}) or a "
                 f"[{layout.pp_interleave_num}][{layout.pipeline_stage}] grid of per-chunk counts",
                 F.quoted_hint(value))
    return None


def _deal_per_stage(value: Any, layout: Layout, path: str, problems: Problems,
                    long_fix: str | None = None) -> Grid | None:
    stages, chunks = layout.pipeline_stage, layout.pp_interleave_num
    if len(value) > stages:
        fix = long_fix or ("use one count per stage, or, if these are layer indices, set swap_config.swap: true "
                           "(MindFormers reads the lists as global layer indices in swap mode)")
        problems.bad(path, value, f"at most pipeline_stage ({stages}) per-stage counts", f"it has {len(value)}; {fix}")
        return None
    if _negative(value, path, problems):
        return None
    totals = layout.stage_totals()
    grid = [list(row) for row in layout.zeros()]
    for stage, count in enumerate(value):
        remaining = totals[stage] if count is True else 0 if count is False else min(count, totals[stage])
        while remaining:  # one layer at a time, round-robin over chunks, skipping full ones
            for chunk in range(chunks):
                if remaining and grid[chunk][stage] < layout.layer_list[chunk][stage]:
                    grid[chunk][stage] += 1
                    remaining -= 1
    return tuple(tuple(row) for row in grid)


def _per_chunk(value: Any, layout: Layout, path: str, problems: Problems) -> Grid | None:
    stages, chunks = layout.pipeline_stage, layout.pp_interleave_num
    shape_ok = len(value) == chunks and all(
        isinstance(row, bool) or (len(row) == stages and all(F.is_int(c) or isinstance(c, bool) for c in row))
        for row in value
    )
    if not shape_ok:
        problems.bad(path, value, f"a [{chunks}][{stages}] grid (pp_interleave_num rows of pipeline_stage "
                     "counts, each count an integer or true/false)")
        return None
    if any(_negative(row, join(path, v), problems) for v, row in enumerate(value) if not isinstance(row, bool)):
        return None
    grid = []
    for row, sizes in zip(value, layout.layer_list):
        cells = [row] * stages if isinstance(row, bool) else row
        grid.append(tuple(size if c is True else 0 if c is False else min(c, size) for c, size in zip(cells, sizes)))
    return tuple(grid)


def _negative(values: Any, path: str, problems: Problems) -> bool:
    bad = [v for v in values if F.is_int(v) and v < 0]
    if bad:
        problems.bad(path, list(values), "counts >= 0", f"negative counts {bad} are not allowed "
                     "(MindFormers would loop forever on them)")
    return bool(bad)


# ---------------------------------------------------------------- swap mode (global indices)

def normalize_indices(value: Any, path: str, problems: Problems) -> Spec | None:
    """Swap mode: ``True`` stays ``True``, ``False`` -> ``()``, a list -> tuple of layer indices.

    Indices are kept as written, out-of-range and negative ones included: MindFormers keeps them in
    its ``Formative ...`` lines and they simply match no layer (:func:`swap_mode_warnings` says so).
    """
    if value is False:
        return ()
    if isinstance(value, (list, tuple)) and all(F.is_int(v) for v in value):
        return tuple(value)
    result = layer_indices(value, path, problems, None, SWAP_MODE_FIX)
    return None if result is F.INVALID else result


def normalize_layer_list(value: Any, path: str, problems: Problems) -> Spec | None:
    """Swap mode, a value of a ``select_*`` dict: MindFormers' check_rules demands a list."""
    if not isinstance(value, (list, tuple)):
        key = path.split(".")[1] if path.count(".") >= 2 else path
        problems.bad(path, value, "a list of layer indices", f"MindFormers: Layer info of {key} must be list when "
                     "enabling swap; write [0, 3] (or [] for none)")
        return None
    return normalize_indices(value, path, problems)


def swap_mode_warnings(formative: Formative, num_layers: int) -> list[str]:
    """One warning per swap-mode recompute setting whose indices match no layer (kept as written)."""
    items = [("recompute_config.recompute", formative.layer_recompute)]
    for key in ("select_recompute", "select_comm_recompute"):
        items += [(f"recompute_config.{key}.{p}", v) for p, v in getattr(formative, key).items()]
    warnings = []
    for path, spec in items:
        outside = [i for i in spec if i < 0 or i >= num_layers] if isinstance(spec, tuple) else []
        if outside:
            warnings.append(f"{path}: layer indices {outside} match no layer (the model has layers 0-"
                            f"{num_layers - 1}); kept as written, as MindFormers does, and they do nothing")
    return warnings


# ---------------------------------------------------------------- pattern dicts

def normalize_select(
    value: Any, defaults: tuple[str, ...], to_spec: Callable[[Any, str], Spec | None], path: str, problems: Problems,
    to_dict_spec: Callable[[Any, str], Spec | None] | None = None,
) -> dict[str, Spec] | None:
    """``select_*`` value -> ordered ``{pattern: spec}``.

    A dict maps each key (its values read by ``to_dict_spec``, default ``to_spec``); a list of
    strings names patterns that apply to all layers; anything else applies the same counts to each
    default pattern.
    """
    if isinstance(value, dict):
        items = [(key, v, join_key(path, key)) for key, v in value.items()]
    elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        items = [(key, True, join(path, index)) for index, key in enumerate(value)]
    else:
        spec = to_spec(value, path)
        return None if spec is None else {key: spec for key in defaults}
    if not F.few_patterns(len(items), value, path, problems):
        return None
    result, ok = {}, True
    for key, raw, key_path in items:
        spec = (to_dict_spec or to_spec)(raw, key_path) if isinstance(value, dict) else to_spec(raw, key_path)
        if F.pattern(key, key_path, problems) is F.INVALID or spec is None:
            ok = False
        result[key] = spec
    return result if ok else None


# Note [Logging what an exclude removed]
# MindFormers' LayerSetting logs "The pattern ... conflicts with ..._exclude and will be removed." once,
# after the layout lines and before the "Formative ..." lines. Normalization is pure and runs more than
# once per config (load_config's check, build_plan, the readings of a list), so logging here printed the
# line once per run and before the layout; the lines travel in Formative.removed instead and the plan's
# log_lines() print them where MindFormers does.
def exclude(select: dict[str, Spec], excludes: Mapping[str, Spec], name: str) -> tuple[dict[str, Spec], list[str]]:
    """Remove select patterns that an exclude pattern names (same scope, either-way fullmatch).

    Returns:
        The kept patterns, and one MindFormers log line per removed one (Note [Logging what an exclude removed]).
    """
    kept, removed = dict(select), []
    for key in excludes:
        try:
            named = [p for p in kept if patterns.same_scope(key, p)]
        except patterns.PatternTooSlow as err:
            raise err.at(f"recompute_config.{name}_exclude") from None
        for pattern in named:
            del kept[pattern]
            removed.append(f"The pattern {pattern} in {name} conflicts with {name}_exclude and will be removed.")
    return kept, removed


def normalize_recompute(
    recompute: MindFormersRecompute, layout: Layout, swap_mode: bool, problems: Problems, excluded: bool = True
) -> dict[str, Any] | None:
    """All five MindFormers recompute keys, normalized, and ``removed`` (the log lines of the patterns the excludes
    removed); ``None`` if any is invalid. ``excluded=False`` leaves the select patterns as written, before the
    excludes remove any (and no ``removed``)."""
    def counts(value: Any, path: str) -> Spec | None:
        return normalize_counts(value, layout, path, problems)

    def exclude_counts(value: Any, path: str) -> Spec | None:
        return normalize_counts(value, layout, path, problems, EXCLUDE_SWAP_FIX if swap_mode else None)

    def indices(value: Any, path: str) -> Spec | None:
        return normalize_indices(value, path, problems)

    def layer_list(value: Any, path: str) -> Spec | None:
        return normalize_layer_list(value, path, problems)

    spec = indices if swap_mode else counts
    dict_spec = layer_list if swap_mode else counts
    base = "recompute_config"
    out = {"layer_recompute": spec(recompute.recompute, join(base, "recompute"))}
    for key, defaults, to_spec in (
        ("select_recompute", DEFAULT_SELECT, spec), ("select_comm_recompute", DEFAULT_COMM, spec),
        ("select_recompute_exclude", (), exclude_counts), ("select_comm_recompute_exclude", (), exclude_counts),
    ):
        out[key] = normalize_select(getattr(recompute, key), defaults, to_spec, join(base, key), problems,
                                    dict_spec if to_spec is spec else None)
    if any(v is None for v in out.values()):
        return None
    if not excluded:
        return out
    out["removed"] = ()
    for key in ("select_recompute", "select_comm_recompute"):
        out[key], removed = exclude(out[key], out[f"{key}_exclude"], key)
        out["removed"] += tuple(removed)
    return out


# ---------------------------------------------------------------- swap_config

def normalize_swap(swap: SwapConfig, problems: Problems) -> tuple[tuple[SwapRule, ...], dict] | None:
    """``swap_config`` -> (layer swap rules, op pattern -> rules). Validated even when swap is off."""
    if swap.layer_swap is None and swap.op_swap is None:
        return (), {DEFAULT_SWAP_OP: (SwapRule(swap.default_prefetch, True),)}
    layer_rules = _collapse(list(enumerate(swap.layer_swap or ())), "swap_config.layer_swap", problems)
    grouped: dict[str, list[tuple[int, SwapEntry]]] = {}
    for index, entry in enumerate(swap.op_swap or ()):
        for name in entry.op_names:
            grouped.setdefault(name, []).append((index, entry))
    op_rules = {name: _collapse(items, "swap_config.op_swap", problems) for name, items in grouped.items()}
    if layer_rules is None or any(rules is None for rules in op_rules.values()):
        return None
    return layer_rules, op_rules


def _collapse(items: list[tuple[int, SwapEntry]], path: str, problems: Problems) -> tuple[SwapRule, ...] | None:
    """Entries with ``layers: true`` collapse into one rule; their prefetch values must agree."""
    rules = tuple(SwapRule(e.backward_prefetch, e.layers if e.layers is True else tuple(e.layers or ()))
                  for _, e in items)
    if not any(rule.layers is True for rule in rules):
        return rules
    first = rules[0].backward_prefetch
    for (index, _), rule in zip(items, rules):
        if rule.backward_prefetch != first:
            problems.bad(join(join(path, index), "backward_prefetch"), rule.backward_prefetch,
                         f"{first} like the other entries, because an entry with layers: true collapses them "
                         "into one", "use one backward_prefetch value, or list layer indices instead of true")
            return None
    return (SwapRule(first, True),)


