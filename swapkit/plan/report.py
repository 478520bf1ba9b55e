"""Per-layer log lines, with the op paths a plan resolves to in a concrete module tree.

Pure: a layer is described by its tree of child names (``{"attention": {"wq": {...}}, ...}``),
so ``swapkit plan`` (against the built-in model) and ``swapkit.apply`` (against the user's model)
print the same lines.

Note [MindFormers op_swap log paths]
MindFormers builds the logged name while walking the pattern: a one-component pattern logs as
``.attention`` (leading dot), a longer one as ``attention.flash_attention`` (the walk strips the
dot of nested matches). Seed 001 shows both forms; we print them the same way, with single
spaces (MindFormers' own line has a doubled space for nested matches).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from swapkit.plan import patterns
from swapkit.plan.plan import LayerPlan, Plan
from swapkit.plan.unmatched import unmatched, unmatched_errors, unmatched_problems

__all__ = ["LayerScopes", "exact_overridden", "layer_lines", "plan_report", "resolve_layer", "summary", "table",
           "unmatched", "unmatched_errors", "unmatched_problems", "with_exact_overridden"]


@dataclass
class LayerScopes:
    """The concrete scopes (dotted paths inside the layer) that a layer's plan names."""

    select: list[str] = field(default_factory=list)
    comm: list[str] = field(default_factory=list)
    op_swap: list[tuple[str, str, int]] = field(default_factory=list)  # (pattern, path, prefetch)
    overridden: list[tuple[str, str]] = field(default_factory=list)  # (what, why)


def resolve_layer(layer: LayerPlan, tree: dict) -> LayerScopes:
    """Resolve a layer plan's patterns against the layer's tree of child names."""
    scopes = LayerScopes()
    scopes.select = _paths(tree, layer.select)
    scopes.comm = [p for p in _paths(tree, layer.comm) if p not in scopes.select]
    scopes.op_swap = [(pattern, path, prefetch) for pattern, prefetch in layer.op_swap
                      for path in patterns.resolve(tree, pattern)]
    recomputed = scopes.select + scopes.comm
    if layer.full and layer.layer_swap is not None:
        scopes.overridden.append(("layer swap", "the layer is fully recomputed"))
    for pattern, path, _ in scopes.op_swap:
        owner = "the layer is fully recomputed" if layer.full else next(
            (f"{r} is recomputed" for r in recomputed if path == r or path.startswith(r + ".")), None)
        if owner:
            scopes.overridden.append((f"op swap {path}", owner))
    return scopes


def exact_overridden(layer: LayerPlan, scopes: LayerScopes) -> tuple[str, ...]:
    """``overridden`` decided on real paths: ``"layer"``, and op patterns all of whose scopes are
    recomputed (or inside a recomputed scope)."""
    hit = {what for what, _ in scopes.overridden}
    patterns_hit = [pattern for pattern, _ in layer.op_swap
                    if (paths := [p for q, p, _ in scopes.op_swap if q == pattern])
                    and all(f"op swap {p}" in hit for p in paths)]
    return (("layer",) if "layer swap" in hit else ()) + tuple(patterns_hit)


def with_exact_overridden(plan: Plan, trees: list[dict]) -> Plan:
    """The plan with ``overridden`` decided against a concrete module tree per layer."""
    layers = tuple(replace(layer, overridden=exact_overridden(layer, resolve_layer(layer, tree)))
                   for layer, tree in zip(plan.layers, trees))
    return replace(plan, layers=layers)


def _paths(tree: dict, pattern_list: tuple[str, ...]) -> list[str]:
    found: list[str] = []
    for pattern in pattern_list:
        found += [p for p in patterns.resolve(tree, pattern) if p not in found]
    return found


