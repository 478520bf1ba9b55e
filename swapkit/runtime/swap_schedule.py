"""A step's swap schedule: when each swapped storage is copied, released and fetched back (DESIGN §4).

The step (``swapkit.runtime.step``) decides at a save whether a new storage is swapped; from then on its
:class:`~swapkit.runtime.records.SwapRecord` belongs to the step's :class:`SwapSchedule`: the open batch it
joins (``swapkit.runtime.batch`` Note [Coalesced copies]), the release queue of forward, the records
waiting for their copy, and the prefetch queue of backward.

Note [Releases never stall compute]
At each tick the records whose horizon has come are released without waiting: at once where the
engine orders reuse after queued copies (Note [Stream-ordered release]), else only if their copy
has finished (``engine.ready``), the others being looked at again on the next tick. A larger
``backward_prefetch`` holds device memory longer but the forward never waits on a copy. Copies
finish in issue order (one FIFO queue per engine), so the waiting records are kept by issue order
(a deque, as records come due in that order almost always; one out of order is inserted) and the
check stops at the first unfinished one. ``engine.ready`` is asked once per batch, not per record:
the batch remembers a copy seen finished (``Batch.copied``), which stays finished, while a failed
copy raises from ``ready`` each time it is asked and is never remembered.

Note [Stream-ordered release]
On a GPU the CPU runs far ahead: at the forward's saves no copy has executed, so waiting for
finished copies would release nothing before backward and make everything tail (the peak of no
swap). An engine with ``stream_ordered_release`` (CUDA) releases a due record once its batch's
copy is *queued*: the source was ``record_stream``-ed on the side stream, so the caching allocator
reuses its block only after the side stream ran the copy (``swapkit.engine.cuda`` Note [Copy
sources are released in stream order]); ``released_bytes`` counts it at once. On CPU no allocator
orders reuse after a queued memcpy, so the thread engine keeps waiting for ``ready``. The release's
storage check still sees any change made before it, and verify's checksum reads the device storage
in order with the copy, never the unfinished host copy (``swapkit.runtime.records`` Notes [Storages
another component may resize], [Verify mode]).

Note [The last k ticks stay on the device]
Records still unreleased when backward begins (their horizon lies beyond the last forward tick,
or their copy had not finished) are used from the device as they are: no round trip, and their
host copies go straight back to the pool. The batch still open then is discarded, not copied
(``swapkit.runtime.batch`` Note [Coalesced copies]): its storages count as ``skipped["tail"]``. The
session remembers the forward length, and in later steps does not offload saves that would land in
that tail (``runtime.skip_tail_offload``, tested by the step before it makes a record): a save at
tick ``t`` with distance ``k`` is skipped when ``t < length <= t + k``. A save at or past the learnt
length proves the prediction wrong (this forward is longer: LayerDrop, an MoE routing more experts,
two forwards before one backward) and is offloaded as in the first step; skipping it too would keep
everything past the old length.

Note [A backward prefetches its own forward's records]
The prefetch queue pops every record whose horizon is at or above the tick unpacked, which is right
for the backward of the whole step: it reads its ticks downwards from the top, so whatever lies above
was needed already. Two forwards in one block, then one backward each (``a.backward()`` then
``b.backward()``), break that: the first backward starts at the top of forward ``a``, below every
tick of forward ``b``, and brought all of ``b``'s swapped storages back to the device at once, where
they waited through ``a``'s backward: no swap for ``b`` at all. No record a backward reads has a
horizon above the highest tick it has read plus the step's longest swap distance, or above the
horizon of a record it has read (the *reach*): autograd reads a graph from its highest sequence
number down, the saves of one node in save order, and a storage saved again later (``x`` and
``x.t()`` saved by one node) is read first at its earlier tick. So a record popped above the reach belongs to
another forward (or to a part of this one no backward reads): it is set aside, held weakly, and
pushed back on the queue once an unpack raises the reach over its horizon: the next saves of the
same node, or ``b``'s backward, which prefetches it in time. The reach only rises (a nested graph
task of reentrant checkpointing returns to its outer task at a lower tick). A record both forwards
saved (a storage both read) is set aside too and fetched when ``a`` first reads it (a late fetch,
still exact). A micro-step is one forward and other micro-steps' look-ahead pops its queue, so it sets
nothing aside (``swapkit.runtime.microsteps``).
"""
from __future__ import annotations

import bisect
import operator
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

import torch

from swapkit.runtime.batch import Batch
from swapkit.runtime.records import StepState, SwapRecord, empty_keeper
from swapkit.runtime.schedule import TickQueue

