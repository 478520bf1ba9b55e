"""CPU copy engine: one worker thread copies into pooled host buffers.

It stands in for the CUDA engine in CPU-only runs: completion flags play the role of CUDA events, and
``latency_s`` / ``bandwidth_gbps`` make each copy take as long as it would over a slower link,
which widens race windows in tests and emulates a PCIe-to-compute ratio in benchmarks. On CPU the
"device" and the host share RAM; the memory the session reports is its own accounting.

Note [Copies after close]
A graph can outlive its session: ``session.remove()`` (which closes the engine) may run while a
forward's graph still waits for its backward. That backward still needs its prefetches. A closed
engine therefore runs each new copy inline on the caller's thread instead of starting a new
worker: no thread outlives ``close``, and the late backward is still correct.

Note [A copy queued while the engine closes]
``_submit`` reads ``_worker`` without a lock, so another thread's ``close`` can stop the worker
between that read and the put: the job lands behind the stop sentinel, no worker ever runs it, and
whoever waits for it waits forever. So such a job is *stranded*, not lost: ``close`` runs what is
left in the queue after joining the worker, and ``_submit`` does the same when it sees the engine
closed after its put. One of the two always sees the job (``_closed`` is set before the worker is
told to stop), and ``_stranded_lock`` keeps the stranded jobs in queue order, each run once.
"""
from __future__ import annotations

import contextlib
import queue
import sys
import threading
import time
from copy import copy as shallow_copy
from functools import partial
from typing import Callable

import torch

from swapkit.engine.base import Source, Waited, check_source, check_storages, region_pairs, storage_changed


# Note [Grouped copies]
# ``offload_storages`` moves the storages of one coalesced batch (swapkit.runtime.batch Note [Coalesced
# copies]) as one job: one hand-off to the worker and one completion flag, and one emulated
# latency per job (the bandwidth term still counts every byte). The worker checks each source
# (swapkit.runtime.records Note [Storages another component may resize]), builds the flat views and
# copies them with one ``_foreach_copy_``: the forward thread only queues the job. An engine whose
# ``offload``, ``offload_many`` or ``_copy`` is replaced (a subclass or an instance attribute: tests
# inject failures and corruption that way, the benchmark's move check counts copies) still sees, and
# can change, every copy: ``offload_storages`` then builds the views on the calling thread and calls
# ``offload_many``, which builds the job by calling ``offload`` for each pair while a group is open on
# the calling thread, so ``_submit`` collects the jobs instead of queueing them.
# A failed copy fails the whole batch.


# Note [Region copies without the interpreter lock]
# The worker is a Python thread: each job it runs holds the interpreter lock, which the forward thread then
# waits for. A batch's job built a flat view of each storage and of each slot and checked every storage twice,
# all in Python: on the benchmark's step of 2000 tiny swapped saves that took about 11 us per saved tensor off
# the forward thread's CPU (a job that copies nothing measured that much less; ``benchmarks/results/overhead``
# round j). Given the C++ ``copy_region`` (``swapkit/runtime/region_copy.cpp``, in the module of
# ``runtime.native_save``) by ``use_native_copies``, which a session with the C++ hooks calls, the job hands
# the batch's sources to it instead: it checks the storages, copies
# each into its slot with ``memcpy`` and checks again with the lock released, and names the first changed
# storage, for which the job raises the error the Python checks raise. The emulated link still sleeps first,
# in Python. Only a CPU engine takes it (``memcpy`` reads host memory), and only where the copies are the
# engine's own (Note [Grouped copies]): a replaced ``offload`` still sees every copy.


