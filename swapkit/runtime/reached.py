"""What a step's forward saves reached among the configured swap scopes, and why candidates stayed.

The session reports a swap that moved nothing: a scope no save reached (``swapkit.runtime.overrides``
Note [Swaps nobody reports]) and a scope whose every candidate was under ``runtime.min_offload_bytes``
(Note [Swaps whose tensors are all small] there). A :class:`ScopesReached` per step collects what both
reports need while the step runs, and answers them when it ends. Only ``seen`` is touched on the save
path, once per change of frame (``swapkit.runtime.step`` Note [The cost of a save]); the rest is
written when a swap scope is entered or a candidate is kept.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from swapkit.runtime.overrides import NOT_ENTERED, OTHER_HOOKS, scope_label

if TYPE_CHECKING:
    from swapkit.runtime.scope import Frame

Scope = tuple[int, str]  # (layer, op path), "" = the whole layer


class ScopesReached:
    """Per step: the swap scopes entered in forward, those some save reached, and the largest candidate
    each scope kept on the device, by reason.

    Args:
        swap_scopes: ``(layer, op path)`` of every configured swap scope.
    """

    def __init__(self, swap_scopes: tuple[Scope, ...] = ()) -> None:
        self.swap_scopes = swap_scopes
        self.seen: set[Scope] = set()  # scopes a forward save reached (the step adds, per change of frame)
        self.layers_ran_before = False  # an earlier step of this `with` block ran bound layers (unused_swaps)
        self._entered: dict[Scope, str | None] = {}  # swap scopes entered in forward -> cause
        self._kept: dict[Frame, dict[str, int]] = {}  # swap scope -> reason it kept a candidate -> largest

    def entered(self, frame: Frame, cause: str | None) -> None:
        """A scope that configures a swap was entered in forward (``cause``: why its saves would not
        reach the session, if known). swapkit.runtime.overrides Note [Swaps nobody reports]"""
        key = (frame.layer, frame.path)
        if self._entered.get(key) is None:
            self._entered[key] = cause

    def kept_in(self, frame: Frame, reason: str, nbytes: int) -> None:
        """A swap candidate saved in ``frame``'s scope stays on the device for ``reason`` (or, ``"moved"``, is a
        storage another scope swaps): the largest such storage per scope and reason (swapkit.runtime.overrides
        Note [Swaps whose tensors are all small])."""
        kept = self._kept.setdefault(frame, {})
        kept[reason] = max(kept.get(reason, 0), nbytes)

    def small_swaps(self, offloaded_by_scope: Mapping[str, int]) -> list[tuple[int, str, int]]:
        """``(layer, op path, largest bytes)`` of each configured swap scope that offloaded nothing (by
        ``offloaded_by_scope``, the step's stats) because every swap candidate saved in it, or in a hooked op
        scope inside it that takes its distance, was under ``runtime.min_offload_bytes`` (Note [Swaps whose
        tensors are all small] in swapkit.runtime.overrides)."""
        reasons: dict[Scope, dict[str, int]] = {}
        for frame, kept in self._kept.items():
            owner = self.swap_owner(frame.layer, frame.path)
            if owner is not None:
                merged = reasons.setdefault(owner, {})
                for reason, nbytes in kept.items():
                    merged[reason] = max(merged.get(reason, 0), nbytes)
        moved = {self.swap_owner(layer, path) for layer, path in self.seen
                 if offloaded_by_scope.get(scope_label(layer, path))}
        return [(layer, path, kept["small"]) for (layer, path), kept in reasons.items()
                if kept.keys() == {"small"} and (layer, path) not in moved]

    def swap_owner(self, layer: int, path: str) -> Scope | None:
        """The configured swap scope whose distance a scope saves under: itself, or the innermost configured one
        around it (an op hooked for recompute inside a swapped layer takes the layer's distance)."""
        around = [p for at, p in self.swap_scopes if at == layer and (p == path or not p or path.startswith(p + "."))]
        return (layer, max(around, key=len)) if around else None

    def unused_swaps(self, saved_any: bool) -> list[tuple[int, str, str | None]]:
        """``(layer, op path, cause)`` of each swap scope no forward save reached, among the layers
        that ran in this step (a layer of another pipeline chunk is not reported). A scope whose hooks
        never ran gets the cause :data:`NOT_ENTERED`; when no hook ran at all in a forward that saved
        tensors, every configured swap is reported that way. When nothing reached the session
        (``saved_any`` false), only the scopes entered under another saved-tensor hooks context are
        reported (a forward under ``no_grad`` saves nothing either, and bypasses nothing)."""
        if not saved_any:
            return [(layer, path, OTHER_HOOKS) for layer, path in self.swap_scopes
                    if self._entered.get((layer, path)) == OTHER_HOOKS]
        if self.rest_of_forward():  # overrides Note [Swaps nobody reports]
            return []
        ran = {layer for layer, _ in self.seen} | {layer for layer, _ in self._entered}
        return [(layer, path, self._entered.get((layer, path), NOT_ENTERED)) for layer, path in self.swap_scopes
                if (layer in ran or not ran) and (layer, path) not in self.seen]

    def rest_of_forward(self) -> bool:
        """Did this step run no bound layer while an earlier step of its ``with`` block did (a gradient penalty
        after ``torch.autograd.grad``)? swapkit.runtime.session Note [The rest of a forward]"""
        return self.layers_ran_before and not (self.seen or self._entered)

    def reached_swap_scopes(self) -> set[Scope]:
        """``(layer, op path)`` of each configured swap scope that some forward save of this step reached."""
        return {scope for scope in self.swap_scopes if scope in self.seen}

    def layers_ran(self) -> bool:
        """Whether a bound layer's hooks ran in this step's forward or an earlier one of its block."""
        return self.layers_ran_before or bool(self.seen or self._entered)