def layer_lines(plan: Plan, layer: LayerPlan, scopes: LayerScopes) -> list[tuple[str, str]]:
    """``(level, message)`` pairs for one layer, MindFormers wording."""
    i, lines = layer.layer, []
    on = "" if plan.swap else " on"
    if layer.full:
        unit = layer.unit or (i, i)
        group = f" (checkpoint unit: layers {unit[0]}-{unit[1]})" if unit[0] != unit[1] else ""
        lines.append(("INFO", f"Set full recompute at layer {i}{group}"))
    if scopes.select:
        lines.append(("INFO", f"Set select recompute{on} at layer {i}: {', '.join(scopes.select)}"))
    if scopes.comm:
        lines.append(("INFO", f"Set select comm recompute{on} at layer {i}: {', '.join(scopes.comm)}"))
    if layer.layer_swap is not None:
        lines.append(("INFO", f"Set layer swap at layer {i} and value is: {layer.layer_swap}"))
    if scopes.op_swap:
        items = [f"{'.' if len(patterns.split(pattern)) == 1 else ''}{path}, value={prefetch}"
                 for pattern, path, prefetch in scopes.op_swap]  # Note [MindFormers op_swap log paths]
        lines.append(("INFO", f"Set op_swap at layer {i}: {', '.join(items)}"))
    for what, why in scopes.overridden:
        lines.append(("WARNING", f"{what} at layer {i} has no effect: {why} (recompute wins over swap)"))
    return lines


def plan_report(plan: Plan, trees: list[dict]) -> list[tuple[str, str]]:
    """Every per-layer line, then the partly-unmatched-pattern warnings (see :func:`unmatched_errors`)."""
    lines: list[tuple[str, str]] = []
    for layer, tree in zip(plan.layers, trees):
        lines += layer_lines(plan, layer, resolve_layer(layer, tree))
    return lines + [("WARNING", message) for message in unmatched(plan, trees)]


def table(plan: Plan) -> str:
    """A readable per-layer table for ``swapkit plan``."""
    header = ("layer", "stage", "chunk", "full", "select", "comm", "swaps", "overridden")
    rows = [header]
    for layer in plan.layers:
        swaps = ([f"layer:{layer.layer_swap}"] if layer.layer_swap is not None else []) + [
            f"{p}:{k}" for p, k in layer.op_swap]
        full = "yes" if layer.full else "-"
        if layer.full and layer.unit and layer.unit[0] != layer.unit[1]:
            full = f"yes [{layer.unit[0]}-{layer.unit[1]}]"
        rows.append((str(layer.layer), str(layer.stage), str(layer.chunk), full,
                     _cell(layer.select), _cell(layer.comm), ", ".join(swaps) or "-",
                     ", ".join(layer.overridden) or "-"))
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def _cell(pattern_list: tuple[str, ...]) -> str:
    return ", ".join(pattern_list) or "-"


def summary(plan: Plan) -> list[str]:
    """A few lines under ``swapkit plan``'s table: what the strategy does, in layer ranges."""
    layout = plan.layout
    lines = [f"{layout.num_layers} layers, {layout.pipeline_stage} pipeline stage(s) x {layout.pp_interleave_num} "
             f"chunk(s); recompute dialect {plan.dialect}; swap {'on' if plan.swap else 'off'}"
             + (f"; model preset {plan.preset}" if plan.preset else "")]
    full = [layer.layer for layer in plan.layers if layer.full]
    lines.append(f"full recompute: {layer_ranges(full)}")
    for title, attr in (("select recompute", "select"), ("comm recompute", "comm")):
        lines += [f"{title} {p}: {layer_ranges(layers)}" for p, layers in _by_pattern(plan, attr).items()]
    swapped = [layer.layer for layer in plan.layers if layer.layer_swap is not None]
    if swapped:
        lines.append(f"layer swap: {layer_ranges(swapped)}")
    ops: dict[str, list[int]] = {}
    for layer in plan.layers:
        for pattern, _ in layer.op_swap:
            ops.setdefault(pattern, []).append(layer.layer)
    lines += [f"op swap {p}: {layer_ranges(layers)}" for p, layers in ops.items()]
    overridden = sum(bool(layer.overridden) for layer in plan.layers)
    if overridden:
        lines.append(f"swaps overridden by recompute on {overridden} layer(s) (see the overridden column)")
    return lines + [f"note: {note}" for note in plan.notes]


def _by_pattern(plan: Plan, attr: str) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for layer in plan.layers:
        for pattern in getattr(layer, attr):
            found.setdefault(pattern, []).append(layer.layer)
    return found


def layer_ranges(layers: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"layers 0-2, 5"``; ``[]`` -> ``"none"``."""
    if not layers:
        return "none"
    parts, start = [], layers[0]
    for previous, current in zip(layers, layers[1:] + [None]):
        if current != previous + 1:
            parts.append(f"{start}-{previous}" if previous != start else str(start))
            start = current
    return "layers " + ", ".join(parts)
