"""Micro-steps: one :class:`~swapkit.runtime.step.Step` per forward of a pipeline chunk for one micro-batch.

A pipeline schedule (``torch.distributed.pipelining``) runs, inside one optimizer step, the forwards
and backwards of several micro-batches in an order of its own (GPipe: all forwards, then all
backwards; 1F1B and Interleaved1F1B: interleaved). Each forward of a chunk is a :class:`MicroStep`
with its own clock, release queue and prefetch queue; :class:`MicroSteps` is the optimizer step
that holds them and adds up what they did.

Note [Micro-steps are independent clocks]
A micro-step's ticks, horizons and prefetch distances count only its own saves. A later forward
never closes, advances or drains an earlier micro-step's queues: the earlier one keeps its records
until its own backward unpacks them, and its backward prefetches them by its own clock. The only
thing micro-steps share is the device-bytes counter of their optimizer step, whose maximum is the
step's ``peak_device_bytes`` (the bytes resident across all live micro-steps at once).

Note [Micro-step tails]
In a single step the last ``k`` ticks of forward stay on the device because backward starts right
after them (``swapkit.runtime.swap_schedule`` Note [The last k ticks stay on the device]). In a pipeline that
is only true of a micro-step whose backward is the next one to run. So when a new forward opens, and
when a backward begins, every micro-step still waiting for its backward releases its tail (each
record once its copy has finished; waiting ones are polled at every later save), except the one
expected to run backward next, whose tail is about to be used. The backward's begin matters for the
last forward of GPipe, which torch runs backward last: no forward opens after it, and before, its
tail stayed on the device through every other micro-batch's backward. "Expected next" is the order
the previous optimizer step ran its backwards in (schedules repeat themselves), or the oldest waiting
micro-step in the first step (GPipe and 1F1B run backwards in forward order). Skipping the offload
of the tail (``runtime.skip_tail_offload``) is applied only to micro-steps whose tail was still on
the device when their backward began in the previous optimizer step (``direct``), with that
micro-step's own forward length; being the last forward opened is not enough (GPipe's last one).

Note [Tail releases from an autograd thread]
A backward's begin releases the other micro-steps' tails on the autograd thread that unpacked its
first tensor, under its own step's lock. One of those micro-steps may be beginning its backward on
another autograd thread at the same time (one backward over several micro-batches, with CPU and CUDA
nodes), dropping the host copies of the same records the release would free
(``swapkit.runtime.swap_schedule`` Note [The last k ticks stay on the device]). So a release takes the
micro-step's lock (swapkit.runtime.records Note [Unpacks from several threads]) and does nothing once
that micro-step's backward began. No two begins wait for each other: each marks its own step begun
before it lists the waiting ones, so of two concurrent begins at most one finds the other waiting.

Note [Looking ahead into the next micro-step]
Backward of micro-step ``m`` at its tick ``t`` prefetches its own records due by ``t``; the
micro-step ``p`` expected to run backward next is treated as if its ticks continued below ``m``'s
tick 0: a record of ``p`` with horizon ``h`` is due once ``t <= h - p.clock``. So the first-needed
records of ``p`` are on their way while ``m``'s last ``k`` ticks are computed. A wrong guess only
brings bytes back early; correctness never depends on it (an unpack waits for its copy).

Note [Unused swaps of an optimizer step]
Each micro-step lists the swap scopes of the layers it ran that no save of its own forward reached
(``SwapStats.unused_swaps``, swapkit.runtime.overrides Note [Swaps nobody reports]). The optimizer
step's stats say which swaps had no effect in the step: a scope listed by some micro-step and
reached by none, once. Concatenating the micro-steps' lists named a scope once per micro-batch, and
named as "no effect" a scope that one micro-batch bypassed while the others swapped under it. The
unused-swap WARNING follows the same rule (``StageSession._unused_swaps``); ``micro_step_stats`` keep
each micro-step's own list.
"""
from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import dataclass, fields
from typing import Any, Callable

import torch

from swapkit.runtime.ledger import ByteLedger
from swapkit.runtime.overrides import scope_label
from swapkit.runtime.records import Saved
from swapkit.runtime.scope import Frame
from swapkit.runtime.step import Step
from swapkit.runtime.stats import SwapStats

Key = tuple[int, int]  # (chunk index in the stage, micro-batch ordinal of that chunk in the step)


