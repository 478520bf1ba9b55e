"""What a copy or a pickle of a model swapkit was applied to keeps of swapkit: nothing.

Note [Copies and pickles of a model swapkit was applied to]
swapkit changes a model in place: recompute wrappers are instance ``forward`` attributes that close
over the original modules, and module hooks (scope frames, the cache watch, a pipeline chunk's
micro-step marks) act on the original's session. ``copy.deepcopy`` copies functions by reference,
so a copy would run the original's modules, and ``pickle`` (``torch.save(model)``, a spawned
process) cannot store a closure at all. Both go through one mechanism:

- every hook swapkit registers is an :class:`AttachedHook` and every wrapped forward an
  :class:`AttachedForward`; a copy or a pickle of one is a stand-in, not the closure: a hook becomes
  :data:`DETACHED`, a no-op hook, and a forward becomes what ``forward`` was before swapkit wrapped
  it (the class's forward, bound to the copied module, or the module's own earlier ``forward``,
  copied as it would have been without swapkit);
- the model's ``_swapkit_applied`` attribute, an :class:`AppliedMarker`, is set after every module
  existed. ``nn.Module`` deep-copies and pickles its ``__dict__`` (``__getstate__``: a shallow copy,
  the same hook dict objects) in insertion order, so both reach the marker after the model's hook
  dicts and every sub-module were copied or stored. The marker then strips the stand-ins from the
  copies (:func:`strip`): hook entries whose hook is :data:`DETACHED` leave the hook dicts with
  their flags, and a ``forward`` that is the class's own forward leaves the instance ``__dict__``.
  A deep copy calls :func:`strip` at once on the copies in deepcopy's memo; a pickle stores a call
  of it (:func:`strip_loaded`) on the hook dicts and modules already stored, which unpickling runs
  after it rebuilt them (only the marker's owner is not rebuilt yet, and swapkit wraps no owner's
  forward). The marker itself copies and pickles as ``None``.
- the marker goes where a copy or a pickle stores it (:func:`mark`): on the model itself, or, for a
  ``torch.compile`` wrapper swapkit was applied to (``OptimizedModule``, which copies and pickles as a
  call that wraps the copy of its ``_orig_mod`` again, never storing its own ``__dict__``), on the
  module it wraps (on the wrapper it would never be stored, and the copy would keep the stand-ins).

The copy is an independent plain model: no swapkit hook or wrapper, the same forward, parameters,
buffers and ``state_dict``; swapkit can be applied to it again. The original is not touched: it
keeps swapping, a pending graph's backward included (nothing of a step lives in the model). Only
what the marker's owner holds is stripped (a pipeline stage's marker names its own chunk's
modules). A pickle names the functions that rebuild it, so loading one imports swapkit; a pickle
of ``copy.deepcopy(model)`` names nothing of swapkit. A layer copied or pickled on its own carries
no marker: its stand-ins stay in its hook dicts as no-op hooks (and a class-forward stand-in in its
``__dict__``), and it computes as the plain layer does, without swapkit. A shallow ``copy.copy``
shares the original's hook dicts (and parameters): a layer's scope hook raises when such a copy is
called (``swapkit.runtime.scope``). A shallow copy of the model shares its sub-modules and holds the
same marker object: while the session lives, applying swapkit to the copy is refused (it would hook
the original's layers a second time; :func:`shallow_copy_message`); ``session.remove()`` clears the
marker's session (:func:`unmark`), so the copy's marker is stale, :func:`applied` ignores it, and
swapkit can be applied to the copy as to the original.
"""
from __future__ import annotations

import sys
from types import MethodType
from typing import Any, Callable, Iterable

from torch import nn

#: the model's (a pipeline chunk's) attribute holding its :class:`AppliedMarker`
APPLIED = "_swapkit_applied"
# the dicts a module hook's id is a key of: pre-hooks and their flags, forward hooks and their flags
HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
              "_forward_hooks_always_called")


class _Detached:
    """A no-op module hook: what a copied or pickled :class:`AttachedHook` is."""

    __slots__ = ()

    def __call__(self, *_: Any) -> None:
        return None

    def __reduce__(self) -> str:
        return "DETACHED"  # stored by name: the one instance, also after unpickling

    def __repr__(self) -> str:
        return "swapkit.runtime.detach.DETACHED"


DETACHED = _Detached()


class AttachedHook:
    """A module hook of swapkit's, which copies and pickles as :data:`DETACHED`.

    Args:
        function: the hook (usually a closure over swapkit's session).
    """

    __slots__ = ("function",)

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function

    def __call__(self, *args: Any) -> Any:
        return self.function(*args)

    def __reduce__(self) -> tuple:
        return detached_hook, ()


class AttachedForward:
    """A wrapped ``forward`` of swapkit's, which copies and pickles as the forward it replaced.

    Args:
        function: the wrapper (a closure over the original module).
        module: the module whose ``forward`` it replaces.
        previous: the module's own ``forward`` attribute before, or ``None`` for its class's.
    """

    __slots__ = ("function", "module", "previous")

    def __init__(self, function: Callable[..., Any], module: nn.Module, previous: Any) -> None:
        self.function, self.module, self.previous = function, module, previous

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(*args, **kwargs)

    def __reduce__(self) -> tuple:
        if self.previous is not None:
            return unchanged, (self.previous,)
        return class_forward, (self.module,)


# What a pickle stores of swapkit: the names detached_hook, unchanged, class_forward and strip_loaded, called
# when it is loaded (so loading imports swapkit; renaming one breaks files saved before).

def detached_hook() -> _Detached:
    """A pickled :class:`AttachedHook`: :data:`DETACHED`."""
    return DETACHED


def unchanged(value: Any) -> Any:
    """A pickled :class:`AttachedForward` that replaced the module's own ``forward``: that forward."""
    return value


