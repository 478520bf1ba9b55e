"""The swap session's own cost per saved tensor (pack + unpack), against bare hooks and no hooks.

One "layer" runs a chain of many tiny ops (``sin`` on a few floats), so each step saves thousands
of tiny tensors and the time per step is dominated by per-tensor overhead, not by math or memcpy.
Nine ways of running the same step, interleaved:

(a) no hooks; (b) identity ``saved_tensors_hooks(lambda t: t, lambda t: t)``; (c) a swapkit
session that keeps everything (accounting only); (d) a swapkit session that swaps everything
(layer swap, ``min_offload_bytes: 0``) through the unthrottled thread engine, with coalesced copies
(the default ``runtime.offload_batch_bytes``); (e) the same with ``offload_batch_bytes: 0``, one copy job per
storage as before coalescing, so the before/after ratio comes from one run; (f) the floor of any safe
keep: hooks that hand autograd a detached keeper with the version it had and check that version at
unpack (autograd stops checking it once hooks are installed; ``swapkit.runtime.records`` Note [Version
keepers]), and do nothing else. Two more ways take (d) apart (Note [Taking the swap way apart]): (g) as (d) with Python's
cyclic garbage collector off during the step, (h) as (d) with every copy run on the thread that queues
it (CPU only). (i) bounds what a keep could cost without swapkit's Python (Note [What a save path in C
would still pay]), and (j) what a coalesced swap could (Note [What a swap in C would still pay]); (k) and
(l) do the same work in C++, as a torch extension would (Note [What a save path in C++ pays]). (m) is (c)
with ``runtime.native_save: true``: swapkit's own C++ hooks serve the plain keeps (``swapkit.runtime.native``
Note [The native save path]); (n) is (d) with it, where they also serve the new swapped storages' saves and the
swapped unpacks up to the schedule's and the record's Python (``native_save.cpp`` Note [Swaps served in C++]).
(o) is (n) with ``runtime.engine_options.inline_bytes: 0``: every copy is handed to the engine's copy thread, as
every copy was before the engine ran small copies on the saving thread (``swapkit.engine.thread`` Note [Small
copies run on the caller]). (d), (n) and the others take the default: their batches (8 storages of 64 bytes)
run on the saving thread whenever no copy is still queued.

Note [What a save path in C would still pay]
Way (i) is a pair of plain hooks that make the torch calls and the allocations a keep needs and
nothing else: the plain-tensor tests, the storage (``untyped_storage()``, its ``id`` and ``nbytes``),
a dict lookup in a storage index (a record found counts only at the version it was made at: a
storage written in place since is a new one, as in the step), a detached keeper, a record built by
one C call and weakly referenced from the index, a handle tuple; the parameter and device tests of a new storage; the
version check at unpack. What (c) adds over (i) is swapkit's own Python: the session's and the
step's frames, the tick, the scope and frame tests, the byte accounting and the record's
finalizer. A save path written in C (an extension module, as swapkit does not ship) would remove
that part and still pay (i)'s torch calls through the same Python objects, so (i) over (b) is the
least ratio such a path could reach for a keep on this machine.

Note [What a save path in C++ pays]
Ways (k) and (l) make a keep's and a coalesced swap's bookkeeping in C++ (``benchmarks/native_save.cpp``,
built on first use with ``torch.utils.cpp_extension``; both ways are left out, saying why, where it cannot
be built). Their hooks are C functions (no Python frame per save) that read the tensor's ``StorageImpl``
directly, without making its Python storage object, and keep the storage index and the records in C++;
a handle is a small C object whose end releases its record.
- (k) is (i) in C++, with a clock and the held bytes and their peak added.
- (l) is (j) in C++: batches of ``SWAP_CALLS_BATCH`` new storages, each batch copied to one host region as
  (j) copies it (a flat byte view per storage, slots at multiples of ``SWAP_CALLS_ALIGN`` bytes, one
  ``_foreach_copy_``), the keepers emptied (``set_()``, version put back), the region copied back once per
  batch at its first unpack and each view rebuilt on it. CPU only, as (j). (A ``memcpy`` per storage
  instead of the views and ``_foreach_copy_`` cost about 2 us less per save in a review's run.)
Neither has swapkit's scope, frame and step bookkeeping, release and prefetch schedule or pool. So (k) and
(l) over (b) are what a keep and a swap written as a torch extension would cost at least, against (i)'s and
(j)'s bounds for the same work calling torch through its Python objects.

Note [What a swap in C would still pay]
Way (j) is to (d) what (i) is to (c): a pair of plain hooks that make the torch calls and allocations a
coalesced swap of every saved storage needs, and nothing else. At pack, (i)'s keep calls, plus the storage's
``data_ptr`` (what the changed-storage checks compare) and the view's ``view_meta``; the storage joins an
open batch, and every ``SWAP_CALLS_BATCH`` new storages (8, (d)'s ``backward_prefetch``: (d) flushes a batch
when its first storage is due for release) the batch is copied as (d)'s engine copies it: one host region,
one flat ``uint8`` view per storage, one ``_foreach_copy_``; then the batch's keepers are emptied
(``set_()``, version counters put back). At unpack, the version check; the first unpack of a batch copies
its region back in one copy into a new buffer, and each handle gets its view rebuilt on it. The copies run
inline, on the main thread (as (h)'s; (d)'s copy thread builds its views and copies), the region is a new
tensor, not a pooled one, and each slot starts at a multiple of ``SWAP_CALLS_ALIGN`` bytes, as a batch's.
CPU only, as (h). What (h) adds over (j) is swapkit's own Python: the session's, step's and records'
frames, the release and prefetch queues and their ticks, the pool, the lock, the accounting and the
finalizers. So (j) over (b) is the least ratio a swap path in C over the same Python objects could reach
on this machine copying on the thread that saves (as (h) does; the CUDA engine queues its copies there
too). (d) builds the views and copies on its copy thread instead: a path that did the same would take
that share off the saving thread (a batch's flush, timed alone, cost about 1.5x the identity hooks per
saved tensor), which makes (j) a bound for (h), not quite for (d).

Note [Taking the swap way apart]
Two costs of (d) are not the session's bookkeeping, and each has its own way, run in the same
repetitions, so that no cross-run difference (another process's load moves the thread engine's cost
by half) enters the comparison:
- (g) disables the cyclic collector for the step only (``gc.disable()`` inside the step's context,
  enabled again after): (d) - (g) is what the young-generation collections during a step cost. A
  *full* collection (a scan of every object of the process, ~90 ms here) lands in about one step of
  ten, so the medians leave it out; the collector clock below measures it.
- The collector clock: ``gc.callbacks`` time every collection, and each way's steps get the
  collections that ran during them, reported as a mean per saved tensor with the number of full
  collections (Note [The collector's clock]).
- (h) closes its session's thread engine after the warm-up, so every copy runs inline on the thread
  that queues it (``swapkit.engine.thread`` Note [Copies after close]): the same copies and the same
  session work, without the hand-off to the copy thread. (d) - (h) was what the hand-offs cost the
  main thread before small copies ran on the saving thread; now only a copy queued behind an unfinished
  one is handed over, and (o) - (n) is what handing every copy over costs. The CUDA engine has no such
  thread (its copies are queued on a stream), so (h) is the closer stand-in for the session's own cost on a
  GPU host, and it runs on CPU only.

Note [Paired per-tensor costs]
Each repetition runs every way once, the order rotated by one way per repetition, so that no way
always runs right after the same other way (a way run after a swap way starts with other caches
and another heap than one run after no hooks). A way's cost per saved tensor in one repetition is
(its step - (a)'s step of the same repetition) / saved tensors per step, and the reported cost is the
median over repetitions; the ratio to (b) is the median cost over (b)'s. Two clocks: wall time, and the
main thread's CPU time (``time.thread_time``). On a shared machine other processes take the cores for
stretches that wall time counts and CPU time does not, so the CPU-time ratios are the stable ones;
they cover the hooks' own work on the thread that runs forward and backward (the critical path of a
GPU step), not the copy thread's. Both are recorded, with the load average before and after.

Note [Each way alone]
Every way of the paired run lives in one process, beside the others' sessions, models and copy
threads, and a way's cost moves with its neighbours: the floor (f) measured 1.3-1.7x the identity
hooks in a process without a swap session and 2.1-2.4x in the paired run. A training process runs
one session. So ``--isolated N`` also runs each way in a process of its own, with only (a) and (b)
beside it, paired in that process as above; ``N`` rounds, the ways' processes rotated each round,
one after another (never two at once). Each process gives the way's ratio to (b) on the CPU clock;
the report gives the median over rounds and the range, next to the paired run's ratios.

Run it alone: ``python benchmarks/microbench.py --out benchmarks/results/overhead`` (default output
``bench-out/overhead``).

It also times the thread engine's own copies of one typical swapped tensor: into a reused host
buffer (what forward's device-to-host copy into the pool does) and into a freshly allocated buffer
(what backward's prefetch does), to explain where a CPU layer swap's time goes.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import logging
import statistics
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterable

import torch
from torch import nn

import swapkit
from swapkit.engine import ThreadCopyEngine
from swapkit.runtime.native import NativeBuildError, native_module
from swapkit.runtime.records import checksum

from common import cpu_model, load_warning, output_dir, positive_int, synchronize, warning_lines


class TinyChain(nn.Module):
    """``length`` tiny ops in a row; each ``sin`` saves its input for backward."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self.length = length

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.length):
            x = torch.sin(x)
        return x