# Note [Small copies run on the caller]
# Handing a job to the worker wakes a sleeping thread, and on the 2-core VM of the benchmarks that wake, not
# the job, is what the forward thread paid: with the copies in C++ and off the interpreter lock, way (n) of
# ``benchmarks/microbench.py`` still cost about 8 us more per saved tensor of its forward and 7-8 us more of
# its backward with a worker than with every copy run on the thread that queues it (round k of
# ``benchmarks/results/overhead``, round i's ``phases.py ROOT handoff``; one job per batch of about 8 saves:
# some 60 us per job). A worker in C++ that never took the interpreter lock (tried in that round, not kept)
# measured the same as the Python one, and ``perf`` put 13% of the forward thread's samples in the kernel's
# wake-up and task-switch paths: the cost is the thread's hand-off, not the lock. So a batch's copy (``offload_storages``) or a prefetch of at
# most ``inline_bytes`` (64 KiB by default, a few microseconds of ``memcpy``, less than a hand-off) runs on
# the thread that queues it (the forward's, or the backward's for a prefetch) when:
# - the engine is on the CPU (with ``runtime.engine: thread`` on a CUDA model a copy on the compute thread
#   would wait for the stream; that engine's copies stay on the worker);
# - the engine's own copy would do it (not replaced: Note [Grouped copies]) and no link is emulated (the
#   emulation needs the copy to be late);
# - every copy queued before it has finished: the copies still complete in issue order, and a copy done when
#   queued is what ``ready``, ``wait`` and the fence already handle.
# Its completion is a finished :class:`ThreadCopy`, its failure reported as a worker's is. It runs out of
# sight of the caller's dispatch modes, as a job on the worker thread does (modes are per thread): a mode
# counting the backward's ops sees no copy of swapkit's. A Ctrl-C (or ``SystemExit``) raised during it is
# not a copy failure: it propagates to the caller, the copy counts as cancelled (:class:`CopyCancelled` on
# its completion, nothing for ``synchronize``), as a step interrupted there is aborted anyway. Larger copies,
# and any copy behind an unfinished one, go to the worker.


class CopyCancelled(RuntimeError):
    """A copy still waiting for its emulated delay when the engine was closed or interrupted."""


# Note [Ctrl-C and the emulated link]
# With `latency_s` up to a second per copy, a queue of copies can take many seconds to drain, and
# leaving a `with session:` block waits for it. When Ctrl-C arrives the work is being thrown away,
# so the emulated delays are cancelled: a copy still sleeping on its delay ends at once with
# CopyCancelled (its bytes never moved, so nothing reads them), which `synchronize` does not report
# as a failure. This happens when `synchronize` runs while a KeyboardInterrupt propagates (the
# session's `__exit__`) and in `close`. A Ctrl-C that only interrupts one `wait` cancels nothing:
# the caller may catch it and go on, and its later copies must still arrive. For the same reason the
# cancel ends with the wait that asked for it, also when a second Ctrl-C cuts that wait short: left on,
# it cancelled every copy of every later step of a session the user went on training with.


# Note [A failed prefetch is reported where its bytes are used]
# ``synchronize`` raises a failed copy nobody was told of yet, so the ``with`` block's exit reports an
# offload whose records never came due. A prefetch is different: its bytes are used only through ``ready``
# or ``wait`` on that very copy (``SwapRecord.restore``), which raise its error, and a prefetch nobody uses
# (a backward stopped by an error before it read those records) harms nothing. Kept for ``synchronize``,
# the error of a prefetch issued by a backward that ran after its block, which has no synchronize of its own
# left, waited on the engine until the next step's exit raised it: a healthy step failed and was aborted
# for a copy of an earlier one. So a prefetch's error stays on its copy only.


class ThreadCopy:
    """Completion of one copy: the worker sets ``done`` (or ``error``) when the bytes are there.
    ``synchronized``: ``synchronize`` reports its failure (not a prefetch's: Note [A failed prefetch is ...])."""

    __slots__ = ("done", "error", "synchronized")

    def __init__(self, synchronized: bool = True) -> None:
        self.done = False
        self.error: BaseException | None = None
        self.synchronized = synchronized


class ThreadFence:
    """Passed once the engine's FIFO worker finished ``copy`` and so every copy queued before it
    (``swapkit.engine.pool`` Note [Slab lifetimes]); a failed or cancelled copy counts as finished."""

    __slots__ = ("_engine", "_copy")

    def __init__(self, engine: ThreadCopyEngine, copy: ThreadCopy) -> None:
        self._engine, self._copy = engine, copy

    def passed(self) -> bool:
        return self._copy.done

    def wait(self) -> None:
        self._engine.wait_done(self._copy)


#: What ``wait`` returns for a copy that had finished and was not timed.
NOT_WAITED = Waited(0.0)


