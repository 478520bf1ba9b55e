"""What the pack hook hands to autograd: a :class:`Saved` handle per saved tensor, and one
storage record per distinct storage (:class:`KeptRecord` or :class:`SwapRecord`).

Note [One move per storage]
Several saved tensors can share a storage (views; Q/K/V reading one input; ``weight.t()``).
Records are keyed by storage, so the bytes move once whatever the number of saves; every handle
keeps its own ``(dtype, size, stride, storage_offset)`` and unpack rebuilds exactly that view on
the restored storage. The whole storage is copied, so a small view of a large storage moves the
large storage.

Note [Version keepers]
With saved-tensor hooks installed autograd no longer checks that a saved tensor was not modified
in place. Each handle keeps the version the tensor had when saved and a *keeper*: ``tensor.detach()``,
which shares the tensor's storage and version counter but not its ``grad_fn``. Holding the
tensor itself would tie a cycle for every op that saves its own output (output -> grad_fn ->
saved variable -> handle -> output) through C++ autograd nodes, which Python's gc cannot see:
a graph dropped without backward would then never be freed, with its records, host buffers
and device memory. When a swapped storage is released, its keepers are emptied with ``set_()`` and
their version counters set back to what they were (:func:`empty_keepers`, what
``torch.autograd._unsafe_preserve_version_counter`` does): they stop holding device memory but keep
counting in-place writes, so unpack can still raise instead of returning stale data.

Note [Unpacks from several threads]
Autograd runs nodes of different devices on different threads at once (a CUDA device thread and
the CPU thread, or one thread per GPU), and unpack hooks run on those threads. Every change of a
record's or a step's state (backward start, prefetch issue, host buffer return, counters) happens
under the step's re-entrant lock; a restore takes the buffer and the copy handle under the lock
and waits outside it, so one slow copy does not serialize the other threads' unpacks.

Note [Storages another component may resize]
Another component may resize or free a storage autograd saved: FSDP2 frees its all-gathered
parameters with ``untyped_storage().resize_(0)`` after a layer's forward (``reshard_after_forward``)
and re-gathers them before its backward. An asynchronous copy of such a storage would read freed
memory: a crash on the thread engine, silent garbage on CUDA. swapkit never queues one for a
parameter (Note [Parameters are recognised when saved] in ``swapkit.runtime.step``). For any
other storage changed behind its back, the record remembers the storage's size and data pointer
when it is saved; the batch checks both when it queues the copy, the thread engine right before
and right after copying, and the record again when it releases the device copy. On CUDA the
release comes as soon as the copy is queued (``swapkit.runtime.swap_schedule`` Note [Stream-ordered
release]), so that check sees a change made between the flush and the release; a resize or free
after the copy was queued cannot reach the copy at all, since the allocator does not reuse the
freed block before the side stream passed the copy (``swapkit.engine.cuda`` Note [Copy sources are
released in stream order]). A mismatch raises :class:`~swapkit.engine.base.StorageChangedError`
naming the layer and op, never a copy the backward would trust. The one window no outside library
can close is a resize that runs *during* the thread engine's memcpy; that is why recognising
parameters, not this check, is the guarantee.

Note [Verify mode]
With ``runtime.verify: true`` a swapped record takes a checksum of its *device* storage when it is
released, before its keepers let go: the storage still holds the bytes autograd saved. It never
reads the host copy, which on CUDA may not have been written yet (the release follows the copy's
queueing, not its completion: ``swapkit.runtime.swap_schedule`` Note [Stream-ordered release]). The checksum
is queued where ``engine.reading_sources`` says: on CUDA the side stream, after the copy, which
waited for the storage's producer stream, while the allocator still holds the block; on the thread
engine inline, the copy having finished. When the prefetched copy is first used, after the engine's
wait, the checksum of the restored buffer must match, or backward raises naming the layer, the op
and the step (on CUDA the compute stream has then waited on the prefetch's event, which the side
stream recorded after the checksum). That covers the whole round trip (device-to-host copy, the
pooled host buffer while it waits, host-to-device copy): a reload race such as
NVIDIA/Megatron-LM#7398, which corrupted gradients while the loss still fell, fails loudly instead.
The checksum is the wrapping sum of the storage read as 64-bit words (plus the bytes past the last
whole word): one memory-bound pass on the device, and one host sync per restore to compare. It
catches overwritten, stale or zeroed buffers; it cannot see two words trading places.

Note [A record's torch calls in C++]
Of what a swapped save costs in Python, two torch calls per record are the largest: emptying the keeper at the
release (``set_()`` and putting its version counter back: about 2.2 us on the benchmarks' 2-core VM) and
rebuilding the saved view at the restore (an empty tensor and ``set_`` on the restored region: about 2.4 us).
A step therefore calls them through ``step.empty_keeper`` and ``step.view_on``: :func:`empty_keeper` and
:func:`view_on` here, or, in a session with ``runtime.native_save``, the same calls made in C++ by the module
of its C++ hooks (``record_ops.cpp``), with the same results: the same ``set_`` and version counter, the same
view (dtype, sizes, strides, offset, the lazy negative and conjugate bits).

Note [Record lifetime]
Records live exactly as long as the autograd graph holds their handles (plus, briefly, the
release queue; the prefetch queue holds them weakly: ``swapkit.runtime.schedule`` Note [The prefetch
queue holds its records weakly]). When the last handle dies the record's ``__del__`` returns its host buffer to
the pool and takes its bytes off the device accounting: nothing is stashed across steps.
The cyclic collector may run that finalizer on any thread, at any allocation, so it waits only for
the step's re-entrant lock, whose holders never wait for a lock a finalizer could hold: the pool's
``release`` never waits for the pool's lock (``swapkit.engine.pool`` Note [Releases never wait for the
pool's lock]), the engine's fence takes no lock, and the CUDA engine's own lock is never held across
an allocation (``swapkit.engine.cuda`` Note [No lock a finalizer waits on]). In the processes
``swapkit train`` owns, a stop signal (SIGINT, SIGTERM, SIGHUP) is never raised inside this finalizer,
which it would cut half-way (``swapkit.distributed.signals`` Note [Interrupts and finalizers]).
"""
from __future__ import annotations