class MicroStep(Step):
    """One forward of one chunk for one micro-batch, and its backward (Note [Micro-steps are independent clocks])."""

    sets_aside = False  # one forward (swapkit.runtime.swap_schedule Note [A backward prefetches its own ...])

    def __init__(self, group: "MicroSteps", key: Key, number: int, *step_args: Any,
                 swap_scopes: tuple[tuple[int, str], ...] = ()) -> None:
        """``step_args``: :class:`Step`'s engine, pool, runtime, parameter storages and tail length."""
        self.group, self.key = group, key
        super().__init__(number, *step_args, on_backward=group.backward_began, swap_scopes=swap_scopes)
        self.forward_done = self.direct = self.tail_released = False
        self.bytes_changed = self._changed_in_group  # its own ledger and the optimizer step's

    def save(self, tensor: torch.Tensor, frame: Frame | None) -> Saved:
        """Pack one tensor; first release what earlier micro-steps' finished copies allow."""
        self.group.poll(self)
        return super().save(tensor, frame)

    def release_tail(self) -> None:
        """Every record is due now; each is released once its copy finished (Note [Micro-step tails]).

        Under this micro-step's lock, and not once its backward began (Note [Tail releases from an autograd
        thread])."""
        with self.lock:
            if self.backward_started:
                return
            self.tail_released = True
            self.schedule.advance(sys.maxsize)

    def poll(self) -> None:
        """Release the due records whose copies have finished since the last look."""
        self.schedule.advance(-1)

    def unpacked(self, tick: int, record: Any = None) -> None:
        super().unpacked(tick, record)
        self.group.look_ahead(self, tick)

    def _prefetches_done(self) -> None:
        """A micro-step keeps watching its unpacks: each one looks ahead into other micro-steps."""

    def prefetch_from(self, bound: int) -> None:
        """Issue the prefetch of every released record with horizon ``>= bound`` (Note [Looking ahead ...])."""
        with self.lock:
            self.schedule.fetch_from(bound)

    def settle(self) -> None:
        """Replay this micro-step's device-byte changes and its optimizer step's (swapkit.runtime.ledger)."""
        super().settle()
        self.group.ledger.settle()

    def _changed_in_group(self, delta: int) -> None:
        """Device bytes changed by ``delta``, in this micro-step and in its optimizer step (whose peak is
        of the micro-steps' sum): two appends, no lock (swapkit.runtime.ledger Note [The device-bytes ledger])."""
        self.ledger.changed(delta)
        self.group.ledger.changed(delta)


@dataclass(frozen=True)
class MicroStepStats:
    """What one micro-step did: its chunk (index within the stage), micro-batch ordinal and counters."""

    chunk: int
    micro_batch: int
    stats: SwapStats


