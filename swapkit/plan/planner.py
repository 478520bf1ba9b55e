"""Choose keep / swap(k) / recompute per layer and scope under a memory budget. Pure (no torch).

Note [Greedy planning]
The search starts from keeping everything. While the predicted peak (``swapkit.plan.simulate``
Note [Cost model]) is above the target, it takes the move with the lowest predicted extra step
time per byte of peak removed (ties: the larger reduction), where a move changes one layer:
swap one more scope (or the whole layer) with a distance ``k``, change the layer's ``k``,
recompute one measured op scope (``select_recompute``; swaps inside it are dropped), or recompute
the layer. Once under the target it tries, layer by layer, cheaper choices that still fit
(fewer swapped scopes, another ``k``, keep), so an early large move does not stay when a later one
made it unnecessary. A second search starts from recomputing every layer and trims the same way
(a descent can stop where no single move helps, e.g. when recomputing a late layer shortens the
time an earlier layer's copies have to finish); the faster fitting plan wins. Every candidate
is replayed in full, so the interplay of layers through the single copy queue is seen. The search
is greedy: it is not guaranteed optimal. The target is the budget less a small margin
(``margin``) because a release near the end of forward depends on copy timing. When no move
lowers the peak any more above the target, the budget cannot be met and the lowest peak any move
sequence reached (also searched for greedily, by peak alone) is reported.
A plan fits when its peak, predicted with copies seen finished late (``release_lag_s``), is under
the target *and* at most ``UNCERTAIN_TOLERANCE`` of that peak depends on copy timing (the peak with
prompt copies is not lower by more): the search counts both as excess, so it prefers plans whose
peak does not hinge on a copy finishing just in time, and the measured peak lands on the prediction.
Under ``runtime.max_host_bytes`` every candidate is replayed with the host pool
(``swapkit.plan.hostpool`` Note [The host pool in the replay]): a swap whose batch the pool refuses
removes nothing from the peak, so no move counts on it, and trimming drops such swaps (as fast, fewer
refused bytes). A budget the cap puts out of reach is searched again without the cap, and the error
names the cap and the host pool that plan needs.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterator

from swapkit.plan.hostpool import HostModel
from swapkit.plan.simulate import Links, Prediction, simulate
from swapkit.plan.trace import SELECT, FlatStep, Trace, compose

PREFETCH_CHOICES = (1, 2, 4, 8)
UNCERTAIN_TOLERANCE = 0.03


class BudgetError(ValueError):
    """The budget is below the lowest peak the planner can reach.

    When ``runtime.max_host_bytes`` is a cause, ``host_cap`` is the cap and ``uncapped`` the prediction
    of the plan the search makes without it (its peak and the host pool bytes it needs); both ``None``
    otherwise."""

    def __init__(self, budget: int, reachable: int, baseline: int, host_cap: int | None = None,
                 uncapped: Prediction | None = None) -> None:
        self.budget, self.reachable, self.baseline = budget, reachable, baseline
        self.host_cap, self.uncapped = host_cap, uncapped
        message = (f"--budget {budget} bytes cannot be met: the smallest reachable peak_device_bytes is "
                   f"{reachable} bytes ({reachable / 2**20:.2f} MiB; keeping everything needs {baseline} "
                   f"bytes); raise --budget to at least {reachable}")
        if host_cap is not None and uncapped is not None:
            reach = "meets the budget" if uncapped.peak_device_bytes <= budget else \
                f"reaches {uncapped.peak_device_bytes} bytes"
            message += (f", or raise runtime.max_host_bytes ({host_cap} bytes): the host pool cannot hold the "
                        f"swaps the plan needs, so they would stay on the device (skipped['host_cap']); without "
                        f"the cap the planner {reach} with a host pool of {uncapped.host_pool_bytes} bytes "
                        f"(set runtime.max_host_bytes to at least that, or remove it)")
        super().__init__(message)


@dataclass(frozen=True)
class Choice:
    """What one layer does: ``keep``, ``recompute``, or ``swap`` of ``scopes`` (``""``: the layer);
    besides keep or swap, ``select`` names one op scope recomputed (MindFormers ``select_recompute``)."""

    action: str = "keep"
    scopes: tuple[str, ...] = ()
    prefetch: int | None = None
    select: str | None = None

    @property
    def mode(self) -> str:
        """The measured mode of this layer's segment (``swapkit.plan.trace``)."""
        return "recompute" if self.action == "recompute" else f"{SELECT}{self.select}" if self.select else "keep"

    @property
    def keeps_all(self) -> bool:
        return self.action == "keep" and self.select is None

    def swap_k(self, scope: str | None) -> int | None:
        if self.action != "swap" or scope is None:
            return None
        return self.prefetch if any(inside(scope, s) for s in self.scopes) else None

    def swap_scope(self, scope: str | None) -> str | None:
        """The swapped scope holding a save in ``scope`` (the frame its batch is in), or ``None``."""
        if self.action != "swap" or scope is None:
            return None
        return next((s for s in self.scopes if inside(scope, s)), None)

    def describe(self) -> str:
        select = f"recompute {self.select}" if self.select else ""
        if self.action != "swap":
            return select or self.action
        swap = f"swap {', '.join(s or '(layer)' for s in self.scopes)} k={self.prefetch}"
        return f"{swap} + {select}" if select else swap