class TinyModel(nn.Module):
    def __init__(self, length: int, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.layers = nn.ModuleList([TinyChain(length)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[0](x * self.weight).sum()


def _session(model: nn.Module, swap: bool, coalesce: bool = True, native: bool = False,
             inline_bytes: int | None = None) -> swapkit.SwapSession:
    runtime = {"min_offload_bytes": 0, **({} if coalesce else {"offload_batch_bytes": 0}),
               **({"native_save": True} if native else {}),
               **({} if inline_bytes is None else {"engine_options": {"inline_bytes": inline_bytes}})}
    config: dict[str, Any] = {"model": {"model_config": {"num_layers": 1}}, "runtime": runtime}
    if swap:
        config["swap_config"] = {"swap": True, "layer_swap": [{"backward_prefetch": 8, "layers": True}]}
    return swapkit.apply(model, config, layers="layers")


def _identity_hooks() -> ContextManager:
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


def _keep_floor(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The least a safe keep needs (way (f)): a detached keeper and the version it had, in a tuple
    (a class with an ``__init__`` adds a Python frame per save, which is no part of the floor)."""
    return tensor.detach(), tensor._version


def _unpack_floor(handle: tuple[torch.Tensor, int]) -> torch.Tensor:
    keeper = handle[0]
    if keeper._version != handle[1]:
        raise RuntimeError("a saved tensor was modified in place")
    return keeper


def _floor_hooks() -> ContextManager:
    return torch.autograd.graph.saved_tensors_hooks(_keep_floor, _unpack_floor)


class _CallsRecord(list):
    """A kept storage's record in way (i): built by one C call, weakly referenced, as ``KeptRecord``."""

    __slots__ = ("__weakref__",)


_STRIDED, _TENSOR, _PARAMETER = torch.strided, torch.Tensor, nn.Parameter


def _keep_calls_hooks() -> ContextManager:
    """Way (i) (Note [What a save path in C would still pay])."""
    index: dict[int, Any] = {}
    device = torch.device("cpu")

    def pack(tensor: torch.Tensor) -> tuple:
        kind = type(tensor)
        if (kind is not _TENSOR and kind is not _PARAMETER) or tensor.layout is not _STRIDED or tensor.is_nested \
                or tensor.is_quantized:
            return tensor.detach(), tensor._version, None
        storage = tensor.untyped_storage()
        key, version = id(storage), tensor._version
        found = index.get(key)
        record = found() if found is not None else None
        if record is not None and record[1] is storage and record[2] == version:  # not written in place since
            return tensor.detach(), version, record
        nbytes = storage.nbytes()
        if tensor._base is not None or tensor.__dict__ or tensor.device != device:
            pass  # the parameter and device tests a new storage needs; their answers do not matter here
        record = _CallsRecord((nbytes, storage, version))
        index[key] = weakref.ref(record)
        return tensor.detach(), version, record

    return torch.autograd.graph.saved_tensors_hooks(pack, _unpack_floor)


def native_save() -> Any:
    """The module of ways (k) and (l) (Note [What a save path in C++ pays]), built on first use (torch caches
    the build in ``TORCH_EXTENSIONS_DIR``).

    Raises:
        RuntimeError: no C++ compiler (or the build failed), with the compiler's output.
    """
    from torch.utils.cpp_extension import load

    source = Path(__file__).resolve().with_name("native_save.cpp")
    return load(name="swapkit_bench_native_save", sources=[str(source)], extra_cflags=["-O2"])


#: the ways built from ``native_save.cpp``
NATIVE_WAYS = ("keep_native", "swap_native")


def _built_native_save(ways: Iterable[str]) -> Any:
    """The module of ways (k) and (l), or ``None`` after saying on stderr why ``ways`` are left out of this run."""
    try:
        return native_save()
    except (RuntimeError, OSError, ImportError) as err:  # no compiler, no ninja, no headers: the build says which
        lines = str(err).strip().splitlines() or [type(err).__name__]
        print(f"microbench: ways {', '.join(ways)} left out: their C++ build failed: {lines[-1][:300]}",
              file=sys.stderr)
        return None


def _native_session_builds(ways: list[str]) -> bool:
    """Can ways (m) and (n) run? If not, say on stderr why they are left out (``swapkit.runtime.native``)."""
    try:
        native_module()
    except NativeBuildError as err:
        print(f"microbench: ways {', '.join(ways)} left out: {err}", file=sys.stderr)
        return False
    return True


def _keep_native_hooks(module: Any) -> Callable[[], ContextManager]:
    """Way (k): a new storage index per step, as the other ways' hooks have."""
    return lambda: torch.autograd.graph.saved_tensors_hooks(*module.make_hooks()[:2])


def _swap_native_hooks(module: Any) -> Callable[[], ContextManager]:
    """Way (l): a new storage index and open batch per step, as way (j)'s."""
    return lambda: torch.autograd.graph.saved_tensors_hooks(*module.make_swap_hooks()[:2])


class _SwapCallsRecord(list):
    """A swapped storage's record in way (j): ``[batch, offset, weakref to the storage, version]``, weakly
    referenced from the storage index, as ``SwapRecord``."""

    __slots__ = ("__weakref__",)


#: saves per copy in way (j): (d)'s ``backward_prefetch``, which bounds its batches (Note [What a swap in C ...])
SWAP_CALLS_BATCH = 8
#: where way (j)'s slots start in a region: at multiples of a batch's alignment (swapkit.runtime.batch.ALIGN)
SWAP_CALLS_ALIGN = 16
_set_versions = torch._C._autograd._unsafe_set_version_counter


def _swap_calls_hooks() -> ContextManager:
    """Way (j) (Note [What a swap in C would still pay]). A batch is ``[storages, keepers, bytes, region,
    restored, sizes]``: ``region`` is set when it is copied to host (its storages and keepers let go then),
    ``restored`` at its first unpack; ``sizes`` alternate each storage's bytes and its slot's padding, as
    ``swapkit.engine.base.region_pairs`` cuts a region."""
    index: dict[int, Any] = {}
    device, flat = torch.device("cpu"), torch.empty(0, dtype=torch.uint8)
    empties: dict[torch.dtype, torch.Tensor] = {}
    batch: list = [[], [], 0, None, None, []]

    def flush() -> None:
        nonlocal batch
        full, batch = batch, [[], [], 0, None, None, []]
        storages, keepers = full[0], full[1]
        region = torch.empty(full[2], dtype=torch.uint8)
        torch._foreach_copy_(region.split_with_sizes(full[5])[::2], [flat.new().set_(storage) for storage in storages])
        versions = tuple(keeper._version for keeper in keepers)
        for keeper in keepers:
            keeper.set_()
        _set_versions(tuple(keepers), versions)
        full[0], full[1], full[3] = None, None, region

    def pack(tensor: torch.Tensor) -> tuple:  # its first lines are way (i)'s, inlined: a shared helper's
        kind = type(tensor)                    # frame would be part of what the way measures
        if (kind is not _TENSOR and kind is not _PARAMETER) or tensor.layout is not _STRIDED or tensor.is_nested \
                or tensor.is_quantized:
            return tensor.detach(), tensor._version, None
        storage = tensor.untyped_storage()
        key, version = id(storage), tensor._version
        found = index.get(key)
        record = found() if found is not None else None
        keeper = tensor.detach()
        if record is None or record[2]() is not storage or record[3] != version:  # new, or written in place since
            nbytes, _ = storage.nbytes(), storage.data_ptr()
            if tensor._base is not None or tensor.__dict__ or tensor.device != device:
                pass  # the parameter and device tests a new storage needs, as in way (i)
            offset, slot = batch[2], -(-nbytes // SWAP_CALLS_ALIGN) * SWAP_CALLS_ALIGN
            record = _SwapCallsRecord((batch, offset, weakref.ref(storage), version))
            index[key] = weakref.ref(record)
            batch[0].append(storage)
            batch[2] = offset + slot
            batch[5] += (nbytes, slot - nbytes)
        meta = (tensor.dtype, tuple(tensor.size()), tensor.stride(), tensor.storage_offset(), tensor.is_conj(),
                tensor.is_neg())
        if record[0][3] is None:  # its batch is still open
            batch[1].append(keeper)
            if len(batch[0]) == SWAP_CALLS_BATCH:
                flush()
        else:  # saved again after its batch was copied: its bytes are on the host already
            _set_versions((keeper.set_(),), (version,))
        return keeper, version, record, meta

    def unpack(handle: tuple) -> torch.Tensor:
        keeper, version, record = handle[:3]
        if keeper._version != version:
            raise RuntimeError("a saved tensor was modified in place")
        if record is None or record[0][3] is None:  # kept, or its batch was never copied
            return keeper
        held = record[0]
        if held[4] is None:
            held[4] = held[3].clone()  # one copy back per batch
        dtype, size, stride, offset, conj, neg = handle[3]
        template = empties.get(dtype)
        if template is None:
            template = empties[dtype] = torch.empty(0, dtype=dtype)
        out = template.new().set_(held[4].untyped_storage(), offset + record[1] // dtype.itemsize, size, stride)
        if neg:
            out = torch._neg_view(out)
        return out.conj() if conj else out

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


@contextlib.contextmanager
def _without_collector(session: swapkit.SwapSession):
    """``session`` with the cyclic garbage collector off until the step ends (way (g))."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with session:
            yield session
    finally:
        if enabled:
            gc.enable()


def count_saved(model: nn.Module, x: torch.Tensor) -> int:
    """Tensors autograd saves in one forward, counted with a pack hook."""
    count = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal count
        count += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return count


def _step(model: nn.Module, x: torch.Tensor, context: Callable[[], ContextManager]) -> tuple[float, float]:
    """One step's wall and main-thread CPU seconds."""
    model.zero_grad(set_to_none=True)
    synchronize(x.device)
    start, cpu = time.perf_counter(), time.thread_time()
    with context():
        model(x).backward()
    synchronize(x.device)
    return time.perf_counter() - start, time.thread_time() - cpu


class CollectorClock:
    """Wall seconds in the cyclic collector, and full collections, since it was made (``gc.callbacks``).

    Note [The collector's clock]
    A full collection comes about once in ten steps here, so the paired medians of Note [Paired
    per-tensor costs] leave it out; this clock sums every collection, full or young, over each way's
    steps, and the report gives its mean per saved tensor. Collections are timed on the wall clock;
    they run on the thread whose allocation triggered them, nearly always the one running the step.
    """

    def __init__(self) -> None:
        self.seconds, self.full = 0.0, 0
        self._start = 0.0
        gc.callbacks.append(self._tick)

    def _tick(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            self.full += info["generation"] == 2
        else:
            self.seconds += time.perf_counter() - self._start

    def close(self) -> None:
        gc.callbacks.remove(self._tick)


WAYS = ("none", "identity", "keep", "swap", "swap_per_tensor", "floor", "swap_no_gc", "swap_inline", "keep_calls",
        "swap_calls", "keep_native", "swap_native", "keep_session_native", "swap_session_native",
        "swap_session_native_thread")
#: the ways that run swapkit's own C++ hooks (``runtime.native_save``)
SESSION_NATIVE_WAYS = ("keep_session_native", "swap_session_native", "swap_session_native_thread")
#: the ways whose sessions swap through the thread engine: their copy jobs and copy thread are reported
SWAP_SESSION_WAYS = ("swap", "swap_per_tensor", "swap_no_gc", "swap_inline", "swap_session_native",
                     "swap_session_native_thread")


def run(device: torch.device, length: int, reps: int, width: int = 16, ways: tuple[str, ...] = WAYS) -> dict[str, Any]:
    """Interleaved reps of the ``ways`` ((a) and (b) always); microseconds per saved tensor for all but
    (a) (Note [Paired per-tensor costs])."""
    x = torch.randn(width, device=device)
    models = {name: TinyModel(length, width).to(device) for name in WAYS if name in ways or name in WAYS[:2]}
    if device.type != "cpu":
        models.pop("swap_inline", None)  # Note [Taking the swap way apart]: the thread engine's hand-offs
        models.pop("swap_calls", None)  # Note [What a swap in C would still pay]: host regions on the CPU only
        models.pop("swap_native", None)  # Note [What a save path in C++ pays]: its memcpy reads host memory
    native_ways = [name for name in NATIVE_WAYS if name in models]
    native = _built_native_save(native_ways) if native_ways else None
    if native is None:
        for name in native_ways:
            models.pop(name)
    makers = {"keep": lambda m: _session(m, False), "swap": lambda m: _session(m, True),
              "swap_per_tensor": lambda m: _session(m, True, coalesce=False),
              "swap_no_gc": lambda m: _session(m, True), "swap_inline": lambda m: _session(m, True),
              "keep_session_native": lambda m: _session(m, False, native=True),
              "swap_session_native": lambda m: _session(m, True, native=True),
              "swap_session_native_thread": lambda m: _session(m, True, native=True, inline_bytes=0)}
    session_native = [name for name in SESSION_NATIVE_WAYS if name in models]
    if session_native and not _native_session_builds(session_native):
        for name in session_native:
            models.pop(name)
    sessions = {name: make(models[name]) for name, make in makers.items() if name in models}
    contexts = {"none": contextlib.nullcontext, "identity": _identity_hooks, "floor": _floor_hooks,
                "keep_calls": _keep_calls_hooks, "swap_calls": _swap_calls_hooks,
                "keep_native": _keep_native_hooks(native), "swap_native": _swap_native_hooks(native),
                **{name: (lambda s=session: s) for name, session in sessions.items()}}
    if "swap_no_gc" in sessions:
        contexts["swap_no_gc"] = lambda s=sessions["swap_no_gc"]: _without_collector(s)
    saved = count_saved(models["none"], x)
    load_before = os.getloadavg()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in models}
    collected = {name: [0.0, 0] for name in models}  # collector seconds, full collections (Note [The collector's clock])
    clock = CollectorClock()
    try:
        for rep in range(reps + 2):  # two warm-up rounds
            if rep == 2 and "swap_inline" in sessions:
                sessions["swap_inline"].engine.close()  # Note [Taking the swap way apart]
            names = list(models)
            shift = rep % len(names)
            for name in names[shift:] + names[:shift]:
                model = models[name]
                before = clock.seconds, clock.full
                seconds = _step(model, x, contexts[name])
                if rep >= 2:
                    times[name].append(seconds)
                    collected[name][0] += clock.seconds - before[0]
                    collected[name][1] += clock.full - before[1]
    finally:
        clock.close()
    stats = {name: session.stats for name, session in sessions.items()}
    copy_threads = {name: _copy_thread_alive(session) for name, session in sessions.items()}
    for session in sessions.values():
        session.remove()
    summary = _summary(times, saved, length, width, stats.get("swap"))
    summary["load_average"] = {"before": load_before, "after": os.getloadavg()}
    summary["collector_us_per_saved_tensor"] = {name: spent / reps / saved * 1e6 for name, (spent, _) in collected.items()}
    summary["full_collections"] = {name: full for name, (_, full) in collected.items()}
    for name in SWAP_SESSION_WAYS:
        jobs = getattr(stats.get(name), "offload_copies", None)  # a tree without coalescing has no such counter
        summary[f"{name}_copy_jobs"] = None if jobs is None else jobs + stats[name].prefetch_copies
        summary[f"{name}_copy_thread"] = copy_threads.get(name)
        offloaded = getattr(stats.get(name), "offloaded_bytes", 0)  # Note [Releases never stall compute]
        summary[f"{name}_released_share"] = stats[name].released_bytes / offloaded if offloaded else None
    return summary


def run_isolated(device: str, length: int, reps: int, rounds: int, ways: tuple[str, ...],
                 scratch: Path, no_gc: bool = False) -> dict[str, dict[str, Any]]:
    """Each of ``ways`` (not (a) or (b)) alone in a process with (a) and (b), ``rounds`` times, rotated
    (Note [Each way alone]): per way, the CPU ratios to (b) of every round, their median and range."""
    alone = [w for w in ways if w not in WAYS[:2]]
    ratios: dict[str, list[float]] = {w: [] for w in alone}
    for turn in range(rounds):
        shift = turn % len(alone) if alone else 0
        for way in alone[shift:] + alone[:shift]:
            out = scratch / f"{way}-{turn}"
            command = [sys.executable, str(Path(__file__).resolve()), "--ways", way, "--reps", str(reps),
                       "--length", str(length), "--device", device, "--out", str(out), *(["--no-gc"] if no_gc else [])]
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
            micro = json.loads((out / "overhead.json").read_text())["microbench"]
            ratios[way].append(micro["cpu_over_identity"][way])
    return {way: {"cpu_over_identity": values, "median": statistics.median(values),
                  "range": [min(values), max(values)]} for way, values in ratios.items() if values}


def _copy_thread_alive(session: swapkit.SwapSession) -> bool | None:
    """Whether the session's engine copies on a thread of its own (``None``: not a thread engine)."""
    worker = getattr(session.engine, "_worker", False)
    return None if worker is False else worker is not None and worker.is_alive()


def _costs(times: dict[str, list[tuple[float, float]]], saved: int, clock: int) -> dict[str, float]:
    """Median over repetitions of each way's paired cost per saved tensor, in microseconds."""
    base = [t[clock] for t in times["none"]]
    return {name: statistics.median((t[clock] - b) / saved * 1e6 for t, b in zip(values, base))
            for name, values in times.items() if name != "none"}


def _summary(times: dict[str, list[tuple[float, float]]], saved: int, length: int, width: int,
             swap_stats: Any) -> dict[str, Any]:
    wall, cpu = _costs(times, saved, 0), _costs(times, saved, 1)
    return {"ops_in_chain": length, "tensor_bytes": width * 4, "saved_tensors_per_step": saved,
            "reps": len(times["none"]),
            "step_time_median_s": {name: statistics.median(t[0] for t in v) for name, v in times.items()},
            "step_cpu_median_s": {name: statistics.median(t[1] for t in v) for name, v in times.items()},
            "us_per_saved_tensor": wall, "cpu_us_per_saved_tensor": cpu,
            "session_keep_over_identity_us": wall["keep"] - wall["identity"] if "keep" in wall else None,
            "over_identity": {name: wall[name] / wall["identity"] for name in wall},
            "cpu_over_identity": {name: cpu[name] / cpu["identity"] for name in cpu},
            "swap_offloaded_tensors": getattr(swap_stats, "offloaded_tensors", None),
            "swap_late_fetches": getattr(swap_stats, "late_fetches", None)}


def engine_copy_gbps(nbytes: int, reps: int = 10) -> dict[str, float]:
    """GB/s of the CPU thread engine copying ``nbytes`` (into a reused buffer and into a new one), and
    of verify mode's checksum of as many bytes (``runtime.verify``: two per round trip)."""
    engine = ThreadCopyEngine("cpu")
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    reused, fresh, summed = [], [], []
    for _ in range(reps + 1):
        reused.append(_timed(lambda: engine.wait(engine.offload(src, dst))))
        fresh.append(_timed(lambda: engine.wait(engine.prefetch(src)[1])))
        summed.append(_timed(lambda: checksum(src)))
    engine.close()
    return {"bytes": nbytes, "reused_buffer_gbps": nbytes / statistics.median(reused[1:]) / 1e9,
            "fresh_buffer_gbps": nbytes / statistics.median(fresh[1:]) / 1e9,
            "verify_checksum_gbps": nbytes / statistics.median(summed[1:]) / 1e9}


def _timed(work: Callable[[], Any]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="swapkit's per-saved-tensor overhead (Note [Paired per-tensor costs])")
    parser.add_argument("--out", type=output_dir, default=Path("bench-out/overhead"))
    parser.add_argument("--length", type=positive_int, default=2000, help="sin ops in the chain (saved tensors per step)")
    parser.add_argument("--reps", type=positive_int, default=30)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--ways", default=",".join(WAYS),
                        help="ways to run, comma-separated (none and identity always run); leave out swap_per_tensor "
                             "to measure a swapkit tree from before runtime.offload_batch_bytes existed")
    parser.add_argument("--no-gc", action="store_true", help="run with Python's cyclic garbage collector disabled")
    parser.add_argument("--isolated", type=positive_int, metavar="ROUNDS",
                        help="also run each way alone in a process of its own, ROUNDS times (Note [Each way alone])")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"--device cuda: CUDA is not available (torch {torch.__version__}); use --device cpu", file=sys.stderr)
        return 2
    logging.getLogger("swapkit").setLevel(logging.ERROR)
    ways = tuple(w for w in args.ways.split(",") if w)
    unknown = sorted(set(ways) - set(WAYS))
    if unknown:
        parser.error(f"--ways: unknown {', '.join(unknown)}; expected some of {', '.join(WAYS)}")
    if args.no_gc:
        gc.disable()  # what the cyclic collector adds: the objects swapkit keeps per saved tensor trigger it
    try:
        micro = run(torch.device(args.device), args.length, args.reps, ways=ways)
    finally:
        gc.enable()
    result = {"env": _env(args), "microbench": micro}
    result["warnings"] = load_warning(result["env"]["cpu_count"], micro["load_average"]["before"],
                                      micro["load_average"]["after"])  # Note [Loaded machines] in common.py
    for warning in result["warnings"]:
        print(f"WARNING: {warning}", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.isolated:
        with tempfile.TemporaryDirectory() as scratch:
            ran = tuple(w for w in ways if w in micro["cpu_over_identity"])  # CUDA runs no swap_inline
            result["isolated"] = run_isolated(args.device, args.length, args.reps, args.isolated, ran, Path(scratch),
                                              args.no_gc)
    (args.out / "overhead.json").write_text(json.dumps(result, indent=1) + "\n")
    text = "\n".join(report_lines(result)) + "\n"
    (args.out / "overhead.md").write_text(text)
    print(text)
    return 0


def _env(args: argparse.Namespace) -> dict[str, Any]:
    import platform, datetime  # noqa: E401 - only the standalone run records these
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "usable_cpus": usable,
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "swapkit": swapkit.__version__, "device": args.device,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "length": args.length, "reps": args.reps, "ways": args.ways, "gc": not args.no_gc}


def report_lines(result: dict[str, Any]) -> list[str]:
    """A Markdown table of the standalone run."""
    micro, env = result["microbench"], result["env"]
    load = micro["load_average"]
    usable = env.get("usable_cpus", env["cpu_count"])
    pinned = f" (the process may run on {usable} of them)" if usable != env["cpu_count"] else ""
    lines = [*warning_lines(result.get("warnings", [])),
             f"# Per-saved-tensor overhead ({env['date']}, torch {env['torch']}, {env.get('cpu', 'CPU')}, "
             f"{env['cpu_count']} cores{pinned}, "
             f"{env['torch_threads']} torch threads, {env['device']}"
             f"{'' if env.get('gc', True) else ', cyclic GC disabled'})", "",
             f"{micro['saved_tensors_per_step']} saved tensors of {micro['tensor_bytes']} bytes per step, "
             f"{micro['reps']} interleaved repetitions, load average {load['before'][0]:.1f} before and "
             f"{load['after'][0]:.1f} after. Costs are medians of paired per-repetition differences to (a) "
             "(Note [Paired per-tensor costs] in benchmarks/microbench.py).", "",
             "| way | wall us/tensor | wall over (b) | main-thread CPU us/tensor | CPU over (b) | collector us/tensor "
             "(mean), full collections |",
             "|---|---|---|---|---|---|"]
    collector, full = micro.get("collector_us_per_saved_tensor", {}), micro.get("full_collections", {})
    for name in [w for w in WAYS[1:] if w in micro["us_per_saved_tensor"]]:
        gc_cell = f"{collector[name]:.2f}, {full[name]}" if name in collector else "—"
        lines.append(f"| {LABELS[name]} | {micro['us_per_saved_tensor'][name]:.2f} | "
                     f"{micro['over_identity'][name]:.2f}x | {micro['cpu_us_per_saved_tensor'][name]:.2f} | "
                     f"{micro['cpu_over_identity'][name]:.2f}x | {gc_cell} |")
    if collector:
        lines += ["", f"Collector: mean wall time in Python's cyclic collector during each way's steps per saved "
                      f"tensor, and the full collections among them over {micro['reps']} repetitions (Note [The "
                      "collector's clock] in benchmarks/microbench.py); the medians before it leave full "
                      "collections out."]
    isolated = result.get("isolated")
    if isolated:
        rounds = len(next(iter(isolated.values()))["cpu_over_identity"])
        lines += ["", f"Each way alone (Note [Each way alone]): main-thread CPU over (b) in a process with only (a) "
                      f"and (b) beside it; median (range) over {rounds} rounds, and the paired run's ratio above.", "",
                  "| way | alone: CPU over (b) | paired run: CPU over (b) |", "|---|---|---|"]
        for name, one in isolated.items():
            low, high = one["range"]
            lines.append(f"| {LABELS[name]} | {one['median']:.2f}x ({low:.2f}-{high:.2f}) | "
                         f"{micro['cpu_over_identity'][name]:.2f}x |")
    if micro["swap_copy_jobs"] is not None:
        lines += ["", f"Copy jobs per step (each way together): {micro['swap_copy_jobs']} in (d), "
                      f"{micro['swap_per_tensor_copy_jobs']} in (e), for {micro['swap_offloaded_tensors']} swapped "
                      f"storages; {micro['swap_late_fetches']} late fetches in (d)'s last step."]
    shares = {name: micro.get(f"{name}_released_share") for name in ("swap", "swap_session_native",
                                                                     "swap_session_native_thread")}
    if any(share is not None for share in shares.values()):  # the rest was not copied by its horizon: kept
        lines += ["", "Offloaded bytes released before backward in the last step (the rest stayed on the device, its "
                      "copy unfinished at its horizon: swapkit.runtime.swap_schedule Note [Releases never stall "
                      "compute]): " + ", ".join(f"{share:.1%} in {LABELS[name][:3]}" for name, share in shares.items()
                                                if share is not None) + "."]
    return lines


LABELS = {"none": "(a) no hooks", "identity": "(b) identity saved_tensors_hooks",
          "keep": "(c) swapkit session, keep all", "swap": "(d) swapkit session, swap all (min_offload_bytes 0)",
          "swap_per_tensor": "(e) as (d), offload_batch_bytes 0 (one copy job per storage)",
          "floor": "(f) floor: detached keeper + version check, no bookkeeping",
          "swap_no_gc": "(g) as (d), cyclic GC off during the step",
          "swap_inline": "(h) as (d), copies inline on the queueing thread (no copy thread)",
          "keep_calls": "(i) a keep's torch calls and allocations alone, no swapkit frames",
          "keep_native": "(k) a keep's bookkeeping in C++ (a torch extension), no Python per save",
          "swap_native": "(l) a coalesced swap's bookkeeping and copies in C++, no Python per save",
          "swap_calls": "(j) a coalesced swap's torch calls and allocations alone, no swapkit frames",
          "keep_session_native": "(m) as (c), runtime.native_save: true (swapkit's C++ hooks)",
          "swap_session_native": "(n) as (d), runtime.native_save: true (swapkit's C++ hooks)",
          "swap_session_native_thread": "(o) as (n), engine_options.inline_bytes: 0 (every copy to the copy thread)"}


if __name__ == "__main__":
    sys.exit(main())