class MicroSteps:
    """The micro-steps of one optimizer step (one ``with session:`` block) and their shared accounting."""

    def __init__(self, number: int, host_allocations: int, previous: "MicroSteps | None") -> None:
        self.number = number
        self.steps: list[MicroStep] = []
        self.backward_order: list[Key] = []
        self._learned = previous.backward_order if previous is not None else None
        self._tails = previous.direct_lengths() if previous is not None else {}
        self._opened: dict[int, int] = defaultdict(int)
        self._last_opened: MicroStep | None = None
        self._allocations_at_start = host_allocations
        self.ledger = ByteLedger()  # the sum over its micro-steps (swapkit.runtime.ledger)

    # ------------------------------------------------------------------ forward

    def open(self, chunk: int, make: Callable[[Key, int | None], MicroStep]) -> MicroStep:
        """A new forward of ``chunk`` saved its first tensor: open its micro-step."""
        key = (chunk, self._opened[chunk])
        self._opened[chunk] += 1
        self._release_tails()
        if self._last_opened is not None:  # its graph may have died since its forward ended (eval-like forwards)
            self._last_opened.settle()
        step = make(key, self._tails.get(key))
        self.steps.append(step)
        self._last_opened = step
        return step

    def forward_ended(self, step: MicroStep) -> None:
        step.forward_done = True
        step.settle()  # bounds the ledgers' backlog (swapkit.runtime.ledger Note [The device-bytes ledger])
        step.schedule.flush()  # its saves are done: its open batch's copy can start (swapkit.runtime.batch)

    def poll(self, current: MicroStep) -> None:
        for waiting in self._waiting():
            if waiting is not current:
                waiting.poll()

    # ------------------------------------------------------------------ backward

    def backward_began(self, step: Step) -> None:
        assert isinstance(step, MicroStep)
        step.direct = not step.tail_released  # its tail was used where it was (Note [Micro-step tails])
        self.backward_order.append(step.key)
        self._release_tails()

    def _release_tails(self) -> None:
        """A forward opened or a backward began: every waiting micro-step but the one expected to run
        backward next releases its tail (Note [Micro-step tails])."""
        expected = self.expected_next()
        for waiting in self._waiting():
            if waiting is not expected and not waiting.tail_released:
                waiting.release_tail()

    def look_ahead(self, step: MicroStep, tick: int) -> None:
        """Note [Looking ahead into the next micro-step]"""
        following = self.expected_next()
        if following is not None and following is not step:
            following.prefetch_from(tick + following.clock)

    def expected_next(self) -> MicroStep | None:
        """The waiting micro-step expected to run backward next (Note [Micro-step tails])."""
        waiting = self._waiting()
        if not waiting:
            return None
        if self._learned is None:
            return waiting[0]
        begun = set(self.backward_order)
        key = next((k for k in self._learned if k not in begun), None)
        return next((s for s in waiting if s.key == key), None)

    def _waiting(self) -> list[MicroStep]:
        return [s for s in self.steps if s.forward_done and not s.backward_started]

    def direct_lengths(self) -> dict[Key, int]:
        """Forward lengths of the micro-steps whose backward directly followed their forward."""
        return {s.key: s.clock for s in self.steps if s.direct}

    # ------------------------------------------------------------------ accounting and end

    def finish(self) -> None:
        """The block ended: forwards without a backward yet wait for their copies (eval, or backward later)."""
        for step in self.steps:
            if not step.backward_started:
                step.schedule.finish_forward()
        if self.steps:
            self.steps[0].engine.synchronize()

    def close(self, aborted: bool = False) -> None:
        for step in self.steps:
            step.close(aborted)

    def per_micro_step(self) -> list[MicroStepStats]:
        return [MicroStepStats(s.key[0], s.key[1], s.snapshot()) for s in self.steps]

    def snapshot(self, host_allocations: int) -> SwapStats:
        """The micro-steps' counters added up; the peak is the peak of their sum."""
        total = SwapStats(step=self.number, skipped=defaultdict(int), offloaded_by_scope=defaultdict(int),
                          recomputed_by_scope=defaultdict(int))
        parts = [s.snapshot() for s in self.steps]
        for part in parts:
            _add(total, part)
        total.skipped, total.offloaded_by_scope = dict(total.skipped), dict(total.offloaded_by_scope)
        total.recomputed_by_scope = dict(total.recomputed_by_scope)
        total.resident_bytes, total.peak_device_bytes = self.ledger.settle()
        total.host_pool_bytes = parts[-1].host_pool_bytes if parts else 0
        total.host_allocations = host_allocations - self._allocations_at_start
        total.micro_steps = len(parts)
        total.unused_swaps = self._unused_swaps(parts)
        return total

    def reached_swap_scopes(self) -> set[tuple[int, str]]:
        """``(layer, op path)`` of each configured swap scope that a save of some micro-step reached."""
        return {scope for step in self.steps for scope in step.scopes.reached_swap_scopes()}

    def _unused_swaps(self, parts: list[SwapStats]) -> list[str]:
        """Note [Unused swaps of an optimizer step]"""
        reached = {scope_label(layer, path) for layer, path in self.reached_swap_scopes()}
        return list(dict.fromkeys(label for part in parts for label in part.unused_swaps if label not in reached))


_NOT_SUMMED = {"step", "peak_device_bytes", "resident_bytes", "host_pool_bytes", "host_allocations", "micro_steps",
               "unused_swaps"}


def _add(total: SwapStats, part: SwapStats) -> None:
    for f in fields(SwapStats):
        value = getattr(part, f.name)
        if f.name in _NOT_SUMMED:
            continue
        if isinstance(value, dict):
            for key, nbytes in value.items():
                getattr(total, f.name)[key] += nbytes
        elif isinstance(value, bool):
            setattr(total, f.name, getattr(total, f.name) or value)
        else:
            setattr(total, f.name, getattr(total, f.name) + value)