KEEP = Choice()
RECOMPUTE = Choice("recompute")


def with_select(choice: Choice, select: str) -> Choice:
    """``choice`` with ``select`` recomputed; swaps of that scope (or inside it) dropped: recompute
    wins over swap there (DESIGN §4)."""
    scopes = tuple(s for s in choice.scopes if not inside(s, select))
    return Choice("swap", scopes, choice.prefetch, select) if scopes else Choice("keep", select=select)


def inside(scope: str, outer: str) -> bool:
    """``scope`` is ``outer`` or lies inside it (``""`` is the whole layer)."""
    return outer == "" or scope == outer or scope.startswith(outer + ".")


@dataclass(frozen=True)
class Planned:
    """The planner's answer: a choice per layer and its prediction (and the baseline's)."""

    choices: tuple[Choice, ...]
    predicted: Prediction
    baseline: Prediction


class Planner:
    """Replays candidate plans of one measured :class:`Trace` (compositions and results cached).

    Args:
        trace: the measured step.
        links: the engine's measured links.
        scopes: per layer, the candidate scope paths worth swapping (see :func:`useful_scopes`).
        min_offload_bytes: the session's ``runtime.min_offload_bytes``.
        host: the session's host pool (``runtime.max_host_bytes``: a swap whose batch the pool refuses
            stays on the device, ``swapkit.plan.hostpool`` Note [The host pool in the replay]);
            ``None``: unbounded.
    """

    def __init__(self, trace: Trace, links: Links, scopes: list[list[str]], min_offload_bytes: int,
                 prefetches: tuple[int, ...] = PREFETCH_CHOICES, host: HostModel | None = None) -> None:
        self.trace, self.links, self.scopes, self.min_bytes = trace, links, scopes, min_offload_bytes
        self.host = host or HostModel()
        self.prefetches = prefetches
        self._steps: dict[tuple[str, ...], FlatStep] = {}
        self.selects = sorted(m[len(SELECT):] for m in trace.modes if m.startswith(SELECT))
        self._cache: dict[tuple[Choice, ...], Prediction] = {}

    def predict(self, choices: tuple[Choice, ...]) -> Prediction:
        """The prediction for one choice per layer."""
        found = self._cache.get(choices)
        if found is None:
            if len(choices) != self.trace.num_layers:  # zip-like code would drop or miss layers silently
                raise ValueError(f"predict: got {len(choices)} choices for a model of {self.trace.num_layers} "
                                 "layers; give one Choice per layer (KEEP, RECOMPUTE or a Choice('swap', ...))")
            modes = tuple(c.mode for c in choices)
            step = self._steps.get(modes)
            if step is None:
                step = self._steps[modes] = compose(self.trace, modes=modes)
            found = self._cache[choices] = self._simulate(
                step, lambda layer, scope: None if layer is None else choices[layer].swap_k(scope),
                lambda layer, scope: choices[layer].swap_scope(scope))
        return found

    def _simulate(self, step: FlatStep, swap_k: Callable[[int | None, str | None], int | None],
                  swap_scope: Callable[[int, str | None], str | None]) -> Prediction:
        """Replay one composed step (a pipeline stage's planner replays its schedule instead)."""
        return simulate(step, swap_k, self.links, self.min_bytes, self.host, swap_scope)

    def without_host_cap(self) -> Planner:
        """This planner with an unbounded host pool (what a budget error compares with)."""
        free = copy.copy(self)
        free.host = dataclasses.replace(self.host, max_bytes=None)
        free._cache = {}
        return free

    def moves(self, choices: tuple[Choice, ...]) -> Iterator[tuple[Choice, ...]]:
        """Every plan that differs from ``choices`` by one step on one layer."""
        for layer, choice in enumerate(choices):
            for new in self._layer_moves(layer, choice):
                yield choices[:layer] + (new,) + choices[layer + 1:]

    def _layer_moves(self, layer: int, choice: Choice) -> Iterator[Choice]:
        if choice.action == "recompute":
            return
        yield RECOMPUTE
        ks = self.prefetches if choice.action == "keep" else (choice.prefetch,)
        for scope in self.scopes[layer]:
            if any(inside(scope, s) for s in choice.scopes) or (choice.select and inside(scope, choice.select)):
                continue
            kept = tuple(s for s in choice.scopes if not inside(s, scope))
            for k in ks:
                yield Choice("swap", tuple(sorted(kept + (scope,))), k, choice.select)
        for k in self.prefetches if choice.action == "swap" else ():
            if k != choice.prefetch:
                yield Choice("swap", choice.scopes, k, choice.select)
        for select in self.selects:
            if select != choice.select:
                yield with_select(choice, select)

    def cheaper(self, layer: int, choice: Choice) -> Iterator[Choice]:
        """Choices of one layer that undo part of ``choice``."""
        yield KEEP
        if choice.select is not None:
            yield Choice(choice.action, choice.scopes, choice.prefetch)
        if choice.action == "swap":
            for scope in choice.scopes if len(choice.scopes) > 1 else ():
                yield Choice("swap", tuple(s for s in choice.scopes if s != scope), choice.prefetch, choice.select)
            for k in self.prefetches:
                if k != choice.prefetch:
                    yield Choice("swap", choice.scopes, k, choice.select)
        for scope in self.scopes[layer] if choice.action == "recompute" else ():
            for k in self.prefetches:
                yield Choice("swap", (scope,), k)


