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


def call_region(function: Callable[..., Any], kwargs: dict, layout: tuple[int, ...], aliases: dict[str, int],
                *inputs: Any) -> Any:
    """The region's call as :func:`distinct_inputs` took it apart, each repeated tensor one object again.

    ``kwargs`` travel to the region as one positional dict (recompute Note [Keyword arguments of
    checkpointed modules]).
    """
    if aliases:
        kwargs = {**kwargs, **{name: inputs[index] for name, index in aliases.items()}}
    return function(*(inputs[index] for index in layout), **kwargs)
