"""The swap session: saved-tensor hooks around the forward, a step per forward/backward.

Thin autograd glue: ``pack`` asks the :class:`~swapkit.runtime.scope.ScopeTracker` where execution is and
hands the tensor to the current :class:`~swapkit.runtime.step.Step`; ``unpack`` checks the version,
drives the prefetch schedule and restores the tensor. Engines, pools and the schedule do the rest.

Note [Packs during backward]
A pack can run while autograd executes a backward (reentrant checkpointing recomputes its region
with grad enabled; double backward saves again). Those tensors belong to the backward, not to
the forward clock: they are kept as they are, get no tick, and cannot open a new step.

Note [Backward after the with block]
``with session:`` must cover the forward; backward may run inside or after it. Unpack hooks are
attached to each saved tensor, so they run after the block too; the block's exit only removes the
pack hooks and, if backward has not started yet, waits for the copies and releases what is due.
"""
from __future__ import annotations

import logging
from itertools import chain
from typing import Any

import torch
from torch import nn

from swapkit.runtime.binding import Binding
from swapkit.engine import CopyEngine, HostPool, make_engine
from swapkit.plan.plan import Plan
from swapkit.runtime.recipes import PackedInput, Recipe, tensor_leaves
from swapkit.runtime.recompute import Recompute
from swapkit.runtime.records import Saved, is_plain
from swapkit.runtime.scope import ScopeTracker
from swapkit.runtime.stats import SwapStats
from swapkit.runtime.step import Step

logger = logging.getLogger(__name__)


