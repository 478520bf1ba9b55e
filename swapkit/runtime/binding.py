"""Binding a plan to a model: find the layer container, resolve op patterns to sub-modules.

The layer container is named by a dotted attribute path relative to the model (``"layers"``,
``"model.layers"``, ``"transformer.h"``). Without one, the single ``nn.ModuleList`` /
``nn.Sequential`` of repeated blocks is taken; when there are several, the error lists them.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from swapkit.config.errors import BindError
from swapkit.plan.plan import LayerPlan, Plan
from swapkit.plan.report import LayerScopes, resolve_layer

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
    model: nn.Module
    layers_path: str
    layers: list[BoundLayer]


def bind(model: nn.Module, plan: Plan, layers_path: str | None = None) -> Binding:
    """Attach the plan's per-layer decisions to the model's layers.

    Raises:
        BindError: if the container cannot be found or its length differs from ``num_layers``.
    """
    path = layers_path or plan.layers_path
    path, container = find_layers(model, path, plan.layout.num_layers)
    layers = list(container)
    if len(layers) != plan.layout.num_layers:
        raise BindError(f"{type(model).__name__}.{path} holds {len(layers)} layers but the config says "
                        f"model.model_config.num_layers: {plan.layout.num_layers}; make them agree")
    bound = [BoundLayer(i, layer, lp, resolve_layer(lp, module_tree(layer)))
             for i, (layer, lp) in enumerate(zip(layers, plan.layers))]
    return Binding(model, path, bound)


def find_layers(model: nn.Module, path: str | None, expected: int | None) -> tuple[str, nn.Module]:
    if path:
        return path, _walk(model, path)
    candidates = [(name, module) for name, module in model.named_modules() if _is_block_list(module)]
    if len(candidates) > 1:
        sized = [(n, m) for n, m in candidates if len(m) == expected]
        candidates = sized if len(sized) == 1 else candidates
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        raise BindError(f"found no nn.ModuleList of repeated layers in {type(model).__name__}; pass "
                        "layers='path.to.layers' (or set model.model_config.layers_path)")
    found = ", ".join(f"{n} ({len(m)} x {type(m[0]).__name__})" for n, m in candidates)
    raise BindError(f"several layer containers in {type(model).__name__}: {found}; pass layers='<one of them>' "
                    "(or set model.model_config.layers_path)")


def _walk(model: nn.Module, path: str) -> nn.Module:
    node: nn.Module = model
    for depth, part in enumerate(path.split(".")):
        children = dict(node.named_children())
        if part not in children:
            where = ".".join(path.split(".")[:depth]) or type(model).__name__
            raise BindError(f"layers path {path!r}: {where} has no child {part!r}; children: "
                            f"{', '.join(children) or 'none'}")
        node = children[part]
    if not isinstance(node, (nn.ModuleList, nn.Sequential)):
        raise BindError(f"layers path {path!r} is a {type(node).__name__}; expected an nn.ModuleList or "
                        "nn.Sequential of layers")
    return node


def _is_block_list(module: nn.Module) -> bool:
    if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
        return False
    kinds = {type(child) for child in module}
    return len(kinds) == 1