class ThreadCopyEngine:
    """Copies run in FIFO order on one daemon thread.

    Args:
        device: the compute device (``cpu``).
        latency_s: fixed delay added to every copy.
        bandwidth_gbps: link bandwidth in gigabytes per second (``None``: as fast as memcpy).
        inline_bytes: a copy of at most this many bytes runs on the calling thread when the queue is idle
            (Note [Small copies run on the caller]); 0: every copy goes to the worker.
    """

    name = "thread"
    host_granule = 1
    #: on CPU nothing orders a freed storage's reuse after a queued copy: release waits for ``ready``
    stream_ordered_release = False
    #: Bounds of the emulated link (the config checks the same ones, with the key path).
    MAX_LATENCY_S = 1.0
    BANDWIDTH_GBPS = (1e-3, 1e5)

    def __init__(self, device: torch.device | str = "cpu", latency_s: float = 0.0,
                 bandwidth_gbps: float | None = None, inline_bytes: int = 64 << 10) -> None:
        self.device = torch.device(device)
        self.latency_s, self.bandwidth_gbps = _checked_link(latency_s, bandwidth_gbps)
        if isinstance(inline_bytes, bool) or not isinstance(inline_bytes, int) or inline_bytes < 0:
            raise ValueError(f"thread engine inline_bytes: got {inline_bytes!r}; expected a whole number of bytes >= 0")
        self.inline_bytes = inline_bytes  # Note [Small copies run on the caller]
        self._closing = threading.Event()  # wakes a copy sleeping for its emulated delay
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._finished = threading.Condition()  # signalled after a copy only while someone waits
        self._waiting = 0
        self._error: BaseException | None = None  # a failed copy nobody was told of yet
        self._closed = False
        self._last: ThreadCopy | None = None  # the last copy queued
        self._queue_lock = threading.Lock()
        self._group: tuple[int, list[Callable[[], None]]] | None = None  # Note [Grouped copies]
        self._latency_paid = False  # read and written by whichever thread runs a job
        self._stranded_lock = threading.Lock()  # Note [A copy queued while the engine closes]
        self._native_region: Callable[[torch.Tensor, list[Source]], int] | None = None  # Note [Region copies ...]

    def use_native_copies(self, copy_region: Callable[[torch.Tensor, list[Source]], int]) -> None:
        """Copy coalesced batches with ``copy_region`` (the C++ hooks' module) on a CPU engine (Note [Region
        copies without the interpreter lock])."""
        if self.device.type == "cpu":
            self._native_region = copy_region

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def offload(self, src: torch.Tensor, dst: torch.Tensor) -> ThreadCopy:
        nbytes, data_ptr = src.untyped_storage().nbytes(), src.data_ptr()

        def job() -> None:  # swapkit.runtime.records Note [Storages another component may resize]
            check_source(src, nbytes, data_ptr)
            self._copy(dst, src)
            check_source(src, nbytes, data_ptr)

        return self._submit(job)

    #: ``producer()`` is always ``None``: a tensor saved on CPU is complete when saved, nothing to order copies
    #: after. ``NoneType`` called returns ``None`` in C, without the Python frame a method costs at every
    #: swapped save (swapkit.runtime.step Note [The cost of a save]).
    producer = staticmethod(type(None))

    def reading_sources(self) -> contextlib.nullcontext:
        """Sources are read after their copy finished (releases wait for ``ready``): no ordering needed."""
        return contextlib.nullcontext()

    def offload_many(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], producer: None = None) -> ThreadCopy:
        """One job, one completion flag for every ``(src, dst)`` pair (Note [Grouped copies])."""
        if self._copies_unchanged():
            sources, targets = [src for src, _ in pairs], [dst for _, dst in pairs]
            queued = [(src.untyped_storage().nbytes(), src.data_ptr()) for src in sources]
            return self._submit(lambda: self._copy_all(targets, sources, queued))
        copy, jobs = ThreadCopy(), []
        self._group = (threading.get_ident(), jobs)
        try:
            for src, dst in pairs:
                self.offload(src, dst)  # a replaced offload still sees every copy
        finally:
            self._group = None
        return self._submit(_run_all(jobs), copy)  # offload_many and offload_storages of a replaced copy

    def offload_storages(self, region: torch.Tensor, sources: list[Source], producer: None = None,
                         where: str = "") -> ThreadCopy:
        """One job for a coalesced batch: the worker checks the sources, builds the flat views and
        copies (Note [Grouped copies]); the calling thread only queues it."""
        if not self._copies_unchanged():
            return self.offload_many(region_pairs(region, sources, self.device), producer)
        job = partial(self._copy_region, region, sources, where)
        return self._run_inline(job) if self._runs_here(region.numel(), "_copy_region") else self._submit(job)

    def _copy_region(self, region: torch.Tensor, sources: list[Source], where: str = "") -> None:
        if self._native_region is not None:  # Note [Region copies without the interpreter lock]
            if self.emulates_link:
                self._link_delay(sum(nbytes for _, _, nbytes, _ in sources))
            changed = self._native_region(region, sources)
            if changed >= 0:
                storage, _, nbytes, _ = sources[changed]
                raise storage_changed(nbytes, storage.nbytes(), where)
            return
        pairs = region_pairs(region, sources, self.device)
        check_storages(sources, where)  # swapkit.runtime.records Note [Storages another component may resize]
        if self.emulates_link:  # the sum is a Python loop on the worker, which holds the GIL meanwhile
            self._link_delay(sum(nbytes for _, _, nbytes, _ in sources))
        torch._foreach_copy_([dst for _, dst in pairs], [src for src, _ in pairs])
        check_storages(sources, where)

    def _copies_unchanged(self) -> bool:
        """None of ``offload``, ``offload_many`` and ``_copy`` replaced (Note [Grouped copies])."""
        cls, own = type(self), self.__dict__
        return "offload" not in own and "offload_many" not in own and cls.offload is ThreadCopyEngine.offload \
            and cls.offload_many is ThreadCopyEngine.offload_many and cls._copy is ThreadCopyEngine._copy

    def _copy_all(self, targets: list[torch.Tensor], sources: list[torch.Tensor],
                  queued: list[tuple[int, int]]) -> None:
        """Copy every source whose storage still has the size and address it was queued with, in one
        ``_foreach_copy_`` (one release of the GIL for the batch, not one per storage)."""
        for src, (nbytes, data_ptr) in zip(sources, queued):  # swapkit.runtime.records Note [Storages another ...]
            check_source(src, nbytes, data_ptr)
        if self.emulates_link:
            self._link_delay(sum(src.numel() for src in sources))
        torch._foreach_copy_(targets, sources)
        for src, (nbytes, data_ptr) in zip(sources, queued):
            check_source(src, nbytes, data_ptr)

    def prefetch(self, src: torch.Tensor) -> tuple[torch.Tensor, ThreadCopy]:
        dst = torch.empty(src.numel(), dtype=torch.uint8, device=self.device)
        job = partial(self._copy, dst, src)
        if self._runs_here(src.numel(), "_copy"):  # Note [Small copies run on the caller]
            return dst, self._run_inline(job, ThreadCopy(synchronized=False))
        return dst, self._submit(job, ThreadCopy(synchronized=False))

    def _runs_here(self, nbytes: int, method: str) -> bool:
        """Does a copy of ``nbytes`` by ``method`` run on the calling thread (Note [Small copies run on the
        caller])? Only the engine's own ``method``, with no emulated link, once every queued copy finished."""
        if nbytes > self.inline_bytes or self.device.type != "cpu" or self.emulates_link or \
                method in self.__dict__ or getattr(type(self), method) is not getattr(ThreadCopyEngine, method):
            return False
        last = self._last
        return last is None or last.done

    def fence(self) -> ThreadFence | None:
        last = self._last
        return None if last is None or last.done else ThreadFence(self, last)

    @property
    def usable_when_ready(self) -> bool:
        """A finished copy's bytes are in place: ``wait`` would return at once, unless it was replaced (a
        subclass or an instance attribute: tests count and gate waits)."""
        return type(self).wait is ThreadCopyEngine.wait and "wait" not in self.__dict__

    def ready(self, copy: ThreadCopy) -> bool:
        """Finished? A failed copy raises here: its bytes must never be trusted (or released)."""
        if copy.done and copy.error is not None:
            self._report(copy.error)
        return copy.done

    def wait(self, copy: ThreadCopy, timed: bool = False) -> Waited:
        if copy.done and not timed:  # the common case once prefetches run ahead: no clock read, no timing built
            if copy.error is not None:
                self._report(copy.error)
            return NOT_WAITED
        start = time.perf_counter()
        self.wait_done(copy)
        if copy.error is not None:
            self._report(copy.error)
        return Waited(time.perf_counter() - start)

    def wait_done(self, copy: ThreadCopy) -> None:
        """Block until the worker finished ``copy`` (successfully or not); reports nothing."""
        if not copy.done:
            with self._finished:
                self._waiting += 1
                try:
                    while not copy.done:  # checked under the lock: the worker signals after setting it
                        self._finished.wait()
                finally:  # a KeyboardInterrupt in wait() must not leave the counter raised
                    self._waiting -= 1

    def _report(self, error: BaseException) -> None:
        """Raise a copy's error; once raised it is no longer pending for ``synchronize``."""
        if self._error is error:
            self._error = None
        raise _reported(error)

    def synchronize(self) -> None:
        """Wait for every queued copy; raise the first copy that failed since the last call."""
        if isinstance(sys.exc_info()[1], KeyboardInterrupt):
            self._closing.set()  # Note [Ctrl-C and the emulated link]
        try:
            if self._worker is not None:
                self.wait(self._submit(lambda: None))
        finally:  # a second Ctrl-C in this wait must not cancel every later copy (Note [Ctrl-C and the ...])
            self._closing.clear()
        error, self._error = self._error, None
        if error is not None:  # the stored object stays on its ThreadCopy: Note [A reported copy error holds no frames]
            raise _reported(error)

    def close(self) -> None:
        """Stop the worker: copies still sleeping for their emulated delay end at once (Ctrl-C never
        waits); copies after close run inline (Note [Copies after close])."""
        with self._start_lock:
            self._closed = True
            worker, self._worker = self._worker, None
        if worker is not None:
            self._closing.set()
            self._jobs.put(None)
            try:
                worker.join()
            finally:  # interrupted: the copies run inline after close must not be cancelled
                self._closing.clear()
        self._run_stranded()

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._link_delay(src.numel())
        dst.copy_(src)

    @property
    def emulates_link(self) -> bool:
        """Copies sleep as the emulated link would take (:meth:`_link_delay`)."""
        return bool(self.latency_s or self.bandwidth_gbps)

    def _link_delay(self, nbytes: int) -> None:
        """Sleep as long as the emulated link takes for ``nbytes`` (its latency once per job); a close
        or Ctrl-C cancels the sleep (Note [Ctrl-C and the emulated link])."""
        latency, self._latency_paid = (0.0 if self._latency_paid else self.latency_s), True  # Note [Grouped copies]
        delay = latency + (nbytes / (self.bandwidth_gbps * 1e9) if self.bandwidth_gbps else 0.0)
        if delay and self._closing.wait(delay):  # the bytes arrive only after the link would have delivered them
            raise CopyCancelled("copy cancelled: the thread copy engine was closed")

    def _submit(self, job: Callable[[], None], copy: ThreadCopy | None = None) -> ThreadCopy | None:
        group = self._group
        if group is not None and group[0] == threading.get_ident():  # Note [Grouped copies]
            group[1].append(job)
            return None
        if self._worker is None and not self._ensure_worker():
            return self._run_inline(job, copy)  # Note [Copies after close]
        copy = copy or ThreadCopy()
        item = (job, copy)  # built before the lock: swapkit.engine.cuda Note [No lock a finalizer waits on]
        with self._queue_lock:  # the last copy queued is the last one in the queue (ThreadFence)
            self._last = copy
            self._jobs.put(item)
        if self._closed:  # Note [A copy queued while the engine closes]
            self._run_stranded()
        return copy

    def _run_inline(self, job: Callable[[], None], copy: ThreadCopy | None = None) -> ThreadCopy:
        """Run ``job`` on the calling thread, unseen by its dispatch modes as the worker's jobs are (Notes [Copies
        after close], [Small copies run on the caller])."""
        copy = copy or ThreadCopy()
        with torch._C._DisableTorchDispatch():
            self._execute(job, copy, caller=True)
        return copy

    def _run_stranded(self) -> None:
        """Run, here and in order, the jobs queued behind a stopped worker (Note [A copy queued while the
        engine closes])."""
        with self._stranded_lock:
            while True:
                try:
                    item = self._jobs.get_nowait()
                except queue.Empty:
                    return
                if item is not None:
                    self._finish(*item)

    def _ensure_worker(self) -> bool:
        """Start the worker if needed; False once the engine is closed."""
        with self._start_lock:
            if self._worker is None and not self._closed:
                self._worker = threading.Thread(target=self._run, name="swapkit-copy", daemon=True)
                self._worker.start()
            return self._worker is not None

    def _execute(self, job: Callable[[], None], copy: ThreadCopy, caller: bool = False) -> None:
        """Run ``job`` for ``copy``; ``caller``: on the thread that queued it, where a Ctrl-C (or ``SystemExit``)
        propagates and cancels the copy (Note [Small copies run on the caller])."""
        self._latency_paid = False  # one emulated latency per job (Note [Grouped copies])
        try:
            job()
        except BaseException as err:  # noqa: BLE001 - handed to whoever asks about this copy
            if caller and not isinstance(err, Exception):
                copy.error, copy.done = CopyCancelled("copy interrupted on the thread that queued it"), True
                raise
            copy.error = err
            if copy.synchronized and not isinstance(err, CopyCancelled):  # a cancelled copy is no failure to report
                self._error = self._error or err
        copy.done = True

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            self._finish(*item)
            del item  # the copy's source and target must not outlive it here

    def _finish(self, job: Callable[[], None], copy: ThreadCopy) -> None:
        """Run a queued job and wake whoever waits for a copy."""
        self._execute(job, copy)
        del job
        if self._waiting:
            with self._finished:
                self._finished.notify_all()


