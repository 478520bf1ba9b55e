"""Which layer / op scope is executing, so every saved tensor knows its swap distance.

Forward pre-hooks push a :class:`Frame`, forward hooks (``always_call=True``, so they also run
when the forward raises) pop it. The innermost scope that configures a swap decides the distance
``k``; an op without its own swap inherits the enclosing layer swap. Every hook is an
``AttachedHook``, which a copy or a pickle of the model leaves behind (``swapkit.runtime.detach``
Note [Copies and pickles of a model swapkit was applied to]).

Note [Recompute does not move the clock]
While a checkpointed region recomputes in backward, its modules' hooks fire again and push and
pop frames. That is harmless: the forward clock only advances when the session's pack hook runs
in forward, and the session ignores packs made during backward (see
``swapkit.runtime.session.Note [Packs during backward]``).

Note [A shared module's swap scope]
A module at several layer positions (``swapkit.runtime.binding`` Note [One module at several layer
positions]) gets one pair of hooks per position, all firing on every call: the last position's frame
is pushed last, so every save of every call lands in it. ``swap_scopes``, the scopes watched for
saves (``swapkit.runtime.overrides`` Note [Swaps nobody reports]), therefore lists a swapped module
once, at its last swapped position: an earlier position's swap is carried out under the later
one's frame, and listing it made every step report it as having moved nothing. An earlier swap whose
module's later position configures none stays listed: its swap really has no effect.

Note [Bookkeeping stays out of compiled graphs]
``torch.compile`` inlines module hooks into the graph it traces: the pushes and pops of the frame
stack would be replayed as side effects after the graph ran, so every tensor a compiled scope
saves would land in the wrong frame (an op swap under compile offloaded 0 bytes), and recipe
bookkeeping traced into a graph breaks it (``set_()`` on a fake tensor). Every piece of swapkit
that runs *inside* a module call - the scope hooks here, the recompute wrappers' recipe capture
and recording (``swapkit.runtime.recompute``) - is therefore wrapped in
``torch.compiler.disable``: Dynamo breaks the graph there and runs it eagerly, so a swapped scope
becomes its own graph whose saves happen while its frame is on the stack. The saved-tensor hooks
themselves are never traced: AOTAutograd's compiled function saves real tensors through them at
run time. The cost is a graph break at each hooked scope boundary (layers and swapped or
recomputed ops), which limits what a compiler can fuse across them. Wrapping happens in
``install`` (at ``swapkit.apply``), which imports ``torch._dynamo`` once per process. Under
``fullgraph=True`` a graph break is an error; :func:`eager` gives Dynamo the reason to print, so
that error names swapkit and the fix instead of "reason: None. Hint: Remove the
torch.compiler.disable call".
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from swapkit.runtime.binding import Binding
from swapkit.runtime.detach import AttachedHook
from swapkit.runtime.kv_cache import CacheArguments

FULLGRAPH = ("swapkit's hooks run eagerly by design (swapkit.runtime.scope Note [Bookkeeping stays out of compiled "
             "graphs]): torch.compile(fullgraph=True) cannot compile a model swapkit is applied to; compile without "
             "fullgraph=True (each bound layer and each swapped or recomputed op scope is then a graph break)")


def eager(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` wrapped in ``torch.compiler.disable``, with the reason Dynamo shows under ``fullgraph=True``
    (Note [Bookkeeping stays out of compiled graphs])."""
    try:
        return torch.compiler.disable(function, reason=FULLGRAPH)
    except TypeError:  # a torch before disable(reason=...)
        return torch.compiler.disable(function)


@dataclass(frozen=True)
class Frame:
    """One active scope: layer index, op path inside the layer (``""`` = the layer itself),
    and the swap distance in force (``None`` = tensors saved here are kept)."""

    layer: int
    path: str
    prefetch: int | None

    @functools.cached_property
    def label(self) -> str:  # read once per swapped storage: built once per frame
        return f"layer {self.layer}: {self.path}" if self.path else f"layer {self.layer}"


