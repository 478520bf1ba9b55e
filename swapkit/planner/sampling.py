"""Run the measurement modes' training steps: traced and untraced steps, interleaved across modes on CPU.

Note [Measuring modes side by side]
A plan is composed from segments measured in different runs (kept, recomputed, select-recomputed,
the swap probe), so what matters is that their times are comparable. On a machine other processes
share, the load changes from second to second: measured one after the other, the recompute run once
came out 60% slower than it ran a minute later while the keep run was right, and the planner
predicted recompute far too expensive. On CPU every mode therefore gets its own model and session
up front and the modes take turns, step by step (A B C A B C ...), so each sees the same mix of
load; the select-recompute scopes are picked from the keep run's warm-up step (bytes only) and
join before the timed steps. The tracing overhead is one factor for all of them
(:func:`pooled_factor`). On CUDA (a dedicated device, and one model copy per mode might not fit)
the modes run one after the other.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from swapkit.config.types import Config
from swapkit.planner.measure import Tracer, candidate_scopes
from swapkit.planner.progress import Progress
from swapkit.planner.segments import scale_segments, to_segments, tracing_factor
from swapkit.planner.steps import BuiltinSteps, ModelSource, ModelSteps


class ModeRun:
    """One mode's model, session and samples: traced steps alternate with untraced ones
    (``swapkit.planner.measure`` Note [Tracing overhead]).

    Args:
        config: the mode's config (``swapkit.planner.measure.mode_config``).
        device: where the model runs.
        patterns: per layer, the op patterns the config names (extra candidate scopes).
        model: a user's model, or ``None`` for the built-in one.
    """

    def __init__(self, config: Config, device: torch.device, patterns: list[tuple[str, ...]],
                 model: ModelSource | None) -> None:
        self.run = BuiltinSteps(config, device) if model is None else ModelSteps(config, model, device)
        self.layers = [bound.module for bound in self.run.session.binding.layers]
        self.scopes = [candidate_scopes(layer, patterns[i]) for i, layer in enumerate(self.layers)]
        self.samples: dict[str, list] = {key: [] for key in ("segments", "orders", "others", "copies", "traced",
                                                             "plain")}
        self.scope_seconds: dict[tuple[int, str], list[float]] = {}
        self.last: Tracer | None = None

    def step_pair(self, number: int, record: bool) -> None:
        """A traced step and an untraced one (numbers ``2n+1`` and ``2n+2``: the same batches in every mode)."""
        self.last = self._traced(2 * number + 1, record)
        for key, values in self.last.scope_seconds.items():
            self.scope_seconds.setdefault(key, []).extend(values)
        start = time.perf_counter()
        self.run.step(2 * number + 2)
        if record:
            self.samples["plain"].append(time.perf_counter() - start)

    def _traced(self, number: int, record: bool) -> Tracer:
        tracer = Tracer(self.layers, self.scopes, self.run.device)
        self.run.session.observer = tracer
        try:
            start = time.perf_counter()
            self.run.step(number)
            end = time.perf_counter()
        finally:
            tracer.remove()
            self.run.session.observer = None
        if record:
            step, order = to_segments(tracer.saves, tracer.events, tracer.start, len(self.layers), tracer.bounds)
            self.samples["segments"].append(step)
            self.samples["orders"].append(order)
            self.samples["others"].append(other_seconds(tracer, end, len(self.layers)))
            self.samples["copies"].append((tracer.copy_times(), tracer.saves[-1][4] if tracer.saves else end))
            self.samples["traced"].append(end - start)
        return tracer

    def result(self, factor: float | None = None) -> tuple[tuple, dict, list[list[str]], list, float]:
        """``((segments per step, backward order, other seconds), scope seconds, scopes, copies,
        median untraced step seconds)``, traced times scaled by ``factor`` (default: this mode's
        untraced over traced step time)."""
        samples = self.samples
        factor = tracing_factor(samples["traced"], samples["plain"]) if factor is None else factor
        seconds = {key: statistics.median(values) * factor for key, values in self.scope_seconds.items()}
        segments = [scale_segments(step, factor) for step in samples["segments"]]
        other = statistics.median(samples["others"]) * factor
        return ((segments, samples["orders"][-1], other), seconds, self.scopes, samples["copies"],
                statistics.median(samples["plain"]))

    def close(self) -> None:
        self.run.close()


def pooled_factor(runs: list[ModeRun]) -> float:
    """The tracing overhead as one factor for every mode measured side by side: the median over all
    pairs of an untraced step over the traced step before it, within [0.2, 1] (one mode's three
    pairs alone swing by 30% on a loaded machine; the hooks cost about the same share in every mode)."""
    ratios = [plain / traced for run in runs for traced, plain in zip(run.samples["traced"], run.samples["plain"])]
    return min(max(statistics.median(ratios), 0.2), 1.0) if ratios else 1.0


def other_seconds(tracer: Tracer, end: float, num_layers: int) -> float:
    """The step's time outside the events' attributed time (``swapkit.planner.measure``
    Note [Backward time follows the event]): from the last layer's end (or the last save) to the
    first backward event, and after the last one (the optimizer)."""
    last_save = tracer.saves[-1][4] if tracer.saves else tracer.start
    forward_end = max(last_save, tracer.bounds.get(num_layers - 1, last_save))
    backward = [at for _, _, at in tracer.events if at >= last_save]  # deaths in forward are no backward
    if not backward:
        return end - forward_end
    return max(backward[0] - forward_end, 0.0) + (end - backward[-1])


Later = Callable[[Tracer, list[list[str]]], dict[str, Config]]


def measure_modes(first: dict[str, Config], later: Later, device: torch.device, patterns: list[tuple[str, ...]],
                  steps: int, warmup: int, model: ModelSource | None, slow: float = 0.0) -> dict[str, tuple]:
    """Every mode's :meth:`ModeRun.result`: the ``first`` modes, then those ``later`` picks from the
    first mode's last warm-up step (its tracer and candidate scopes), side by side on CPU
    (Note [Measuring modes side by side]). At least one warm-up step runs. Each round is logged as it
    ends, at INFO when ``slow`` (seconds the link measurement will sleep after the rounds:
    ``swapkit.planner.progress`` Note [An emulated link makes planning slow])."""
    warmup = max(warmup, 1)
    if device.type != "cpu":
        progress = Progress(len(first) * (warmup + steps), slow > 0, slow)
        return _one_after_another(first, later, device, patterns, steps, warmup, model, progress)
    progress = Progress(2 * warmup + steps, slow > 0, slow)
    runs: dict[str, ModeRun] = {}
    try:
        for mode, config in first.items():
            runs[mode] = ModeRun(config, device, patterns, model)
        _rounds(runs, range(warmup), False, progress)
        keep = next(iter(runs.values()))
        picked = later(keep.last, keep.scopes)
        added = {mode: ModeRun(config, device, patterns, model) for mode, config in picked.items()}
        if added:
            _rounds(added, range(warmup), False, progress)
        else:  # no round to run or to count for them
            progress.rounds -= warmup
        runs.update(added)
        _rounds(runs, range(warmup, warmup + steps), True, progress)
        factor = pooled_factor(list(runs.values()))
        return {mode: run.result(factor) for mode, run in runs.items()}
    finally:
        for run in runs.values():
            run.close()


def _one_after_another(first: dict[str, Config], later: Later, device: torch.device,
                       patterns: list[tuple[str, ...]], steps: int, warmup: int,
                       model: ModelSource | None, progress: Progress | None = None) -> dict[str, tuple]:
    progress = progress or Progress(len(first) * (warmup + steps), False)
    results: dict[str, tuple] = {}
    keep: tuple | None = None
    for mode, config in first.items():
        results[mode], warm = _alone(mode, config, device, patterns, steps, warmup, model, progress)
        keep = keep or warm
    picked = later(*keep)
    progress.rounds += len(picked) * (warmup + steps)
    for mode, config in picked.items():
        results[mode], _ = _alone(mode, config, device, patterns, steps, warmup, model, progress)
    return results


def _alone(mode: str, config: Config, device: torch.device, patterns: list[tuple[str, ...]], steps: int,
           warmup: int, model: ModelSource | None, progress: Progress) -> tuple[tuple, tuple]:
    run = ModeRun(config, device, patterns, model)
    try:
        _rounds({mode: run}, range(warmup), False, progress)
        warm = (run.last, run.scopes)
        _rounds({mode: run}, range(warmup, warmup + steps), True, progress)
        return run.result(), warm
    finally:
        run.close()


def _rounds(runs: dict[str, ModeRun], numbers: range, record: bool, progress: Progress) -> None:
    for number in numbers:
        start = time.perf_counter()
        for run in runs.values():
            run.step_pair(number, record)
        progress.round_done(list(runs), time.perf_counter() - start)

