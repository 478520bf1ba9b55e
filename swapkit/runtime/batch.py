"""Coalesced copies: the swapped storages of one scope travel as one host region, one copy each way.

Note [Coalesced copies]
One copy job per swapped storage costs a thread hand-off (thread engine) or a ``wait_stream``, a
copy and an event (CUDA) per saved tensor, whatever its size. Instead the step keeps one open
:class:`Batch`: each new swap record takes the next slot of it (its offset, aligned to
:data:`ALIGN` bytes so every dtype's view can be rebuilt on the region), and nothing is copied yet.
The batch holds each storage with its offset, size and address, not a view of it. It is *flushed* --
one pooled host region of exactly its size, one copy job with one completion handle for all its
storages (``engine.offload_storages``: the engine builds a flat view of each storage and cuts the
slots from the region by one ``split_with_sizes``, on its worker thread where it has one) -- when:
- a save arrives from another frame (the scope changed), a new storage is saved on another stream
  (Note [A batch has one producer]), or the next storage would take the batch past
  ``runtime.offload_batch_bytes`` (``0``: every storage is its own batch, flushed when saved);
- one of its records comes due for release (a record is released only once its copy was queued or
  has finished, so the copy must have started by its horizon: the batch never holds device memory
  longer than ``backward_prefetch`` allows, it only moves the copy's start from the save to, at the
  latest, that horizon);
- the forward ends without a backward (the ``with`` block's exit).
A batch still open when backward begins is *discarded* instead: none of its records came due, so
all of them are in the tail and used from the device as they are (``swapkit.runtime.swap_schedule`` Note
[The last k ticks stay on the device]); copying it would only queue a useless copy on the engine's FIFO
queue ahead of the first prefetches, and take a host region. It takes no region, queues nothing,
and its bytes count as ``skipped["tail"]``, not as offloaded.
A storage resized or freed between its save and the flush raises there, before any copy is queued
(``swapkit.runtime.records.Note [Storages another component may resize]``); the engine checks
again around each copy.
Copies still finish in issue order (one FIFO queue per engine), so the step's pending releases are
ordered by ``(batch.issued, offset)``.

Backward brings the batch back with one prefetch: the first record due issues one host-to-device
copy of the whole region into one device buffer; each record restores from its slice of it. The
host region then goes back to the pool at once (``swapkit.engine.pool.Note [Host buffer reuse is
ordered by the copy queue]``), or, for a batch never prefetched, when the last record needing it
lets go (dropped in the tail, or dead). Lifetimes: records hold their batch, never the reverse, so
a record still dies with the last handle autograd holds (``swapkit.runtime.records.Note [Record
lifetime]``); the batch holds its sources only until its copy is queued. The restored views share
the region's device buffer, so its memory goes when the last of them dies; the session's
accounting still counts each record's bytes separately. Storages still on the device when backward
begins (the tail) are copied back as part of the region too: one copy is cheaper than cutting it.

If the pool cannot give the region (``runtime.max_host_bytes``) the batch is *kept* too: its records
stay on the device, are never released, and their bytes count as ``skipped["host_cap"]``.

Note [A batch has one producer]
On CUDA a saved storage may still be being written by kernels queued on the stream it was saved on
(``swapkit.engine.cuda`` Note [D2H waits for the producer]), and the copy of a batch waits on one
stream. So a batch remembers the stream its first storage was saved on (``engine.producer()``,
read when a new storage joins it) and a storage saved on another stream does not join it: the open
batch is flushed and a new one opened, and each copy waits on exactly the stream its storages were
saved on, whichever stream is current when it is flushed. The thread engine's producer is always
``None`` (a tensor saved on CPU is complete): batches never split there.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from swapkit.engine.base import Source, StorageChangedError, check_storages

if TYPE_CHECKING:
    from swapkit.runtime.records import StepState
    from swapkit.runtime.scope import Frame

#: Byte alignment of each storage inside a region (the largest element size, complex128).
ALIGN = 16


class Batch:
    """Swapped storages of one frame that share one host region and one copy each way."""

    __slots__ = ("step", "frame", "producer", "nbytes", "count", "data_bytes", "_sources", "host", "d2h",
                 "issued", "flushed", "kept", "copied", "device", "h2d", "arrived", "device_storage", "device_at",
                 "holders")

    def __init__(self, step: StepState, frame: Frame, producer: Any = None) -> None:
        self.step, self.frame, self.producer = step, frame, producer  # Note [A batch has one producer]
        self.nbytes = self.count = self.data_bytes = 0
        self._sources: list[Source] | None = []  # (storage, offset, bytes, address) until flushed
        self.host: torch.Tensor | None = None
        self.d2h: Any = None
        self.issued = -1
        self.flushed = False  # closed: copied, kept or discarded
        self.kept = False  # never copied (refused by the pool, or discarded): its storages stay on the device
        self.copied = False  # its copy to host was seen finished (swap_schedule Note [Releases never stall ...])
        self.device: torch.Tensor | None = None
        self.h2d: Any = None
        self.arrived = False  # its copy back was seen finished (arrival_seen)
        self.device_storage: torch.UntypedStorage | None = None  # device's storage and byte offset: read once
        self.device_at = 0
        self.holders = 0  # records that may still need the host region (until fetch gives it back)

    def fits(self, frame: Frame, nbytes: int, limit: int, producer: Any) -> bool:
        """Can a storage of ``nbytes`` saved in ``frame`` on ``producer`` join this open batch?"""
        return frame is self.frame and (producer is self.producer or producer == self.producer) and (
            self.nbytes == 0 or self.nbytes + nbytes <= limit)

    def add(self, storage: torch.UntypedStorage, nbytes: int, data_ptr: int) -> int:
        """Take the next slot for ``storage`` (``nbytes`` at ``data_ptr`` now); returns its byte offset in
        the region."""
        offset = self.nbytes
        self._sources.append((storage, offset, nbytes, data_ptr))
        self.nbytes = offset + -(-nbytes // ALIGN) * ALIGN
        self.count += 1
        self.data_bytes += nbytes
        self.holders += 1
        return offset

    def flush(self, issued: int) -> bool:
        """Queue the one device-to-host copy (Note [Coalesced copies]); False if the pool refused."""
        sources, self._sources, self.flushed = self._sources, None, True
        if self.holders == 0:
            return True  # every record died before its copy started: nothing to move
        try:  # swapkit.runtime.records Note [Storages another component may resize]
            check_storages(sources, self.frame.label)
        except StorageChangedError:
            self.kept = True  # its records are never released: nothing was copied
            raise
        host = self.step.pool.acquire(self.nbytes)
        if host is None:
            self.kept = True
            return False
        self.host, self.issued = host, issued  # returned by the records' let_go even if the copy fails
        self.d2h = self.step.engine.offload_storages(  # Note [A batch has one producer]
            host, sources, self.producer, self.frame.label)
        return True

    def discard(self) -> None:
        """Backward began while this batch was open: copy nothing, keep its storages on the device
        (Note [Coalesced copies]). It never took a host region."""
        self._sources, self.flushed, self.kept = None, True, True

    def fetch(self) -> None:
        """Issue the one host-to-device copy of the region (once); the host region returns to the pool."""
        if self.device is None:
            self.device, self.h2d = self.step.engine.prefetch(self.host)
            self.device_storage, self.device_at = self.device.untyped_storage(), self.device.storage_offset()
            self._return_host()

    def arrival_seen(self) -> bool:
        """Has the copy back finished? Remembered once it has: a copy that finished stays finished, and a
        failed one raises from ``engine.ready`` each time it is asked (called under the step's lock)."""
        self.arrived = self.step.engine.ready(self.h2d)
        return self.arrived

    def let_go(self) -> None:
        """A record no longer needs the host region (prefetched, used in place, or dead)."""
        self.holders -= 1
        if self.holders == 0:
            self._return_host()

    def _return_host(self) -> None:
        host, self.host = self.host, None
        if host is not None:
            self.step.pool.release(host)
