"""One step of a swap session: the forward clock, the storage index, the counters.

A step is one forward and its backward. The session opens a new step on ``__enter__`` and when a
forward pack arrives after the current step's backward began (several micro-batches inside one
``with`` block).

The swapped storages' copies, releases and fetches back are the step's
:class:`~swapkit.runtime.swap_schedule.SwapSchedule`'s.

Note [Parameters are recognised when saved]
Parameter storages are never swapped (DESIGN §4). The set the session builds from
``model.parameters()`` and ``model.buffers()`` when a step starts is not enough under FSDP2:
``fully_shard`` replaces each parameter by a sharded DTensor, and in forward it registers an
*unsharded* ``nn.Parameter`` on the module, built on an all-gather buffer that it frees again
(``resize_(0)``) after the layer's forward. Linear layers save ``weight.t()``, a view of that
unsharded parameter. So a saved tensor also counts as a parameter when it is an ``nn.Parameter``
or a view whose ``_base`` is one: two attribute reads per new storage, no walk over the model.
A storage recognised that way joins the step's set, so a later save of a detached alias of it is
found by storage. What is still missed is a parameter's storage reached only through a detached
alias or a non-view op (``weight.detach()`` saved by a custom function); if another component
then resizes it, the copy fails loudly (Note [Storages another component may resize] in
``swapkit.runtime.records``).

Note [The cost of a save]
``save`` and ``unpacked`` run once per saved tensor, so a step of many small ops pays for every
attribute read there. What keeps them lean, each giving the same guarantee as the longer form:
- ``save`` makes one index lookup; a storage already recorded in this step costs a detach and a
  handle, and everything else a new storage needs (parameter, device and recompute checks, the
  record, the accounting) happens once, in ``_first_save``;
- the storage index maps the storage's key (its ``StorageImpl`` address,
  :func:`~swapkit.runtime.records.storage_key`) to one weak reference to the record; a
  :class:`KeptRecord` holds its first keeper, and so its storage (which adds no lifetime because each
  of its handles holds a keeper of that storage): while it lives no other storage has its key. A
  :class:`SwapRecord` lets its storage go at the release and holds a weak reference, so a recycled key
  is caught by ``record.storage() is storage``; a kept record is a list, built without a Python frame;
- ``isinstance(t, nn.Parameter)`` runs the metaclass hook (a failing ``getattr`` on the tensor); a plain
  ``torch.Tensor`` that is not a view and has no attributes is no parameter, and the others are asked
  :func:`~swapkit.runtime.records.is_parameter`, which answers from ``type`` and ``__dict__``;
- a save asks the schedule for the releases due only once a swap record was queued in the step
  (``_scheduled``), and looks at the open batch and the scopes seen only when the frame changed since
  the previous save, the recomputable outputs only when there are some, and a frame's label (the
  stats key) is built once per frame;
- the tick queues append records pushed in tick order to a deque and keep a heap only for the others
  (``swapkit.runtime.schedule`` Note [In-order pushes]); the records waiting for their copy are a
  deque in copy order, and the engine is asked whether a copy finished once per batch, in forward
  (``swapkit.runtime.swap_schedule`` Note [Releases never stall compute]) and in backward
  (``SwapRecord.restore``);
- a release is the record's own (it counts ``released_bytes``) and its push on the prefetch queue, with
  no other method between; a restore whose batch was seen arrived skips ``engine.wait`` where the
  engine says a finished copy needs none (``usable_when_ready``: the thread engine, not CUDA, whose
  reading stream must still join the copy);
- a device-byte change is one append to the step's ledger, a C call with no lock (records die on any
  thread): the total and its peak are replayed in order when read (``swapkit.runtime.ledger`` Note
  [The device-bytes ledger]);
- in backward, once nothing is left to prefetch, the step turns ``watch_unpacks`` off and the session's
  unpack no longer calls it: only backward pops the prefetch queue and nothing pushes to it any more,
  so an empty queue stays empty (a :class:`~swapkit.runtime.microsteps.MicroStep` keeps watching: it
  looks ahead into other micro-steps). The queue is asked whether it is empty only at an unpack that
  prefetched nothing, so watching stops one unpack later, never at the cost of an unpack that prefetched;
- the handle is a tuple (:class:`~swapkit.runtime.records.Saved`, built by one C call, unpacked by
  index), the current frame is one attribute of the scope tracker, the plain-tensor test is inlined
  here, and the tick queues read a record's horizon with ``attrgetter``;
- a swapped storage costs the forward thread no tensor per copy: its batch keeps the storage and the
  engine builds the copy views, on its worker thread where it has one (``swapkit.runtime.batch`` Note
  [Coalesced copies]); a release empties the keepers and sets their version counters back with one
  call (:func:`~swapkit.runtime.records.empty_keepers`), and a restore builds its view with
  ``Tensor.new`` of a per-step empty tensor, not ``torch.empty``'s argument parsing;
- a swap record keeps its first keeper in a slot: a list per record would be one more object for the
  cyclic garbage collector to scan in every collection while the step lives: every object a save
  leaves alive until backward brings the next full collection nearer. On the benchmark's process
  the collector measured 1-5 us per swapped save depending on the run, 3-15% of a swap session's cost
  (``benchmarks/results/overhead``). For the same reason a handle's view metadata
  holds its size as a plain tuple, not a ``torch.Size`` (:func:`~swapkit.runtime.records.view_meta`),
  the tick queues' entries are pairs of integers (``swapkit.runtime.schedule`` Note [Heap entries the
  collector does not see]) and the records waiting for their copy sit in a deque, with no entry object
  each: a swapped save leaves about five tracked objects, not seven.
What is left is measured by ``benchmarks/microbench.py`` against bare identity hooks and against the
floor of any safe keep (a detached keeper and its version, Note [Version keepers] in
``swapkit.runtime.records``): see ``benchmarks/results/overhead``.
"""
from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from typing import Any, Callable