if TYPE_CHECKING:
    from swapkit.config.types import RuntimeConfig
    from swapkit.runtime.reached import ScopesReached
    from swapkit.runtime.scope import Frame

_horizon = operator.attrgetter("horizon")  # a record's tick key, read in C (step Note [The cost of a save])

#: ``(batch.issued, offset)``: where a record's bytes are in the engine's FIFO copy queue (swapkit.runtime.batch
#: Note [Coalesced copies]), read in C
_copy_order = operator.attrgetter("batch.issued", "offset")


class ScheduledStep(StepState, Protocol):
    """What the schedule needs of its step (:class:`swapkit.runtime.step.Step`), named here so that the
    dependencies stay one way: step -> swap schedule -> records."""

    runtime: RuntimeConfig
    scopes: ScopesReached
    sets_aside: bool  # Note [A backward prefetches its own forward's records]
    clock: int


class SwapSchedule:
    """The swap records of one step, from their first save to their fetch back in backward.

    Args:
        step: the step that saves them; its records, batches and counters are the step's own. The
            schedule holds it weakly: the step holds the schedule, and a step no longer referenced is
            freed by its reference count, not left to the cyclic collector.
    """

    def __init__(self, step: ScheduledStep) -> None:
        self._step = weakref.ref(step)
        self.engine, self.stats, self.scopes = step.engine, step.stats, step.scopes
        self._batch_limit = step.runtime.offload_batch_bytes
        self._batch: Batch | None = None  # the open batch (swapkit.runtime.batch Note [Coalesced copies])
        self._producer = step.engine.producer  # swapkit.runtime.batch Note [A batch has one producer]
        self._release_queued = step.engine.stream_ordered_release  # Note [Stream-ordered release]
        self._sets_aside = step.sets_aside  # Note [A backward prefetches its own forward's records]
        self._batches = 0  # batches flushed: their copy order
        self._release: TickQueue[SwapRecord] = TickQueue(_horizon)
        self._pending: deque[SwapRecord] = deque()  # due, copy unfinished, in copy order (Note [Releases ...])
        self._prefetch: TickQueue[SwapRecord] = TickQueue(_horizon, descending=True, weak=True)  # Note [The
        # prefetch queue holds its records weakly] in swapkit.runtime.schedule
        self._longest = 0  # the longest swap distance of the step's records
        self._reach = -1  # the highest tick unpacked plus _longest: no record above it is prefetched (Note [A
        # backward prefetches its own forward's records])
        self._beyond: list[weakref.ref] = []  # records due but above the reach, for a later backward

    # ------------------------------------------------------------------ forward

    def add(self, storage: torch.UntypedStorage, nbytes: int, version: int, frame: Frame, tick: int,
            keeper: torch.Tensor) -> SwapRecord:
        """The swap record of a new storage saved at ``tick`` in ``frame``'s swap scope, in a batch's slot."""
        batch, producer = self._batch, self._producer()  # swapkit.runtime.batch Note [A batch has one producer]
        if batch is None or not batch.fits(frame, nbytes, self._batch_limit, producer):
            batch = self._open_batch(frame, producer)
        record = SwapRecord(self._step(), nbytes, version, frame, tick, batch, storage, keeper)
        if frame.prefetch > self._longest:
            self._longest = frame.prefetch
        stats = self.stats
        stats.offloaded_tensors += 1
        stats.offloaded_bytes += nbytes
        stats.offloaded_by_scope[frame.label] += nbytes
        self._release.push(record)
        if not self._batch_limit:
            self.flush()
        return record

    def saved_again(self, record: SwapRecord, keeper: torch.Tensor, tick: int) -> None:
        """A later save of ``record``'s storage at ``tick``, kept by ``keeper``, pushes its horizon out."""
        record.saved_again(tick)
        if record.released:  # the storage lives on elsewhere; its bytes are already on the host
            empty_keeper(keeper)
            self._prefetch.push(record)  # its horizon moved out: prefetch earlier
        else:
            record.more += (keeper,)

    def frame_changed(self, frame: Frame | None) -> None:
        """A save from another frame than the previous one: the open batch is flushed if the scope changed
        (swapkit.runtime.batch Note [Coalesced copies])."""
        if self._batch is not None and frame is not self._batch.frame:
            self.flush()

    def _open_batch(self, frame: Frame, producer: Any) -> Batch:
        """Flush the open batch, which a new swap record cannot join, and open the one it joins
        (swapkit.runtime.batch Notes [Coalesced copies], [A batch has one producer])."""
        self.flush()
        batch = self._batch = Batch(self._step(), frame, producer)
        return batch

    def flush(self) -> None:
        """Queue the open batch's copy; if the pool refused its region, its storages stay on the device."""
        batch, self._batch = self._batch, None
        if batch is None or batch.flushed:
            return
        self._batches += 1
        if not batch.flush(self._batches):
            self._not_offloaded(batch, "host_cap")
        elif batch.d2h is not None:
            self.stats.offload_copies += 1

    def _not_offloaded(self, batch: Batch, reason: str) -> None:
        """A batch's storages were counted as offloaded when saved, but stay on the device: ``reason``."""
        stats, label = self.stats, batch.frame.label
        stats.offloaded_tensors -= batch.count
        stats.offloaded_bytes -= batch.data_bytes
        stats.offloaded_by_scope[label] -= batch.data_bytes
        if not stats.offloaded_by_scope[label]:
            del stats.offloaded_by_scope[label]
        stats.skipped[reason] += batch.data_bytes
        self.scopes.kept_in(batch.frame, reason, 0)

    def advance(self, tick: int) -> None:
        """Release the records whose horizon has come and whose copy was queued (Note [Stream-ordered
        release]) or has finished (Note [Releases never stall compute])."""
        pending = self._pending
        for record in self._release.pop_due(tick):
            if not record.batch.flushed and record.batch is self._batch:
                self.flush()  # due before its batch filled (swapkit.runtime.batch Note [Coalesced copies])
            if record.batch.kept:  # never copied: its storages stay on the device
                continue
            if self._release_queued:
                record.release()
                self._prefetch.push(record)
            elif not pending or _copy_order(pending[-1]) < _copy_order(record):
                pending.append(record)
            else:
                bisect.insort(pending, record, key=_copy_order)
        while pending and (pending[0].batch.copied or self._copy_finished(pending[0].batch)):
            record = pending.popleft()  # Note [Releases never stall compute]
            record.release()
            self._prefetch.push(record)  # its bytes come back in backward

    def _copy_finished(self, batch: Batch) -> bool:
        """Has ``batch``'s copy to host finished? Remembered once it has (Note [Releases never stall compute])."""
        batch.copied = self.engine.ready(batch.d2h)
        return batch.copied

    def finish_forward(self) -> None:
        """Forward ended without a backward yet: wait for copies, release what is due by its last tick."""
        self.flush()
        self.engine.synchronize()
        self.advance(self._step().clock - 1)

    # ------------------------------------------------------------------ backward

    def begin_backward(self) -> None:
        """Backward began: the open batch is not copied, and what was not released stays on the device
        (Note [The last k ticks stay on the device])."""
        batch, self._batch = self._batch, None
        if batch is not None and not batch.flushed:
            batch.discard()
            self._not_offloaded(batch, "tail")
        for record in [*self._pending, *self._release.drain()]:
            record.drop_host_copy()
            if not record.batch.kept:
                self.stats.tail_bytes += record.nbytes
        self._pending.clear()

    def unpacked(self, tick: int, record: Any) -> bool:
        """Backward unpacked a tensor saved at ``tick`` (its storage's ``record``, if any): fetch every record
        due by then. True when nothing was due and nothing is left to fetch. Under the step's lock."""
        if self._sets_aside:
            top = record.horizon if type(record) is SwapRecord and record.horizon > tick + self._longest \
                else tick + self._longest  # a storage saved again later reaches its last save
            if top > self._reach:
                self._reach_up(top)
        due = self._prefetch.pop_due(tick)
        for record in due:
            if record.horizon <= self._reach or not self._sets_aside:
                record.fetch(tick)
            else:  # Note [A backward prefetches its own forward's records]
                self._beyond.append(weakref.ref(record))
        return not due and not (self._beyond or self._prefetch)

    def _reach_up(self, reach: int) -> None:
        """An unpack above every tick read so far: fetch the records set aside that are now within reach
        (Note [A backward prefetches its own forward's records])."""
        self._reach = reach
        if self._beyond:
            records = [record for record in (ref() for ref in self._beyond) if record is not None]
            self._beyond = [weakref.ref(record) for record in records if record.horizon > reach]
            for record in records:
                if record.horizon <= reach:
                    self._prefetch.push(record)  # popped when an unpack comes due for it

    def fetch_from(self, bound: int) -> None:
        """Fetch every released record with horizon ``>= bound`` (a micro-step's look-ahead,
        ``swapkit.runtime.microsteps``). Under the step's lock."""
        for record in self._prefetch.pop_due(bound):
            record.fetch(bound)

    def close(self) -> None:
        """Drop every queue: records live on only through the graph's handles."""
        self._batch = None  # an open batch's sources go with it; its records keep it for their lifetime
        self._release.drain()
        self._prefetch.drain()
        self._beyond.clear()
        self._pending.clear()
