"""Replay a composed step under a swap decision: predicted peak, step time and bytes moved.

Pure Python (no torch). The replay follows the session's own rules (``swapkit.runtime.swap_schedule``) on
the measured compute timeline, with one FIFO copy queue standing in for the engine.

Note [Cost model]
What the planner predicts, and where it is wrong:
- Memory is the session's ``peak_device_bytes``: every distinct storage the session counts is
  added at its first save and taken off when its record dies (measured position in backward). A
  swapped storage (first saved at tick ``t`` in a scope swapped with distance ``k``, at least
  ``min_offload_bytes``, and ``t + k`` before the forward's last tick: Note [The last k ticks stay
  on the device] in ``swapkit.runtime.swap_schedule``) is released at the first save at or after its horizon
  whose time is past the end of its device-to-host copy, and is added back when backward first
  unpacks a tick ``<=`` its horizon. Recompute is a different measured segment (the layer's saves
  replaced by its checkpoint inputs; for a select-recomputed op, its region's inputs and, in
  backward, the bytes its recipe rebuilds until the recipe dies).
- The host pool (``runtime.max_host_bytes``): a swapped storage whose batch the pool refuses stays
  on the device (no copies, no release), and the pool's bytes are predicted as the session reports
  them (``swapkit.plan.hostpool`` Note [The host pool in the replay]).
- Copies run one at a time in issue order on one queue (the thread engine's worker; the CUDA
  engine's side stream). A copy takes ``latency + bytes / bandwidth`` of its direction, measured on
  the engine (:mod:`swapkit.planner.link`) and starts when issued or when the previous copy ends.
- A release is predicted at the first save strictly later than ``release_lag_s`` after its copy's
  predicted end: twice the largest delay measured (``swapkit.planner.measure`` Note [Release lag])
  in how late a copy was still seen unfinished while the forward keeps the host thread busy (on
  the thread engine the worker waits for the interpreter lock and a core; up to the 5 ms switch
  interval on an idle machine, tens of ms on an overloaded one). Budgets are hard limits, so the
  peak is predicted
  for a late copy: a plan whose peak needs copies to finish just in time is not chosen.
- With gradient accumulation every micro-batch is its own swap step: the peak is one micro-batch's
  and the step's compute, copies and waits are counted once per micro-batch (the loss, measured
  once in the step's other time, is not).
- Time is the measured compute between session events (median of the measured steps), plus the
  time a restore waits for its host-to-device copy (exposed wait: it delays everything after it),
  plus the step's time outside session events. Recompute cost is in the measured recompute
  segment's backward.
- Each copy costs the compute thread ``copy_overhead_s`` (issuing it, the session's bookkeeping for
  a swapped storage, and on the thread engine the worker's memcpy and interpreter-lock hand-offs
  competing with compute; on CUDA copies share memory bandwidth): the probe run's measured slowdown
  over the keep run, beyond the waits the replay predicts for it, per copy it made
  (``swapkit.planner.run`` Note [Copy overhead]). One number for every copy, large or small.
- Not modelled: allocator effects (``torch.cuda.max_memory_allocated`` also sees
  what recompute re-materializes in backward, the session does not), and run-to-run noise in the
  measured compute times. A swap whose release lands near the end of forward depends on copy
  timing: a copy slower than predicted leaves it on the device at the peak.
- Memory is exact when copies are (tests run the thread engine with copies made inline, and a
  grid of fixed plans mixing every kind of decision lands on the session's own count); with a
  real copy thread it is as right as the link and the lag: on a loaded machine both vary.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable

from swapkit.plan.hostpool import HostModel, host_use
from swapkit.plan.trace import FlatStep


@dataclass(frozen=True)
class Link:
    """One direction's cost of a copy: ``latency_s + nbytes / bytes_per_s``."""

    latency_s: float
    bytes_per_s: float

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


@dataclass(frozen=True)
class Links:
    """The engine's measured device-to-host and host-to-device links (they differ on PCIe), and
    how much later than that a finished offload may be seen finished while compute runs
    (``release_lag_s``, Note [Cost model])."""

    d2h: Link
    h2d: Link
    release_lag_s: float = 0.0
    copy_overhead_s: float = 0.0  # compute time each copy costs the compute thread (Note [Cost model])


