"""The views of a restored storage that autograd was handed, and the in-place check on them.

Note [Writes to restored tensors]
Plain autograd's unpack returns the saved tensor itself, so an in-place write to it during backward
(a custom function reusing its saved input as the gradient buffer) bumps the version counter every
alias shares, and any later unpack of that storage (another consumer, or a second backward with
``retain_graph=True``) raises. A storage restored from the host (``swapkit.runtime.records.SwapRecord``)
is a fresh tensor on the prefetched buffer with a version counter of its own, which no keeper shares:
every later unpack would hand on the overwritten bytes and gradients would be silently wrong. So a
swap record remembers the views it handed out, one per saved view (``restored``: meta -> the view
and its version then), and hands the same view out again for the same meta (autograd wraps what an
unpack returns in a tensor of its own sharing the view's version counter, so a write through it
reaches that counter). A restore first checks that none of them was written since; a write raises
there, naming the layer/op, where plain autograd raises too. A write that no later unpack of the
storage sees is legal, as in plain autograd, and goes unnoticed. One view per meta keeps the check
and the memory bounded however many backward passes run over one graph (a Jacobian taken row by
row with ``retain_graph=True``). An output a recipe rebuilds in backward
(``swapkit.runtime.recipes.RecomputedOutput``) is handed out the same way.
"""
from __future__ import annotations

from typing import Any, Callable

import torch


def handed_out(restored: dict[tuple, tuple[torch.Tensor, int]], meta: tuple, where: str, step: int,
               build: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """The view of one restored storage that ``meta`` describes: the one handed out before, or ``build(*args)``
    remembered in ``restored``, after checking that no view handed out was written in place since
    (Note [Writes to restored tensors]). Called under the step's lock.

    Args:
        restored: ``meta -> (view, its version when first handed out)`` for one storage.
        meta: the saved view's ``swapkit.runtime.records.view_meta``.
        where: the layer/op label the error names.
        step: the step number the error names.
        build: makes the view, from ``args``, when none was handed out for ``meta``.

    Raises:
        RuntimeError: a view handed out before was modified in place.
    """
    for view, version in restored.values():
        if view._version != version:
            raise restored_modified_error(where, step, version, view._version)
    found = restored.get(meta)
    if found is not None:
        return found[0]
    view = build(*args)
    restored[meta] = (view, view._version)
    return view


def restored_modified_error(where: str, step: int, version: int, now: int) -> RuntimeError:
    """Note [Writes to restored tensors]"""
    return RuntimeError(
        f"swapkit: a tensor saved for backward in {where} was modified by an in-place operation during the "
        f"backward of step {step}, after swapkit restored it (version {version} -> {now}); a "
        "later use needs the original values and autograd would fail here without swapkit too. Make the "
        "backward that writes it out-of-place (return x * grad instead of x.mul_(grad)), or clone the saved "
        "tensor before changing it.")
