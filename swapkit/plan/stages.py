"""The peak of one pipeline stage: a micro-batch's measured step replayed once per micro-batch in
the stage's schedule order, as :mod:`swapkit.runtime.microsteps` runs them. Pure (no torch).

Note [Stage peak model]
A pipeline stage's session (``swapkit.runtime.stage_session``) opens one micro-step per forward of
its chunk; micro-steps share only the device-bytes counter whose maximum is the stage's
``peak_device_bytes``. The planner measures one micro-batch of the stage's layers in one process
(a :class:`~swapkit.plan.trace.Trace` over the stage's layers, local indices) and replays it once
per micro-batch, in the order the schedule runs them on stage ``s`` of ``P`` with ``M``
micro-batches (:func:`schedule_actions`, as torch's ``ScheduleGPipe`` and ``Schedule1F1B`` do):
GPipe runs every forward, then every backward (``M`` in flight); 1F1B runs ``min(M, P - s)``
forwards, then alternates backward and forward (``P - s`` in flight). Each micro-step follows the
single-step replay's rules (``swapkit.plan.simulate`` Note [Cost model]) and the micro-step rules:
- A new forward's first save, and a backward's begin, release the tail of every micro-step still
  waiting for its backward except the one expected to run backward next (the oldest: GPipe and
  1F1B run backwards in forward order), each record once its copy is seen finished; waiting
  micro-steps release due records at every later forward save (``swapkit.runtime.microsteps``
  Note [Micro-step tails]). GPipe's last forward so releases its tail when the first backward begins.
- The tail of a micro-step is offloaded, except on a micro-step whose tail was still on the device
  when its backward began in the previous optimizer step (``runtime.skip_tail_offload``): the
  replay predicts a steady step (the second on), where those skip it.
- When a backward begins, its micro-step's unreleased records stay on the device (no round trip);
  at each unpack of tick ``t`` it fetches its own released records with horizon ``>= t`` and those
  of the micro-step expected next with horizon ``>= t + its forward length`` (Note [Looking ahead
  into the next micro-step]).
- Copies of every micro-step share one queue and one compute timeline: the stage's actions one
  after another.
- Micro-steps share one host pool too: under ``runtime.max_host_bytes`` each micro-batch's refused
  batches stay on its device (``swapkit.plan.hostpool`` Note [The host pool in a pipeline stage]).
Where it is wrong:
- The time a stage waits for its neighbours (the pipeline bubble, sends and receives) is not on the
  timeline, so copies finish later in the replay than in the run: a release the replay calls late
  may come earlier in the run (the peak is over-predicted, never under, when that is all that moves).
- The release lag (``swapkit.planner.measure`` Note [Release lag]) is measured in one process; on
  the thread engine the ranks' copy threads then compete with every rank's compute for the same
  cores and see copies finished later than that (``benchmarks/planner_stages.py`` on a shared
  2-core machine, three runs: 2, 0 and 4 of 12 stage peaks over the budget, the worst 2.2 times
  its prediction; exact with prompt copies).
- The predicted seconds are the stage's busy time, not the step time: they count the measured
  step's time outside session events (the loss and the optimizer among it) once per micro-batch,
  and are not checked against a run.
- Interleaved schedules (several chunks per stage) are not replayed. The first optimizer step
  offloads every tail (nothing learnt yet), so its peak may differ from the steady one.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable

from swapkit.plan.hostpool import HostModel, stage_host_use
from swapkit.plan.planner import BudgetError, Choice, Planner
from swapkit.plan.simulate import Links, Prediction, _Record, _Replay
from swapkit.plan.trace import FlatStep, Trace

SCHEDULES = ("gpipe", "1f1b")


def schedule_actions(schedule: str, stages: int, stage: int, micro_batches: int) -> tuple[tuple[str, int], ...]:
    """The order stage ``stage`` of ``stages`` runs its forwards (``"F", m``) and backwards (``"B", m``).

    Example:
        >>> schedule_actions("1f1b", 2, 0, 3)
        (('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('B', 2))

    Raises:
        ValueError: a schedule other than ``gpipe`` or ``1f1b``.
    """
    if schedule == "gpipe":
        return tuple([("F", m) for m in range(micro_batches)] + [("B", m) for m in range(micro_batches)])
    if schedule != "1f1b":
        raise ValueError(f"schedule {schedule!r} is not replayed per stage (one of {SCHEDULES})")
    warmup = min(micro_batches, stages - stage)
    actions = [("F", m) for m in range(warmup)]
    for m in range(micro_batches):
        actions.append(("B", m))
        if warmup + m < micro_batches:
            actions.append(("F", warmup + m))
    return tuple(actions)


def direct_micro_batches(actions: tuple[tuple[str, int], ...]) -> frozenset[int]:
    """Micro-batches whose tail is still on the device when their backward begins: no forward open or
    backward begin released it, as each releases the tails of the waiting micro-batches but the oldest.
    They skip offloading their tail from the second optimizer step on (Note [Stage peak model]).

    Example:
        >>> sorted(direct_micro_batches(schedule_actions("gpipe", 2, 0, 3)))
        [0]
    """
    direct, released, waiting = set(), set(), []
    for kind, m in actions:
        if kind == "F":
            released.update(waiting[1:])
            waiting.append(m)
            continue
        waiting.remove(m)
        if m not in released:
            direct.add(m)
        released.update(waiting[1:])
    return frozenset(direct)


class _Group:
    """What micro-steps share: the clock, the copy queue, the device bytes and their peak."""

    def __init__(self) -> None:
        self.now = self.queue_free = 0.0
        self.bytes = self.peak = 0


class _MicroReplay(_Replay):
    """One micro-batch's replay on its stage's shared clock, queue and byte counter."""

    def __init__(self, group: _Group, step: FlatStep, swap_k, links: Links, min_bytes: int, skip_tail: bool,
                 refused: frozenset = frozenset()) -> None:
        self.group = group
        shared = group.now, group.queue_free, group.bytes
        super().__init__(step, swap_k, links, min_bytes, refused)  # it zeroes the shared counters: put them back
        group.now, group.queue_free, group.bytes = shared
        self.skip_tail = skip_tail
        self.fetchable: list[tuple[int, int, _Record]] = []  # (-horizon when pushed, issue order, record)

    now = property(lambda self: self.group.now, lambda self, v: setattr(self.group, "now", v))
    queue_free = property(lambda self: self.group.queue_free, lambda self, v: setattr(self.group, "queue_free", v))
    bytes = property(lambda self: self.group.bytes, lambda self, v: setattr(self.group, "bytes", v))

    def _add(self, nbytes: int) -> None:
        self.group.bytes += nbytes
        self.group.peak = max(self.group.peak, self.group.bytes)

    def _in_tail(self, horizon: int, last: int) -> bool:
        return self.skip_tail and super()._in_tail(horizon, last)  # a tail the session no longer offloads

    def saved_again(self, record: _Record, tick: int) -> None:
        """A later save pushes the horizon out; a released record is queued for prefetch again."""
        super().saved_again(record, tick)
        if record.released:
            heapq.heappush(self.fetchable, (-record.horizon, record.issued, record))

    def _released(self, record: _Record) -> None:
        heapq.heappush(self.fetchable, (-record.horizon, record.issued, record))

    def release_tail(self) -> None:
        """Every record is due now (``MicroStep.release_tail``)."""
        self._advance(1 << 62)

    def poll(self) -> None:
        """Release due records whose copies are seen finished (``MicroStep.poll``)."""
        self._advance(-1)

    def begin_backward(self) -> None:
        """Unreleased records stay on the device (``SwapSchedule.begin_backward``)."""
        self.due, self.pending = [], []

    def fetch_from(self, bound: int) -> None:
        """Fetch every released record with horizon ``>= bound`` not fetched yet."""
        while self.fetchable and -self.fetchable[0][0] >= bound:
            pushed, _, record = heapq.heappop(self.fetchable)
            if not record.fetched and record.horizon == -pushed:
                self._fetch(record)

    def _free(self, storage: tuple) -> None:
        record = self.records.get(storage)
        if record is not None:
            record.fetched = True  # dead: never fetched again
        super()._free(storage)

    def backward_events(self, ahead: "_MicroReplay | None") -> None:
        """This micro-batch's backward, looking ahead into ``ahead`` (Note [Stage peak model])."""
        for event in self.step.backward:
            if event[0] == "f":
                self._free(event[1])
            elif event[0] == "a":
                self.records[event[1]] = _Record(event[2], 0, None, None)
                self._add(event[2])
            else:
                tick = event[1]
                self.fetch_from(tick)
                if ahead is not None:
                    ahead.fetch_from(tick + len(ahead.step.forward))
                self._restore(self.step.forward[tick].storage)
            self.now += event[-1]


@dataclass(frozen=True)
class StageSchedule:
    """How stage ``stage`` of ``stages`` runs: the torch schedule and the micro-batch count."""

    schedule: str
    stages: int
    stage: int
    micro_batches: int
    skip_tail_offload: bool = True

    def actions(self) -> tuple[tuple[str, int], ...]:
        return schedule_actions(self.schedule, self.stages, self.stage, self.micro_batches)


def simulate_stage(step: FlatStep, swap_k, links: Links, schedule: StageSchedule,
                   min_offload_bytes: int = 1024, host: HostModel | None = None,
                   swap_scope: Callable[[int, str | None], str | None] | None = None) -> Prediction:
    """Predict one steady optimizer step of a pipeline stage whose micro-batch is ``step``
    (Note [Stage peak model]); ``step_seconds`` is the stage's busy time, bubbles excluded.

    Args:
        host: the stage session's host pool; a batch it refuses stays on the device
            (``swapkit.plan.hostpool`` Note [The host pool in a pipeline stage]). ``None``: an
            unbounded pool of packed regions.
        swap_scope: the swapped scope holding a save of a layer (its batch's frame).
    """
    actions = schedule.actions()
    direct = direct_micro_batches(actions) if schedule.skip_tail_offload else frozenset()
    use = stage_host_use(step, swap_k, swap_scope, min_offload_bytes, host or HostModel(), actions, direct)
    replay = _stage_replay(step, swap_k, links, actions, direct, min_offload_bytes, use.refused)
    prompt = replay
    if links.release_lag_s:
        prompt = _stage_replay(step, swap_k, Links(links.d2h, links.h2d, 0.0, links.copy_overhead_s), actions,
                               direct, min_offload_bytes, use.refused)
    group, micro = replay
    waits: dict = {}
    for one in micro.values():
        for layer, wait in one.layer_wait.items():
            waits[layer] = waits.get(layer, 0.0) + wait
    return Prediction(group.peak, group.now + step.other_seconds * schedule.micro_batches,
                      sum(m.moved for m in micro.values()), sum(m.wait for m in micro.values()),
                      sum(m.late for m in micro.values()), prompt[0].peak, sum(m.copies for m in micro.values()),
                      tuple(sorted(waits.items(), key=lambda item: (item[0] is None, item[0] or 0))),
                      use.pool_bytes, use.refused_bytes)


def _stage_replay(step: FlatStep, swap_k, links: Links, actions: tuple[tuple[str, int], ...], direct: frozenset[int],
                  min_offload_bytes: int, refused: dict[int, frozenset]) -> tuple[_Group, dict[int, _MicroReplay]]:
    group, micro, waiting = _Group(), {}, []
    for kind, m in actions:
        if kind == "F":
            micro[m] = _MicroReplay(group, step, swap_k, links, min_offload_bytes, m in direct, refused[m])
            _forward(micro[m], waiting)
            waiting.append(micro[m])
        else:
            waiting.remove(micro[m])
            micro[m].begin_backward()
            for other in waiting[1:]:  # the oldest runs backward next: it keeps its tail
                other.release_tail()
            micro[m].backward_events(waiting[0] if waiting else None)
    return group, micro


def _forward(replay: _MicroReplay, waiting: list[_MicroReplay]) -> None:
    """``_Replay.forward`` with the other waiting micro-steps polled at every save; the first save
    opens the micro-step, which releases the tails of all waiting ones but the oldest."""
    def poll_others(tick: int) -> None:
        for other in waiting[1:] if tick == 0 else ():  # the oldest runs backward next: it keeps its tail
            other.release_tail()
        for other in waiting:
            if other.pending:  # only records already due can be released by a poll
                other.poll()

    replay.forward(poll_others)


class StagePlanner(Planner):
    """A :class:`~swapkit.plan.planner.Planner` whose predictions are a pipeline stage's
    (:func:`simulate_stage`); the trace is one micro-batch of the stage's layers."""

    def __init__(self, trace: Trace, links: Links, scopes: list[list[str]], min_offload_bytes: int,
                 schedule: StageSchedule, host: HostModel | None = None) -> None:
        super().__init__(trace, links, scopes, min_offload_bytes, host=host)
        self.schedule = schedule

    def _simulate(self, step: FlatStep, swap_k: Callable[[int | None, str | None], int | None],
                  swap_scope: Callable[[int, str | None], str | None]) -> Prediction:
        """The stage's schedule replayed on its host pool (``swapkit.plan.hostpool`` Note [The host
        pool in a pipeline stage])."""
        return simulate_stage(step, swap_k, self.links, self.schedule, self.min_bytes, self.host, swap_scope)


class StageBudgetError(BudgetError):
    """A pipeline stage's budget is below the lowest peak the planner reaches on that stage."""

    def __init__(self, stage: int, budget: int, reachable: int, baseline: int, host_cap: int | None = None,
                 uncapped: Prediction | None = None) -> None:
        super().__init__(budget, reachable, baseline, host_cap, uncapped)
        self.stage = stage
        self.args = (f"pipeline stage {stage}: {self.args[0]}",)

    def __str__(self) -> str:
        return self.args[0]
