"""Pooled host buffers for swapped storages, reused across steps.

Buffers are flat ``uint8`` tensors keyed by their byte size (every swapped storage is copied as
raw bytes, so the dtype is always ``uint8``). In steady-state training the same sizes come back
every step, so after the first step no host memory is allocated.

Note [Host buffer reuse is ordered by the copy queue]
A buffer goes back to the pool as soon as its storage record dies, even if a copy that used it
might still be queued. That is safe because every copy of an engine runs on one FIFO queue (one
CUDA side stream, or one worker thread): the next copy into a reused buffer is queued after every
earlier copy that read or wrote it.
"""
from __future__ import annotations

import threading
from collections import defaultdict
from typing import Callable

import torch


class HostPool:
    """Size-keyed free lists of host buffers with an optional cap on total bytes.

    Args:
        allocate: makes a new buffer of ``n`` bytes (pinned on CUDA).
        max_bytes: total host bytes the pool may own; ``None`` is unbounded.
    """

    def __init__(self, allocate: Callable[[int], torch.Tensor], max_bytes: int | None = None) -> None:
        self._allocate = allocate
        self.max_bytes = max_bytes
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._lock = threading.Lock()  # buffers come back from the autograd thread on CUDA
        self.total_bytes = 0
        self.allocations = 0
        self._closed = False

    def acquire(self, nbytes: int) -> torch.Tensor | None:
        """A buffer of exactly ``nbytes``, or ``None`` if a new one would exceed the cap."""
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
            if self.max_bytes is not None and self.total_bytes + nbytes > self.max_bytes:
                return None
            self.total_bytes += nbytes  # reserved under the lock, so two callers cannot overshoot the cap
        try:
            buffer = self._allocate(nbytes)
        except BaseException:
            with self._lock:
                self.total_bytes -= nbytes
            raise
        with self._lock:
            self.allocations += 1
        return buffer

    def release(self, buffer: torch.Tensor) -> None:
        with self._lock:
            if not self._closed:  # records outliving ``clear`` just drop their buffer
                self._free[buffer.numel()].append(buffer)

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(size * len(buffers) for size, buffers in self._free.items())

    def clear(self) -> None:
        """Drop every free buffer and stop taking buffers back (the session was removed)."""
        with self._lock:
            self._closed = True
            freed = sum(size * len(buffers) for size, buffers in self._free.items())
            self._free.clear()
            self.total_bytes -= freed