import torch

from swapkit.config.types import RuntimeConfig
from swapkit.engine import CopyEngine, HostPool
from swapkit.runtime.autocast import autocast_cached
from swapkit.runtime.ledger import SETTLE_TICKS, ByteLedger
from swapkit.runtime.overrides import scope_label
from swapkit.runtime.reached import ScopesReached
from swapkit.runtime.recipes import Recipe, RecomputableOutputs, RecomputedOutput
from swapkit.runtime.records import (
    KeptRecord, Saved, SwapRecord, empty_keeper, is_parameter, make_saved, view_meta, view_on,
)
from swapkit.runtime.scope import Frame
from swapkit.runtime.stats import SwapStats
from swapkit.runtime.swap_schedule import SwapSchedule


_TENSOR, _PARAMETER, _STRIDED = torch.Tensor, torch.nn.Parameter, torch.strided


_SETTLE_MASK = SETTLE_TICKS - 1


class Step:
    """Per-step state. Created by :class:`swapkit.runtime.session.SwapSession`."""

    #: records due above the reach wait for a backward that reads that high (swapkit.runtime.swap_schedule Note [A
    #: backward prefetches its own forward's records])
    sets_aside = True

    def __init__(self, number: int, engine: CopyEngine, pool: HostPool, runtime: RuntimeConfig,
                 param_storages: set[int], tail_ticks: int | None,
                 on_backward: Callable[["Step"], None], swap_scopes: tuple[tuple[int, str], ...] = ()) -> None:
        self.number, self.engine, self.pool, self.runtime = number, engine, pool, runtime
        self.device = engine.device
        self.verify = runtime.verify  # swapkit.runtime.records Note [Verify mode]
        self.param_storages = param_storages
        self.tail_ticks = tail_ticks if runtime.skip_tail_offload else None
        self._on_backward = on_backward
        self.clock = 0
        self.backward_started = self.aborted = self.closed = False
        self.superseded = False  # closed because the session started the next step (session Note [A backward ...])
        self.watch_unpacks = True  # the session calls unpacked() (Note [The cost of a save])
        self._index: dict[int, weakref.ref] = {}  # storage_key -> its record (Note [The cost of a save])
        #: the C++ hooks' records (a KeptIndex: swapkit.runtime.native_save.cpp Note [The records kept in C++]),
        #: given by a session with ``runtime.native_save``; looked up where ``_index`` has no live record
        self.kept_natively: Any = None
        self.usable_when_ready = getattr(engine, "usable_when_ready", False)  # SwapRecord.restore skips its wait
        self._scheduled = False  # a swap record was queued this step (Note [The cost of a save])
        self._last_frame: Frame | None = None  # the frame of the previous save: scopes.seen has it
        self._recomputable = RecomputableOutputs(self.device)
        self._skipped_storages: set[int] = set()
        self._timings: list[Any] = []
        self.empties: dict[torch.dtype, torch.Tensor] = {}  # swapkit.runtime.records.view_on
        #: a record's torch calls: the Python's, or the C++ module's in a session with ``runtime.native_save``
        #: (swapkit.runtime.records Note [A record's torch calls in C++])
        self.view_on: Callable[..., torch.Tensor] = view_on
        self.empty_keeper: Callable[[torch.Tensor], None] = empty_keeper
        self._allocations_at_start = pool.allocations
        self.stats = SwapStats(step=number, skipped=defaultdict(int), offloaded_by_scope=defaultdict(int),
                               recomputed_by_scope=defaultdict(int))
        self.ledger = ByteLedger()  # swapkit.runtime.ledger Note [The device-bytes ledger]
        self.bytes_changed = self.ledger.changed  # +n / -n device bytes, from any thread: one C call
        self.scopes = ScopesReached(swap_scopes)  # what the saves reached (overrides Note [Swaps nobody reports])
        self.schedule = SwapSchedule(self)  # the swapped storages' copies, releases and fetches
        self.lock = threading.RLock()  # swapkit.runtime.records Note [Unpacks from several threads]

    # ------------------------------------------------------------------ forward

    def save(self, tensor: torch.Tensor, frame: Frame | None) -> Saved:
        """Pack one tensor saved in forward: tick it, then keep it or start its swap.

        This runs once per saved tensor: Note [The cost of a save] keeps it lean."""
        tick = self.clock
        self.clock = tick + 1
        if self._scheduled:
            self.schedule.advance(tick)
        if frame is not self._last_frame:
            self._frame_seen(frame)
        if (type(tensor) is not _TENSOR and type(tensor) is not _PARAMETER) or tensor.layout is not _STRIDED \
                or tensor.is_nested or tensor.is_quantized:  # not swapkit.runtime.records.is_plain: inlined
            return make_saved((tensor.detach(), tensor._version, self, tick, None, None, frame))
        storage = tensor.untyped_storage()
        key, version = storage._cdata, tensor._version  # records.storage_key, inlined
        found = self._index.get(key)
        record = found() if found is not None else None
        if record is None and self.kept_natively is not None:
            record = self.kept_natively.get(key)
        if record is None or record.version != version or (record.swapped and record.storage() is not storage):
            return self._first_save(tensor, storage, key, tick, frame, version)  # new, recycled id, or overwritten
        if not record.swapped:
            return make_saved((tensor.detach(), version, self, tick, record, None, frame))
        return self._swapped_handle(tensor, record, tick, frame, version)

    def _first_save(self, tensor: torch.Tensor, storage: torch.UntypedStorage, key: int, tick: int,
                    frame: Frame | None, version: int) -> Saved:
        """A storage this step has no record of: a parameter, foreign or empty (kept, no record), a
        recomputable output, or a new kept or swapped record."""
        nbytes = storage.nbytes()
        parameter = key in self.param_storages or (  # a plain non-view tensor without attributes is none
            (type(tensor) is not torch.Tensor or tensor._base is not None or tensor.__dict__)
            and self._is_parameter(tensor, key))
        if parameter or nbytes == 0 or tensor.device != self.device:
            self._not_candidate(parameter, key, nbytes, frame)
            return make_saved((tensor.detach(), version, self, tick, None, None, frame))
        recomputed = self._recomputable.find(key, storage, version) if self._recomputable.entries else None
        if recomputed is not None:
            return self._recomputed_handle(tensor, recomputed, tick, frame, version)
        keeper = tensor.detach()  # Note [Version keepers] in swapkit.runtime.records
        record = self._swap_record(storage, key, nbytes, tick, frame, version, keeper) \
            if frame is not None and frame.prefetch is not None and self._not_cached(tensor, key, nbytes) else None
        self.stats.saved_bytes += nbytes  # only the forward thread saves
        self.bytes_changed(nbytes)
        if not tick & _SETTLE_MASK:
            self.settle()  # bounds the unsettled changes (swapkit.runtime.ledger)
        if self.kept_natively is not None:
            self.kept_natively.forget(key)  # the record below is the newer: native_save.cpp Note [The records ...]
        if record is None:
            record = KeptRecord((self, nbytes, version, keeper))
            self._index[key] = weakref.ref(record)  # Note [The cost of a save]
            return make_saved((keeper, version, self, tick, record, None, frame))
        self._index[key] = weakref.ref(record)
        return make_saved((keeper, version, self, tick, record, view_meta(tensor), frame))

    def _frame_seen(self, frame: Frame | None) -> None:
        self._last_frame = frame
        self.schedule.frame_changed(frame)
        if frame is not None:
            self.scopes.seen.add((frame.layer, frame.path))

    def _not_candidate(self, parameter: bool, key: int, nbytes: int, frame: Frame | None) -> None:
        reason = "parameter" if parameter else "not_on_device" if nbytes else None
        if frame is not None and frame.prefetch is not None and reason is not None:
            self._skip(reason, key, nbytes, None)  # no candidate: not what its scope kept (overrides Note [Swaps ...])

    def _swapped_handle(self, tensor: torch.Tensor, record: SwapRecord, tick: int, frame: Frame | None,
                        version: int) -> Saved:
        if frame is not record.frame and frame is not None and frame.prefetch is not None:
            self.scopes.kept_in(frame, "moved", record.nbytes)  # another scope moves it: overrides Note [Swaps whose ...]
        keeper = tensor.detach()  # Note [Version keepers] in swapkit.runtime.records
        self.schedule.saved_again(record, keeper, tick)
        return make_saved((keeper, version, self, tick, record, view_meta(tensor), frame))

    def _not_cached(self, tensor: torch.Tensor, key: int, nbytes: int) -> bool:
        """A swap candidate that autocast's cache does not hold (swapkit.runtime.autocast Note [Autocast's cached
        casts]); one it holds is kept and counted, as a parameter is: no threshold would move it."""
        if autocast_cached(tensor):
            self._skip("autocast_cache", key, nbytes, None)
            return False
        return True

    def _is_parameter(self, tensor: torch.Tensor, key: int) -> bool:
        """Note [Parameters are recognised when saved]"""
        base = tensor._base
        if is_parameter(tensor) or (base is not None and is_parameter(base)):
            self.param_storages.add(key)  # later saves of a detached alias are found by storage
            return True
        return False

    def register_outputs(self, recipe: Recipe, outputs: list[torch.Tensor], inputs: set[int]) -> None:
        """Outputs a recipe can rebuild (``swapkit.runtime.recipes.Note [Output recompute]``)."""
        self._recomputable.register(recipe, outputs, inputs, self.param_storages)

    def _recomputed_handle(self, tensor: torch.Tensor, recomputed: RecomputedOutput, tick: int,
                           frame: Frame | None, version: int) -> Saved:
        if not recomputed.counted:
            recomputed.counted = True
            self.stats.recomputed_output_bytes += recomputed.nbytes
        keeper = tensor.detach()
        self.empty_keeper(keeper)  # tracks in-place writes, holds no memory (swapkit.runtime.records Note [Version keepers])
        return make_saved((keeper, version, self, tick, recomputed, view_meta(tensor), frame))

    def region_checkpointed(self, label: str) -> None:
        """A checkpoint region ran in forward (``SwapStats.recomputed_by_scope``)."""
        self.stats.recomputed_by_scope[label] += 1

    def output_recomputed(self, nbytes: int) -> None:
        with self.lock:
            self.stats.output_recomputes += 1
        self.bytes_changed(nbytes)

    def _swap_record(self, storage: torch.UntypedStorage, key: int, nbytes: int, tick: int, frame: Frame,
                     version: int, keeper: torch.Tensor) -> SwapRecord | None:
        """A swap record for a new storage saved in a swapped scope, or ``None`` (skipped: kept)."""
        if nbytes < self.runtime.min_offload_bytes:
            return self._skip("small", key, nbytes, frame)
        if self.tail_ticks is not None and tick < self.tail_ticks <= tick + frame.prefetch:
            return self._skip("tail", key, nbytes, frame)  # swap_schedule Note [The last k ticks stay on the device]
        record = self.schedule.add(storage, nbytes, version, frame, tick, keeper)
        self._scheduled = True
        return record

    def _skip(self, reason: str, key: int, nbytes: int, frame: Frame | None) -> None:
        """Count a storage saved in a swap scope that stays on the device; ``frame``: the scope, for a swap
        candidate (``None`` for a parameter or a tensor on another device, which no threshold would move)."""
        if key not in self._skipped_storages:
            self._skipped_storages.add(key)
            self.stats.skipped[reason] += nbytes
            if frame is not None:
                self.scopes.kept_in(frame, reason, nbytes)
        return None

    # ------------------------------------------------------------------ backward

    def unpacked(self, tick: int, record: Any = None) -> None:
        """Backward unpacked a tensor saved at ``tick`` (its storage's ``record``, if any): prefetch every record
        due by then. Once nothing is left to prefetch, ``watch_unpacks`` turns off and the session stops calling."""
        with self.lock:
            if not self.backward_started and torch._C._current_graph_task_id() != -1:
                self._begin_backward()
            if self.schedule.unpacked(tick, record) and self.backward_started:
                self._prefetches_done()  # asked only when nothing was due (Note [The cost of a save])

    def _prefetches_done(self) -> None:
        """Only backward pops the prefetch queue and nothing pushes to it any more: an empty queue
        stays empty (Note [The cost of a save])."""
        self.watch_unpacks = False

    def _begin_backward(self) -> None:
        self.backward_started = True
        self.schedule.begin_backward()
        self._on_backward(self)

    def verified(self) -> None:
        with self.lock:
            self.stats.verified_tensors += 1

    def late_fetch(self, lead: int, timing: Any) -> None:
        """A first use that waited for its copy (``timing``: how long), ``lead`` ticks after it was issued."""
        with self.lock:
            self.stats.prefetch_lead_ticks += max(lead, 0)
            self.stats.late_fetches += 1
            self._timings.append(timing)

    # ------------------------------------------------------------------ accounting and end

    def settle(self) -> None:
        """Replay the device-byte changes so far (swapkit.runtime.ledger Note [The device-bytes ledger])."""
        self.ledger.settle()

    @property
    def device_bytes(self) -> int:
        """Saved bytes this step holds on the device now (swapkit.runtime.ledger Note [The device-bytes ledger])."""
        return self.ledger.settle()[0]

    def close(self, aborted: bool = False, superseded: bool = False) -> None:
        """Drop the schedule (records live on only through the graph's handles); ``superseded``: the
        session opened the next step (not ``remove()`` nor an error)."""
        self.aborted = self.aborted or aborted
        self.superseded = self.superseded or superseded
        self.closed = True  # a backward that begins later runs without the schedule (session Note [A backward ...])
        self.schedule.close()
        self._index.clear()
        if self.kept_natively is not None:
            self.kept_natively.clear()
        self._recomputable.clear()

    def snapshot(self) -> SwapStats:
        """The counters as a plain :class:`SwapStats` (resolves CUDA timings)."""
        stats = self.stats
        seconds = sum(t.seconds() for t in self._timings)
        resident, peak = self.ledger.settle()
        return SwapStats(**{
            **vars(stats), "ticks": self.clock, "wait_seconds": seconds, "resident_bytes": resident,
            "peak_device_bytes": peak,
            "host_pool_bytes": self.pool.total_bytes, "host_allocations": self.pool.allocations
            - self._allocations_at_start, "skipped": dict(stats.skipped),
            "offloaded_by_scope": dict(stats.offloaded_by_scope), "aborted": self.aborted, "micro_steps": 1,
            "recomputed_by_scope": dict(stats.recomputed_by_scope),
            "unused_swaps": [scope_label(layer, path) for layer, path, _ in self.scopes.unused_swaps(self.clock > 0)],
        })