class ScopeTracker:
    """A stack of frames maintained by module hooks on the bound layers and swapped ops."""

    def __init__(self) -> None:
        self.stack: list[Frame] = []
        self.current: Frame | None = None  # the top of the stack, read once per saved tensor
        self._handles: list[tuple[nn.Module, RemovableHandle]] = []
        # called with the frame of every scope that configures its own swap, when it is entered
        self.on_swap_enter: Callable[[Frame], None] | None = None
        self.swap_scopes: list[tuple[int, str]] = []  # (layer, op path) of every hooked swap, "" = layer
        self._swap_modules: dict[tuple[int, str], nn.Module] = {}  # each swap scope's module
        # called with a swapping layer's index and the cache arguments it got, when it is given a cache
        self.on_cache: Callable[[int, list[str]], None] | None = None

    @property
    def top(self) -> Frame | None:
        return self.current

    def _moved(self) -> None:
        self.current = self.stack[-1] if self.stack else None

    def install(self, binding: Binding) -> None:
        for layer in binding.layers:
            overridden = {what for what, _ in layer.scopes.overridden}
            layer_k = None if "layer swap" in overridden else layer.plan.layer_swap
            self._hook(layer.module, layer.index, "", layer_k)
            op_swaps = [(path, k) for _, path, k in layer.scopes.op_swap if f"op swap {path}" not in overridden]
            for path, prefetch in op_swaps:  # tensors of a recomputed op never reach us
                self._hook(layer.submodule(path), layer.index, path, prefetch)
            if layer_k is not None or op_swaps:
                self._watch_cache(layer.module, layer.index)

    def remove(self) -> None:
        for _, handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.stack.clear()
        self.current = None
        self.swap_scopes.clear()
        self._swap_modules.clear()

    def hooked_modules(self) -> list[nn.Module]:
        """The modules carrying this tracker's hooks (detach Note [Copies and pickles of a model ...])."""
        return [module for module, _ in self._handles]

    def _add_swap_scope(self, module: nn.Module, layer: int, path: str) -> None:
        """Note [A shared module's swap scope]"""
        earlier = [key for key, other in self._swap_modules.items() if other is module]
        self.swap_scopes = [key for key in self.swap_scopes if key not in earlier]
        for key in earlier:
            del self._swap_modules[key]
        self.swap_scopes.append((layer, path))
        self._swap_modules[(layer, path)] = module

    def reset(self) -> None:
        """Forget frames left behind by an interrupted forward."""
        self.stack.clear()
        self.current = None

    def _hook(self, module: nn.Module, layer: int, path: str, prefetch: int | None) -> None:
        if prefetch is not None:
            self._add_swap_scope(module, layer, path)
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
            self.current = frame
            if prefetch is not None and self.on_swap_enter is not None:
                self.on_swap_enter(frame)  # swapkit.runtime.overrides Note [Swaps nobody reports]

        def leave(_module: nn.Module, _args: Any, _output: Any) -> None:
            for depth in range(len(self.stack) - 1, -1, -1):  # pop through frames an exception skipped
                frame = self.stack[depth]
                if frame.layer == layer and frame.path == path:
                    del self.stack[depth:]
                    self._moved()
                    return

        self._handles.append((module, module.register_forward_pre_hook(AttachedHook(eager(enter)))))
        self._handles.append((module, module.register_forward_hook(AttachedHook(eager(leave)), always_call=True)))

    def _watch_cache(self, module: nn.Module, layer: int) -> None:
        """swapkit.runtime.kv_cache Note [Caches hold swapped storages]"""
        arguments = CacheArguments(module.forward)

        def check(_module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            names = arguments.in_use(args, kwargs)
            if names and self.on_cache is not None:
                self.on_cache(layer, names)

        self._handles.append((module, module.register_forward_pre_hook(AttachedHook(eager(check)),
                                                                           with_kwargs=True)))


def _copy_error(module: nn.Module, layer: int, path: str) -> RuntimeError:
    """A shallow copy (``copy.copy``) shares the hooked module's hook dicts and so calls its hooks
    (swapkit.runtime.detach Note [Copies and pickles of a model swapkit was applied to])."""
    where = f"layer {layer}" + (f" op {path}" if path else "")
    return RuntimeError(f"swapkit: this {type(module).__name__} is a copy of {where} of a model swapkit was applied to, "
                        "and it shares that model's swapkit hooks (a shallow copy); use copy.deepcopy or pickle, "
                        "which leave swapkit behind, or call session.remove() before copying it")