class SwapSession:
    """Swap and recompute applied to one model. Create it with :func:`swapkit.apply`.

    Example:
        >>> session = swapkit.apply(model, "configs/seed001_swap_op.yaml")  # doctest: +SKIP
        >>> with session:
        ...     loss = model(x).sum()
        ...     loss.backward()
        >>> session.stats.offloaded_bytes  # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, binding: Binding, plan: Plan, tracker: ScopeTracker,
                 recompute: Recompute) -> None:
        self.model, self.binding, self.plan = model, binding, plan
        self.tracker, self.recompute = tracker, recompute
        self.engine: CopyEngine | None = None
        self.pool: HostPool | None = None
        self._step: Step | None = None
        self._last: Step | None = None  # the latest step whose backward began (or that failed)
        self._steps = 0
        self._forward_ticks: int | None = None  # forward length of the last step, for the tail
        self._hooks: Any = None
        self._removed = False
        self.observer: Any = None  # sees every forward save and backward unpack (swapkit.planner.measure)
        recompute.output_sink = self

    def __repr__(self) -> str:
        state = "removed" if self._removed else "active" if self._hooks is not None else "ready"
        engine = type(self.engine).__name__ if self.engine is not None else "not started"
        plan = self.plan
        swapped = sum(layer.layer_swap is not None or bool(layer.op_swap) for layer in plan.layers)
        recomputed = sum(layer.full or bool(layer.select or layer.comm) for layer in plan.layers)
        preset = f", preset={plan.preset}" if plan.preset else ""
        return (f"SwapSession({type(self.model).__name__}.{self.binding.layers_path}: {len(plan.layers)} layers"
                f"{preset}, swap on {swapped}, recompute on {recomputed}, engine={engine}, steps={self._steps}, "
                f"{state})")

    # ------------------------------------------------------------------ context manager

    def __enter__(self) -> "SwapSession":
        if self._removed:
            raise RuntimeError("this SwapSession was removed; call swapkit.apply(model, config) again")
        if self._hooks is not None:
            raise RuntimeError("this SwapSession is already active; sessions do not nest")
        self._ensure_engine()
        self._start_step()
        self.tracker.reset()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        hooks, self._hooks = self._hooks, None
        hooks.__exit__(None, None, None)
        self.tracker.reset()
        step = self._step
        try:
            if exc_type is None and not step.backward_started:  # Note [Backward after the with block]
                step.finish_forward()
            else:
                self.engine.synchronize()  # no copy outlives the block; a failed one raises here
        except BaseException:
            self._abort(step)
            if exc_type is None:
                raise
            logger.warning("swapkit: a copy also failed while leaving the block after an error", exc_info=True)
        if exc_type is not None:
            self._abort(step)

    def _abort(self, step: Step) -> None:
        step.close(aborted=True)
        self._last = step

    # ------------------------------------------------------------------ hooks

    def _pack(self, tensor: torch.Tensor) -> Saved:
        if torch._C._current_graph_task_id() != -1:  # Note [Packs during backward]
            return Saved(tensor, tensor._version, None, -1, None, None, self.tracker.top)
        step = self._step
        if step.backward_started:  # the next micro-batch's forward inside the same block
            step = self._start_step()
        saved = step.save(tensor, self.tracker.top)
        if self.observer is not None:
            self.observer.saved(saved)
        return saved

    def _unpack(self, saved: Saved) -> torch.Tensor:
        if saved.keeper._version != saved.version:
            raise _modified_error(saved)
        if saved.step is not None:
            saved.step.unpacked(saved.tick)
        record = saved.record
        if record is None or not record.swapped or not record.released:
            tensor = saved.keeper
        else:
            tensor = record.restore(saved.meta, saved.tick)
        if self.observer is not None and saved.step is not None:
            self.observer.unpacked(saved)  # after the restore: a recipe it ran has its bytes counted
        return tensor

    # ------------------------------------------------------------------ output recompute

    def records_recipes(self) -> bool:
        """Recipes are recorded in forward while the session is active (Note [Output recompute])."""
        return self._hooks is not None and torch._C._current_graph_task_id() == -1

    def record_recipe(self, function: Any, args: tuple, kwargs: dict, state: tuple, out: Any) -> None:
        """After a selected scope ran: remember how to rebuild its outputs for their consumers."""
        def pack(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            return PackedInput(self._pack(value), value.requires_grad)

        inputs = {id(v.untyped_storage()) for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)
                  and is_plain(v)}
        packed_args, packed_kwargs = tuple(pack(a) for a in args), {k: pack(v) for k, v in kwargs.items()}
        step = self._step  # _pack above opened a new step if this is the next micro-batch
        recipe = Recipe(step, function, packed_args, packed_kwargs, self._unpack, *state)
        step.register_outputs(recipe, tensor_leaves(out), inputs)

    # ------------------------------------------------------------------ steps

    def _start_step(self) -> Step:
        if self._step is not None:
            self._step.close()
        self._steps += 1
        params = {id(t.untyped_storage()) for t in chain(self.model.parameters(), self.model.buffers())}
        self._step = Step(self._steps, self.engine, self.pool, self.plan.runtime, params, self._forward_ticks,
                          self._backward_began)
        return self._step

    def _backward_began(self, step: Step) -> None:
        self._forward_ticks = step.clock
        self._last = step

    def _ensure_engine(self) -> None:
        device = next(chain(self.model.parameters(), self.model.buffers()), torch.empty(0)).device
        if self.engine is None or self.engine.device != device:
            if self.engine is not None:
                self.engine.close()
            self.engine = make_engine(self.plan.runtime, device)
            self.pool = HostPool(self.engine.host_buffer, self.plan.runtime.max_host_bytes)
            self._forward_ticks = None

    # ------------------------------------------------------------------ public

    @property
    def stats(self) -> SwapStats:
        """Counters of the last step whose backward ran (or that failed); zeros before any."""
        step = self._last or self._step
        return step.snapshot() if step is not None else SwapStats()

    @property
    def active(self) -> bool:
        return self._hooks is not None

    def remove(self) -> None:
        """Undo everything :func:`swapkit.apply` did: hooks, recompute wrappers, engine, pool."""
        if self._hooks is not None:
            raise RuntimeError("cannot remove a SwapSession inside its `with` block")
        if self._removed:
            return
        self.tracker.remove()
        self.recompute.remove()
        self.recompute.output_sink = None
        if self._step is not None:
            self._step.close()
        if self.engine is not None:
            self.engine.close()
        if self.pool is not None:
            self.pool.clear()
        self.model.__dict__.pop("_swapkit_applied", None)
        self._removed = True


def _modified_error(saved: Saved) -> RuntimeError:
    where = saved.frame.label if saved.frame is not None else "outside the bound layers"
    now = saved.keeper._version
    return RuntimeError(
        f"swapkit: a tensor saved for backward in {where} was modified by an in-place operation after it "
        f"was saved (version {saved.version} -> {now}); backward needs the original values and autograd "
        "would fail here without swapkit too. Make that operation out-of-place (x = x + y instead of "
        "x += y) or clone the tensor before changing it."
    )
