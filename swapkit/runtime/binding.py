"""Binding a plan to a model: find the layer containers, resolve op patterns to sub-modules.

A layer container is named by a dotted attribute path relative to the model (``"layers"``,
``"model.layers"``, ``"transformer.h"``). Without one, the single ``nn.ModuleList`` /
``nn.Sequential`` / ``nn.ModuleDict`` of repeated blocks is taken; when there are several, the
error lists them.

Note [Several layer containers]
An encoder-decoder model keeps its layers in two containers (``encoder.block``,
``decoder.block``). One session may bind several: ``layers=["encoder.block", "decoder.block"]``
numbers their layers globally in the order given (encoder layers 0..E-1, decoder layers E..),
and every config key that names layers (``layer_swap.layers``, ``recompute: [..]``, the
per-stage counts of the layout) uses that numbering; ``num_layers`` is the total. The order is
the user's, not the order of execution: it only names layers. A Megatron ``uniform`` unit runs
its layers back to back inside one checkpoint, so it may not span two containers.

Note [Layers in a ModuleDict]
torchtitan keeps a model's layers in an ``nn.ModuleDict`` keyed by layer id, so that a pipeline
split, which deletes the other stages' keys, leaves every parameter's name unchanged. Such a
container holds its layers in insertion order, which is the order its forward loops over them
(``for layer in self.layers.values()``) and the order swapkit numbers them in; binding works on
a plain ``nn.ModuleList`` of its values (a view: it registers nothing on the model, so names
and ``state_dict`` keys stay as they are). Iterating a ``ModuleDict`` itself yields its keys.

Note [Hybrid models]
Auto-detection takes the one outermost list of identical blocks. A hybrid model's layers are not
identical (Jamba and Zamba interleave attention and state-space blocks of two classes in one
``nn.ModuleList``), so its layer list is no candidate, and a small list that is (two prediction
heads, a pair of projections) would be bound in its place without a word: every swap and
recompute then lands on the wrong modules. So a guess is refused when some ``nn.ModuleList`` or
``nn.ModuleDict`` of mixed blocks outside it holds more parameters than it: the error names both
and what to write. A model whose identical blocks hold most of it, beside a small mixed list, binds
as before. An explicit path binds any container.

Note [One module at several layer positions]
A model that shares weights between layers (ALBERT-style: ``nn.ModuleList([block] * 4)``) puts one
module object at several positions. swapkit's scope hooks and recompute wrappers belong to the
module, not to the position: every call of the shared module pushes the frames of all its
positions (the last one is innermost, so its swap applies to every call) and a recompute
configured at any of its positions recomputes every call. Gradients stay exact, but per-layer
settings that differ between the positions cannot hold, so binding logs a WARNING naming the
positions and what applies to them. A recompute region is wrapped once per module, under the label
of the first position that configures it: wrapped once per position, the checkpoints nested (three
deep on a block shared by three positions) and each call was counted at every position in
``recomputed_by_scope``. A Megatron ``uniform`` unit cannot hold such a module at all: it replaces
its members' forwards with one checkpoint of the whole unit and pass-throughs, which the module's
calls at its other positions ran too (another loss, silently, on ``[a, b, a]`` in units of two;
nothing recomputed on ``[a, a, a]`` in one unit). ``apply`` raises naming the unit and the positions.
The same holds one level down: a sub-module shared between distinct layers (Zamba's shared attention
block, a projection tied across layers) that the config names as an op scope in one layer carries that
layer's hooks and wrapper, so its calls from the other layers are swapped or recomputed too, and
counted under the configuring layer. Binding warns about each such scope, naming the layers that hold it.
A pipeline stage's chunks are checked the same way, over the stage's layers and their global indices
(``swapkit.runtime.stage_binding.bind_stage``).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from swapkit.config.errors import BindError, show
from swapkit.plan.plan import LayerPlan, Plan
from swapkit.plan.report import LayerScopes, resolve_layer


logger = logging.getLogger(__name__)
CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)

__all__ = ["BindError", "Binding", "BoundLayer", "bind", "find_layers", "module_tree"]


def module_tree(module: nn.Module) -> dict:
    """Child-name tree of a module: ``{"attention": {"wq": {...}, ...}, ...}``."""
    return {name: module_tree(child) for name, child in module.named_children()}


@dataclass
class BoundLayer:
    """One layer of the model with its plan and the concrete sub-modules the plan names."""

    index: int
    module: nn.Module
    plan: LayerPlan
    scopes: LayerScopes

    def submodule(self, path: str) -> nn.Module:
        return self.module.get_submodule(path)


@dataclass
class Binding:
    """The bound model: its layer containers (Note [Several layer containers]) and their layers."""

    model: nn.Module
    layers_paths: tuple[str, ...]
    layers: list[BoundLayer]

    @property
    def layers_path(self) -> str:
        """The container path, or the paths joined with ``", "`` when there are several."""
        return ", ".join(self.layers_paths)


def bind(model: nn.Module, plan: Plan, layers_path: str | Sequence[str] | None = None) -> Binding:
    """Attach the plan's per-layer decisions to the model's layers.

    Args:
        model: the model.
        plan: the resolved plan; ``plan.layers_path`` is used when ``layers_path`` is ``None``.
        layers_path: a dotted container path, a list of them (Note [Several layer containers]),
            or ``None`` to auto-detect the one container of repeated layers.

    Raises:
        BindError: a container cannot be found, the layer count differs from ``num_layers``, or a
            uniform recompute unit spans two containers or holds a module found at several positions.
    """
    found = find_containers(model, layers_path, plan.layers_path)
    layers = [layer for _, container in found for layer in container]
    paths = tuple(path for path, _ in found)
    if len(layers) != plan.layout.num_layers:
        where = container_label(type(model).__name__, " + ".join(paths))
        raise BindError(f"{where} holds {len(layers)} layers but the config says "
                        f"model.model_config.num_layers: {plan.layout.num_layers}; make them agree, or leave "
                        "num_layers out and swapkit counts the layers (on the command line: --set "
                        "model.model_config.num_layers=null)")
    _check_units(plan, found)
    bound = [BoundLayer(i, layer, lp, resolve_layer(lp, module_tree(layer)))
             for i, (layer, lp) in enumerate(zip(layers, plan.layers))]
    check_shared(type(model).__name__, bound)
    logger.info("Bound layers: %s", describe(found))
    return Binding(model, paths, bound)


def check_shared(owner: str, bound: list[BoundLayer]) -> None:
    """Note [One module at several layer positions]: warn about layers and configured op scopes that are one
    module, and refuse a uniform unit holding such a layer. ``bound``: a model's layers, or a pipeline stage's
    (global indices), ``owner`` names their model or stage.

    Raises:
        BindError: a uniform recompute unit holds a module found at several positions.
    """
    positions: dict[int, list[int]] = {}
    for layer in bound:
        positions.setdefault(id(layer.module), []).append(layer.index)
    _warn_shared(owner, bound, positions)
    _check_shared_units(bound, positions)
    _warn_shared_scopes(bound)


def _warn_shared(owner: str, bound: list[BoundLayer], positions: dict[int, list[int]]) -> None:
    plans = {layer.index: layer for layer in bound}
    for shared in (p for p in positions.values() if len(p) > 1):
        last = plans[shared[-1]]
        none = "" if last.plan.layer_swap is not None else _idle_swaps([plans[i] for i in shared[:-1]])
        logger.warning("swapkit: layers %s of %s are one %s object (a module at several positions): swapkit's "
                       "hooks and wrappers belong to the module, so every call of it gets the layer swap configured "
                       "for layer %d%s, and the op swaps and the recompute configured for any of these layers; give "
                       "these layers the same settings "
                       "(Note [One module at several layer positions])", ", ".join(map(str, shared)), owner,
                       type(last.module).__name__, last.index, none)


def _idle_swaps(earlier: list[BoundLayer]) -> str:
    """``" (none: the layer swaps configured for layers 0, 1 have no effect)"`` where the last position configures
    no layer swap, or nothing if these earlier positions configure none either. Only a layer swap is shadowed by
    the last position's layer frame; an earlier position's op swap pushes its own frame inside every call and
    swaps there, unless a later position configures the same op (``swapkit.runtime.scope`` Note [A shared
    module's swap scope])."""
    idle = [layer.index for layer in earlier if layer.plan.layer_swap is not None]
    if not idle:
        return ""
    many = len(idle) > 1
    return (f" (none: the layer swap{'s' if many else ''} configured for layer{'s' if many else ''} "
            f"{', '.join(map(str, idle))} {'have' if many else 'has'} no effect)")


def _warn_shared_scopes(bound: list[BoundLayer]) -> None:
    """Note [One module at several layer positions]: a configured op scope that distinct layers share."""
    modules = {layer.index: layer.module for layer in bound}
    holders: dict[int, list[int]] = {}
    for layer in bound:
        for module in layer.module.modules():
            holders.setdefault(id(module), []).append(layer.index)
    warned: set[int] = set()
    for layer in bound:
        for path in dict.fromkeys([*layer.scopes.select, *layer.scopes.comm, *(p for _, p, _ in layer.scopes.op_swap)]):
            module = layer.submodule(path)
            held = holders[id(module)]
            if id(module) in warned or all(modules[i] is layer.module for i in held):
                continue
            warned.add(id(module))
            logger.warning("swapkit: op scope %s of layer %d is one %s object with layers %s's (a sub-module shared "
                           "between layers): swapkit's hooks and wrappers belong to the module, so its calls from all "
                           "these layers get the swap and recompute configured for it here (counted under layer %d); "
                           "give it the same settings in these layers, or configure its layers instead "
                           "(Note [One module at several layer positions])", path, layer.index,
                           type(module).__name__, ", ".join(map(str, held)), layer.index)


def container_label(owner: str, path: str) -> str:
    """``LlamaModel.layers``, or ``Sequential`` when the module itself is the layer container (path ``''``)."""
    return f"{owner}.{path}" if path else owner


def describe(found: list[tuple[str, nn.Module]]) -> str:
    """``model.layers (layers 0-3: 4 x LlamaDecoderLayer)``, one entry per container."""
    parts, start = [], 0
    for path, container in found:
        kinds = " / ".join(sorted({type(m).__name__ for m in container})) or "empty"
        name = path or "the model itself"
        parts.append(f"{name} (layers {start}-{start + len(container) - 1}: {len(container)} x {kinds})")
        start += len(container)
    return ", ".join(parts)


def find_containers(model: nn.Module, paths: str | Sequence[str] | None,
                    configured: str | Sequence[str] | None = None) -> list[tuple[str, nn.Module]]:
    """The named containers in order, or the one auto-detected container.

    Args:
        model: the model.
        paths: the ``layers`` argument: a dotted path, a list of them, or ``None``.
        configured: ``model.model_config.layers_path``, used when ``paths`` is ``None``; an error about
            it names that key.

    Raises:
        BindError: ``paths`` is not a path or list of paths, or a path names no layer container.
    """
    if paths is None and configured is not None:
        try:
            return find_containers(model, configured)
        except BindError as err:
            raise BindError(f"model.model_config.layers_path: {err}") from None
    if not (paths is None or isinstance(paths, str) or
            (isinstance(paths, Sequence) and all(isinstance(p, str) for p in paths))):
        raise BindError(f"layers={_shown(paths)}: expected the dotted path of the layer container ('model.layers'), a "
                        "list of them (['encoder.block', 'decoder.block']), or None to auto-detect it")
    if paths is None or isinstance(paths, str):
        return [find_layers(model, paths)]
    if not paths or len(set(paths)) != len(paths):
        raise BindError(f"layers={list(paths)!r}: expected distinct container paths, e.g. "
                        "['encoder.block', 'decoder.block']")
    return [(path, _walk(model, path)) for path in paths]


def _shown(value: object) -> str:
    """A ``layers`` argument in an error: plain values as written, a module (or other object) by its type."""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_shown(item) for item in value[:4]) + (", ..." if len(value) > 4 else "") + "]"
    return show(value) if isinstance(value, (str, int, float, bool, type(None))) else f"<{type(value).__name__}>"


def find_layers(model: nn.Module, path: str | None) -> tuple[str, nn.Module]:
    """The container at ``path``, or the only outermost list of repeated blocks.

    A list inside a layer of another candidate (a layer's experts) is not a candidate: it cannot
    hold the model's layers. Several remaining candidates are an error listing them.
    """
    if path is not None:  # "" names the model itself (an nn.Sequential of blocks, as pipelining splits)
        return path, _walk(model, path)
    candidates = _outermost([(name, module) for name, module in model.named_modules() if _is_block_list(module)])
    if len(candidates) == 1:
        _check_not_hybrid(model, *candidates[0])
        return candidates[0][0], as_list(candidates[0][1])
    if not candidates:
        raise BindError(f"found no nn.ModuleList, nn.Sequential or nn.ModuleDict of repeated layers in "
                        f"{type(model).__name__}{_empty_containers(model)}; pass "
                        "layers='path.to.layers' (or set model.model_config.layers_path)")
    raise BindError(_several_containers(type(model).__name__, candidates))


def _empty_containers(model: nn.Module) -> str:
    """``' (model.layers is empty: ...)'`` when the model has empty containers: why none was found
    (a transformers config with num_hidden_layers: 0), runtime.resolve Note [An empty layer container]."""
    empty = [name for name, module in model.named_modules() if name and isinstance(module, CONTAINERS) and not module]
    if not empty:
        return ""
    return (f" ({', '.join(empty[:4])} {'is' if len(empty) == 1 else 'are'} empty: a model built with no layers "
            "has nothing to swap or recompute)")


def _check_not_hybrid(model: nn.Module, name: str, found: nn.Module) -> None:
    """Refuse a guess that a list of mixed blocks holding more of the model contradicts (Note [Hybrid models])."""
    mixed = [(other, module) for other, module in _outermost(
        [(n, m) for n, m in model.named_modules() if _is_mixed_list(m)]) if not other.startswith(name + ".")]
    size = _parameters(found)
    larger = [(other, module) for other, module in mixed if _parameters(module) > size]
    if larger:
        other, module = max(larger, key=lambda item: _parameters(item[1]))
        kinds = ", ".join(sorted({type(child).__name__ for child in module.children()}))
        raise BindError(
            f"auto-detected layers: {name} ({len(found)} x {type(next(found.children())).__name__}, "
            f"{size:,} parameters) is the only list of identical blocks in {type(model).__name__}, but {other} "
            f"({len(module)} blocks of mixed types: {kinds}; {_parameters(module):,} parameters) holds more of the "
            f"model and looks like its layers; say which container holds the layers: layers={other!r} (or "
            f"layers={name!r} to keep the guess) to swapkit.apply, or model.model_config.layers_path in a YAML "
            "config (Note [Hybrid models])")


def _parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _several_containers(model_name: str, candidates: list[tuple[str, nn.Module]]) -> str:
    """What to write to choose among several containers, in the API and in a YAML config."""
    found = ", ".join(f"{n} ({len(m)} x {type(next(m.children())).__name__})" for n, m in candidates)
    names = [n for n, _ in candidates]
    return (f"several layer containers in {model_name}: {found}; say which hold the layers, in order. In Python: "
            f"pass layers={names!r} (or layers={names[0]!r} for one) to swapkit.apply. In a YAML config: set "
            f"model.model_config.layers_path: [{', '.join(names)}] (swapkit plan also takes --layers {names[0]} "
            "for one container)")


def _outermost(candidates: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    names = [name for name, _ in candidates]
    return [(name, module) for name, module in candidates
            if not any(name.startswith(other + ".") for other in names if other and other != name)]


def _check_units(plan: Plan, found: list[tuple[str, nn.Module]]) -> None:
    """A uniform unit runs back to back inside one checkpoint: it cannot span two containers."""
    start = 0
    for path, container in found:
        end = start + len(container) - 1
        for layer in plan.layers[start:end + 1]:
            if layer.unit and (layer.unit[0] < start or layer.unit[1] > end):
                raise BindError(f"recompute_method: uniform unit of layers {layer.unit[0]}-{layer.unit[1]} spans "
                                f"two layer containers ({path} holds layers {start}-{end}); choose "
                                "recompute_num_layers so units stay inside one container, or use "
                                "recompute_method: block")
        start = end + 1


def _check_shared_units(bound: list[BoundLayer], positions: dict[int, list[int]]) -> None:
    """Note [One module at several layer positions]: a uniform unit's members run nowhere else."""
    for layer in bound:
        unit, shared = layer.plan.unit, positions[id(layer.module)]
        if layer.plan.full and unit is not None and unit[0] != unit[1] and len(shared) > 1:
            raise BindError(
                f"recompute_method: uniform unit of layers {unit[0]}-{unit[1]}: layer {layer.index} is the "
                f"{type(layer.module).__name__} object of layers {', '.join(map(str, shared))} (a module at several "
                "positions, as in weight-shared ALBERT-style models); a unit replaces the forwards of its layers "
                "with one checkpoint running them all, which the module's calls at its other positions would run "
                "too. Use recompute_method: block, or give each position a module of its own "
                "(Note [One module at several layer positions])")


def _walk(model: nn.Module, path: str) -> nn.Module:
    node: nn.Module = model
    for depth, part in enumerate(path.split(".") if path else ()):
        children = dict(node.named_children())
        if part not in children:
            prefix = ".".join(path.split(".")[:depth])
            shown = [f"{prefix}.{name}" if prefix else name for name in children]
            raise BindError(f"layers path {path!r}: {prefix or type(model).__name__} has no child {part!r}; "
                            f"children: {', '.join(children) or 'none'}{_containers_hint(model, shown)}")
        node = children[part]
    if not isinstance(node, CONTAINERS):
        raise _not_a_container(model, path, node)
    return as_list(node)


def _not_a_container(model: nn.Module, path: str, node: nn.Module) -> BindError:
    what = f"layers path {path!r}" if path else "layers path '' (the model itself)"
    kind = type(node).__name__
    return BindError(f"{what} is {'an' if kind[0] in 'AEIOU' else 'a'} {kind}; expected an nn.ModuleList, "
                     "nn.Sequential or nn.ModuleDict of layers; pass the dotted path of the layer container, or None "
                     f"to auto-detect{_containers_hint(model, [])}")


def _containers_hint(model: nn.Module, shown: list[str]) -> str:
    """The model's lists of repeated blocks, the paths a wrong ``layers`` most likely meant (a Hugging Face
    causal LM's are ``model.layers``, not ``layers``); empty when there is none or the error lists them."""
    found = [name for name, _ in _outermost([(n, m) for n, m in model.named_modules() if _is_block_list(m)])]
    if not found or set(found) <= set(shown):
        return ""
    names = " or ".join(repr(name) if name else "'' (the model itself)" for name in found[:4])
    kind = "list" if len(found) == 1 else "lists"
    return f"; did you mean {names} (the model's {kind} of repeated blocks)?"


def as_list(container: nn.Module) -> nn.Module:
    """The container's layers as a sequence in order (Note [Layers in a ModuleDict])."""
    return nn.ModuleList(container.values()) if isinstance(container, nn.ModuleDict) else container


def _is_mixed_list(module: nn.Module) -> bool:
    """A ``ModuleList`` / ``ModuleDict`` of blocks of several types (a hybrid model's layers; Note [Hybrid
    models]); an ``nn.Sequential`` of mixed modules is a sub-network, not a layer list."""
    if not isinstance(module, (nn.ModuleList, nn.ModuleDict)) or len(module) < 2:
        return False
    return len({type(child) for child in module.children()}) > 1


def _is_block_list(module: nn.Module) -> bool:
    if not isinstance(module, CONTAINERS) or len(module) < 2:
        return False
    kinds = {type(child) for child in module.children()}
    return len(kinds) == 1
