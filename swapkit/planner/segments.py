"""A traced step's raw records as :class:`~swapkit.plan.trace.Segment` s, and the measured steps of
every mode as one :class:`~swapkit.plan.trace.Trace`. Pure Python over the tracer's records; the
rules are the notes in :mod:`swapkit.planner.measure` (Records that die in forward, Medians of
events and of steps, Backward time follows the event, Tracing overhead) and ``swapkit.plan.trace``
Note [Forward time is tiled by segment].
"""
from __future__ import annotations

import dataclasses
import statistics

from swapkit.plan.trace import KEEP, PRE, Alloc, Free, Save, Segment, Trace, Unpack


def to_segments(saves: list, events: list, start: float, num_layers: int,
                bounds: dict[int, float] | None = None) -> tuple[dict[int, Segment], list[int]]:
    """One step's raw records as segments and the order backward reached the segments. A forward
    save carries the time since the previous save in its segment, a segment the time after its
    last save until it ended (``bounds``: segment -> end; Note [Forward time is tiled by segment]
    in ``swapkit.plan.trace``); a backward event the time until the next one (the backward work
    that follows it, a recompute included: ``swapkit.planner.measure``
    Note [Backward time follows the event])."""
    forward: dict[int, list[Save]] = {s: [] for s in [PRE, *range(num_layers + 1)]}
    backward: dict[int, list] = {s: [] for s in forward}
    frees, events = _forward_frees(saves, events)
    begins = _segment_begins(start, num_layers, bounds or {})
    last = dict(begins)
    previous = start
    for (segment, name, nbytes, scope, at), freed in zip(saves, frees):
        since = last[segment] if last[segment] != float("inf") else previous  # no bound seen: since the last save
        forward[segment].append(Save(name, nbytes, scope, max(at - since, 0.0), freed))
        last[segment] = previous = at
    tails = {s: max(bounds[s] - last[s], 0.0) if bounds and s in bounds and last[s] != float("inf") else 0.0
             for s in forward}
    order: list[int] = []
    current = num_layers
    for (kind, what, at), following in zip(events, [e[2] for e in events[1:]] + [None]):
        after = following - at if following is not None else 0.0
        if kind == "u":
            current = what[0]
            backward[current].append(Unpack(what[0], what[1], after))
            if current not in order:
                order.append(current)
        elif kind == "a":
            backward[current].append(Alloc(what[0], what[1], after))
        else:
            backward[current].append(Free(what, after))
    segments = {s: Segment(tuple(forward[s]), tuple(backward[s]), tails[s]) for s in forward}
    return segments, order + [s for s in forward if s not in order]


def _segment_begins(start: float, num_layers: int, bounds: dict[int, float]) -> dict[int, float]:
    """When each segment's forward began: the step's start for PRE, else when the one before ended
    (a segment whose end was not seen begins at its first save)."""
    begins: dict[int, float] = {PRE: start}
    for s in range(num_layers + 1):
        before = bounds.get(s - 1) if s > 0 else bounds.get(PRE)
        begins[s] = before if before is not None else float("inf")
    return begins


def _forward_frees(saves: list, events: list) -> tuple[list[tuple], list]:
    """Per forward save, the records that died since the previous save (a scope's records may die
    in forward: ``swapkit.planner.measure`` Note [Records that die in forward]), and the events left for backward."""
    first_unpack = next((at for kind, _, at in events if kind == "u"), float("inf"))
    last_save = saves[-1][4] if saves else float("-inf")
    early = [(at, what) for kind, what, at in events if kind == "f" and at < min(first_unpack, last_save)]
    frees: list[list] = [[] for _ in saves]
    index = 0
    for at, what in early:
        while saves[index][4] < at:
            index += 1
        frees[index].append(what)
    rest = [e for e in events if not (e[0] == "f" and e[2] < min(first_unpack, last_save))]
    return [tuple(f) for f in frees], rest


def median_segments(steps: list[dict[int, Segment]]) -> dict[int, Segment]:
    """Per event, the median time over steps (the event sequence must be the same in every step),
    scaled so that the events add up to the median step (``swapkit.planner.measure``
    Note [Medians of events and of steps])."""
    first = steps[0]
    same = all(len(s[k].forward) == len(first[k].forward) and len(s[k].backward) == len(first[k].backward)
               for s in steps for k in first)
    if not same:
        return steps[-1]
    medians = {k: Segment(_median_events([s[k].forward for s in steps]),
                          _median_events([s[k].backward for s in steps]), statistics.median(s[k].tail for s in steps))
               for k in first}
    total = _seconds(medians)
    return scale_segments(medians, statistics.median(_seconds(s) for s in steps) / total) if total else medians


def _seconds(segments: dict[int, Segment]) -> float:
    return sum(sum(e.seconds for e in seg.forward) + seg.tail + sum(e.seconds for e in seg.backward)
               for seg in segments.values())


def _median_events(runs: list[tuple]) -> tuple:
    return tuple(dataclasses.replace(events[0], seconds=statistics.median(e.seconds for e in events))
                 for events in zip(*runs))


def tracing_factor(traced: list[float], plain: list[float]) -> float:
    """Untraced over traced median step time, within [0.2, 1] (``swapkit.planner.measure``
    Note [Tracing overhead])."""
    if not traced or not plain:
        return 1.0
    return min(max(statistics.median(plain) / statistics.median(traced), 0.2), 1.0)


def scale_segments(segments: dict[int, Segment], factor: float) -> dict[int, Segment]:
    """Every event's seconds times ``factor``."""
    def scale(events: tuple) -> tuple:
        return tuple(dataclasses.replace(e, seconds=e.seconds * factor) for e in events)

    return {k: Segment(scale(seg.forward), scale(seg.backward), seg.tail * factor) for k, seg in segments.items()}


def build_trace(num_layers: int, runs: dict[str, tuple[list, list, float]],
                scope_seconds: dict[tuple[int, str], float], micro_batches: int = 1) -> Trace:
    """A :class:`Trace` from per-mode ``(step segments, backward order, other seconds)`` of steps of
    one micro-batch; a training step runs ``micro_batches`` of them."""
    modes = {mode: median_segments(steps) for mode, (steps, _, _) in runs.items()}
    order = runs[KEEP][1]
    other = {mode: seconds for mode, (_, _, seconds) in runs.items()}
    return Trace(num_layers, modes, tuple(order), other, scope_seconds, micro_batches)