@dataclass(frozen=True)
class Prediction:
    """What a plan is predicted to do in one steady-state step."""

    peak_device_bytes: int
    step_seconds: float
    moved_bytes_per_step: int
    wait_seconds: float
    late_fetches: int
    peak_if_prompt: int = 0  # the peak if every copy were seen finished on time (no release lag)
    copies: int = 0  # copies per step, both directions
    layer_wait: tuple[tuple[int | None, float], ...] = ()  # exposed wait by layer (None: outside layers)
    # the host pool's bytes (SwapStats.host_pool_bytes) and the swapped bytes runtime.max_host_bytes keeps on
    # the device (skipped["host_cap"], a pipeline stage's summed over its micro-batches): swapkit.plan.hostpool;
    # None where not modelled (a Prediction built by hand)
    host_pool_bytes: int | None = None
    host_cap_bytes: int = 0

    @property
    def uncertain_bytes(self) -> int:
        """How much of the peak depends on copies being seen finished in time."""
        return max(self.peak_device_bytes - self.peak_if_prompt, 0)

    def to_json(self) -> dict:
        document = {"peak_device_bytes": self.peak_device_bytes, "step_seconds": round(self.step_seconds, 6),
                    "moved_bytes_per_step": self.moved_bytes_per_step}
        if self.host_pool_bytes is not None:
            document.update(host_pool_bytes=self.host_pool_bytes, host_cap_bytes=self.host_cap_bytes)
        return document


class _Record:
    __slots__ = ("nbytes", "horizon", "k", "d2h_end", "h2d_end", "released", "fetched", "resident", "issued", "layer")

    def __init__(self, nbytes: int, tick: int, k: int | None, layer: int | None) -> None:
        self.nbytes, self.k, self.horizon, self.layer = nbytes, k, tick + (k or 0), layer
        self.d2h_end = self.h2d_end = 0.0
        self.released = self.fetched = False
        self.resident = True


class _Replay:
    """One replay; ``swap_k(layer, scope)`` gives the distance in force for a first save there."""

    def __init__(self, step: FlatStep, swap_k: Callable[[int | None, str | None], int | None], links: Links,
                 min_offload_bytes: int, refused: frozenset = frozenset()) -> None:
        self.step, self.swap_k, self.links, self.min_bytes = step, swap_k, links, min_offload_bytes
        self.refused = refused  # storages the host pool keeps on the device (swapkit.plan.hostpool)
        self.records: dict[tuple, _Record] = {}
        self.now = self.queue_free = self.wait = 0.0
        self.bytes = self.peak = self.moved = self.late = 0
        self.due: list[tuple[int, int, _Record]] = []  # (horizon, issue order, record) still to release
        self.pending: list[_Record] = []  # due, copy maybe unfinished; issue order
        self.issued = self.copies = 0
        self.layer_wait: dict[int | None, float] = {}  # exposed wait by the layer whose storage was late

    def _copy(self, link: Link, nbytes: int) -> float:
        self.now += self.links.copy_overhead_s  # issuing and running it slows compute (Note [Cost model])
        start = max(self.now, self.queue_free)
        self.queue_free = start + link.seconds(nbytes)
        self.moved += nbytes
        self.copies += 1
        return self.queue_free

    def _add(self, nbytes: int) -> None:
        self.bytes += nbytes
        self.peak = max(self.peak, self.bytes)

    def forward(self, at_save: Callable[[int], None] | None = None) -> None:
        """Replay the forward's saves; ``at_save(tick)`` runs first at each (other micro-steps' polls)."""
        last = len(self.step.forward) - 1
        for tick, save in enumerate(self.step.forward):
            self.now += save.seconds
            if at_save is not None:
                at_save(tick)
            for storage in save.frees:
                self._free(storage)
            self._advance(tick)
            if save.storage is None:
                continue
            record = self.records.get(save.storage)
            if record is None:
                self._new(save, tick, last)
            elif record.k is not None:
                self.saved_again(record, tick)

    def saved_again(self, record: _Record, tick: int) -> None:
        """A later save pushes the horizon out (swapkit.runtime.schedule)."""
        record.horizon = max(record.horizon, tick + record.k)

    def _new(self, save, tick: int, last: int) -> None:
        k = self.swap_k(save.layer, save.scope)
        if k is not None and (save.nbytes < self.min_bytes or self._in_tail(tick + k, last)
                              or save.storage in self.refused):
            k = None  # kept: too small, in the forward's tail, or its batch refused by the host pool
        record = self.records[save.storage] = _Record(save.nbytes, tick, k, save.layer)
        self._add(save.nbytes)
        if k is not None:
            record.d2h_end = self._copy(self.links.d2h, save.nbytes)
            record.issued = self.issued
            self.issued += 1
            bisect.insort(self.due, (record.horizon, record.issued, record))

    def _in_tail(self, horizon: int, last: int) -> bool:
        """A save due only after the forward's last tick is not offloaded."""
        return horizon >= last + 1

    def _advance(self, tick: int) -> None:
        while self.due and self.due[0][0] <= tick:
            horizon, _, record = self.due.pop(0)
            if record.horizon != horizon:  # moved out by a later save
                bisect.insort(self.due, (record.horizon, record.issued, record))
                continue
            bisect.insort(self.pending, record, key=lambda r: r.issued)
        while self.pending and self.pending[0].d2h_end + self.links.release_lag_s < self.now:
            record = self.pending.pop(0)
            if record.resident:  # not dead already (a record that died in forward)
                record.released, record.resident = True, False
                self.bytes -= record.nbytes
                self._released(record)

    def _released(self, record: _Record) -> None:
        """A record left the device in forward (a micro-step replay queues it for prefetch)."""

    def backward(self) -> None:
        released = sorted((r for r in self.records.values() if r.released), key=lambda r: -r.horizon)
        cursor = 0
        for event in self.step.backward:
            if event[0] == "f":
                self._free(event[1])
            elif event[0] == "a":  # a recipe rebuilt a selected op's outputs
                self.records[event[1]] = _Record(event[2], 0, None, None)
                self._add(event[2])
            else:
                tick = event[1]
                while cursor < len(released) and released[cursor].horizon >= tick:
                    self._fetch(released[cursor])
                    cursor += 1
                self._restore(self.step.forward[tick].storage)
            self.now += event[-1]  # the backward work after the event (swapkit.planner.measure)

    def _fetch(self, record: _Record) -> None:
        record.fetched, record.resident = True, True
        record.h2d_end = self._copy(self.links.h2d, record.nbytes)
        self._add(record.nbytes)

    def _restore(self, storage: tuple | None) -> None:
        record = self.records.get(storage) if storage is not None else None
        if record is None or not record.released or record.h2d_end <= self.now:
            return
        self.late += 1
        self.wait += record.h2d_end - self.now
        self.layer_wait[record.layer] = self.layer_wait.get(record.layer, 0.0) + record.h2d_end - self.now
        self.now = record.h2d_end
        record.h2d_end = 0.0  # waited once; later unpacks of the storage find it there

    def _free(self, storage: tuple) -> None:
        record = self.records.pop(storage, None)
        if record is not None and record.resident:
            self.bytes -= record.nbytes


