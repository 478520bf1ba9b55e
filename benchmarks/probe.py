"""Untimed probe steps: independent checks of what the swap session reports about itself.

Note [Live bytes probe]
The session's ``peak_device_bytes`` counts the storages that pass through its saved-tensor hooks.
The probe counts independently, without the hooks: a ``TorchDispatchMode`` registers every storage
an op produces on the compute device during the step (weak references with a callback that
subtracts its bytes when the storage dies) and reports the peak of the live total and the total
at the end of the forward. Parameter and buffer storages are excluded (view ops such as
``weight.t()`` return them); gradients made during backward count. On CPU the swap engine's host
copies live in the same RAM but come from the pool made in earlier steps, so they do not count.
Whatever is alive at the end of the forward and not saved for backward (the loss) counts too.

Note [Move check]
For one step the engine's ``offload_storages`` (the one way a batch's copy reaches any engine:
``swapkit.runtime.batch`` Note [Coalesced copies]) is wrapped to record the storage behind every
device-to-host copy (held strongly for that step, so no address is reused). Wrapping ``offload``
instead saw only the thread engine's copies: the CUDA engine's batches never call it, and the first
H100 runs reported 0 copies there. Two facts are then
checked from the outside: no recorded storage overlaps a parameter or buffer, and no storage was
copied twice.
"""
from __future__ import annotations

import threading
import weakref
from itertools import chain
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from swapkit.train.model import lm_loss

from common import synchronize
from variants import Runner


class LiveBytes(TorchDispatchMode):
    """Live bytes of the storages created under the mode (Note [Live bytes probe])."""

    def __init__(self, device: torch.device, exclude: set[int]) -> None:
        super().__init__()
        self.device_type = device.type
        self.exclude = exclude  # ids of parameter and buffer storages
        self.live = self.peak = 0
        self._refs: dict[int, weakref.ref] = {}
        self._lock = threading.Lock()  # the copy worker may drop the last reference

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.device.type == self.device_type:
                self._track(leaf.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key, nbytes = id(storage), storage.nbytes()
        with self._lock:
            if key in self._refs or key in self.exclude or nbytes == 0:
                return
            self._refs[key] = weakref.ref(storage, lambda _ref, key=key, n=nbytes: self._freed(key, n))
            self.live += nbytes
            self.peak = max(self.peak, self.live)

    def _freed(self, key: int, nbytes: int) -> None:
        with self._lock:
            self._refs.pop(key, None)
            self.live -= nbytes


@dataclass
class Probe:
    """What one probe step saw; ``grads`` are compared with the baseline's."""

    loss: torch.Tensor
    grads: list[torch.Tensor]
    peak_live_bytes: int
    forward_end_live_bytes: int


def live_bytes_probe(runner: Runner, batch: tuple[torch.Tensor, torch.Tensor]) -> Probe:
    """One step under :class:`LiveBytes`; also returns the loss and gradients."""
    model, device = runner.model, runner.setup.device
    model.zero_grad(set_to_none=True)
    synchronize(device)
    mode = LiveBytes(device, {id(t.untyped_storage()) for t in chain(model.parameters(), model.buffers())})
    with runner.context(), mode:
        loss = lm_loss(model(batch[0]), batch[1])
        forward_end = mode.live
        if runner.backward_inside:
            loss.backward()
    if not runner.backward_inside:
        with mode:
            loss.backward()
    synchronize(device)
    grads = [p.grad.detach().clone() for p in model.parameters()]
    return Probe(loss.detach(), grads, mode.peak, forward_end)


def compare(probe: Probe, reference: Probe) -> dict[str, Any]:
    """Loss and gradients against the baseline's: exact equality and the largest difference."""
    diffs = [(g - r).abs().max().item() for g, r in zip(probe.grads, reference.grads)]
    return {"loss_equal": bool(torch.equal(probe.loss, reference.loss)),
            "grads_equal": all(torch.equal(g, r) for g, r in zip(probe.grads, reference.grads)),
            "grad_max_abs_diff": max(diffs, default=0.0)}


def move_check(runner: Runner, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
    """Note [Move check]: parameter bytes moved and storages moved twice in one step."""
    engine = runner.session.engine
    copied: list[torch.UntypedStorage] = []
    original = engine.offload_storages

    def offload_storages(region: torch.Tensor, sources: list, *args: Any, **kwargs: Any) -> Any:
        copied.extend(storage for storage, _, _, _ in sources)
        return original(region, sources, *args, **kwargs)

    engine.offload_storages = offload_storages
    try:
        runner.step(batch, record=False)
    finally:
        del engine.offload_storages  # back to the class's method
    stats = runner.session.stats
    return {"offload_copies": len(copied), "distinct_storages_moved": len({id(s) for s in copied}),
            "moved_twice": len(copied) - len({id(s) for s in copied}),
            "parameter_bytes_moved": _parameter_overlap(runner.model, copied),
            "stats_offloaded_tensors": stats.offloaded_tensors,
            "offloaded_le_saved": stats.offloaded_bytes <= stats.saved_bytes,
            "parameter_bytes_skipped": stats.skipped.get("parameter", 0)}


def _parameter_overlap(model: torch.nn.Module, copied: list[torch.UntypedStorage]) -> int:
    """Bytes of copied storages whose address range overlaps a parameter's or buffer's storage."""
    spans = [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
             for t in [*model.parameters(), *model.buffers()]]
    moved = 0
    for storage in copied:
        start, size = storage.data_ptr(), storage.nbytes()
        if any(start < p + n and p < start + size for p, n in spans):
            moved += size
    return moved
