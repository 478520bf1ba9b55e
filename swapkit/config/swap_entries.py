"""Reading ``swap_config.layer_swap`` / ``swap_config.op_swap`` items into :class:`SwapEntry`."""
from __future__ import annotations

from collections import Counter
from typing import Any

from swapkit.config import fields as F
from swapkit.config.errors import Problems, join, show
from swapkit.config.types import SwapConfig, SwapEntry
from swapkit.config.fields import Key

SWAP_FIX = "list global layer indices such as [0, 3], or true for every layer"


def read_swap_entries(
    value: Any, path: str, problems: Problems, with_op: bool, num_layers: int | None
) -> tuple[SwapEntry, ...] | None:
    """Validate one swap list (``None`` = not given). A single mapping counts as a one-item list
    (DESIGN §3: "list (or one dict)")."""
    if value is None or value is F.INVALID:
        return value
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        what = "{op_name, backward_prefetch, layers}" if with_op else "{backward_prefetch, layers}"
        problems.bad(path, value, f"a list of {what} mappings")
        return F.INVALID
    keys = {
        "backward_prefetch": Key(F.integer(1), required=True),
        "layers": Key(_layers(num_layers), required=True),
    }
    if with_op:
        keys["op_name"] = Key(_op_names, required=True)
    entries = []
    for index, item in enumerate(value):
        values = F.read_section(item, join(path, index), keys, problems)
        if not F.any_invalid(values):
            entries.append(SwapEntry(values["backward_prefetch"], values["layers"], values.get("op_name", ())))
    if len(entries) != len(value):
        return F.INVALID
    names = {name for entry in entries for name in entry.op_names}
    return tuple(entries) if F.few_patterns(len(names), value, path, problems) else F.INVALID


def _layers(num_layers: int | None) -> F.Check:
    def check(value: Any, path: str, problems: Problems) -> Any:
        return layer_indices(value, path, problems, num_layers, SWAP_FIX)

    return check