import functools
import weakref
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

from swapkit.engine.base import storage_bytes, storage_changed
from swapkit.runtime.restored import handed_out

if TYPE_CHECKING:
    import threading

    from swapkit.engine import CopyEngine, HostPool
    from swapkit.runtime.scope import Frame
    from swapkit.runtime.stats import SwapStats


class StepState(Protocol):
    """What records and recipes need of the step that owns them (:class:`swapkit.runtime.step.Step`).

    Naming the needs here, rather than importing the step, keeps the runtime's dependencies one
    way: step -> recipes -> records.
    """

    number: int
    verify: bool
    empties: dict[torch.dtype, torch.Tensor]  # empty tensors on the device, one per dtype (records.view_on)
    view_on: Callable[..., torch.Tensor]  # records.view_on, or the C++ one (Note [A record's torch calls in C++])
    empty_keeper: Callable[[torch.Tensor], None]  # records.empty_keeper, or the C++ one (the same Note)
    engine: CopyEngine
    usable_when_ready: bool  # the engine's (swapkit.engine.base.CopyEngine)
    pool: HostPool
    lock: threading.RLock
    stats: SwapStats  # changed under ``lock`` (Note [Unpacks from several threads])

    #: ``bytes_changed(+n)`` / ``bytes_changed(-n)``: device bytes held, from any thread without a lock
    #: (swapkit.runtime.ledger Note [The device-bytes ledger])
    bytes_changed: Callable[[int], None]

    def late_fetch(self, lead: int, timing: Any) -> None: ...

    def verified(self) -> None: ...

    def output_recomputed(self, nbytes: int) -> None: ...


class Saved(tuple):
    """The object autograd stores instead of a saved tensor: ``(keeper, version, step, tick, record, meta,
    frame)``, read by name. A tuple built by :func:`make_saved` costs one C call, where a class's
    ``__init__`` costs a Python frame (``swapkit.runtime.step`` Note [The cost of a save]); the hot unpack
    reads it by index."""

    __slots__ = ()
    __eq__, __ne__, __hash__ = object.__eq__, object.__ne__, object.__hash__  # a handle is equal only to itself
    keeper = property(itemgetter(0), doc="Note [Version keepers]")
    version = property(itemgetter(1), doc="the keeper's version when saved")
    step = property(itemgetter(2), doc="the step that saved it (None: a pack during backward)")
    tick = property(itemgetter(3))
    record = property(itemgetter(4), doc="its storage's record (None: kept without one)")
    meta = property(itemgetter(5), doc="(dtype, size, stride, storage_offset, conj, neg) of a swapped view")
    frame = property(itemgetter(6))


