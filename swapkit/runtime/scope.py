"""Which layer / op scope is executing, so every saved tensor knows its swap distance.

Forward pre-hooks push a :class:`Frame`, forward hooks (``always_call=True``, so they also run
when the forward raises) pop it. The innermost scope that configures a swap decides the distance
``k``; an op without its own swap inherits the enclosing layer swap.

Note [Recompute does not move the clock]
While a checkpointed region recomputes in backward, its modules' hooks fire again and push and
pop frames. That is harmless: the forward clock only advances when the session's pack hook runs
in forward, and the session ignores packs made during backward (see
``swapkit.runtime.session.Note [Packs during backward]``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from swapkit.runtime.binding import Binding


@dataclass(frozen=True)
class Frame:
    """One active scope: layer index, op path inside the layer (``""`` = the layer itself),
    and the swap distance in force (``None`` = tensors saved here are kept)."""

    layer: int
    path: str
    prefetch: int | None

    @property
    def label(self) -> str:
        return f"layer {self.layer}: {self.path}" if self.path else f"layer {self.layer}"


class ScopeTracker:
    """A stack of frames maintained by module hooks on the bound layers and swapped ops."""

    def __init__(self) -> None:
        self.stack: list[Frame] = []
        self._handles: list[tuple[nn.Module, RemovableHandle]] = []

    @property
    def top(self) -> Frame | None:
        return self.stack[-1] if self.stack else None

    def install(self, binding: Binding) -> None:
        for layer in binding.layers:
            overridden = {what for what, _ in layer.scopes.overridden}
            layer_k = None if "layer swap" in overridden else layer.plan.layer_swap
            self._hook(layer.module, layer.index, "", layer_k)
            for _, path, prefetch in layer.scopes.op_swap:
                if f"op swap {path}" not in overridden:  # tensors of a recomputed op never reach us
                    self._hook(layer.submodule(path), layer.index, path, prefetch)

    def remove(self) -> None:
        for _, handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.stack.clear()

    def detach_copies(self, memo: dict) -> None:
        """Remove the hooks from deep copies of the hooked modules (``memo`` maps ids to copies)."""
        for module, handle in self._handles:
            copy = memo.get(id(module))
            if copy is not None:
                for hooks in (copy._forward_pre_hooks, copy._forward_hooks, copy._forward_hooks_always_called):
                    hooks.pop(handle.id, None)

    def reset(self) -> None:
        """Forget frames left behind by an interrupted forward."""
        self.stack.clear()

    def _hook(self, module: nn.Module, layer: int, path: str, prefetch: int | None) -> None:
        frames: dict[int | None, Frame] = {}  # by the prefetch in force; built once, not per call

        def enter(called: nn.Module, _args: Any) -> None:
            if called is not module:
                raise _copy_error(called, layer, path)
            parent = self.top
            inherited = parent.prefetch if parent is not None and parent.layer == layer else None
            k = prefetch if prefetch is not None else inherited
            frame = frames.get(k)
            if frame is None:
                frame = frames[k] = Frame(layer, path, k)
            self.stack.append(frame)

        def leave(_module: nn.Module, _args: Any, _output: Any) -> None:
            for depth in range(len(self.stack) - 1, -1, -1):  # pop through frames an exception skipped
                frame = self.stack[depth]
                if frame.layer == layer and frame.path == path:
                    del self.stack[depth:]
                    return

        self._handles.append((module, module.register_forward_pre_hook(enter)))
        self._handles.append((module, module.register_forward_hook(leave, always_call=True)))


def _copy_error(module: nn.Module, layer: int, path: str) -> RuntimeError:
    """swapkit.runtime.session Note [Deep copies of a model swapkit was applied to]"""
    where = f"layer {layer}" + (f" op {path}" if path else "")
    return RuntimeError(f"swapkit: this {type(module).__name__} is a copy of {where} of a model swapkit was applied to, "
                        "and it still carries that model's swapkit hooks and wrappers; deep-copy the whole model "
                        "(swapkit removes itself from the copy) or call session.remove() before copying it")