# Note [A reported copy error holds no frames]
# A failed copy's error stays on its ThreadCopy, which its batch holds, which its records hold. Raising
# that very object would append the frames it passes through (an unpack hook, the backward) to its
# ``__traceback__``, and those frames hold tensors whose autograd graph holds the records: a cycle
# through C++ autograd nodes the cyclic collector cannot see, so every failed step kept its records,
# and the pool its host regions, forever. Each report therefore raises a copy of the error (same type,
# arguments and worker-side traceback, chained to the original's cause): the frames go on the copy,
# which the caller owns and drops. An error that cannot be copied is raised as it is. That holds for
# every report: ``ready`` and ``wait`` on the copy, and ``synchronize``, which reports a failure none of
# them did yet (the ``with`` block's exit, when no record of the failed batch came due in forward).


def _reported(error: BaseException) -> BaseException:
    """A copy of a stored copy error to raise (Note [A reported copy error holds no frames])."""
    try:
        raised = shallow_copy(error)
    except Exception:  # noqa: BLE001 - an exotic constructor: raise the original
        return error
    raised.__cause__, raised.__context__ = error.__cause__, error.__context__
    raised.__suppress_context__ = error.__suppress_context__
    return raised.with_traceback(error.__traceback__)


def _run_all(jobs: list[Callable[[], None]]) -> Callable[[], None]:
    def run() -> None:
        for job in jobs:
            job()

    return run


def _checked_link(latency_s: float, bandwidth_gbps: float | None) -> tuple[float, float | None]:
    """The emulated link's options, refused when they would hang (1e9 s) or overflow (1e-300 GB/s)."""
    high = ThreadCopyEngine.MAX_LATENCY_S
    if isinstance(latency_s, bool) or not (isinstance(latency_s, (int, float)) and 0 <= latency_s <= high):
        raise ValueError(f"thread engine latency_s: got {latency_s!r}; expected a number from 0 to {high} seconds")
    low, top = ThreadCopyEngine.BANDWIDTH_GBPS
    if bandwidth_gbps is not None and (isinstance(bandwidth_gbps, bool) or not (
            isinstance(bandwidth_gbps, (int, float)) and low <= bandwidth_gbps <= top)):
        raise ValueError(f"thread engine bandwidth_gbps: got {bandwidth_gbps!r}; expected null or a number "
                         f"from {low:g} to {top:g} GB/s")
    return float(latency_s), None if bandwidth_gbps is None else float(bandwidth_gbps)