def class_forward(module: nn.Module) -> MethodType:
    """``module``'s class's ``forward`` bound to it: a copied wrapper's stand-in until :func:`strip`."""
    return MethodType(type(module).forward, module)


def strip(hooked: Iterable[tuple[dict, ...]], modules: Iterable[nn.Module]) -> None:
    """Remove swapkit's stand-ins from copies (Note [Copies and pickles of a model swapkit was applied to]).

    Args:
        hooked: the hook dicts of each copied module that swapkit hooked, in :data:`HOOK_DICTS` order.
        modules: copied modules whose ``forward`` swapkit wrapped.
    """
    for pre_hooks, pre_flags, hooks, *flags in hooked:
        _strip_hooks(pre_hooks, (pre_flags,))
        _strip_hooks(hooks, flags)
    for module in modules:
        forward = module.__dict__.get("forward")
        if isinstance(forward, MethodType) and forward.__self__ is module and forward.__func__ is type(module).forward:
            del module.__dict__["forward"]


def _strip_hooks(hooks: dict, flags: Iterable[dict]) -> None:
    for key in [key for key, hook in hooks.items() if hook is DETACHED]:
        del hooks[key]
        for flag in flags:
            flag.pop(key, None)


def hook_dicts(module: nn.Module) -> tuple[dict, ...]:
    """``module``'s hook dicts in the order :func:`strip` takes them."""
    return tuple(getattr(module, name) for name in HOOK_DICTS)


class AppliedMarker:
    """A model's (or a pipeline chunk's) ``_swapkit_applied`` attribute.

    Note [Copies and pickles of a model swapkit was applied to]

    Args:
        session: the :class:`~swapkit.runtime.session.SwapSession` applied to ``owner``.
        owner: the model or chunk the attribute is set on.
    """

    __slots__ = ("session", "owner")

    def __init__(self, session: Any, owner: nn.Module) -> None:
        self.session, self.owner = session, owner

    def _touched(self) -> tuple[list[tuple[dict, ...]], list[nn.Module]]:
        """The hook dicts of the owner's hooked modules, and its wrapped modules (none once removed)."""
        if self.session is None:
            return [], []
        own = {id(m) for m in self.owner.modules()}
        hooked, wrapped = self.session.attached_modules()
        return ([hook_dicts(m) for m in _unique(hooked) if id(m) in own],
                [m for m in _unique(wrapped) if id(m) in own])

    def __deepcopy__(self, memo: dict) -> None:
        hooked, wrapped = self._touched()
        copies = [tuple(memo[id(d)] for d in dicts) for dicts in hooked if all(id(d) in memo for d in dicts)]
        strip(copies, [memo[id(m)] for m in wrapped if id(m) in memo])
        return None

    def __reduce__(self) -> tuple:
        return strip_loaded, self._touched()  # the session (threads, hooks) never travels


def strip_loaded(hooked: list[tuple[dict, ...]], modules: list[nn.Module]) -> None:
    """Unpickling a marker: strip what the model's rebuilt modules carry of swapkit; the attribute is ``None``."""
    strip(hooked, modules)
    return None


def _unique(modules: Iterable[nn.Module]) -> list[nn.Module]:
    return list({id(m): m for m in modules}.values())


def stored_module(module: nn.Module) -> nn.Module:
    """The module whose ``__dict__`` a copy or a pickle of ``module`` stores: ``module``, or the module a
    ``torch.compile`` wrapper wraps (Note [Copies and pickles of a model swapkit was applied to])."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: no torch.compile wrapper exists
    while eval_frame is not None and isinstance(module, eval_frame.OptimizedModule):
        module = module._orig_mod
    return module


def applied(module: nn.Module) -> AppliedMarker | None:
    """The marker of the live session applied to ``module``, or ``None`` (also for the stale marker a
    shallow copy kept of a session since removed)."""
    marker = stored_module(module).__dict__.get(APPLIED)
    return marker if marker is not None and marker.session is not None else None


def carries_swapkit(module: nn.Module) -> bool:
    """Whether ``module`` or a sub-module holds a live hook or forward wrapper of a swapkit session: a layer
    another model shares (a shallow ``copy.copy`` swapkit was applied to, or a module containing this layer
    or contained in it), which ``apply`` refuses to hook a second time."""
    for sub in module.modules():
        if isinstance(sub.__dict__.get("forward"), AttachedForward):
            return True
        for hooks in (sub._forward_pre_hooks, sub._forward_hooks):
            if any(isinstance(hook, AttachedHook) for hook in hooks.values()):
                return True
    return False


def shallow_copy_message(module: nn.Module, marker: AppliedMarker) -> str | None:
    """Why swapkit cannot be applied to ``module`` when it is a shallow copy of the model ``marker`` is
    on (Note [Copies and pickles of a model swapkit was applied to]), or ``None`` when it is not one."""
    if marker.owner is stored_module(module):
        return None
    return (f"this {type(module).__name__} is a shallow copy (copy.copy) of a model swapkit is applied to: it shares "
            "that model's layers and their hooks; call remove() on that model's SwapSession first, or apply "
            "swapkit to a copy.deepcopy of the model")


def mark(module: nn.Module, session: Any) -> None:
    """Set ``module``'s marker, last (a plain attribute: no module, parameter or buffer)."""
    home = stored_module(module)
    object.__setattr__(home, APPLIED, AppliedMarker(session, home))


def unmark(module: nn.Module) -> None:
    """Remove ``module``'s marker and clear its session (``session.remove()``): a shallow copy of
    ``module`` holds the same marker, now stale."""
    marker = stored_module(module).__dict__.pop(APPLIED, None)
    if marker is not None:
        marker.session = None