def plan_budget(planner: Planner, budget: int, margin: float = 0.02) -> Planned:
    """Choose per layer under ``budget`` bytes of predicted peak (Note [Greedy planning]).

    Raises:
        BudgetError: no plan the search finds reaches the budget.
        ValueError: ``budget`` is not a whole number of bytes >= 1.
    """
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget: got {budget!r}; expected a whole number of bytes >= 1 "
                         "(swapkit.plan.size.parse_size reads a size such as '64MiB')")
    keep = tuple(KEEP for _ in range(planner.trace.num_layers))
    baseline = planner.predict(keep)
    if baseline.peak_device_bytes <= budget:
        return Planned(keep, baseline, baseline)
    target = int(budget * (1 - margin))
    # The lowest-peak plan is a candidate too, so the minimum an error reports can always be planned.
    found = [_descend(planner, keep, target, by_time=True), tuple(RECOMPUTE for _ in keep), _lowest(planner)]
    fitting = [c for c in found if planner.predict(c).peak_device_bytes <= budget]
    if not fitting:
        lowest = min(planner.predict(c).peak_device_bytes for c in found)
        raise BudgetError(budget, lowest, baseline.peak_device_bytes, *_host_cap_cause(planner, budget, target, lowest))
    trimmed = [_trim(planner, c, max(target, planner.predict(c).peak_device_bytes)) for c in fitting]
    choices = min(trimmed, key=lambda c: (excess(planner.predict(c), budget) > 0, planner.predict(c).step_seconds))
    return Planned(choices, planner.predict(choices), baseline)


def _host_cap_cause(planner: Planner, budget: int, target: int, lowest: int) -> tuple:
    """``(max_host_bytes, a plan's prediction without it)`` when the cap keeps the budget out of reach:
    without the cap the search goes lower (the plan it would choose, or else its lowest); ``()`` when
    there is no cap or it is no cause."""
    cap = planner.host.max_bytes
    if cap is None:
        return ()
    free = planner.without_host_cap()
    chosen = free.predict(_descend(free, tuple(KEEP for _ in range(free.trace.num_layers)), target, by_time=True))
    best = chosen if chosen.peak_device_bytes <= budget else free.predict(_lowest(free))
    return (cap, best) if best.peak_device_bytes < lowest else ()


