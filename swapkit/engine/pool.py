"""Pooled host memory for swapped storages: a few large slabs, sub-allocated, reused across steps.

Every swapped storage is copied as raw bytes, so a host buffer is a flat ``uint8`` view of a slab
the engine allocated (pinned on CUDA: ``swapkit.engine.pinned``). The pool places each request
in the smallest free range that fits (``swapkit.engine.slabs``), and coalesces a freed range with
its free neighbours, so in steady-state training the same ranges come back every step and, after
the first step, no host memory is allocated. ``total_bytes`` is what the slabs really hold (for
CUDA, what is registered as pinned), and ``max_bytes`` caps it.

Note [Slab lifetimes]
A range goes back to the free list only once no copy can still read or write it. ``release``
takes a fence from the engine (``CopyEngine.fence``: on CUDA the event of the last copy queued on
the side stream, on the thread engine the last queued job; both queues are FIFO, so the fence
passing means every copy queued before the release finished, the range's device-to-host copy and
its host-to-device read included) and parks the range until the fence has passed; ``acquire``
reclaims parked ranges in release order. When no free range fits a request, the pool waits for
the oldest fences rather than grow: the wait is usually empty (a step's prefetches finished long
before the next forward), and it keeps the slabs at the steady state and under the cap. (On CUDA a
non-empty wait holds the CPU back until the side stream has passed that fence; growing instead
would pin memory the steady state never needs.)
A slab's memory itself is kept alive by its views: a view handed out, a view an in-flight copy
holds (``swapkit.engine.cuda`` Note [Host targets outlive their copies]), or the
pool. ``clear`` (the session was removed, after its engine synchronized) drops the pool's own
references; a slab whose ranges are all back is then freed (unregistered on CUDA), one a
surviving record still uses is freed with that record's view.

Note [Host buffer reuse is ordered by the copy queue]
Callers give a buffer back as soon as they no longer need it (a record issued its prefetch, or
died), even if a copy that uses it is still queued. That is safe: the range is parked until the
engine's fence passes (Note [Slab lifetimes]), and even without a fence (a pool made with
``fence=None``) every copy of an engine runs on one FIFO queue, so the next copy into a reused range
is queued after every earlier copy that read or wrote it.

Note [Releases never wait for the pool's lock]
``release`` runs in ``SwapRecord.__del__`` (``swapkit.runtime.records`` Note [Record lifetime]), and the
cyclic garbage collector runs such finalizers on whatever thread allocates, at any allocation:
possibly while that very thread holds this pool's lock (inside ``acquire``, or inside ``release``
while the engine makes a fence object). Waiting for the lock there would wait forever, and waiting
for it on another thread while holding the step's lock inverts the lock order with a finalizer that
wants the step's lock. So ``release`` only *tries* the lock: when it is taken, the buffer goes onto
a deferred queue (``deque.append`` needs no lock), and whoever takes the lock next (``acquire``,
``release``, ``free_bytes``, ``clear``) gives the deferred buffers back first. A deferred buffer's
fence is taken when it is drained, later than its release: a later fence is passed only after the
earlier one, so it is as safe (Note [Slab lifetimes]). A bad buffer (not from this pool, or given back
twice) raises where it is drained.

Note [Same-size reuse]
Steady-state training asks for the same sizes every step, so a freed range is first kept whole in
a list for its exact size, with its view: a request of that size takes it back at once, as the
same tensor object, with no best-fit search, split or merge. Only a request no such list serves
merges every kept range back into the free ranges (coalescing neighbours) before the best fit, so
kept ranges never make the pool grow.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Callable

import torch

from swapkit.engine.base import Fence
from swapkit.engine.slabs import ALIGNMENT, Block, SlabAllocator, next_slab_bytes, slab_kind


class HostPool:
    """Host slabs sub-allocated into exact-size ``uint8`` buffers, with an optional cap on total bytes.

    Args:
        allocate: makes a new slab of ``n`` bytes (pinned on CUDA); it may return more (a whole
            page), and the pool counts what it returns.
        max_bytes: total host bytes the slabs may hold; ``None`` is unbounded.
        fence: the engine's ``fence`` (Note [Slab lifetimes]); ``None`` frees a range at once,
            which is safe only while all copies run on one FIFO queue.
        granule: slab sizes are rounded up to a multiple of it before the cap is checked.
        alignment: every buffer starts at a multiple of it from its slab's start.

    Example:
        >>> pool = HostPool(lambda n: torch.empty(n, dtype=torch.uint8))
        >>> host = pool.acquire(1000)
        >>> pool.release(host)
    """

    def __init__(self, allocate: Callable[[int], torch.Tensor], max_bytes: int | None = None, *,
                 fence: Callable[[], Fence | None] | None = None, granule: int = 1,
                 alignment: int = ALIGNMENT) -> None:
        self._allocate, self._fence, self._granule = allocate, fence, granule
        self.max_bytes = _checked_cap(max_bytes)
        self._slabs = SlabAllocator(alignment)
        self._memory: dict[int, torch.Tensor] = {}  # slab id -> its bytes (dropped by ``clear``)
        self._live: dict[int, tuple[Block, torch.Tensor]] = {}  # data_ptr -> a buffer handed out
        self._parked: deque[tuple[Fence, Block, torch.Tensor]] = deque()  # Note [Slab lifetimes]
        self._kept: dict[int, list[tuple[Block, torch.Tensor]]] = {}  # nbytes -> Note [Same-size reuse]
        self._kept_bytes = 0
        self._lock = threading.Lock()  # buffers come back from autograd threads
        self._deferred: deque[torch.Tensor] = deque()  # Note [Releases never wait for the pool's lock]
        self.allocations = 0
        self._closed = False

    @property
    def total_bytes(self) -> int:
        """Bytes the slabs hold (pinned bytes on CUDA)."""
        return self._slabs.held_bytes

    @property
    def free_bytes(self) -> int:
        """Bytes in free ranges, after reclaiming the ranges whose fences passed."""
        with self._lock:
            self._drain()
            self._reclaim(wait=False)
            return self._slabs.free_bytes + self._kept_bytes

    def acquire(self, nbytes: int) -> torch.Tensor | None:
        """A ``uint8`` buffer of exactly ``nbytes``, or ``None`` if a new slab would exceed the cap.

        Raises:
            ValueError: the pool was cleared (its session was removed).
        """
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        with self._lock:
            if self._closed:
                raise ValueError("swapkit: this host pool was cleared (its session was removed); it hands out "
                                 "no buffers")
            self._drain()
            self._reclaim(wait=False)
            kept = self._kept.get(nbytes)
            if kept:  # Note [Same-size reuse]
                block, view = kept.pop()
                self._kept_bytes -= block.span
            else:
                block = self._place(nbytes)
                if block is None:
                    return None
                view = self._memory[block.slab][block.offset:block.offset + block.nbytes]
            self._live[view.data_ptr()] = (block, view)
            return view

    def release(self, buffer: torch.Tensor) -> None:
        """Give back a buffer :meth:`acquire` returned; its range is reused once its copies finished.

        Raises:
            ValueError: ``buffer`` is not a buffer this pool handed out and has not had back.
        """
        if buffer.numel() == 0:
            return
        if not self._lock.acquire(blocking=False):
            self._deferred.append(buffer)  # Note [Releases never wait for the pool's lock]
            return
        try:
            self._drain()
            self._give_back(buffer)
        finally:
            self._lock.release()

    def _drain(self) -> None:
        """Give back the buffers released while the lock was taken (Note [Releases never wait for the pool's lock])."""
        deferred = self._deferred
        while deferred:
            self._give_back(deferred.popleft())

    def _give_back(self, buffer: torch.Tensor) -> None:
        entry = self._live.pop(buffer.data_ptr(), None)
        if entry is not None and entry[1].numel() != buffer.numel():  # a part of a buffer, at its start
            self._live[buffer.data_ptr()], entry = entry, None
        if entry is None:
            raise ValueError(f"swapkit host pool: a buffer of {buffer.numel()} bytes at {buffer.data_ptr():#x} "
                             "was not handed out by this pool, or was given back twice")
        fence = self._fence() if self._fence is not None and not self._closed else None
        if fence is None:
            self._free(*entry)
        else:
            self._parked.append((fence, *entry))

    def clear(self) -> None:
        """Drop every free slab and hand out no more buffers (the session was removed; its engine has
        synchronized). Buffers still out free their slab when the last of them comes back."""
        with self._lock:
            self._drain()
            self._closed = True
            while self._parked:
                self._free(*self._parked.popleft()[1:])
            self._merge_kept()
            for slab in list(self._memory):
                if self._slabs.is_free(slab):
                    self._slabs.remove_slab(slab)
                del self._memory[slab]

    def _place(self, nbytes: int) -> Block | None:
        """Best fit in a slab of the request's kind, else a new slab, else (at the cap) room in the other kind."""
        kind = slab_kind(nbytes)
        return self._fit(nbytes, kind) or self._grow(nbytes, kind) or self._slabs.allocate(nbytes, 1 - kind)

    def _fit(self, nbytes: int, kind: int) -> Block | None:
        """A free range for ``nbytes``, waiting for parked ranges before giving up (Note [Slab lifetimes])."""
        self._merge_kept()
        block = self._slabs.allocate(nbytes, kind)
        while block is None and self._parked:
            self._reclaim(wait=True)
            self._merge_kept()
            block = self._slabs.allocate(nbytes, kind)
        return block

    def _merge_kept(self) -> None:
        """Give every kept range back to the free ranges, coalesced (Note [Same-size reuse])."""
        for kept in self._kept.values():
            for block, _ in kept:
                self._slabs.free(block)
        self._kept.clear()
        self._kept_bytes = 0

    def _grow(self, nbytes: int, kind: int) -> Block | None:
        """Open a slab sized by :func:`~swapkit.engine.slabs.next_slab_bytes` and allocate from it."""
        size = next_slab_bytes(nbytes, self._slabs.held_bytes, self.max_bytes, self._granule)
        if size is None:
            return None
        memory = self._allocate(size)
        if memory.dtype != torch.uint8 or memory.dim() != 1 or memory.numel() < size:
            raise TypeError(f"swapkit host pool: the engine's host_buffer({size}) returned {memory.dtype} of shape "
                            f"{tuple(memory.shape)}; expected a flat uint8 tensor of at least {size} bytes")
        if self.max_bytes is not None and self._slabs.held_bytes + memory.numel() > self.max_bytes:
            return None  # the allocator rounded past the cap: give the slab back and refuse
        slab = self._slabs.add_slab(memory.numel(), kind)
        self._memory[slab] = memory
        self.allocations += 1
        return self._slabs.allocate(nbytes, kind)

    def _reclaim(self, wait: bool) -> None:
        """Free parked ranges whose fence passed, in release order; ``wait`` waits for the oldest first."""
        if wait and self._parked:
            self._parked[0][0].wait()
        while self._parked and self._parked[0][0].passed():
            self._free(*self._parked.popleft()[1:])

    def _free(self, block: Block, view: torch.Tensor) -> None:
        if block.slab in self._memory:
            self._kept.setdefault(block.nbytes, []).append((block, view))  # Note [Same-size reuse]
            self._kept_bytes += block.span
            return
        self._slabs.free(block)  # cleared: the slab goes once all of it is back
        if self._slabs.is_free(block.slab):
            self._slabs.remove_slab(block.slab)


def _checked_cap(max_bytes: int | None) -> int | None:
    """``max_bytes`` as given, refused unless ``None`` or a whole number of bytes >= 0."""
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0):
        raise ValueError(f"swapkit host pool max_bytes: got {max_bytes!r}; expected None or a whole number of "
                         "bytes >= 0 (runtime.max_host_bytes)")
    return max_bytes
