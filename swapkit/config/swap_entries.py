"""Reading ``swap_config.layer_swap`` / ``swap_config.op_swap`` items into :class:`SwapEntry`."""
from __future__ import annotations

from typing import Any

from swapkit.config import fields as F
from swapkit.config.types import SwapConfig, SwapEntry
from swapkit.config.errors import Problems, join
from swapkit.config.fields import Key

SWAP_FIX = "list global layer indices such as [0, 3], or true for every layer"


def read_swap_entries(
    value: Any, path: str, problems: Problems, with_op: bool, num_layers: int | None
) -> tuple[SwapEntry, ...] | None:
    """Validate one swap list (``None`` = not given). A single mapping counts as a one-item list."""
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
    return tuple(entries) if len(entries) == len(value) else F.INVALID


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
        problems.bad(path, value, "true, false or a list of layer indices", fix)
        return F.INVALID
    bad = [v for v in value if v < 0 or (num_layers is not None and v >= num_layers)]
    if bad:
        upper = f" < num_layers ({num_layers})" if num_layers is not None else ""
        problems.bad(path, value, f"layer indices >= 0{upper}", f"out of range: {bad}")
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
                             f"layer indices >= 0 < num_layers ({num_layers})", f"out of range: {bad}")
