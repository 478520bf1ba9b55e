"""What the budget planner writes: MindFormers-style YAML sections, a per-layer table, JSON. Pure.

The sections use swap mode (``swap_config.swap: true``), so ``recompute_config.recompute`` takes
global layer indices and a layer or op swap is ``{backward_prefetch, layers}`` with global indices,
exactly what a MindFormers user writes by hand; the file loads unchanged with ``swapkit train``.
"""
from __future__ import annotations

import re
from typing import Any

from swapkit.plan.planner import Choice, Planned
from swapkit.plan.trace import KEEP, Trace


def op_pattern(path: str) -> str:
    r"""A module path as an op pattern that names exactly it: ``attention.wq`` -> ``attention\.wq``."""
    return r"\.".join(re.escape(part) for part in path.split("."))


def planned_sections(choices: tuple[Choice, ...], use_reentrant: bool = False) -> dict[str, Any]:
    """``recompute_config`` and ``swap_config`` for the choices (global layer indices); keeping
    everything is written as ``swap: false`` and ``recompute: false``."""
    if all(c.keeps_all for c in choices):
        return {"recompute_config": {"recompute": False, "select_recompute": False, "select_comm_recompute": False},
                "swap_config": {"swap": False}}
    recomputed = [i for i, c in enumerate(choices) if c.action == "recompute"]
    selected: dict[str, list[int]] = {}
    for i, choice in enumerate(choices):
        if choice.select is not None:
            selected.setdefault(op_pattern(choice.select), []).append(i)
    recompute: dict[str, Any] = {"recompute": recomputed or False, "select_recompute": selected or False,
                                 "select_comm_recompute": False}
    if use_reentrant:
        recompute["use_reentrant"] = True
    layer_swap: dict[int, list[int]] = {}
    op_swap: dict[tuple[str, int], list[int]] = {}
    for i, choice in enumerate(choices):
        for scope in choice.scopes if choice.action == "swap" else ():
            if scope == "":
                layer_swap.setdefault(choice.prefetch, []).append(i)
            else:
                op_swap.setdefault((scope, choice.prefetch), []).append(i)
    swap = {"swap": True,
            "layer_swap": [{"backward_prefetch": k, "layers": layers} for k, layers in sorted(layer_swap.items())],
            "op_swap": [{"op_name": op_pattern(scope), "backward_prefetch": k, "layers": layers}
                        for (scope, k), layers in op_swap.items()]}
    return {"recompute_config": recompute, "swap_config": swap}


def planned_config(raw: dict[str, Any], choices: tuple[Choice, ...], use_reentrant: bool = False) -> dict[str, Any]:
    """The user's config (as read, overrides applied) with the planned strategy in place of theirs."""
    out = {key: value for key, value in raw.items() if key not in ("recompute_config", "swap_config")}
    out.update(planned_sections(choices, use_reentrant))
    return out


def layer_rows(trace: Trace, planned: Planned, min_offload_bytes: int) -> list[dict[str, Any]]:
    """Per layer: decision, saved bytes when kept, bytes it moves, and its predicted cost: the
    layer's forward time if recomputed, plus the exposed wait for its swapped storages."""
    waits = dict(planned.predicted.layer_wait)
    rows = []
    for layer, choice in enumerate(planned.choices):
        saved, swapped = _layer_bytes(trace, layer, choice, min_offload_bytes)
        forward = trace.scope_seconds.get((layer, ""), 0.0)
        recompute = forward if choice.action == "recompute" else trace.scope_seconds.get((layer, choice.select), 0.0)
        cost = (recompute if choice.action == "recompute" or choice.select else 0.0) + waits.get(layer, 0.0)
        rows.append({"layer": layer, "decision": choice.describe(), "action": choice.action,
                     "swapped_scopes": list(choice.scopes), "backward_prefetch": choice.prefetch,
                     "select_recompute": choice.select,
                     "saved_bytes": saved, "swapped_bytes": swapped, "forward_seconds": forward,
                     "predicted_cost_seconds": cost})
    return rows


def _layer_bytes(trace: Trace, layer: int, choice: Choice, min_offload_bytes: int) -> tuple[int, int]:
    seen: set = set()
    saved = swapped = 0
    for save in trace.modes[KEEP][layer].forward:
        if save.storage is None or save.storage in seen:
            continue
        seen.add(save.storage)
        saved += save.nbytes
        if save.nbytes >= min_offload_bytes and choice.swap_k(save.scope) is not None:
            swapped += save.nbytes
    return saved, swapped


DECISION_WIDTH = 46  # the decision column's least width; a longer decision widens it for every row


def table_head(rows: list[dict[str, Any]]) -> str:
    """The report's header, its decision column as wide as the longest decision of ``rows``."""
    return (f"{'layer':<6} {'decision':<{decision_width(rows)}} {'saved MiB':>9} {'swapped MiB':>11} "
            f"{'forward ms':>10} {'predicted cost ms':>17}")


def decision_width(rows: list[dict[str, Any]]) -> int:
    return max([DECISION_WIDTH] + [len(row["decision"]) for row in rows])


def row_cells(row: dict[str, Any], width: int = DECISION_WIDTH) -> str:
    """One layer's row of the report (aligned under :func:`table_head` of rows whose decisions fit ``width``)."""
    return (f"{row['layer']:<6} {row['decision']:<{width}} {row['saved_bytes'] / 2**20:>9.3f} "
            f"{row['swapped_bytes'] / 2**20:>11.3f} {row['forward_seconds'] * 1e3:>10.2f} "
            f"{row['predicted_cost_seconds'] * 1e3:>17.2f}")


def table(rows: list[dict[str, Any]], planned: Planned) -> str:
    """The per-layer report and the predicted totals, as text."""
    width = decision_width(rows)  # a swap of several scopes is longer than the default column
    lines = [table_head(rows)] + [row_cells(row, width) for row in rows]
    p, b = planned.predicted, planned.baseline
    lines.append(f"predicted: peak_device_bytes {p.peak_device_bytes} (keep all: {b.peak_device_bytes}), "
                 f"step {p.step_seconds * 1e3:.1f} ms (keep all: {b.step_seconds * 1e3:.1f} ms), "
                 f"moved {p.moved_bytes_per_step} bytes/step (out and back)"
                 + ("" if p.host_pool_bytes is None else f", host pool {p.host_pool_bytes} bytes"))
    if p.host_cap_bytes:  # a plan the search chose keeps them only where it still fits (swapkit.plan.hostpool)
        lines.append(f"predicted: runtime.max_host_bytes keeps {p.host_cap_bytes} swapped bytes on the device "
                     "(the host pool cannot hold their batches; counted in the peak)")
    return "\n".join(lines)


def to_json(sections: dict[str, Any], rows: list[dict[str, Any]], planned: Planned, budget: int) -> dict[str, Any]:
    """``swapkit plan --budget --json``: the plan, the per-layer rows and the predictions."""
    return {"budget_bytes": budget, "plan": sections, "layers": rows, "predicted": planned.predicted.to_json(),
            "baseline": planned.baseline.to_json()}
