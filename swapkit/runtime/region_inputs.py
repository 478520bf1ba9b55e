"""The inputs of a checkpointed region, each tensor object once.

Note [A tensor passed to a region more than once]
Checkpointing saves a region's tensor inputs for backward and hands the saved ones to the
recomputation. Under a swap session each save goes through the saved-tensor hooks and comes back
as a tensor object of its own, so a tensor given twice (``nn.MultiheadAttention`` called as
``attn(x, x, x)``, as ``nn.TransformerEncoderLayer`` does) reached the re-run as three distinct
objects. Modules that branch on identity (``query is key``: one packed input projection, else
three) then recomputed along another path and ``torch.utils.checkpoint`` failed with "Recomputed
values ... have different metadata". So each distinct tensor object is handed to ``checkpoint``
once, with the positions it fills (and the keywords that name it as well), and the region is
called with one object in each of them, as in forward. Reentrant checkpointing, which detaches each
input on its own even without a session, keeps the identity the same way. A list, tuple or dict
argument (a named tuple, an ``OrderedDict`` and a ``defaultdict`` too) travels by reference
(checkpointing saves only top-level tensors): where one of its elements, at any depth, is a tensor
also passed at the top level (``f(x, [x])``, ``f(x, [(x, 1)])``), the re-run gets a copy of the
container with that element replaced by the top-level re-run object (:func:`substituted`: the
containers on the way to it are copied, of their own types, once each however many paths reach
them, the others shared). The forward call gets the caller's own container: a module may append to
it or fill it in. Other objects (a dataclass, a dict subclass) are not looked into: README
limitations.

Note [Keyword tensors written after the region]
Keyword tensors that are not also positional reach the region by reference (recompute Note [Keyword
arguments of checkpointed modules]): they are not saved, so no saved-tensor hook sees them and no
version keeper guards them. A caller that writes one in place after the region ran
(``y = probe(x, scale=scale); scale.add_(1)``) would have the recomputation use the new values:
wrong gradients, silently, where the plain model's autograd raises. So each such tensor's version is
taken when the region is called, and the re-run checks it before calling the region again: a write
in between raises, naming the region and the keyword. (A write *by* the region itself raises at once,
recompute Note [Regions that write their inputs].)

Note [Regions with nothing to differentiate]
A region whose tensor inputs (nested ones included) and parameters all have ``requires_grad=False``
(the frozen lower layers of a fine-tune) gets no gradient and autograd saves nothing in it: there is
nothing to recompute. Reentrant checkpointing refused such a region (swapkit's error asked for an
input that requires grad "otherwise the region's parameters get no gradient", although the
parameters were frozen), and non-reentrant checkpointing ran it for nothing and counted it in
``SwapStats.recomputed_by_scope`` although backward never re-runs it; a MindFormers op scope also
recorded an output recipe, whose inputs the session then kept (and swapped) for a backward that
never comes. Such a region runs plainly, as without swapkit (a key/value cache left as it is), and
is not counted. A frozen region that reads a trainable tensor through neither its inputs nor
its parameters (a closure) still gets its gradient: a plain run is autograd's own.
"""
from __future__ import annotations

from collections import OrderedDict, defaultdict
from copy import copy
from typing import Any, Callable, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_leaves


#: Containers whose elements may alias a region's top-level tensors (at any depth; these exact types, and named
#: tuples: :func:`walked`)
CONTAINERS = (list, tuple, dict, OrderedDict, defaultdict)

#: Where an element sits in nested containers: the key or index at each level, outermost first
Path = tuple[Any, ...]


class RegionLayout(NamedTuple):
    """How :func:`call_region` puts a region's call back together from its distinct inputs."""

    layout: tuple[int, ...]  # for each position of the call, its index in the inputs
    aliases: dict[str, int]  # keyword tensors that are also positional -> their index
    nested: tuple[tuple[int, dict[Path, int]], ...]  # (position, {element path: index}) of containers
    nested_keywords: dict[str, dict[Path, int]]  # keyword containers -> {element path: index}


def walked(value: Any) -> bool:
    """Whether :func:`nested_elements` looks into ``value``: one of :data:`CONTAINERS` or a named tuple."""
    kind = type(value)
    return kind in CONTAINERS or (issubclass(kind, tuple) and isinstance(getattr(kind, "_fields", None), tuple))


def nested_elements(value: Any, pick: Callable[[Any], Any]) -> dict[Path, Any]:
    """``{path: pick(item)}`` of the items inside the (nested) :func:`walked` containers ``value`` for which
    ``pick`` gives something other than ``None``; a container is walked where ``pick`` gives ``None``."""
    if not walked(value):
        return {}
    found: dict[Path, Any] = {}
    for key, item in (value.items() if isinstance(value, dict) else enumerate(value)):
        if (got := pick(item)) is not None:
            found[(key,)] = got
        elif walked(item):
            found.update({(key, *path): got for path, got in nested_elements(item, pick).items()})
    return found


def aliased_elements(value: Any, index_of: Callable[[Any], int | None]) -> dict[Path, int]:
    """``{path: index}`` of the tensors inside the (nested) containers ``value`` that ``index_of`` knows."""
    return nested_elements(value, lambda item: index_of(item) if isinstance(item, torch.Tensor) else None)


