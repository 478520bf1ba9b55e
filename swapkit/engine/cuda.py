"""CUDA copy engine: a side stream, events per copy, pinned host buffers.

Note [D2H waits for the producer]
A saved activation may still be being written by kernels queued on its producer stream when the
pack hook runs (the CPU runs ahead of the GPU). The side stream therefore waits on that stream
before the device-to-host copy, so the copy reads finished data. The producer is the stream that was
current when the storage was *saved* (``producer``), which a batch remembers (``swapkit.runtime.batch``
Note [A batch has one producer]), not the stream current when the batch is flushed: a forward run
under ``with torch.cuda.stream(s):`` inside ``with session:`` is flushed at the block's exit on the
default stream, and two branches of a forward on two streams flush each other's batches.

Note [H2D target reuse]
The device buffer a prefetch fills is allocated on the compute stream, as DESIGN section 5 asks: it
then behaves like any compute-stream tensor once the compute stream has waited on the copy's event.
The caching allocator may hand out a block whose previous owner's last kernels are still queued
on the compute stream; the side stream waits on the compute stream before writing, so it can
never overwrite memory such a kernel still reads.

Note [Copy sources are released in stream order]
The device side of a device-to-host copy (a saved storage) is ``record_stream``-ed on the side stream
when its copy is queued, and the engine keeps no reference to it. Whenever the storage is then
freed -- released by its record once due (``swapkit.runtime.swap_schedule`` Note [Stream-ordered release]),
its graph dropped mid-forward, a branch whose backward never runs, or a component that calls
``resize_(0)`` on it -- the caching allocator records an event on the side stream at the free and
hands the block out again only after that event, that is after every side-stream copy queued up to
the free, this one included. ``torch.cuda.memory_allocated()`` drops at the free; the block
itself waits (the allocator synchronizes only when it runs out of memory and must reclaim it). So the
CPU never waits for a copy before dropping a storage, however far ahead of the GPU it runs, and no
copy can read a reused block. Holding the source until the copy's event completed instead (what
this engine did before) kept the memory allocated until the CPU next looked after the GPU had run
the copy: in a GPU-bound forward that is after the forward, and swapping saved nothing.
The cost: a block freed while the side stream is behind waits for every copy queued before its free,
not only its own. ``record_stream`` protects only blocks of PyTorch's caching allocator; a saved
tensor whose memory comes from elsewhere (DLPack from another library) must outlive its copy by
other means.

Note [Host targets outlive their copies]
The host side of every copy (a view of a pool slab: the D2H target, the H2D source) stays in
:class:`Inflight` until the copy's event has completed. Host slabs are not the CachingHostAllocator's
(``swapkit.engine.pinned``), which would record events for them, so nothing but this reference keeps a
slab mapped while a copy uses it after the pool was cleared. The device target of a prefetch stays
there too until the stream it was allocated on has joined the copy (Note [A joined prefetch target
is stream-ordered]), so it cannot go back to the allocator while the side stream still writes it,
even if every record that would read it dies first (a graph freed in the middle of its backward).

Note [A joined prefetch target is stream-ordered]
Once the compute stream the target was allocated on has waited on the copy's event, everything that
stream runs later -- the block's next owner included, since the allocator hands a freed block out
again in that stream's order -- runs after the copy. From then on the target needs no other guard
and is dropped from :class:`Inflight`: it is freed when autograd lets go of its last saved view, in
the order the CPU issues work, as any compute-stream tensor. Holding it until the copy's event
completed instead (what this engine did before) tied device memory to how far the GPU lags the CPU:
in a GPU-bound backward the CPU issues every prefetch long before the GPU runs them, so every
target stayed allocated at once, and the step's peak (``max_memory_allocated``) fell by 6% where the
saved bytes fell by 82% (an H100, benchmarks/results/cuda). ``record_stream`` on the side stream
would not help: the allocator would then wait for the side stream to pass the free, which is as far
behind. A target whose own stream never joins (the records die unread, or only another stream reads
them) stays held until the copy completed, as before. It must be the target's *own* stream: a block
goes back only to the stream it was allocated on, and with expandable segments the allocator unmaps
memory after synchronizing that stream alone, so a wait queued on any other stream would leave the
side-stream copy unordered against both. This relies on a stream-ordered allocator (the native
caching allocator, or ``cudaMallocAsync``), as Note [Copy sources are released in stream order] does.

Note [A prefetched buffer used on another stream]
A prefetched buffer belongs to the stream that was current when the prefetch was issued. If a
backward node that unpacks it runs on another stream (a forward that used several streams), the
buffer is ``record_stream``-ed on that stream at the wait, so the allocator does not reuse it
while that stream may still read it.

Note [Fences are the last copy's event]
The pool parks a released host range until a fence passes (``swapkit.engine.pool`` Note [Slab
lifetimes]). The side stream runs its copies in order, so the event of the last copy queued before
the release is such a fence: no extra event is recorded per release.

Note [No lock a finalizer waits on]
The cyclic garbage collector runs finalizers (``SwapRecord.__del__``, which gives host regions back
to the pool, which asks for a fence) on whatever thread allocates, at any allocation: one made while
that thread holds a lock runs a finalizer that must not wait for the same lock. So:
``fence`` reads the last event with one attribute read, no lock (a reference assignment is atomic
in Python), and :meth:`Inflight.prune` stops when the lock is taken (the next copy prunes). Nor does
any code hold the lock across a call that allocates Python objects (the collector runs only at an
allocation): ``prune`` queries the event outside it and takes it only to pop, ``keep_until`` builds
its entry before taking it. So no finalizer runs while the lock is held, and a thread holding the
step's lock that waits for this one (a prefetch issued in an unpack) waits only for a few
allocation-free lines, never for a finalizer that wants the step's lock.

Note [One job per coalesced batch]
``offload_storages`` moves the storages of one coalesced batch (``swapkit.runtime.batch`` Note [Coalesced
copies]) into one pinned host region: it builds a flat ``uint8`` view of each whole storage on this
device and its slot of the region (``swapkit.engine.base.region_pairs``), then ``offload_many`` queues
one ``wait_stream`` of the side stream on the batch's producer
stream before any source is read (Note [D2H waits for the producer]), then one ``copy_`` per storage
into its slot of the region, all queued back to back on the side stream, and one event recorded after
the last of them: the batch is ready when that event is. The prefetch brings the whole region back
with one ``copy_`` into one device buffer and one event; every record rebuilds its views on that
buffer at its offset. Lifetimes: Note [Copy sources are released in stream order] for the sources,
Note [Host targets outlive their copies] for the region. Reuse: a region the records let go of goes
back to the pool, which hands its range out again only after a fence (Note [Fences are the last
copy's event]) has passed.

Note [A copy is joined once per stream]
A coalesced prefetch is one copy and one event for every record of its batch, and each record's
first use calls ``wait``. Once a stream has waited on the event (and the buffer was recorded on
it), everything queued on that stream later is ordered after the copy, so a second ``wait`` from the
same stream has nothing to add and returns at once. ``joined`` lists the streams that have waited
(the wrappers are ``CurrentStream``'s, so ``in`` matches by identity first). A stream is added only
after its ``wait_event`` is queued, so two threads racing on one copy may both wait (harmless),
never neither. A timed wait (a late fetch) always queues its events: the measurement is of that
wait. ``Stream`` equality is by handle, so the one case that would skip a needed wait is a user
destroying an external stream while a copy is live and creating another that gets the same handle.

Note [Switching to the side stream]
Every copy is queued with the side stream made current and the caller's stream restored after,
as ``with torch.cuda.stream(side):`` does. That context manager, though, parses a device argument
and builds a ``Stream`` wrapper on entry, and asks the driver how many devices there are (twice):
on an H100 host about a tenth of the swap path's CPU time in the microbenchmark's profile
(benchmarks/results/cuda/lease3/overhead). :class:`SideStream` does the same two stream switches with
``torch.cuda.set_stream``, and reads the stream to restore through ``CurrentStream``. One difference
matters: ``set_stream`` of a stream on another device also makes that device current, which
``torch.cuda.stream`` undoes on exit and a plain ``set_stream`` back would not, so when the current
device is not the engine's the switch goes through ``torch.cuda.stream`` as before. What to restore
is kept per ``with`` (a new ``SideStream`` each time), never on the engine: copies are queued from
several threads (forward on the main thread, prefetches from autograd's device thread), and CUDA's
current stream is per thread.

Note [Compute stream is read at use]
The current stream is read on every call, never cached: backward runs on the autograd device thread
with the stream of each forward op set as current, and users may run forward under their own
stream. What is cached is the Python wrapper: ``torch.cuda.current_stream(device)`` parses its
device argument and builds a new ``Stream`` each call (about a third of the CUDA engine's CPU time
per saved tensor on an H100 host, benchmarks/results/cuda/overhead). ``CurrentStream`` reads the
raw ``(stream_id, device_index, device_type)`` from the C getter that function itself calls and
maps it to one ``Stream`` per distinct stream. A ``Stream`` wrapper holds no resource (the stream
belongs to its pool or its creator), so keeping one alive keeps nothing alive.

Note [No copies inside CUDA graph capture]
While the current stream captures a CUDA graph (``torch.cuda.graph``, ``make_graphed_callables``, and
the recordings of ``torch.compile(mode="reduce-overhead")``), work queued on it is recorded, not run, and
replayed later on whatever those addresses then hold. A swap copy recorded there would replay into a
host slab the pool has long given to another batch, the side stream's wait on the capturing stream
is itself refused by CUDA, and pinning a new slab is an API call capture forbids: each fails deep in the
driver, or not at all and wrongly. So the engine refuses to allocate a slab or queue a copy while the
current stream is capturing, with a :class:`CaptureError` that names the scope and what to do instead.
Asking costs one driver query per batch, per prefetch and per new slab, not per saved tensor.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Any

import torch

from swapkit.engine.base import Source, region_pairs
from swapkit.engine.pinned import PAGE, device_pinned_memory


class CudaCopy:
    """One copy on the side stream: its completion event, and for a prefetch its target buffer and
    the compute stream the buffer was allocated on."""

    __slots__ = ("event", "buffer", "stream", "joined", "held")

    def __init__(self, event: torch.cuda.Event, buffer: torch.Tensor | None = None,
                 stream: torch.cuda.Stream | None = None, held: list | None = None) -> None:
        self.event, self.buffer, self.stream = event, buffer, stream
        self.joined: tuple[torch.cuda.Stream, ...] = ()  # Note [A copy is joined once per stream]
        self.held = held  # what Inflight keeps alive for a prefetch: [host source, device target]

    def joined_by(self, stream: torch.cuda.Stream) -> None:
        """``stream`` has queued its wait on the event (Note [A copy is joined once per stream])."""
        if stream not in self.joined:
            self.joined += (stream,)
        if stream == self.stream and self.held is not None:
            held, self.held = self.held, None  # the copy no longer reaches the host view either
            del held[1:]  # Note [A joined prefetch target is stream-ordered]


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


class Inflight:
    """The copies still running, each with what it must keep alive, in queue order (Note [Host targets
    outlive their copies]), and the event of the last one queued (Note [Fences are the last copy's event]).

    An event is anything with ``query()``: no CUDA here, so the locking (Note [No lock a finalizer
    waits on]) is tested on CPU.
    """

    def __init__(self) -> None:
        self._entries: deque[tuple[Any, Any]] = deque()  # (event, what it keeps alive)
        self.last: Any = None  # read without the lock: Note [No lock a finalizer waits on]
        self._lock = threading.Lock()  # unpacks run on several autograd threads

    def __len__(self) -> int:
        return len(self._entries)

    def held(self) -> list[Any]:
        """What each running copy keeps alive, oldest first."""
        return [held for _, held in self._entries]

    def keep_until(self, done: Any, held: Any) -> None:
        """Hold ``held`` until ``done`` has completed; ``done`` is the new last event."""
        entry = (done, held)  # built before the lock: no allocation under it (Note [No lock a finalizer ...])
        with self._lock:
            self._entries.append(entry)
            self.last = done

    def prune(self, blocking: bool = False) -> None:
        """Drop what completed copies held (one stream: they complete in order). Without ``blocking``
        it stops when the lock is taken (Note [No lock a finalizer waits on])."""
        entries = self._entries
        while entries:
            try:
                head = entries[0]
            except IndexError:  # another thread pruned it meanwhile
                return
            if not head[0].query():  # outside the lock: a call may allocate, and so collect
                return
            if not self._lock.acquire(blocking=blocking):
                return
            try:
                popped = entries.popleft() if entries and entries[0] is head else None
            finally:
                self._lock.release()
            if popped is not None and isinstance(popped[1], list):
                popped[1].clear()  # a prefetch's CudaCopy shares this list: it must not keep the host view
            del popped  # its references go here, outside the lock

    def forget_last(self, last: Any) -> None:
        """Every copy up to ``last`` completed: unless a later one was queued, no fence is needed."""
        with self._lock:
            if self.last is last:
                self.last = None


class CurrentStream:
    """``torch.cuda.current_stream(device)`` for one device, without building a wrapper per call
    (Note [Compute stream is read at use])."""

    MAX_STREAMS = 256  # distinct streams remembered; past it the map starts over (wrappers are cheap)

    def __init__(self, device: torch.device) -> None:
        torch.cuda._lazy_init()  # what torch.cuda.current_stream does first; the raw getter does not
        self.index = torch.cuda._utils._get_device_index(device, optional=True)
        self._raw = torch._C._cuda_getCurrentStream  # what torch.cuda.current_stream calls (every CUDA build)
        self._streams: dict[tuple[int, int, int], torch.cuda.Stream] = {}

    def __call__(self) -> torch.cuda.Stream:
        raw = self._raw(self.index)
        stream = self._streams.get(raw)
        if stream is None:
            if len(self._streams) >= self.MAX_STREAMS:
                self._streams = {}
            stream = torch.cuda.Stream(stream_id=raw[0], device_index=raw[1], device_type=raw[2])
            self._streams[raw] = stream
        return stream


class SideStream:
    """``with SideStream(engine):`` queues work on ``engine.stream`` and restores the caller's stream
    (Note [Switching to the side stream])."""

    __slots__ = ("_engine", "_restore", "_fallback")

    def __init__(self, engine: CudaCopyEngine) -> None:
        self._engine = engine

    def __enter__(self) -> None:
        engine = self._engine
        if torch.cuda.current_device() != engine.device.index:
            self._fallback = torch.cuda.stream(engine.stream)
            self._fallback.__enter__()
            return
        self._fallback = None
        self._restore = engine.current()
        torch.cuda.set_stream(engine.stream)

    def __exit__(self, *exc: object) -> None:
        if self._fallback is not None:
            self._fallback.__exit__(*exc)
        else:
            torch.cuda.set_stream(self._restore)


class CaptureError(RuntimeError):
    """A swap copy or pinned slab was asked for while the current CUDA stream captures a graph (Note [No
    copies inside CUDA graph capture])."""


def refuse_capture(what: str, where: str = "") -> None:
    """Raise :class:`CaptureError` if the current CUDA stream is capturing (Note [No copies inside CUDA graph
    capture]); ``what``: the copy or allocation, ``where``: the scope it is for."""
    if torch.cuda.is_current_stream_capturing():
        scope = f" for {where}" if where else ""
        raise CaptureError(
            f"swapkit: {what}{scope} was asked for while the current CUDA stream is capturing a CUDA graph; swap "
            "copies and pinned host memory cannot be recorded in a graph. Keep swapped layers out of capture: use "
            "torch.compile(mode='max-autotune-no-cudagraphs') or the default mode instead of 'reduce-overhead', "
            "leave those layers out of torch.cuda.graph / make_graphed_callables, or set their swap off in "
            "swap_config")


class CudaCopyEngine:
    """Device<->host copies on one side stream of ``device``."""

    name = "cuda"
    host_granule = PAGE
    stream_ordered_release = True  # Note [Copy sources are released in stream order]
    usable_when_ready = False  # the reading stream still waits on the copy's event (and records the buffer)

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        if self.device.index is None:  # "cuda": the current device, fixed now (as self.stream is)
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.stream = torch.cuda.Stream(device=self.device)
        self.inflight = Inflight()
        self.current = CurrentStream(self.device)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A pinned slab of exactly ``nbytes`` rounded to a page, registered on this engine's device
        (``swapkit.engine.pinned`` Notes [Pinned memory without power-of-two rounding], [Pinning on the
        engine's device])."""
        refuse_capture("a pinned host slab")  # Note [No copies inside CUDA graph capture]
        return device_pinned_memory(nbytes, self.device.index)

    def fence(self) -> CudaFence | None:
        last = self.inflight.last  # no lock: Note [No lock a finalizer waits on]
        return None if last is None else CudaFence(last)

    def producer(self) -> torch.cuda.Stream:
        """The stream saved tensors are produced on now (Note [D2H waits for the producer])."""
        return self._compute()

    def reading_sources(self) -> SideStream:
        """Work that reads a queued copy's source runs after it on the side stream, which waited for the
        source's producer; the allocator keeps the source's block until the side stream passed it."""
        return SideStream(self)

    def offload(self, src: torch.Tensor, dst: torch.Tensor) -> CudaCopy:
        return self.offload_many([(src, dst)])

    def offload_many(self, pairs: list[tuple[torch.Tensor, torch.Tensor]],
                     producer: torch.cuda.Stream | None = None, where: str = "") -> CudaCopy:
        """Every pair's copy after one ``wait_stream`` on ``producer`` (the current stream if ``None``),
        one event for all (Note [One job per coalesced batch])."""
        refuse_capture("a device-to-host copy", where)  # Note [No copies inside CUDA graph capture]
        self.inflight.prune()
        self.stream.wait_stream(producer if producer is not None else self._compute())  # Note [D2H waits ...]
        with SideStream(self):  # Note [Switching to the side stream]
            for src, dst in pairs:
                src.record_stream(self.stream)  # Note [Copy sources are released in stream order]
                dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        self.inflight.keep_until(done, [dst for _, dst in pairs])  # Note [Host targets outlive their copies]
        return CudaCopy(done)

    def offload_storages(self, region: torch.Tensor, sources: list[Source],
                         producer: torch.cuda.Stream | None = None, where: str = "") -> CudaCopy:
        """A coalesced batch: its flat views, then :meth:`offload_many` (copies are queued from this thread)."""
        return self.offload_many(region_pairs(region, sources, self.device), producer, where)

    def prefetch(self, src: torch.Tensor) -> tuple[torch.Tensor, CudaCopy]:
        refuse_capture("a host-to-device prefetch")  # Note [No copies inside CUDA graph capture]
        self.inflight.prune()
        compute = self._compute()
        dst = torch.empty(src.numel(), dtype=torch.uint8, device=self.device)  # on the compute stream
        self.stream.wait_stream(compute)  # Note [H2D target reuse]
        with SideStream(self):  # Note [Switching to the side stream]
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        held = [src, dst]  # Note [Host targets outlive their copies]
        self.inflight.keep_until(done, held)
        return dst, CudaCopy(done, dst, compute, held)

    def ready(self, copy: CudaCopy) -> bool:
        self.inflight.prune()
        return copy.event.query()

    def wait(self, copy: CudaCopy, timed: bool = False) -> CudaTiming | NoTiming:
        self.inflight.prune()
        compute = self._compute()
        if not timed and compute in copy.joined:
            return NoTiming()  # Note [A copy is joined once per stream]
        if copy.buffer is not None and compute != copy.stream:
            copy.buffer.record_stream(compute)  # Note [A prefetched buffer used on another stream]
        if not timed:
            compute.wait_event(copy.event)
            copy.joined_by(compute)  # after the wait is queued: a racing reader waits again, never less
            return NoTiming()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(compute)
        compute.wait_event(copy.event)
        end.record(compute)
        copy.joined_by(compute)
        return CudaTiming(start, end)

    def synchronize(self) -> None:
        last = self.inflight.last
        self.stream.synchronize()
        self.inflight.prune(blocking=True)  # every copy queued before the synchronize completed
        self.inflight.forget_last(last)  # no copy left that a fence would wait for, unless one came since

    def close(self) -> None:
        self.synchronize()

    def _compute(self) -> torch.cuda.Stream:
        return self.current()  # Note [Compute stream is read at use]
