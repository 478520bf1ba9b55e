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
input on its own even without a session, keeps the identity the same way.

Note [Keyword tensors written after the region]
Keyword tensors that are not also positional reach the region by reference (recompute Note [Keyword
arguments of checkpointed modules]): they are not saved, so no saved-tensor hook sees them and no
version keeper guards them. A caller that writes one in place after the region ran
(``y = probe(x, scale=scale); scale.add_(1)``) would have the recomputation use the new values:
wrong gradients, silently, where the plain model's autograd raises. So each such tensor's version is
taken when the region is called, and the re-run checks it before calling the region again: a write
in between raises, naming the region and the keyword. (A write *by* the region itself raises at once,
recompute Note [Regions that write their inputs].)
"""
from __future__ import annotations

from typing import Any, Callable

import torch


def distinct_inputs(args: tuple, kwargs: dict) -> tuple[tuple, tuple[int, ...], dict[str, int]]:
    """Each tensor object of ``args`` once (Note [A tensor passed to a region more than once]).

    Args:
        args: the region's positional arguments.
        kwargs: its keyword arguments (they travel by reference; only those that are one of ``args``
            are looked up).

    Returns:
        ``inputs`` (the positional arguments, a repeated tensor only at its first position), ``layout``
        (for each position of ``args`` its index in ``inputs``) and ``aliases`` (keyword -> index in
        ``inputs`` for keyword tensors that are also positional).
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
    return tuple(inputs), tuple(layout), aliases


def unsaved_keywords(kwargs: dict, aliases: dict[str, int]) -> tuple[tuple[str, torch.Tensor, int], ...]:
    """``(name, tensor, version)`` of each keyword tensor held by reference (Note [Keyword tensors written
    after the region])."""
    return tuple((name, value, value._version) for name, value in kwargs.items()
                 if isinstance(value, torch.Tensor) and name not in aliases)


def call_region(function: Callable[..., Any], kwargs: dict, layout: tuple[int, ...], aliases: dict[str, int],
                unsaved: tuple[tuple[str, torch.Tensor, int], ...], label: str, *inputs: Any) -> Any:
    """The region's call as :func:`distinct_inputs` took it apart, each repeated tensor one object again.

    ``kwargs`` travel to the region as one positional dict (recompute Note [Keyword arguments of
    checkpointed modules]); ``unsaved`` (:func:`unsaved_keywords`) must still have their versions
    (Note [Keyword tensors written after the region]).
    """
    for name, tensor, version in unsaved:
        if tensor._version != version:
            raise _keyword_written_error(label, name, version, tensor._version)
    if aliases:
        kwargs = {**kwargs, **{name: inputs[index] for name, index in aliases.items()}}
    return function(*(inputs[index] for index in layout), **kwargs)


def _keyword_written_error(label: str, name: str, before: int, after: int) -> RuntimeError:
    """Note [Keyword tensors written after the region]"""
    return RuntimeError(
        f"swapkit: the keyword argument {name!r} of the recomputed region {label} was modified by an in-place "
        f"operation after the region ran (version {before} -> {after}); recompute re-runs the region in backward "
        "with it and would get other values (wrong gradients; without recompute autograd would fail here too). "
        "Make that operation out-of-place, or clone the tensor before passing it")