def layer_indices(value: Any, path: str, problems: Problems, num_layers: int | None, fix: str) -> Any:
    """``true``/``false`` or a list of global layer indices in ``[0, num_layers)``."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (list, tuple)) and any(isinstance(v, (list, tuple)) for v in value):
        problems.bad(path, value, "a flat list of global layer indices; 2-D lists are not allowed here", fix)
        return F.INVALID
    if not isinstance(value, (list, tuple)) or not all(F.is_int(v) for v in value):
        quoted = F.quoted_hint(value)
        problems.bad(path, value, "true, false or a list of layer indices", f"{quoted}; {fix}" if quoted else fix)
        return F.INVALID
    bad = [v for v in value if v < 0 or (num_layers is not None and v >= num_layers)]
    if bad:
        problems.bad(path, value, *_out_of_range(show(bad), num_layers))
        return F.INVALID
    if num_layers is not None and len(value) > num_layers:  # repeats only; bounds the per-layer lookups
        problems.bad(path, value, f"at most num_layers ({num_layers}) layer indices",
                     f"it lists {len(value):,}; list each layer once")
        return F.INVALID
    return tuple(value)


def _op_names(value: Any, path: str, problems: Problems) -> Any:
    names = F.string_list(value, path, problems)
    if names is F.INVALID:
        return names
    checked = [F.pattern(name, path, problems) for name in names]
    return F.INVALID if F.INVALID in checked else names


def check_swap_layers(swap: SwapConfig, num_layers: int, problems: Problems) -> None:
    """Layer indices of ``layer_swap`` / ``op_swap`` entries must be ``< num_layers``.

    The loader checks this when ``num_layers`` is written; when the model counts the layers
    (``swapkit.apply``), this runs once the count is known.
    """
    for key in ("layer_swap", "op_swap"):
        for index, entry in enumerate(getattr(swap, key) or ()):
            if entry.layers is True or entry.layers is False:
                continue
            bad = [v for v in entry.layers if v >= num_layers]
            if bad:
                problems.bad(join(join(join("swap_config", key), index), "layers"), list(entry.layers),
                             *_out_of_range(show(bad), num_layers))


def _out_of_range(bad: str, num_layers: int | None) -> tuple[str, str]:
    """What a ``layers`` list with indices outside the model expects, and the fix."""
    if num_layers is None:
        return "layer indices >= 0", f"out of range: {bad}; remove them"
    return (f"global layer indices 0 to {num_layers - 1} (num_layers is {num_layers})",
            f"out of range: {bad}; remove them, or list layers below {num_layers}")


# Note [Swap settings that do less than written]
# Three swap settings load (MindFormers accepts them too) but do less than they say, so each gets one
# WARNING naming the key path when the config is loaded:
# - a layer listed twice in one entry's `layers` (`[0, 0]`): the repeat does nothing;
# - two entries (of layer_swap, or of op_swap for one op name) that list the same layer with
#   different backward_prefetch values: the first entry wins for that layer (DESIGN §3, as MindFormers
#   builds its per-layer dict), the later value is silently dropped there;
# - `default_prefetch` next to `layer_swap` or `op_swap`: MindFormers uses it only for the default
#   strategy ("only takes effect when swap=True, layer_swap=None, and op_swap=None", seed 001);
#   likewise `default_prefetch` alone while `swap` is false.
#: At most this many overlap warnings per list; the rest are counted in the last one.
MAX_OVERLAP_WARNINGS = 5


def swap_warnings(raw: Any, swap: SwapConfig) -> list[str]:
    """Warnings for swap settings that do less than written (Note [Swap settings that do less than written])."""
    if any(getattr(swap, key) is F.INVALID for key in ("layer_swap", "op_swap", "default_prefetch")):
        return []
    out = _ignored_default_prefetch(raw, swap)
    for key in ("layer_swap", "op_swap"):
        out += _empty_entries(getattr(swap, key) or (), join("swap_config", key))
        out += _repeated_layers(getattr(swap, key) or (), join("swap_config", key))
    for index, entry in enumerate(swap.op_swap or ()):
        out += F.repeated_patterns(f"swap_config.op_swap[{index}].op_name", entry.op_names, "swapped")
    out += _overlaps(list(enumerate(swap.layer_swap or ())), "swap_config.layer_swap", "")
    grouped: dict[str, list[tuple[int, SwapEntry]]] = {}
    for index, entry in enumerate(swap.op_swap or ()):
        for name in entry.op_names:
            grouped.setdefault(name, []).append((index, entry))
    for name, items in grouped.items():
        out += _overlaps(items, "swap_config.op_swap", f" for op_name {name!r}")
    return out


def _ignored_default_prefetch(raw: Any, swap: SwapConfig) -> list[str]:
    if not (isinstance(raw, dict) and "default_prefetch" in raw):
        return []
    given = [key for key in ("layer_swap", "op_swap") if getattr(swap, key) is not None]
    if swap.swap is False and not given:  # with lists given, warn_inactive_swap names them instead
        return [f"swap_config.default_prefetch ({swap.default_prefetch}) is inactive because swap_config.swap is "
                "false; set swap_config.swap: true to swap with the default strategy, or remove default_prefetch"]
    if not given:
        return []
    return [f"swap_config.default_prefetch ({swap.default_prefetch}) is ignored: it applies only to the default "
            "swap strategy (swap_config.swap: true with neither layer_swap nor op_swap), as in MindFormers, and "
            f"swap_config.{' and swap_config.'.join(given)} {'are' if len(given) > 1 else 'is'} given; set "
            "backward_prefetch in each entry and remove default_prefetch"]


def _empty_entries(entries: tuple[SwapEntry, ...], path: str) -> list[str]:
    """Entries whose ``layers`` (``false`` or ``[]``) name no layer: they swap nothing."""
    return [f"{join(join(path, index), 'layers')} is {show(entry.layers if isinstance(entry.layers, bool) else [])}: "
            "this entry swaps no layer; list the layers it should swap (or true for all), or remove the entry"
            for index, entry in enumerate(entries) if not entry.layers]  # true is the only truthy bool


def _repeated_layers(entries: tuple[SwapEntry, ...], path: str) -> list[str]:
    out = []
    for index, entry in enumerate(entries):
        if isinstance(entry.layers, bool):
            continue
        repeated = sorted(layer for layer, count in Counter(entry.layers).items() if count > 1)
        if repeated:
            out.append(f"{join(join(path, index), 'layers')} lists layer(s) {repeated} more than once "
                       f"({show(list(entry.layers))}); a layer is swapped once, the repeats do nothing: "
                       "list each layer once")
    return out


def _overlaps(items: list[tuple[int, SwapEntry]], path: str, what: str) -> list[str]:
    """Entries listing a layer that an earlier entry with another backward_prefetch already claimed."""
    claimed: dict[int, tuple[int, int]] = {}  # layer -> (entry index, prefetch) of the first entry listing it
    shared: dict[tuple[int, int], list[int]] = {}  # (first, later) entry index -> layers both list
    prefetch = {index: entry.backward_prefetch for index, entry in items}
    for index, entry in items:
        if isinstance(entry.layers, bool):  # true collapses (equal prefetch checked), false lists nothing
            continue
        for layer in dict.fromkeys(entry.layers):
            first = claimed.setdefault(layer, (index, entry.backward_prefetch))
            if first[0] != index and first[1] != entry.backward_prefetch:
                shared.setdefault((first[0], index), []).append(layer)
    out = [_overlap_message(path, what, first, later, sorted(layers), prefetch)
           for (first, later), layers in list(shared.items())[:MAX_OVERLAP_WARNINGS]]
    if len(shared) > MAX_OVERLAP_WARNINGS:
        out[-1] += f" ({len(shared) - MAX_OVERLAP_WARNINGS:,} more overlapping pairs of {path} not listed)"
    return out


def _overlap_message(path: str, what: str, first: int, later: int, layers: list[int], prefetch: dict) -> str:
    a, b = join(path, first), join(path, later)
    return (f"{a} and {b}{what} both list layer(s) {show(layers)} with different backward_prefetch "
            f"({prefetch[first]} and {prefetch[later]}); the first entry wins: they get backward_prefetch "
            f"{prefetch[first]} from {a}, and {b}'s {prefetch[later]} is ignored for them; list each layer in one entry")
