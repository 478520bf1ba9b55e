"""The session's host pool in the budget planner's replay: batches, the pool's bytes, ``max_host_bytes``.

Pure Python (no torch). :func:`host_use` walks a composed step's forward as the session batches it
and asks a ledger of the host pool for each batch's region; :mod:`swapkit.plan.simulate` then keeps
on the device the storages of every batch the pool refused.

Note [The host pool in the replay]
At run time a swapped storage joins the open batch of its scope (``swapkit.runtime.batch`` Note
[Coalesced copies]); when the batch is flushed the pool is asked for one region of the batch's size
(each slot rounded up to 16 bytes), and where it refuses (``runtime.max_host_bytes``) the whole batch
stays on the device (``skipped["host_cap"]``). The replay does the same:
- a batch is the run of new swapped storages saved in one frame (the swapped scope of a layer that
  holds the save; the layer itself for a layer swap), closed where the runtime flushes it: a save in
  another frame (any save, a kept or uncounted one too), a storage that would take it past
  ``runtime.offload_batch_bytes`` (``0``: one storage per batch), or a member coming due
  (``tick >= horizon``; a later save of a member moves its horizon out). Storages too small or (in a
  steady step) in the forward's tail are not swapped and join no batch (``swapkit.plan.simulate``
  Note [Cost model]).
- Regions are asked for in that order and none comes back during forward: a swapped record lives
  until backward (the step's queues hold it), and its region goes back when backward prefetches the
  batch or drops it from the tail (``swapkit.engine.pool`` Note [Host buffer reuse is ordered by the
  copy queue]). So the host bytes in use peak at the end of forward, and every region is back (its
  fence passed, or the next forward's request waits for it) before the next step asks again.
- They go back in backward's order, which decides which block the pool hands out next (it reuses
  the block of a size freed last) and so, near the cap, which batches it refuses: first the batches
  whose every member is in the tail (let go when backward begins), then the others as backward
  prefetches them, the one with the latest horizon first.
- The ledger is the pool's own placement on offsets (``swapkit.engine.slabs.SlabLedger``, which
  the planner gives the replay with the engine's page granule): slab sizes, the shared and exact
  kinds, same-size reuse, the cap. The replay runs steps on it until the refused batches repeat (at
  most :data:`MAX_STEPS`) and reports the last (the steady one the planner predicts):
  ``host_pool_bytes`` is what the slabs hold, as the session's stats say, and the refused batches
  are that step's. The first step also offloads the saves
  of the forward's tail (the session learns the forward's length only then: ``swapkit.runtime.swap_schedule``
  Note [The last k ticks stay on the device]), so its slabs may be larger than the steady step needs,
  and the pool keeps them.
Where it is approximate:
- Without a ledger from the engine (a pure caller), :class:`PackedLedger` packs regions end to end:
  no slab rounding, so ``host_pool_bytes`` is the data's (aligned), and the cap refuses a batch only
  where the data would cross it.
- The pool waits for a parked range's fence and places a request of a new size by best fit: where
  ranges were parked (a fence not yet passed) rather than kept when the next step asks, the real
  layout can differ from the ledger's, and so can a refusal near the cap.
- Frames are told apart by layer and swapped scope, as the plan names them; a module shared by
  several layer positions saves in its last position's frame (``swapkit.runtime.scope`` Note [A
  shared module's swap scope]), which the replay does not follow. On CUDA the producer stream also
  splits batches (``swapkit.runtime.batch`` Note [A batch has one producer]); the replay assumes one
  stream.
- Copy timing is still per storage (each swapped storage's copy issued at its save,
  ``swapkit.plan.simulate`` Note [Cost model]); only the pool's decisions are per batch.

Note [The host pool in a pipeline stage]
A pipeline stage's micro-steps (``swapkit.runtime.microsteps``) share the stage session's one pool,
so a stage's regions are asked for and given back in the order its schedule runs forwards and
backwards (:func:`stage_host_use`, with the actions ``swapkit.plan.stages.schedule_actions`` lists),
and a cap refuses the batches of whichever micro-batch asks when the pool is full: under GPipe the
later forwards'. The replay follows the runtime's micro-step rules:
- a forward's batches ask for regions as a single step's do, and the batch still open when the
  forward ends is flushed, not discarded (``MicroSteps.forward_ended``): it asks too;
- a backward gives back its own micro-step's regions in backward's order; before them, if the
  micro-step expected next (the oldest waiting) had its tail released when a later forward opened
  or an earlier backward began (``swapkit.runtime.microsteps`` Note [Micro-step tails]), the regions
  of its batches that hold a save of the tail: this backward prefetches those ahead (Note [Looking
  ahead into the next micro-step]), and a batch's region goes back at its prefetch;
- from the second optimizer step on, the micro-steps whose tail was still on the device when their
  backward began (``swapkit.plan.stages.direct_micro_batches``) do not offload their tail
  (``runtime.skip_tail_offload``), the others still do.
Each micro-batch gets its own refused storages (the same trace replayed, different decisions), and
the stage's ``host_cap_bytes`` is their sum. Where it is approximate, beyond the single step's
points: within one backward the look-ahead's regions come back interleaved with the backward's own,
not all before them, which can change which block the pool hands out next.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from swapkit.plan.trace import FlatSave, FlatStep

#: A slot's alignment inside a batch's region (``swapkit.runtime.batch.ALIGN``).
SLOT_ALIGN = 16
#: The pool's range alignment (``swapkit.engine.slabs.ALIGNMENT``).
RANGE_ALIGN = 512
#: Steps the replay runs at most while the pool's refusals still change from one step to the next.
MAX_STEPS = 8


class Ledger(Protocol):
    """What the replay asks of the host pool (``swapkit.engine.slabs.SlabLedger`` is the pool's own)."""

    @property
    def held_bytes(self) -> int: ...

    def acquire(self, nbytes: int) -> Any | None: ...

    def release(self, handle: Any) -> None: ...


class PackedLedger:
    """Regions packed end to end (each rounded to the pool's alignment), at most ``max_bytes`` in use
    (Note [The host pool in the replay]: the model without the engine's slabs)."""

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = max_bytes
        self.live = self.held_bytes = 0

    def acquire(self, nbytes: int) -> int | None:
        span = -(-nbytes // RANGE_ALIGN) * RANGE_ALIGN
        if self.max_bytes is not None and self.live + span > self.max_bytes:
            return None
        self.live += span
        self.held_bytes = max(self.held_bytes, self.live)
        return span

    def release(self, span: int) -> None:
        self.live -= span


@dataclass(frozen=True)
class HostModel:
    """The session's host pool settings the replay follows.

    Args:
        max_bytes: ``runtime.max_host_bytes`` (``None``: unbounded).
        batch_bytes: ``runtime.offload_batch_bytes``.
        ledger: makes a fresh ledger for a cap (the planner passes the engine's ``SlabLedger``).
        skip_tail: ``runtime.skip_tail_offload`` (steady steps do not offload the forward's tail).
    """

    max_bytes: int | None = None
    batch_bytes: int = 16 << 20
    ledger: Callable[[int | None], Ledger] = field(default=PackedLedger, compare=False)
    skip_tail: bool = True


@dataclass(frozen=True)
class HostUse:
    """What the pool does in a steady step: the storages it keeps on the device, their bytes, and the
    bytes its slabs hold (``SwapStats.host_pool_bytes``)."""

    refused: frozenset = frozenset()
    refused_bytes: int = 0
    pool_bytes: int = 0


def swap_distance(save: FlatSave, tick: int, last: int, swap_k: Callable[[int | None, str | None], int | None],
                  min_offload_bytes: int, skip_tail: bool = True) -> int | None:
    """The distance of a new storage first saved at ``tick``, or ``None`` where it is kept: not in a
    swapped scope, smaller than ``min_offload_bytes``, or (``skip_tail``: a steady step) due only
    after the forward's last tick."""
    k = swap_k(save.layer, save.scope)
    if k is None or save.nbytes < min_offload_bytes or (skip_tail and tick + k >= last + 1):
        return None
    return k


class _Batch:
    __slots__ = ("frame", "members", "nbytes", "data_bytes")

    def __init__(self, frame: tuple) -> None:
        self.frame, self.members, self.nbytes, self.data_bytes = frame, [], 0, 0


class _Batcher:
    """One forward of the step, batched as the session batches it (Note [The host pool in the replay])."""

    def __init__(self, step: FlatStep, swap_k, swap_scope, min_offload_bytes: int, host: HostModel,
                 ledger: Ledger, skip_tail: bool, flush_at_end: bool = False) -> None:
        self.step, self.swap_k, self.swap_scope, self.min_bytes = step, swap_k, swap_scope, min_offload_bytes
        self.skip_tail, self.flush_at_end = skip_tail, flush_at_end
        self.tail_released = False  # a micro-step's: its tail left the device before its backward
        self.limit, self.ledger = host.batch_bytes, ledger
        self.open: _Batch | None = None
        self.horizon: dict[tuple, int] = {}  # swapped storage -> its horizon
        self.k: dict[tuple, int] = {}
        self.seen: set[tuple] = set()
        self.regions: list[tuple[Any, list]] = []  # (region, the batch's members), in forward order
        self.refused: set[tuple] = set()
        self.refused_bytes = 0

    def run(self) -> None:
        last = len(self.step.forward) - 1
        for tick, save in enumerate(self.step.forward):
            batch = self.open
            if batch is not None and (min(self.horizon[s] for s in batch.members) <= tick
                                      or self._frame(save) != batch.frame):
                self._flush()  # a member came due, or the scope changed
            if save.storage is None:
                continue
            if save.storage in self.seen:
                if save.storage in self.k:  # a later save moves the horizon out (swapkit.runtime.schedule)
                    self.horizon[save.storage] = max(self.horizon[save.storage], tick + self.k[save.storage])
                continue
            self.seen.add(save.storage)
            k = swap_distance(save, tick, last, self.swap_k, self.min_bytes, self.skip_tail)
            if k is not None:
                self._join(save, tick, k)
        if self.flush_at_end:
            self._flush()  # a micro-step's forward end queues its open batch (MicroSteps.forward_ended)
        self.open = None  # a step's still open when backward begins: discarded, its storages stay (tail)

    def _frame(self, save: FlatSave) -> tuple | None:
        if save.layer is None:
            return None
        return save.layer, self.swap_scope(save.layer, save.scope)

    def _join(self, save: FlatSave, tick: int, k: int) -> None:
        self.k[save.storage], self.horizon[save.storage] = k, tick + k
        batch = self.open
        if batch is None or (batch.nbytes and batch.nbytes + save.nbytes > self.limit):
            self._flush()
            batch = self.open = _Batch(self._frame(save))
        batch.members.append(save.storage)
        batch.nbytes += -(-save.nbytes // SLOT_ALIGN) * SLOT_ALIGN
        batch.data_bytes += save.nbytes
        if not self.limit:
            self._flush()

    def _flush(self) -> None:
        batch, self.open = self.open, None
        if batch is None:
            return
        region = self.ledger.acquire(batch.nbytes)
        if region is None:  # the pool refused: the batch stays on the device
            self.refused.update(batch.members)
            self.refused_bytes += batch.data_bytes
        else:
            self.regions.append((region, batch.members))

    def _in_backward_order(self, regions: list[tuple[Any, list]]) -> list[tuple[Any, list]]:
        """``regions`` in the order backward gives them back (Note [The host pool in the replay])."""
        last = len(self.step.forward) - 1

        def order(entry: tuple[Any, list]) -> tuple[bool, int]:
            horizons = [self.horizon[s] for s in entry[1]]
            return min(horizons) <= last, -max(horizons)  # all in the tail first, then the latest horizon first

        return sorted(regions, key=order)

    def give_back(self, ledger: Ledger, ahead_only: bool = False) -> None:
        """Return this forward's regions to ``ledger`` in backward's order. With ``ahead_only``, only
        the regions of batches holding a save of the tail: what the backward of the micro-step before
        prefetches ahead once this one's tail was released (Note [The host pool in a pipeline stage])."""
        last = len(self.step.forward) - 1
        going, staying = [], []
        for entry in self.regions:
            ahead = max(self.horizon[s] for s in entry[1]) > last
            (going if ahead or not ahead_only else staying).append(entry)
        for region, _ in self._in_backward_order(going):
            ledger.release(region)
        self.regions = staying


def host_use(step: FlatStep, swap_k: Callable[[int | None, str | None], int | None],
             swap_scope: Callable[[int, str | None], Any] | None, min_offload_bytes: int,
             host: HostModel) -> HostUse:
    """The pool's decisions in the second of two steps of ``step`` (Note [The host pool in the replay]).

    Args:
        swap_scope: the swapped scope that holds a save in a layer (its frame); ``None`` to tell
            frames apart by their distance only.
    """
    scope_of = swap_scope or (lambda layer, scope: swap_k(layer, scope))
    ledger = host.ledger(host.max_bytes)
    refused: frozenset | None = None
    for number in range(MAX_STEPS):  # the first step offloads its tail too (nothing learnt yet)
        batcher = _Batcher(step, swap_k, scope_of, min_offload_bytes, host, ledger, number > 0 and host.skip_tail)
        batcher.run()
        batcher.give_back(ledger)  # every region is back before the next step asks
        if number > 0 and frozenset(batcher.refused) == refused:
            break  # steady
        refused = frozenset(batcher.refused)
    return HostUse(frozenset(batcher.refused), batcher.refused_bytes, ledger.held_bytes)


@dataclass(frozen=True)
class StageHostUse:
    """What one pipeline stage's pool does in a steady optimizer step: per micro-batch, the storages
    it keeps on the device; their bytes summed over micro-batches; the bytes its slabs hold."""

    refused: dict[int, frozenset]
    refused_bytes: int = 0
    pool_bytes: int = 0


def stage_host_use(step: FlatStep, swap_k: Callable[[int | None, str | None], int | None],
                   swap_scope: Callable[[int, str | None], Any] | None, min_offload_bytes: int, host: HostModel,
                   actions: tuple[tuple[str, int], ...], direct: frozenset[int]) -> StageHostUse:
    """The pool's decisions in a steady optimizer step of a pipeline stage whose micro-batch is ``step``
    and which runs ``actions`` (``("F", m)``, ``("B", m)``); ``direct``: the micro-batches that skip
    offloading their tail from the second step on (Note [The host pool in a pipeline stage])."""
    scope_of = swap_scope or (lambda layer, scope: swap_k(layer, scope))
    ledger = host.ledger(host.max_bytes)
    refused: dict[int, frozenset] | None = None
    for number in range(MAX_STEPS):  # the first step offloads every tail (nothing learnt yet)
        skipping = direct if number > 0 and host.skip_tail else frozenset()
        batchers = _stage_step(step, swap_k, scope_of, min_offload_bytes, host, ledger, actions, skipping)
        found = {m: frozenset(batcher.refused) for m, batcher in batchers.items()}
        if number > 0 and found == refused:
            break  # steady
        refused = found
    return StageHostUse(found, sum(b.refused_bytes for b in batchers.values()), ledger.held_bytes)


def _stage_step(step: FlatStep, swap_k, scope_of, min_offload_bytes: int, host: HostModel, ledger: Ledger,
                actions: tuple[tuple[str, int], ...], skipping: frozenset[int]) -> dict[int, _Batcher]:
    """One optimizer step of the stage on the shared ``ledger``; every region is back at its end."""
    batchers: dict[int, _Batcher] = {}
    waiting: list[_Batcher] = []  # forward done, backward not begun, oldest first
    for kind, m in actions:
        if kind == "F":
            for other in waiting[1:]:  # all but the oldest, which runs backward next
                other.tail_released = True
            batcher = batchers[m] = _Batcher(step, swap_k, scope_of, min_offload_bytes, host, ledger,
                                             m in skipping, flush_at_end=True)
            batcher.run()
            waiting.append(batcher)
        else:
            batcher = batchers[m]
            waiting.remove(batcher)
            for other in waiting[1:]:  # a backward's begin releases them too (GPipe's last forward)
                other.tail_released = True
            if waiting and waiting[0].tail_released:
                waiting[0].give_back(ledger, ahead_only=True)  # prefetched ahead by this backward
            batcher.give_back(ledger)
    return batchers