def reachable_peak(planner: Planner) -> int:
    """The lowest peak the greedy search reaches when it minimizes the peak alone."""
    return planner.predict(_lowest(planner)).peak_device_bytes


def _lowest(planner: Planner) -> tuple[Choice, ...]:
    """The plan the greedy search reaches when it minimizes the peak alone."""
    return _descend(planner, tuple(KEEP for _ in range(planner.trace.num_layers)), 0, by_time=False)


def excess(prediction: Prediction, target: int, tolerance: float = UNCERTAIN_TOLERANCE) -> int:
    """Bytes of predicted peak above ``target``, plus the bytes of peak that depend on copy timing
    beyond ``tolerance`` of the peak (Note [Greedy planning]); 0 when the plan fits for sure."""
    over = max(prediction.peak_device_bytes - target, 0)
    return over + max(prediction.uncertain_bytes - int(tolerance * prediction.peak_device_bytes), 0)


def _descend(planner: Planner, choices: tuple[Choice, ...], target: int, by_time: bool) -> tuple[Choice, ...]:
    current = planner.predict(choices)
    measure = (lambda p: excess(p, target)) if by_time else (lambda p: p.peak_device_bytes)
    while measure(current) > (0 if by_time else target):
        best, best_key = None, None
        for move in planner.moves(choices):
            new = planner.predict(move)
            gain = measure(current) - measure(new)
            if gain <= 0:
                continue
            cost = max(new.step_seconds - current.step_seconds, 0.0) / gain if by_time else 0.0
            key = (cost, -gain)
            if best_key is None or key < best_key:
                best, best_key = move, key
        if best is None:
            return choices
        choices, current = best, planner.predict(best)
    return choices


def _trim(planner: Planner, choices: tuple[Choice, ...], target: int) -> tuple[Choice, ...]:
    improved = True
    while improved:
        improved = False
        current = planner.predict(choices)
        for layer, choice in enumerate(choices):
            for new in planner.cheaper(layer, choice):
                candidate = choices[:layer] + (new,) + choices[layer + 1:]
                result = planner.predict(candidate)
                if excess(result, target) == 0 and _better(result, current):
                    choices, current, improved = candidate, result, True
                    break
    return choices


def _better(new: Prediction, current: Prediction) -> bool:
    """Faster; or as fast with fewer swapped bytes the host pool refuses (a swap that stays on the device
    only costs the run its bookkeeping and a ``skipped["host_cap"]`` count)."""
    return new.step_seconds < current.step_seconds or (
        new.step_seconds == current.step_seconds and new.host_cap_bytes < current.host_cap_bytes)


def select_candidates(trace: Trace, candidates: list[str], min_offload_bytes: int, limit: int = 2) -> list[str]:
    """The children of layer 0 (among ``candidates``) owning the most saved bytes: the op scopes the
    planner measures select-recomputed (one measurement run each)."""
    children = [c for c in useful_scopes(trace, 0, candidates, min_offload_bytes) if c and "." not in c]
    owned = {c: _owned_bytes(trace, 0, c) for c in children}
    return sorted(children, key=lambda c: -owned[c])[:limit]


def _owned_bytes(trace: Trace, layer: int, scope: str) -> int:
    seen: set = set()
    total = 0
    for save in trace.modes["keep"][layer].forward:
        new = save.storage is not None and save.storage not in seen
        if new and save.scope is not None and inside(save.scope, scope):
            total += save.nbytes
        seen.add(save.storage)
    return total


def useful_scopes(trace: Trace, layer: int, candidates: list[str], min_offload_bytes: int) -> list[str]:
    """Candidate scopes that own swappable bytes, dropping one that owns exactly what an enclosing one does."""
    segment = trace.modes["keep"][layer]
    seen: set = set()
    owned: dict[str, frozenset] = {}
    for save in segment.forward:
        if save.storage is None or save.storage in seen:
            continue
        seen.add(save.storage)
        if save.nbytes >= min_offload_bytes and save.scope is not None:
            for scope in candidates:
                if inside(save.scope, scope):
                    owned[scope] = owned.get(scope, frozenset()) | {save.storage}
    useful: list[str] = []
    for scope in sorted(owned, key=lambda s: (s.count(".") + bool(s), s)):
        if not any(inside(scope, outer) and owned[outer] == owned[scope] for outer in useful):
            useful.append(scope)
    return useful