def substituted(value: Any, elements: dict[Path, Any], copies: dict[int, Any] | None = None) -> Any:
    """A copy of the nested containers ``value`` with ``elements`` (path -> new element) put in, copying only
    the containers on those paths; ``value`` itself where they are its elements already (the forward call: a
    module may fill the caller's list or dict). ``copies``: those made so far for one call, by the original's
    id, so that a container reached by two paths (``f(x, states, [states])``) is one copy."""
    copies = {} if copies is None else copies
    if id(value) in copies:
        return copies[id(value)]
    inner: dict[Any, dict[Path, Any]] = {}
    for (key, *rest), element in elements.items():
        inner.setdefault(key, {})[tuple(rest)] = element
    changed = {key: (paths[()] if () in paths else substituted(value[key], paths, copies))
               for key, paths in inner.items()}
    if all(value[key] is item for key, item in changed.items()):
        return value
    copies[id(value)] = _rebuilt(value, changed)
    return copies[id(value)]


def _rebuilt(value: Any, changed: dict[Any, Any]) -> Any:
    """A copy of the container ``value``, of its type, with ``changed`` (key -> new element) put in."""
    if isinstance(value, dict):
        rebuilt = copy(value)  # of its type: an OrderedDict, a defaultdict with its default factory
        rebuilt.update(changed)
        return rebuilt
    items = list(value)
    for key, item in changed.items():
        items[key] = item
    if type(value) is list:
        return items
    return tuple(items) if type(value) is tuple else type(value)._make(items)


def distinct_inputs(args: tuple, kwargs: dict) -> tuple[tuple, RegionLayout]:
    """Each tensor object of ``args`` once (Note [A tensor passed to a region more than once]).

    Args:
        args: the region's positional arguments.
        kwargs: its keyword arguments (they travel by reference; only those that are one of ``args``
            are looked up, also as elements of a keyword container).

    Returns:
        ``inputs`` (the positional arguments, a repeated tensor only at its first position) and the
        :class:`RegionLayout` that rebuilds the call from them.
    """
    inputs: list[Any] = []
    first: dict[int, int] = {}  # id(tensor) -> index in inputs
    layout = []
    for value in args:
        if isinstance(value, torch.Tensor) and id(value) in first:
            layout.append(first[id(value)])
            continue
        if isinstance(value, torch.Tensor):
            first[id(value)] = len(inputs)
        layout.append(len(inputs))
        inputs.append(value)
    aliases = {k: first[id(v)] for k, v in kwargs.items() if isinstance(v, torch.Tensor) and id(v) in first}
    index_of = lambda tensor: first.get(id(tensor))  # noqa: E731
    nested = tuple((position, found) for position, value in enumerate(args)
                   if (found := aliased_elements(value, index_of)))
    nested_keywords = {name: found for name, value in kwargs.items() if (found := aliased_elements(value, index_of))}
    return tuple(inputs), RegionLayout(tuple(layout), aliases, nested, nested_keywords)


def unsaved_keywords(kwargs: dict, aliases: dict[str, int]) -> tuple[tuple[str, torch.Tensor, int], ...]:
    """``(name, tensor, version)`` of each keyword tensor held by reference (Note [Keyword tensors written
    after the region])."""
    return tuple((name, value, value._version) for name, value in kwargs.items()
                 if isinstance(value, torch.Tensor) and name not in aliases)


def call_region(function: Callable[..., Any], kwargs: dict, shape: RegionLayout,
                unsaved: tuple[tuple[str, torch.Tensor, int], ...], label: str, *inputs: Any) -> Any:
    """The region's call as :func:`distinct_inputs` took it apart, each repeated tensor one object again.

    ``kwargs`` travel to the region as one positional dict (recompute Note [Keyword arguments of
    checkpointed modules]); ``unsaved`` (:func:`unsaved_keywords`) must still have their versions
    (Note [Keyword tensors written after the region]).
    """
    for name, tensor, version in unsaved:
        if tensor._version != version:
            raise _keyword_written_error(label, name, version, tensor._version)
    copies: dict[int, Any] = {}  # substituted: one copy of a container the call holds twice
    if shape.aliases or shape.nested_keywords:
        kwargs = {**kwargs, **{name: inputs[index] for name, index in shape.aliases.items()},
                  **{name: substituted(kwargs[name], {key: inputs[i] for key, i in found.items()}, copies)
                     for name, found in shape.nested_keywords.items()}}
    args = [inputs[index] for index in shape.layout]
    for position, found in shape.nested:
        args[position] = substituted(args[position], {key: inputs[i] for key, i in found.items()}, copies)
    return function(*args, **kwargs)


def _keyword_written_error(label: str, name: str, before: int, after: int) -> RuntimeError:
    """Note [Keyword tensors written after the region]"""
    return RuntimeError(
        f"swapkit: the keyword argument {name!r} of the recomputed region {label} was modified by an in-place "
        f"operation after the region ran (version {before} -> {after}); recompute re-runs the region in backward "
        "with it and would get other values (wrong gradients; without recompute autograd would fail here too). "
        "Make that operation out-of-place, or clone the tensor before passing it")


def nothing_to_differentiate(args: tuple, kwargs: dict, modules: list[nn.Module]) -> bool:
    """Whether no tensor input and no parameter of ``modules`` requires grad (Note [Regions with nothing
    to differentiate])."""
    if any(isinstance(a, torch.Tensor) and a.requires_grad for a in (*args, *kwargs.values())):
        return False  # the usual case, without flattening the arguments
    inputs = (leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor))
    if any(tensor.requires_grad for tensor in inputs):
        return False
    return not any(p.requires_grad for module in modules for p in module.parameters())