#: ``make_saved((keeper, version, step, tick, record, meta, frame))``: a :class:`Saved`.
make_saved = functools.partial(tuple.__new__, Saved)


class KeptRecord(list):
    """A storage that stays on the device; exists for storage de-duplication and accounting.

    ``KeptRecord((step, nbytes, version, keeper))``, read by name. Most saves of a step that keeps are
    each a new storage, so a record is built at nearly every save: as a list it is built by one C call,
    where a class's ``__init__`` costs a Python frame (``swapkit.runtime.step`` Note [The cost of a save];
    :class:`Saved` is a tuple for the same reason, but a tuple takes no weak reference, which the
    step's storage index holds). It holds its first save's keeper, and so its storage: that adds no
    lifetime, since every handle of the record holds a keeper of the same storage. While it lives, no
    other storage can have its index key (:func:`storage_key`)."""

    __slots__ = ("__weakref__",)
    __eq__, __ne__, __hash__ = object.__eq__, object.__ne__, object.__hash__  # a record is equal only to itself
    __repr__ = object.__repr__  # not its storage's bytes
    swapped = released = False
    step = property(itemgetter(0))
    nbytes = property(itemgetter(1))
    version = property(itemgetter(2), doc="its storage's version when first saved")

    def storage(self) -> torch.UntypedStorage:
        """The storage this record stands for (``SwapRecord.storage`` is a weak reference)."""
        return self[3].untyped_storage()

    def __del__(self) -> None:  # Note [Record lifetime]
        self[0].bytes_changed(-self[1])


