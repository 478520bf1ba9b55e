"""A session's WARNINGs about configured swaps that move nothing, each given once per session.

Three kinds (``swapkit.runtime.overrides`` builds their messages): a swap scope no save reached (Note
[Swaps nobody reports] there), a scope whose every candidate was small (Note [Swaps whose tensors are
all small]) and a step whose swaps moved nothing at all (Note [Swaps that move nothing]). The step
collects what its saves reached (``swapkit.runtime.reached``); the session says when to report and of
which step (a stage session: of its optimizer step); a :class:`SwapReports` names the causes it can
tell from the bound model and writes each warning once.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Iterable

from swapkit.runtime.overrides import (FROZEN, HF_CHECKPOINT, NO_GRAD, NOT_ENTERED, OTHER_HOOKS, SHARED_FIX,
                                       distance_key, idle_message, shared_cause, small_message, unused_message)

if TYPE_CHECKING:
    from swapkit.plan.plan import Plan
    from swapkit.runtime.binding import Binding, BoundLayer
    from swapkit.runtime.stats import SwapStats

logger = logging.getLogger(__name__)


class SwapReports:
    """The once-per-session warnings of one session.

    Args:
        binding: the session's bound layers (their modules tell the frozen and HF-checkpointed causes).
        plan: the session's plan (the runtime's threshold, and the config key of the swap distance).
    """

    def __init__(self, binding: Binding, plan: Plan) -> None:
        self.binding, self.plan = binding, plan
        self._reported: set[tuple] = set()  # unused swaps (layer, path), small ones ("small", layer, path), warned
        self.idle_reported = False  # overrides Note [Swaps that move nothing]: once per session

    def unused(self, unused: Iterable[tuple[int, str, str | None]], step: int) -> None:
        """One WARNING per swap scope and cause among ``unused`` (``(layer, op path, cause)``), naming every
        layer where it went unused in training step ``step``; a scope is reported once per session."""
        layers: dict[tuple[str, str | None], list[int]] = {}
        fixes: dict[str | None, str] = {}
        for layer, path, cause in unused:
            if (layer, path) not in self._reported:
                self._reported.add((layer, path))
                shared = self._positions_sharing(layer)
                # binding Note [One module at several layer positions]: the last position's layer frame shadows an
                # earlier layer swap; an earlier op swap pushes a frame of its own in every call
                if not path and cause in (None, NOT_ENTERED) and shared[-1] != layer:
                    cause = shared_cause(shared)
                    fixes[cause] = SHARED_FIX
                elif cause is None and self._frozen(layer, path):
                    cause = FROZEN
                elif cause in (OTHER_HOOKS, NO_GRAD) and self._hf_checkpointed(layer):
                    cause = HF_CHECKPOINT
                layers.setdefault((path, cause), []).append(layer)
        for (path, cause), where in layers.items():
            logger.warning(unused_message(sorted(where), path, cause, step, fixes.get(cause)))

    def small(self, small: Iterable[tuple[int, str, int]], step: int) -> None:
        """One WARNING per op path (or layer swap) among ``small`` (``(layer, op path, largest bytes)``) whose
        tensors were all small, naming every layer where they were (overrides Note [Swaps whose tensors are all
        small]); a scope is reported once per session."""
        paths: dict[str, tuple[list[int], int]] = {}
        for layer, path, largest in small:
            if ("small", layer, path) not in self._reported:  # its own kind: the scope may still go unused later
                self._reported.add(("small", layer, path))
                where, most = paths.get(path, ([], 0))
                paths[path] = (where + [layer], max(most, largest))
        for path, (where, largest) in paths.items():
            logger.warning(small_message(sorted(where), path, largest, self.plan.runtime.min_offload_bytes, step))

    def idle(self, step: int, ticks: int, stats: SwapStats) -> None:
        """overrides Note [Swaps that move nothing]: training step ``step`` saved ``ticks`` tensors in forward (the
        longest micro-step's in a pipeline stage) with these ``stats``."""
        message = idle_message(step, ticks, stats.offloaded_bytes, stats.skipped, self.plan.runtime,
                               distance_key(self.plan.origins))
        if message is not None:
            self.idle_reported = True
            logger.warning(message)

    def _bound(self, layer: int) -> BoundLayer | None:
        """The bound layer at position ``layer``, or None."""
        return next((b for b in self.binding.layers if b.index == layer), None)

    def _hf_checkpointed(self, layer: int) -> bool:
        """The layer's module has HF gradient checkpointing on (overrides Note [Swaps nobody reports])."""
        bound = self._bound(layer)
        return bound is not None and getattr(bound.module, "gradient_checkpointing", False) is True

    def _positions_sharing(self, layer: int) -> list[int]:
        """The bound positions whose module is layer ``layer``'s, in order (``[layer]`` when it has its own)."""
        bound = self._bound(layer)
        return [layer] if bound is None else [b.index for b in self.binding.layers if b.module is bound.module]

    def _frozen(self, layer: int, path: str) -> bool:
        """The scope's module has parameters and none requires grad (overrides Note [Swaps nobody reports])."""
        bound = self._bound(layer)
        if bound is None:
            return False
        params = list((bound.submodule(path) if path else bound.module).parameters())
        return bool(params) and not any(p.requires_grad for p in params)