def simulate(step: FlatStep, swap_k: Callable[[int | None, str | None], int | None], links: Links,
             min_offload_bytes: int = 1024, host: HostModel | None = None,
             swap_scope: Callable[[int, str | None], str | None] | None = None) -> Prediction:
    """Predict one steady-state step of ``step`` when first saves in (layer, scope) are swapped with
    distance ``swap_k(layer, scope)`` (``None``: kept). Note [Cost model].

    Args:
        host: the session's host pool (``runtime.max_host_bytes``, ``runtime.offload_batch_bytes``); a
            batch the pool refuses stays on the device (``swapkit.plan.hostpool`` Note [The host pool
            in the replay]). ``None``: an unbounded pool of packed regions.
        swap_scope: the swapped scope holding a save of a layer (its batch's frame); ``None`` tells
            frames apart by distance.

    Example:
        >>> from swapkit.plan.trace import FlatSave, FlatStep
        >>> step = FlatStep((FlatSave(("a",), 4096, 0, "", 0.001), FlatSave(None, 0, None, None, 0.001)),
        ...                 (("u", 0, 0.001), ("f", ("a",), 0.0)), 0.0)
        >>> simulate(step, lambda layer, scope: None, Links(Link(0, 1e9), Link(0, 1e9))).peak_device_bytes
        4096
    """
    use = host_use(step, swap_k, swap_scope, min_offload_bytes, host or HostModel())
    replay = _Replay(step, swap_k, links, min_offload_bytes, use.refused)
    replay.forward()
    replay.backward()
    prompt = replay.peak
    if links.release_lag_s:
        prompt_links = Links(links.d2h, links.h2d, 0.0, links.copy_overhead_s)
        prompt_replay = _Replay(step, swap_k, prompt_links, min_offload_bytes, use.refused)
        prompt_replay.forward()
        prompt_replay.backward()
        prompt = prompt_replay.peak
    n = step.micro_batches  # each micro-batch is its own swap step: the same peak, n times the work
    waits = tuple(sorted(((layer, n * wait) for layer, wait in replay.layer_wait.items()),
                         key=lambda item: (item[0] is None, item[0] or 0)))
    return Prediction(replay.peak, n * replay.now + step.other_seconds, n * replay.moved, n * replay.wait,
                      n * replay.late, prompt, n * replay.copies, waits, use.pool_bytes, use.refused_bytes)