class SwapRecord:
    """A storage copied to host memory, released from the device, and prefetched back.

    Its bytes travel in a slot of a :class:`~swapkit.runtime.batch.Batch` (Note [Coalesced copies] in
    ``swapkit.runtime.batch``): one host region and one copy each way for the storages of a scope."""

    __slots__ = ("step", "nbytes", "version", "frame", "horizon", "keeper", "more", "batch", "offset", "released",
                 "device_buffer", "h2d", "issued_at", "waited", "resident", "storage", "data_ptr", "checksum",
                 "needs_host", "restored", "__weakref__")
    swapped = True

    def __init__(self, step: StepState, nbytes: int, version: int, frame: Frame, tick: int, batch: Any,
                 storage: torch.UntypedStorage, keeper: torch.Tensor) -> None:  # batch: a swapkit.runtime.batch.Batch
        self.step, self.nbytes, self.version, self.frame = step, nbytes, version, frame
        self.horizon = tick + frame.prefetch
        self.keeper: torch.Tensor | None = keeper  # the first save's (Note [Version keepers])
        self.more: tuple[torch.Tensor, ...] = ()  # later saves' keepers, before the release (no list per record)
        self.storage, self.data_ptr = weakref.ref(storage), storage.data_ptr()
        self.checksum: torch.Tensor | None = None  # Note [Verify mode]
        self.batch, self.offset = batch, batch.add(storage, nbytes, self.data_ptr)
        self.needs_host = True  # holds a share of the batch's host region until it lets go
        self.resident = True
        self.released = False
        self.device_buffer: torch.Tensor | None = None
        self.h2d: Any = None
        self.issued_at = -1  # the backward tick whose unpack issued the prefetch
        self.waited = False
        self.restored: dict[tuple, tuple[torch.Tensor, int]] | None = None  # set by fetch: swapkit.runtime.restored

    def saved_again(self, tick: int) -> None:
        """A later save of this storage keeps it (or brings it back) until ``tick + k``."""
        self.horizon = max(self.horizon, tick + self.frame.prefetch)

    def release(self) -> None:
        """Drop every device reference; the copy has finished or, on an engine with
        ``stream_ordered_release``, been queued (Note [Version keepers])."""
        storage = self.storage()  # alive: the keepers hold it until now
        if storage is not None and (storage.nbytes() != self.nbytes or storage.data_ptr() != self.data_ptr):
            raise storage_changed(self.nbytes, storage.nbytes(), self.frame.label)  # Note [Storages another ...]
        if self.step.verify and storage is not None:  # Note [Verify mode]
            engine = self.step.engine
            with engine.reading_sources():
                self.checksum = checksum(storage_bytes(storage, engine.device))
        if self.more:
            empty_keepers((self.keeper, *self.more))
        else:  # one save of the storage, the common case: no tuple built (step Note [The cost of a save])
            self.step.empty_keeper(self.keeper)  # Note [A record's torch calls in C++]
        self.keeper, self.more = None, ()
        self.released = True
        self.resident = False
        self.step.stats.released_bytes += self.nbytes
        self.step.bytes_changed(-self.nbytes)

    def fetch(self, tick: int) -> None:
        """Start the host-to-device copy (once) at backward tick ``tick``; the host buffer can go
        back to the pool at once (``swapkit.engine.pool.Note [Host buffer reuse is ordered by the
        copy queue]``). Called under the step's lock (Note [Unpacks from several threads])."""
        if self.device_buffer is not None:
            return
        step, batch, stats = self.step, self.batch, self.step.stats
        self.issued_at = tick
        if batch.device is None:
            batch.fetch()
            stats.prefetch_copies += 1
        self.device_buffer, self.h2d = batch.device, batch.h2d  # the whole region: restore reads at offset
        self.restored = {}  # swapkit.runtime.restored Note [Writes to restored tensors]
        self.needs_host = False  # the batch's fetch gave its host region back to the pool: nothing to let go
        stats.prefetched_tensors += 1
        stats.prefetched_bytes += self.nbytes
        if not self.resident:  # back on the device
            step.bytes_changed(self.nbytes)
            self.resident = True

    def restore(self, meta: tuple, tick: int) -> torch.Tensor:
        """The saved view (saved at ``tick``), rebuilt on the prefetched storage; waits for the
        copy if it is not done (a late fetch). Note [Unpacks from several threads]."""
        step, batch = self.step, self.batch
        with step.lock:
            first = not self.waited
            late = self.device_buffer is None or (first and not (batch.arrived or batch.arrival_seen()))
            if self.device_buffer is None:
                self.fetch(tick)
            buffer, copy, lead = self.device_buffer, self.h2d, self.issued_at - tick
            if first:
                self.waited = True
                if not late and lead > 0:  # its copy finished without error (ready said so): the wait cannot fail
                    step.stats.prefetch_lead_ticks += lead
            restored = self.restored
            if restored:  # a view handed out before: checked for writes (swapkit.runtime.restored)
                view = handed_out(restored, meta, self.frame.label, step.number, step.view_on, batch.device_storage,
                                  batch.device_at + self.offset, meta, step.empties)
            else:  # the first: nothing to check, no frame for it (step Note [The cost of a save])
                view = step.view_on(batch.device_storage, batch.device_at + self.offset, meta, step.empties)
                restored[meta] = (view, view._version)
        timing = step.engine.wait(copy, timed=late and first) if late or not (
            batch.arrived and step.usable_when_ready) else None  # seen finished: nothing to wait for
        if first:
            if late:  # counted once the copy arrived: a failed one counts nowhere
                step.late_fetch(lead, timing)
            if self.checksum is not None:
                self._verify(buffer)
        return view

    def _verify(self, buffer: torch.Tensor) -> None:
        """Note [Verify mode]"""
        expected, self.checksum = self.checksum, None
        got = checksum(slot(buffer, self.offset, self.nbytes))  # this record's bytes of the batch's region
        if not torch.equal(got, expected):
            raise RuntimeError(
                f"swapkit verify: the bytes restored for a tensor saved in {self.frame.label} during step "
                f"{self.step.number} differ from those offloaded (checksum {got.item()} != {expected.item()}, "
                f"{self.nbytes} bytes); a device-to-host copy, its host buffer or the prefetch was corrupted. "
                "Its gradients would be wrong.")
        self.step.verified()

    def drop_host_copy(self) -> None:
        """Backward began before this storage was released: it is used from the device as is."""
        with self.step.lock:
            self._let_go()

    def _let_go(self) -> None:
        if self.needs_host:
            self.needs_host = False
            self.batch.let_go()

    def __del__(self) -> None:  # Note [Record lifetime]
        try:
            needs_host, resident = self.needs_host, self.resident
        except AttributeError:  # a failed __init__ set neither (they are set together, after the batch slot)
            return
        if needs_host:
            with self.step.lock:
                self._let_go()
        if resident:
            self.step.bytes_changed(-self.nbytes)


def empty_keepers(keepers: tuple[torch.Tensor, ...]) -> None:
    """Let ``keepers`` stop holding their storage while they go on counting in-place writes (Note [Version
    keepers]): ``set_()`` each, then put their version counters back as they were. The private setter
    ``torch.autograd._unsafe_preserve_version_counter`` calls, without its context manager's Python
    (swapkit.runtime.step Note [The cost of a save])."""
    versions = tuple(map(_version_of, keepers))
    try:
        for keeper in keepers:
            keeper.set_()
    finally:  # a failed set_ (a dispatch mode refusing it) must not leave a false in-place write behind
        _set_versions(keepers, versions)


