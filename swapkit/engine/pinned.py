"""Pinned host memory of exactly the size asked for: anonymous ``mmap`` + ``cudaHostRegister``.

Note [Pinned memory without power-of-two rounding]
``torch.empty(n, pin_memory=True)`` goes through PyTorch's CachingHostAllocator, which rounds every
request up to the next power of two (``PowerOf2Ceil`` in ``ATen/core/CachingHostAllocator.h``,
unless the process-wide ``pinned_max_round_threshold`` allocator option is set before CUDA starts)
and keeps the rounded block cached: a 33 MiB buffer pins 64 MiB, and a mix of activation sizes
pins ~1.5-2x its bytes. swapkit does not rely on a process-wide option; it allocates its own slabs:

* the memory is an anonymous ``mmap`` of the size rounded up to a page, so it is page-aligned and
  no other allocation shares its pages (two registrations of one page would fail);
* ``cudaHostRegister`` pins exactly those pages, which the driver then treats as pinned for
  asynchronous copies (``Tensor.is_pinned()`` is true), the same path PyTorch's checkpoint stager
  (``torch.cuda._pin_memory_utils``) and other exact-size pinned pools use;
* the tensor is made with ``torch.frombuffer``, so its storage owns the mapping: the mapping is
  unregistered and unmapped only when the last view of the storage dies, and unregistered *before*
  it is unmapped (``PinnedMapping.__del__`` runs before ``mmap`` unmaps).

A registered page costs what ``cudaHostAlloc``'s does, and registration runs once per slab
(``swapkit.engine.slabs`` Note [Slab sizes]), never per saved tensor. The registration functions
are parameters, so everything but the CUDA calls is tested on CPU. A failed registration raises,
but also stays recorded as the thread's CUDA last error: ``torch.cuda.cudart()`` has no
``cudaGetLastError`` to reset it (README, Limitations).

Note [Pinning on the engine's device]
``cudaHostRegister`` and ``cudaHostUnregister`` run in the context of the calling thread's current
device, and create that device's primary context if it has none. The pool opens slabs on the forward
thread and a slab is unregistered on whatever thread drops its last view, whose current device need
not be the model's: a model on ``cuda:1`` in a process that never called ``torch.cuda.set_device`` (the
current device is still 0) started a context on GPU 0 at its first slab -- a few hundred MiB of GPU 0
per process, so with one process per GPU every rank put one there (pytorch/pytorch#21081, which
PyTorch's own pinned allocator avoids by switching to a device that has a context). So both calls run
under ``torch.cuda.device`` of the engine's device (:func:`device_pinned_memory`), whose context exists
since the model lives there; ``torch.cuda.device`` switches back without creating the previous device's
context. The pages are registered ``cudaHostRegisterPortable``, pinned for every context, so which
device registers them changes nothing else.
"""
from __future__ import annotations

import functools
import logging
import mmap
from typing import Callable

import torch

from swapkit.engine.slabs import round_up

logger = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, like cudaHostAlloc's default


class PinnedMapping(mmap.mmap):
    """An anonymous mapping that unregisters itself from CUDA before it is unmapped."""

    unregister: Callable[[int], int] | None = None
    address = 0

    def __del__(self) -> None:
        if self.unregister is not None:
            try:
                status = self.unregister(self.address)
            except Exception as err:  # noqa: BLE001 - the device switch, at interpreter exit (CUDA or torch gone)
                status = err
            if status:  # at interpreter exit CUDA may be gone already; nothing is left to leak
                logger.debug("cudaHostUnregister(%#x) returned %s", self.address, status)


def _cuda_register(address: int, nbytes: int, device: int | None = None) -> int:
    with torch.cuda.device(device):  # Note [Pinning on the engine's device]; None: the current device
        return int(torch.cuda.cudart().cudaHostRegister(address, nbytes, _PORTABLE))


def _cuda_unregister(address: int, device: int | None = None) -> int:
    with torch.cuda.device(device):  # Note [Pinning on the engine's device]
        return int(torch.cuda.cudart().cudaHostUnregister(address))


def device_pinned_memory(nbytes: int, device: int) -> torch.Tensor:
    """:func:`pinned_host_memory` registered and unregistered on CUDA device ``device`` (Note [Pinning on
    the engine's device])."""
    return pinned_host_memory(nbytes, functools.partial(_cuda_register, device=device),
                              functools.partial(_cuda_unregister, device=device))


def pinned_host_memory(nbytes: int, register: Callable[[int, int], int] = _cuda_register,
                       unregister: Callable[[int], int] = _cuda_unregister) -> torch.Tensor:
    """A flat ``uint8`` tensor of ``nbytes`` rounded up to a page, page-aligned and registered
    (Note [Pinned memory without power-of-two rounding]).

    Args:
        nbytes: bytes wanted (>= 1).
        register: ``cudaHostRegister(address, nbytes)``, returning a CUDA error code.
        unregister: ``cudaHostUnregister(address)``, run when the memory is released.

    Raises:
        RuntimeError: the registration failed (out of pinnable memory, ``ulimit -l``).
    """
    size = round_up(max(nbytes, 1), PAGE)
    mapping = PinnedMapping(-1, size)
    memory = torch.frombuffer(mapping, dtype=torch.uint8)
    address = memory.data_ptr()
    status = register(address, size)
    if status:
        raise RuntimeError(f"swapkit: cudaHostRegister of {size} bytes of host memory failed (CUDA error {status}); "
                           "the host may be out of pinnable memory: lower runtime.max_host_bytes, swap fewer "
                           "scopes, or raise the locked-memory limit (ulimit -l)")
    mapping.address, mapping.unregister = address, unregister
    return memory
