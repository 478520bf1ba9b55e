"""Autocast's cached casts: low-precision copies that the autocast block, not the saved graph, keeps alive.

Note [Autocast's cached casts]
Inside ``torch.autocast`` an op that runs in lower precision casts its float32 arguments, and autocast
*caches* the cast of a leaf that requires grad (a parameter, or an input leaf) until the outermost
autocast block exits: every use in the forward reuses one bf16/fp16 copy of each weight. Linear layers
save that copy (``weight.t()`` of it) for backward. Swapping it copied it to the host and dropped the
session's reference, but the cache still held it until the autocast block ended, at the end of the
forward: no device byte was freed while the forward ran, yet the stats counted it offloaded and
released and ``peak_device_bytes`` left it out. Where backward runs inside the same block (``swapkit
train``'s step) the copy then came back for nothing. Where the block wraps only the forward (the
usual use, HF's Trainer) the block's end frees the swapped copy until its prefetch: device bytes
saved only after the forward's end, where the cache held every copy at once, so the peak stays
where it was and the copies travel both ways for it (39% of a layer swap's bytes on a tiny HF Llama
under bf16 autocast; a 7B Llama layer's bf16 weights are 400 MB). So a new storage saved in a swap scope
is kept, and counted in ``stats.skipped["autocast_cache"]``, when it is such a copy: its tensor (or the
base of its view) has dtype autocast's lower-precision dtype, was made by a copy (``ToCopyBackward0``)
straight from a float32 leaf that requires grad and is not a view (what ``cached_cast`` in
``aten/src/ATen/autocast_mode.cpp`` caches), while an autocast block is open with its cache enabled and
that dtype for the tensor's device. The test costs attribute reads on swap candidates only (never on a
keep-only session). A copy the user made explicitly with ``weight.to(torch.bfloat16)`` inside autocast
looks the same and is kept too: a missed swap, never a wrong gradient. Autocast entered around each
layer separately (its cache then dies with each block) makes the same copies kept, as if cached. Casts
autocast does not cache (of frozen weights, of activations) die with the saved graph and are swapped as
any activation. A cast autocast first made under ``no_grad`` inside the block is cached without a
``grad_fn``; reused with grad later, it is not recognised and is swapped as before: bytes moved for
nothing, never a wrong gradient.
"""
from __future__ import annotations

import torch

_LOWER = (torch.bfloat16, torch.float16)


def autocast_cached(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is (a view of) a cast that autocast caches (Note [Autocast's cached casts])."""
    if tensor.dtype not in _LOWER:
        return False
    base = tensor if tensor._base is None else tensor._base
    node = base.grad_fn
    if node is None or node.name() != "ToCopyBackward0" or not _caching(base):
        return False
    source = node.next_functions[0][0] if node.next_functions else None
    leaf = getattr(source, "variable", None)  # only AccumulateGrad nodes have one
    return leaf is not None and leaf.dtype == torch.float32 and leaf._base is None


def _caching(cast: torch.Tensor) -> bool:
    """An autocast block is open, with its cache on, casting ``cast``'s device to ``cast``'s dtype.

    ``torch.is_autocast_enabled`` cannot tell: an op's autocast kernel excludes autocast's dispatch key while
    it runs, and the pack hook runs inside it, so it reads ``False`` there. The nesting level can: autocast's
    ``__enter__`` raises it, its ``__exit__`` lowers it and clears the cache when it reaches 0, so the cache
    lives while it is above 0. Reading it back (raise, then lower) changes nothing: only ``__exit__`` clears.
    """
    if not torch.is_autocast_cache_enabled() or torch.get_autocast_dtype(cast.device.type) != cast.dtype:
        return False
    level = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    return level > 1