def empty_keeper(keeper: torch.Tensor) -> None:
    """:func:`empty_keepers` of one keeper."""
    version = keeper._version
    try:
        keeper.set_()
    finally:
        _set_versions((keeper,), (version,))


_set_versions = torch._C._autograd._unsafe_set_version_counter
_version_of = attrgetter("_version")


def is_parameter(tensor: torch.Tensor) -> bool:
    """``isinstance(tensor, nn.Parameter)`` without the metaclass hook's cost for plain tensors: a
    plain tensor counts as a parameter only through an ``_is_param`` attribute in its ``__dict__``."""
    if type(tensor) is torch.Tensor:
        return bool(tensor.__dict__) and bool(tensor.__dict__.get("_is_param", False))
    return isinstance(tensor, torch.nn.Parameter)


def checksum(flat: torch.Tensor) -> torch.Tensor:
    """Wrapping sum of a flat ``uint8`` buffer read as 64-bit words, plus its last ``n % 8`` bytes
    (Note [Verify mode]). ``int64`` words need no widening copy: one pass at memory speed."""
    head = flat.numel() - flat.numel() % 8
    return flat[:head].view(torch.int64).sum() + flat[head:].sum(dtype=torch.int64)


def slot(region: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
    """``region[offset:offset + nbytes]`` of a flat ``uint8`` buffer, built with ``set_`` as :func:`rebuild`
    builds views (no slicing op: a dispatch-mode op count of backward sees none)."""
    flat = torch.empty(0, dtype=torch.uint8, device=region.device)
    return flat.set_(region.untyped_storage(), region.storage_offset() + offset, (nbytes,), (1,))


def view_meta(tensor: torch.Tensor) -> tuple:
    """What ``rebuild`` needs, including the lazy conjugate / negative bits of a view.

    Every item is an object the cyclic garbage collector does not track: the size is a plain tuple,
    not a ``torch.Size`` (a tuple subclass, which the collector tracks for life). So the collector
    untracks the whole tuple at its first look and never carries it into the old generation, whose
    growth triggers full collections (swapkit.runtime.step Note [The cost of a save])."""
    return (tensor.dtype, tuple(tensor.size()), tensor.stride(), tensor.storage_offset(), tensor.is_conj(),
            tensor.is_neg())


def rebuild(buffer: torch.Tensor, meta: tuple, empties: dict[torch.dtype, torch.Tensor]) -> torch.Tensor:
    """The view ``meta`` describes, on the storage of ``buffer``, ``buffer.storage_offset()`` bytes in (Note
    [One move per storage])."""
    return view_on(buffer.untyped_storage(), buffer.storage_offset(), meta, empties)


def view_on(storage: torch.UntypedStorage, at: int, meta: tuple,
            empties: dict[torch.dtype, torch.Tensor]) -> torch.Tensor:
    """The view ``meta`` describes, on ``storage`` from byte ``at`` (a record's slot of a batch's region,
    aligned to ``batch.ALIGN``). The new tensor is ``Tensor.new`` of an empty one cached per dtype in
    ``empties`` (a step's, all on its device), which skips ``torch.empty``'s argument parsing
    (swapkit.runtime.step Note [The cost of a save])."""
    dtype, size, stride, offset, conj, neg = meta
    template = empties.get(dtype)
    if template is None:
        template = empties[dtype] = torch.empty(0, dtype=dtype, device=storage.device)
    out = template.new().set_(storage, offset + at // dtype.itemsize, size, stride)
    if neg:
        out = torch._neg_view(out)
    return out.conj() if conj else out


def storage_key(tensor: torch.Tensor) -> int:
    """The key of ``tensor``'s storage in a step's storage index: the address of its ``StorageImpl``
    (``UntypedStorage._cdata``), which the native save path reads without making the Python storage
    object (``swapkit.runtime.native`` Note [The native save path]). Unique among live storages; a
    record that does not keep its storage alive checks identity too (``swapkit.runtime.step`` Note [The
    cost of a save])."""
    return tensor.untyped_storage()._cdata


def is_plain(tensor: torch.Tensor) -> bool:
    """A dense strided tensor whose bytes are its storage (no subclass, nested or quantized)."""
    return (type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.layout == torch.strided
            and not tensor.is_nested and not tensor.is_quantized)
