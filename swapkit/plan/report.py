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

import difflib
import re
from dataclasses import dataclass, field, replace

from swapkit.plan import patterns
from swapkit.plan.normalize import DEFAULT_SWAP_OP
from swapkit.plan.plan import LayerPlan, Plan


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


def unmatched(plan: Plan, trees: list[dict]) -> list[str]:
    """Warnings for patterns that match in some bound layers but not in others they apply to.

    A pattern that matches in no layer at all is an error instead (:func:`unmatched_errors`).
    """
    return [f"{kind} pattern {pattern!r} matches no sub-module in layer(s) {layers}; it has no effect there"
            for (kind, pattern), layers in _missing(plan, trees).items() if _matches_somewhere(pattern, trees)]


def unmatched_errors(plan: Plan, trees: list[dict], model_name: str = "the model") -> list[str]:
    """One error per pattern that matches no sub-module in any bound layer (a config that does nothing)."""
    paths = sorted({path for tree in trees for path in _all_paths(tree)})
    return [_unmatched_error(kind, pattern, paths, model_name)
            for (kind, pattern), _ in _missing(plan, trees).items() if not _matches_somewhere(pattern, trees)]


def _missing(plan: Plan, trees: list[dict]) -> dict[tuple[str, str], list[int]]:
    """(setting, pattern) -> the layers it applies to where it matches nothing."""
    select_kind = "recompute_config.module_scopes" if plan.dialect == "megatron" else "select_recompute"
    missing: dict[tuple[str, str], list[int]] = {}
    for layer, tree in zip(plan.layers, trees):
        for kind, pattern_list in ((select_kind, layer.select), ("select_comm_recompute", layer.comm),
                                   ("op_swap", tuple(p for p, _ in layer.op_swap))):
            for pattern in pattern_list:
                if not patterns.resolve(tree, pattern):
                    missing.setdefault((kind, pattern), []).append(layer.layer)
    return missing


def _matches_somewhere(pattern: str, trees: list[dict]) -> bool:
    return any(patterns.resolve(tree, pattern) for tree in trees)


def _all_paths(tree: dict, prefix: str = "") -> list[str]:
    out: list[str] = []
    for name, subtree in tree.items():
        path = f"{prefix}.{name}" if prefix else name
        out += [path] + _all_paths(subtree, path)
    return out


def _unmatched_error(kind: str, pattern: str, paths: list[str], model_name: str) -> str:
    message = f"{kind} pattern {pattern!r} matches no sub-module in any layer of {model_name}"
    if pattern == DEFAULT_SWAP_OP:
        attention = [p for p in paths if re.search(r"attn|attention", p.split(".")[-1], re.IGNORECASE)]
        found = ", ".join(attention[:6]) or "none"
        return (f"{message}. It is swapkit's default swap op (swap_config.swap: true without layer_swap/op_swap) "
                f"and this model has no flash_attention scope; attention-like scopes found: {found}. Set "
                "model.model_config.preset to the model family, or write swap_config.op_swap: [{op_name: "
                f"{_as_pattern(attention[0]) if attention else '<scope>'}, backward_prefetch: 1, layers: true}}]")
    if patterns.display(pattern) == pattern and "." in pattern and pattern in paths:
        return (f"{message}. Components of a pattern are separated by the two characters \\. (a bare '.' is a "
                f"regex wildcard inside one name): write '{_as_pattern(pattern)}'")
    close = difflib.get_close_matches(patterns.display(pattern), paths, n=3, cutoff=0.6)
    quoted = ", ".join("'" + _as_pattern(c) + "'" for c in close)
    hint = f"did you mean {quoted}?" if close else \
        f"its layers' children are: {', '.join(p for p in paths if '.' not in p)}"
    return f"{message}; {hint}"


def _as_pattern(path: str) -> str:
    return path.replace(".", patterns.SEPARATOR)


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
            f"{patterns.display(p)}:{k}" for p, k in layer.op_swap]
        full = "yes" if layer.full else "-"
        if layer.full and layer.unit and layer.unit[0] != layer.unit[1]:
            full = f"yes [{layer.unit[0]}-{layer.unit[1]}]"
        rows.append((str(layer.layer), str(layer.stage), str(layer.chunk), full,
                     _cell(layer.select), _cell(layer.comm), ", ".join(swaps) or "-",
                     ", ".join(patterns.display(p) if p != "layer" else p for p in layer.overridden) or "-"))
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def _cell(pattern_list: tuple[str, ...]) -> str:
    return ", ".join(patterns.display(p) for p in pattern_list) or "-"


def summary(plan: Plan) -> list[str]:
    """A few lines under ``swapkit plan``'s table: what the strategy does, in layer ranges."""
    layout = plan.layout
    lines = [f"{layout.num_layers} layers, {layout.pipeline_stage} pipeline stage(s) x {layout.pp_interleave_num} "
             f"chunk(s); recompute dialect {plan.dialect}; swap {'on' if plan.swap else 'off'}"
             + (f"; model preset {plan.preset}" if plan.preset else "")]
    full = [layer.layer for layer in plan.layers if layer.full]
    lines.append(f"full recompute: {_ranges(full)}")
    for title, attr in (("select recompute", "select"), ("comm recompute", "comm")):
        lines += [f"{title} {patterns.display(p)}: {_ranges(layers)}" for p, layers in _by_pattern(plan, attr).items()]
    swapped = [layer.layer for layer in plan.layers if layer.layer_swap is not None]
    if swapped:
        lines.append(f"layer swap: {_ranges(swapped)}")
    ops: dict[str, list[int]] = {}
    for layer in plan.layers:
        for pattern, _ in layer.op_swap:
            ops.setdefault(pattern, []).append(layer.layer)
    lines += [f"op swap {patterns.display(p)}: {_ranges(layers)}" for p, layers in ops.items()]
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


def _ranges(layers: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"layers 0-2, 5"``; ``[]`` -> ``"none"``."""
    if not layers:
        return "none"
    parts, start = [], layers[0]
    for previous, current in zip(layers, layers[1:] + [None]):
        if current != previous + 1:
            parts.append(f"{start}-{previous}" if previous != start else str(start))
            start = current
    return "layers " + ", ".join(parts)
