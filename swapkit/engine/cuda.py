"""CUDA copy engine: a side stream, events per copy, pinned host buffers.

Note [D2H waits for the producer]
A saved activation may still be being written by kernels queued on the compute stream when the
pack hook runs (the CPU runs ahead of the GPU). The side stream therefore waits on the compute
stream before the device-to-host copy, so the copy reads finished data.

Note [H2D target reuse]
The device buffer a prefetch fills is allocated on the compute stream, as DESIGN §5 asks: it then
behaves like any compute-stream tensor once the compute stream has waited on the copy's event.
The caching allocator may hand out a block whose previous owner's last kernels are still queued
on the compute stream; the side stream waits on the compute stream before writing, so it can
never overwrite memory such a kernel still reads.

Note [Copy sources and targets outlive their copies]
The engine keeps every copy's device side (the D2H source, the H2D target) and its host side (a
view of a pool slab) in ``_inflight`` until the copy's event has completed. Without it, a storage
record that dies early (its graph freed mid-forward, or a branch whose backward never runs) could
return memory to the allocator while the side stream still reads or writes it; and host slabs are
not the CachingHostAllocator's (``swapkit.engine.pinned``), which would record events for them,
so nothing but this reference keeps a slab mapped while a copy uses it after the pool was cleared.
This replaces ``record_stream``, which would delay the reuse of *every* freed block until all later
side-stream work finished.
Holding the source keeps its storage object alive, not its memory: a component that calls
``resize_(0)`` on it (FSDP2 resharding) frees the block anyway, and the queued copy would read
whatever the allocator puts there next. Parameters are therefore never queued, and a size or
address change is caught when the record releases the device copy (``swapkit.runtime.records``
Note [Storages another component may resize]).

Note [A prefetched buffer used on another stream]
A prefetched buffer belongs to the stream that was current when the prefetch was issued. If a
backward node that unpacks it runs on another stream (a forward that used several streams), the
buffer is ``record_stream``-ed on that stream at the wait, so the allocator does not reuse it
while that stream may still read it.

Note [Fences are the last copy's event]
The pool parks a released host range until a fence passes (``swapkit.engine.pool`` Note [Slab
lifetimes]). The side stream runs its copies in order, so the event of the last copy queued before
the release is such a fence: no extra event is recorded per release.

Note [One job per coalesced batch]
``offload_many`` moves the storages of one coalesced batch (``swapkit.runtime.batch`` Note [Coalesced
copies]) into one pinned host region: one ``wait_stream`` of the side stream on the compute stream
before any source is read (Note [D2H waits for the producer]), then one ``copy_`` per storage into its
slot of the region, all queued back to back on the side stream, and one event recorded after the last
of them: the batch is ready when that event is, and the session never looks at a slot before. The
prefetch brings the whole region back with one ``copy_`` into one device buffer and one event; every
record rebuilds its views on that buffer at its offset. Lifetimes: every source and every target of a
batch stay in ``_inflight`` until the batch's event has completed (Note [Copy sources and targets
outlive their copies]). Reuse: a region the records let go of goes back to the pool, which hands its
range out again only after a fence (Note [Fences are the last copy's event]) has passed.

Note [Compute stream is read at use]
``torch.cuda.current_stream()`` is read on every call, never cached: backward runs on the
autograd device thread with the stream of each forward op set as current, and users may run
forward under their own stream.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Any

import torch

from swapkit.engine.pinned import PAGE, pinned_host_memory


class CudaCopy:
    """One copy on the side stream: its completion event, and for a prefetch its target buffer and
    the compute stream the buffer was allocated on."""

    __slots__ = ("event", "buffer", "stream")

    def __init__(self, event: torch.cuda.Event, buffer: torch.Tensor | None = None,
                 stream: torch.cuda.Stream | None = None) -> None:
        self.event, self.buffer, self.stream = event, buffer, stream


class CudaTiming:
    """Time the compute stream spent waiting, measured by two timing events around the wait."""

    __slots__ = ("_start", "_end")

    def __init__(self, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        self._start, self._end = start, end

    def seconds(self) -> float:
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1000.0


class NoTiming:
    __slots__ = ()

    def seconds(self) -> float:
        return 0.0


class CudaFence:
    """Note [Fences are the last copy's event]"""

    __slots__ = ("event",)

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def passed(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()


class CudaCopyEngine:
    """Device<->host copies on one side stream of ``device``."""

    name = "cuda"
    host_granule = PAGE

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)
        self._inflight: deque[tuple[torch.cuda.Event, Any]] = deque()  # event, what it must keep alive
        self._last: torch.cuda.Event | None = None  # the event of the last copy queued
        self._lock = threading.Lock()  # unpacks run on several autograd threads

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A pinned slab of exactly ``nbytes`` rounded to a page (Note [Pinned memory without
        power-of-two rounding] in ``swapkit.engine.pinned``)."""
        return pinned_host_memory(nbytes)

    def fence(self) -> CudaFence | None:
        with self._lock:
            return None if self._last is None else CudaFence(self._last)

    def offload(self, src: torch.Tensor, dst: torch.Tensor) -> CudaCopy:
        return self.offload_many([(src, dst)])

    def offload_many(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> CudaCopy:
        """Every pair's copy after one ``wait_stream``, one event for all (Note [One job per coalesced batch])."""
        self._prune()
        self.stream.wait_stream(self._compute())  # Note [D2H waits for the producer]
        with torch.cuda.stream(self.stream):
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        self._keep_until(done, pairs)  # Note [Copy sources and targets outlive their copies]
        return CudaCopy(done)

    def prefetch(self, src: torch.Tensor) -> tuple[torch.Tensor, CudaCopy]:
        self._prune()
        compute = self._compute()
        dst = torch.empty(src.numel(), dtype=torch.uint8, device=self.device)  # on the compute stream
        self.stream.wait_stream(compute)  # Note [H2D target reuse]
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        self._keep_until(done, (src, dst))
        return dst, CudaCopy(done, dst, compute)

    def _keep_until(self, done: torch.cuda.Event, held: Any) -> None:
        """Hold ``held`` (copy sources and targets) until ``done`` has completed; ``done`` is the new fence."""
        with self._lock:
            self._inflight.append((done, held))  # Note [Copy sources and targets outlive their copies]
            self._last = done  # Note [Fences are the last copy's event]

    def ready(self, copy: CudaCopy) -> bool:
        self._prune()
        return copy.event.query()

    def wait(self, copy: CudaCopy, timed: bool = False) -> CudaTiming | NoTiming:
        self._prune()
        compute = self._compute()
        if copy.buffer is not None and compute != copy.stream:
            copy.buffer.record_stream(compute)  # Note [A prefetched buffer used on another stream]
        if not timed:
            compute.wait_event(copy.event)
            return NoTiming()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(compute)
        compute.wait_event(copy.event)
        end.record(compute)
        return CudaTiming(start, end)

    def synchronize(self) -> None:
        last = self._last
        self.stream.synchronize()
        self._prune()  # every copy queued before the synchronize completed; later ones stay tracked
        with self._lock:
            if self._last is last:
                self._last = None  # no copy left that a fence would wait for

    def close(self) -> None:
        self.synchronize()

    def _compute(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)  # Note [Compute stream is read at use]

    def _prune(self) -> None:
        with self._lock:
            while self._inflight and self._inflight[0][0].query():  # one stream: completes in order
                self._inflight.popleft()
