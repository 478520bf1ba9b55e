"""The swap session: saved-tensor hooks around the forward, a step per forward/backward.

Thin autograd glue: ``pack`` asks the :class:`~swapkit.runtime.scope.ScopeTracker` where execution is and
hands the tensor to the current :class:`~swapkit.runtime.step.Step`; ``unpack`` checks the version,
drives the prefetch schedule and restores the tensor. Engines, pools and the schedule do the rest.

Note [Packs during backward]
A pack can run while autograd executes a backward (reentrant checkpointing recomputes its region
with grad enabled; double backward saves again). Those tensors belong to the backward, not to
the forward clock: they are kept as they are, get no tick, and cannot open a new step.

Note [One session per thread, one thread per session]
Saved-tensor hooks are thread-local and stack: the innermost pair wins. A second session entered
on a thread where one is active would silently take over from the outer one, and one session
entered from two threads at once would mix two forwards on one clock and one scope stack (and a
race between two entries could leave a hook installed on a thread). Entering is therefore
claimed atomically under a lock: a session already active anywhere, or another session active on
this thread, raises instead.

Note [An exit cut short]
Python runs a signal's handler between bytecodes, so Ctrl-C can land in ``__exit__`` after its ``try``
began and before the hooks were popped (as ``_leave``, or the hooks' ``__exit__``, is called): the
``finally`` frees the session (``_owner``), but its hooks stay innermost on the thread. Every later
``with session:`` then met "another session active on this thread" (itself) and ``remove()`` "inside its
`with` block": the session was lost for good, and every later save on that thread still went through it.
``_leave`` therefore forgets the hooks (``_hooks``) only once they are popped, and the next entry on that
thread, finding its own hooks innermost with no owner, finishes that exit first, as an exit by that
interrupt (the step is aborted, its copies waited for). Ctrl-C landing before the ``try`` (the
``__exit__`` call itself) leaves ``_owner`` set too, which looks like a nested entry; that window is a
few bytecodes, and no Python code closes it.

Note [Backward after the with block]
``with session:`` must cover the forward; backward may run inside or after it. Unpack hooks are
attached to each saved tensor, so they run after the block too; the block's exit only removes the
pack hooks and, if backward has not started yet, waits for the copies and releases what is due.

Note [A backward after the next forward]
A step is one forward and its backward; the next ``with session:`` block starts the next step and
closes the previous one, dropping its release and prefetch schedule (a forward whose graph was
dropped, as in an evaluation under the session with gradients on, must not hold its records and
host regions any longer). A backward that begins after that, as in two ``with`` blocks followed by
one ``(loss_a + loss_b).backward()``, is still exact, but the earlier step's swapped tensors are
fetched on demand, each restore waiting for its copy (late fetches). The session logs one WARNING
per session when that happens, saying to run the forwards that are backpropagated together inside
one ``with`` block, where they share one step and its prefetches. Keeping a step open until a later
one instead would hold a dropped graph's host regions for that long, or cost every save a check.

Note [The rest of a forward]
A pack that arrives after the step's backward began opens a new step: the next micro-batch's forward.
A gradient penalty does that too, with no new micro-batch: ``torch.autograd.grad(out, x,
create_graph=True)`` begins the step's backward, then ``g.square()`` saves ``g`` outside the layers,
and ``(out + penalty).backward()`` begins the backward of that small step. Its stats (a tick or two,
nothing offloaded) would become the session's, and its length the forward length that the next
step's tail skip learns (``swapkit.runtime.swap_schedule`` Note [The last k ticks stay on the device]):
the next forward's tail would be offloaded and brought straight back, every step. So a step that runs no
bound layer while an earlier step of its ``with`` block did (``ScopesReached.rest_of_forward``) is the rest of
that forward: its backward's beginning changes neither the session's stats nor the learnt length,
and reports nothing (overrides Note [Swaps nobody reports] uses the same test). Its saves stay as
they are (kept or not: it has no swap scope) and its gradients are exact either way.

Note [A training forward outside the with block]
The saved-tensor hooks are installed only inside ``with session:``; a forward that runs outside it
(the block forgotten, or put around the optimizer step only) saves its tensors as plain autograd
does, and every configured swap does nothing, silently. The scope tracker's hooks stay installed
from ``apply`` to ``remove``, so when a swapped scope is entered with grad enabled, outside any
backward (a recompute re-run), while the session is not active, the session logs one WARNING per
session naming the layer. Forwards under ``torch.no_grad()`` (evaluation, a pipeline's shape
inference) save nothing and are not reported.
"""
from __future__ import annotations

import logging
import threading
from itertools import chain
from typing import Any

import torch
from torch import nn

from swapkit.runtime.binding import Binding, container_label
from swapkit.engine import CopyEngine, HostPool, make_engine, make_pool
from swapkit.plan.plan import Plan, swap_counts
from swapkit.runtime.detach import unmark
from swapkit.runtime.dynamo import out_of_dynamo
from swapkit.runtime.kv_cache import swap_cache_warning
from swapkit.runtime.native import native_copies, native_hooks, native_record_ops
from swapkit.runtime.overrides import entry_cause
from swapkit.runtime.recipes import PackedInput, Recipe, tensor_leaves
from swapkit.runtime.recompute import Recompute
from swapkit.runtime.records import Saved, is_plain, make_saved, storage_key
from swapkit.runtime.region_inputs import aliased_elements, substituted
from swapkit.runtime.reports import SwapReports
from swapkit.runtime.scope import Frame, ScopeTracker
from swapkit.runtime.stats import SwapStats
from swapkit.runtime.step import Step

logger = logging.getLogger(__name__)
_graph_task_id = torch._C._current_graph_task_id  # -1 outside a backward


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
        self._hook_pair: tuple[Any, Any] | None = None  # swapkit.runtime.dynamo Note [Saved-tensor hooks ...]
        self._native: tuple[Any, Any, Any] | None = None  # C++ (pack, unpack, saver): Note [The native save path]
        self._removed = False
        self._final_stats: SwapStats | None = None  # what stats said when remove() ran
        self._entry_lock = threading.Lock()
        self._owner: int | None = None  # the thread inside the `with` block
        self.reports = SwapReports(binding, plan)  # swaps that move nothing: each warning once per session
        self._late_reported = False  # Note [A backward after the next forward]: once per session
        self._outside_reported = False  # Note [A training forward outside the with block]: once per session
        self._cache_reported = False  # kv_cache Note [Caches hold swapped storages]: once per session
        self.observer: Any = None  # sees every forward save and backward unpack (swapkit.planner.measure)
        recompute.output_sink = self
        tracker.on_swap_enter = self._swap_scope_entered
        tracker.on_cache = self._cache_given

    def __repr__(self) -> str:
        state = "removed" if self._removed else "active" if self._hooks is not None else "ready"
        engine = type(self.engine).__name__ if self.engine is not None else "not started"
        plan = self.plan
        swapped = swap_counts(plan.layers)
        recomputed = sum(layer.recomputes for layer in plan.layers)
        preset = f", preset={plan.preset}" if plan.preset else ""
        return (f"SwapSession({container_label(type(self.model).__name__, self.binding.layers_path)}: "
                f"{len(plan.layers)} layers"
                f"{preset}, swap on {swapped}, recompute on {recomputed}, engine={engine}, steps={self._steps}, "
                f"{state})")

    # ------------------------------------------------------------------ context manager

    def __enter__(self) -> "SwapSession":
        self._claim()
        try:
            self._ensure_engine()
            self._hook_pair = self._hooks_to_install()  # before the step: it gives it the C++ index
            self._start_step()
            self.tracker.reset()
            hooks = torch.autograd.graph.saved_tensors_hooks(*self._hook_pair)  # Note [Saved-tensor hooks ...]
            hooks.__enter__()
            self._hooks = hooks
        except BaseException:
            self._owner = None
            raise
        return self

    #: pipeline stages keep the Python hooks (swapkit.runtime.native Note [The native save path])
    native_supported = True

    def _hooks_to_install(self) -> tuple[Any, Any]:
        """The Python hooks, marked for Dynamo to skip, or the C++ hooks that fall back to them
        (``runtime.native_save``: swapkit.runtime.native Note [The native save path])."""
        pair = out_of_dynamo(self._pack, self._unpack)
        if not (self.plan.runtime.native_save and self.native_supported):
            return pair
        if self._native is None:
            self._native = native_hooks(self, *pair)
        native_copies(self.engine)  # after _ensure_engine, which may have made a new one
        return self._native[:2]

    @property
    def native_counts(self) -> tuple[int, int] | None:
        """``(saves, unpacks)`` the C++ hooks served so far (``None``: they are not installed): Note [The
        native save path] in swapkit.runtime.native."""
        return self._native[2].counts() if self._native is not None else None

    @property
    def native_swap_counts(self) -> tuple[int, int] | None:
        """Of :attr:`native_counts`, the ``(saves, unpacks)`` of swapped storages (``native_save.cpp`` Note
        [Swaps served in C++])."""
        return self._native[2].swap_counts() if self._native is not None else None

    def _claim(self) -> None:
        """Note [One session per thread, one thread per session]"""
        other = active_session()
        if other is self and self._owner is None and self._hooks is not None:  # Note [An exit cut short]
            self._leave(KeyboardInterrupt)
            other = active_session()
        with self._entry_lock:
            if self._removed:
                raise RuntimeError("this SwapSession was removed; call swapkit.apply(model, config) again")
            if self._owner is not None:
                raise RuntimeError("this SwapSession is already active (sessions do not nest, and one session "
                                   "serves one thread at a time); leave its `with` block first")
            if other is not None:
                raise RuntimeError(f"another swapkit session (on {type(other.model).__name__}) is already active "
                                   "on this thread and would be silently replaced; leave its `with` block before "
                                   "entering this one. To swap several models in one step, apply swapkit once to a "
                                   "module holding them all, with layers=[...] naming each model's layer container "
                                   "(one global layer numbering, in the order given)")
            self._owner = threading.get_ident()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self._leave(exc_type)
        finally:
            self._owner = None

    def _pop_hooks(self) -> None:
        self._hooks.__exit__(None, None, None)  # popped, then forgotten: Note [An exit cut short]
        self._hooks = None

    def _leave(self, exc_type: Any) -> None:
        self._pop_hooks()
        if self._native is not None:
            self._native[2].forget_step()  # the session keeps its step; the hooks need none outside the block
        self.tracker.reset()
        step = self._step
        if exc_type is None and step.clock == 0 and step.scopes.unused_swaps(saved_any=False):
            self._bypassed(step)
        try:
            if exc_type is None and not step.backward_started:  # Note [Backward after the with block]
                step.schedule.finish_forward()
            else:
                self.engine.synchronize()  # no copy outlives the block; a failed one raises here
        except BaseException:
            self._abort(step)
            if exc_type is None:
                raise
            logger.warning("swapkit: a copy also failed while leaving the block after an error", exc_info=True)
        if exc_type is not None:
            self._abort(step)

    def _bypassed(self, step: Step) -> None:
        """No save reached the session: another hooks context covered every swap scope that ran, and no
        backward the session sees will begin (overrides Note [Swaps nobody reports]). Its stats are the
        session's, and its swaps are reported now."""
        self._last = step
        self._report_unused(step)

    def _abort(self, step: Step) -> None:
        step.close(aborted=True)
        self._last = step

    # ------------------------------------------------------------------ hooks

    def _pack(self, tensor: torch.Tensor) -> Saved:
        frame = self.tracker.current
        if _graph_task_id() != -1:  # Note [Packs during backward]
            return make_saved((tensor.detach(), tensor._version, None, -1, None, None, frame))
        step = self._step
        if step.backward_started:  # the next micro-batch's forward inside the same block
            step = self._start_step(continued=True)
        saved = step.save(tensor, frame)
        if self.observer is not None:
            self.observer.saved(saved)
        return saved

    def _unpack(self, saved: Saved) -> torch.Tensor:
        keeper, version, step, tick, record = saved[:5]  # by index: swapkit.runtime.step Note [The cost of a save]
        if keeper._version != version:
            raise _modified_error(saved)
        if step is not None and step.watch_unpacks:
            step.unpacked(tick, record)
        if record is None or not record.released:  # a kept record is never released
            tensor = keeper
        else:
            tensor = record.restore(saved[5], tick)
        if self.observer is not None and step is not None:
            self.observer.unpacked(saved)  # after the restore: a recipe it ran has its bytes counted
        return tensor

    # ------------------------------------------------------------------ output recompute

    def records_recipes(self) -> bool:
        """Recipes are recorded in forward while the session is active (Note [Output recompute])."""
        return self._hooks is not None and torch._C._current_graph_task_id() == -1

    def region_checkpointed(self, label: str) -> None:
        """A recompute region ran in forward (``SwapStats.recomputed_by_scope``), counted while active."""
        step = self._counting_step()
        if step is not None:
            step.region_checkpointed(label)

    def _counting_step(self) -> Step | None:
        return self._step if self.records_recipes() else None

    def record_recipe(self, function: Any, args: tuple, kwargs: dict, state: tuple, out: Any,
                      label: str = "a selected scope") -> None:
        """After a selected scope ran: remember how to rebuild its outputs for their consumers."""
        packed: dict[int, PackedInput] = {}  # one handle per tensor object (recipes Note [One object per input])

        def pack(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            if id(value) not in packed:
                packed[id(value)] = PackedInput(self._pack(value), value.requires_grad)
            return packed[id(value)]

        copies: dict[int, Any] = {}  # region_inputs.substituted: one copy of a container held twice

        def pack_aliases(value: Any) -> Any:  # region_inputs Note [A tensor passed to a region more than once]
            found = aliased_elements(value, lambda tensor: id(tensor) if id(tensor) in packed else None)
            return substituted(value, {key: packed[i] for key, i in found.items()}, copies) if found else value

        inputs = {storage_key(v) for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)
                  and is_plain(v)}
        packed_args, packed_kwargs = tuple(pack(a) for a in args), {k: pack(v) for k, v in kwargs.items()}
        packed_args = tuple(pack_aliases(a) for a in packed_args)  # after every top-level tensor was packed
        packed_kwargs = {k: pack_aliases(v) for k, v in packed_kwargs.items()}
        step = self._step  # _pack above opened a new step if this is the next micro-batch
        recipe = Recipe(step, function, packed_args, packed_kwargs, self._unpack, *state, label=label)
        step.register_outputs(recipe, tensor_leaves(out), inputs)

    # ------------------------------------------------------------------ steps

    def _start_step(self, continued: bool = False) -> Step:
        """Open the next step; ``continued``: a forward went on after a backward inside the same block."""
        previous = self._step
        if previous is not None:
            previous.close(superseded=True)
        self._steps += 1
        params = {storage_key(t) for t in chain(self.model.parameters(), self.model.buffers())}
        self._step = Step(self._steps, self.engine, self.pool, self.plan.runtime, params, self._forward_ticks,
                          self._backward_began, tuple(self.tracker.swap_scopes))
        # overrides Note [Swaps nobody reports]
        self._step.scopes.layers_ran_before = continued and previous.scopes.layers_ran()
        if self._native is not None:  # native_save.cpp Note [The records kept in C++]
            self._step.kept_natively = self._native[2].kept_index()
            self._step.view_on, self._step.empty_keeper = native_record_ops()  # records Note [A record's torch ...]
        return self._step

    def _backward_began(self, step: Step) -> None:
        if step.scopes.rest_of_forward():  # Note [The rest of a forward]
            return
        self._forward_ticks = step.clock
        self._last = step
        self._report_unused(step)
        if step.superseded and not step.aborted and step.stats.offloaded_tensors and not self._late_reported:
            self._late_reported = True
            logger.warning(late_backward_message(step.number))
        if not self.reports.idle_reported:
            self.reports.idle(step.number, step.clock, step.stats)

    def _outside_block(self, frame: Frame) -> bool:
        """Is the session inactive? Warns once if a training forward runs a swapped scope then
        (Note [A training forward outside the with block])."""
        if self._hooks is not None:
            return False
        if not self._outside_reported and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            self._outside_reported = True
            scope = f" op {frame.path}" if frame.path else ""
            logger.warning("swapkit: layer %d%s, configured to swap, ran a forward with grad enabled outside "
                           "`with session:`; swapkit swapped nothing there (saved-tensor hooks act only inside "
                           "the block). Run the forward, or schedule.step(...), inside `with session:` (backward "
                           "may follow inside or after it); run a forward meant to bypass swapkit under "
                           "torch.no_grad() or after session.remove(); warned once per session", frame.layer, scope)
        return True

    def _swap_scope_entered(self, frame: Frame) -> None:
        """swapkit.runtime.overrides Note [Swaps nobody reports]"""
        if self._outside_block(frame):
            return
        step = self._step  # None in a pipeline stage before a chunk's first save opens its micro-step
        if step is not None and torch._C._current_graph_task_id() == -1:  # not a recompute in backward
            step.scopes.entered(frame, entry_cause(self._hook_pair[0]))

    def _cache_given(self, layer: int, names: list[str]) -> None:
        """swapkit.runtime.kv_cache Note [Caches hold swapped storages]"""
        if (not self._cache_reported and self._hooks is not None and torch.is_grad_enabled()
                and torch._C._current_graph_task_id() == -1):
            self._cache_reported = True
            logger.warning(swap_cache_warning(layer, names))

    def _report_unused(self, step: Step) -> None:
        """The unused swaps of ``step`` and, if its swaps moved anything, the small ones (a scope is reported once
        per session: swapkit.runtime.reports)."""
        number = self._step_number(step)
        self.reports.unused(self._unused_swaps(step), number)
        if self._offloaded(step):  # else the step-wide idle warning names the threshold
            self.reports.small(step.scopes.small_swaps(step.stats.offloaded_by_scope), number)

    def _unused_swaps(self, step: Step) -> list[tuple[int, str, str | None]]:
        """The swap scopes the unused-swap warning names for ``step``
        (:meth:`swapkit.runtime.reached.ScopesReached.unused_swaps`)."""
        return step.scopes.unused_swaps(step.clock > 0)

    def _step_number(self, step: Step) -> int:
        """The step a warning names: the training step (a stage session's is its optimizer step's)."""
        return step.number

    def _offloaded(self, step: Step) -> bool:
        """Did the step's swaps offload anything (so the step-wide idle warning stays silent)?"""
        return bool(step.stats.offloaded_bytes)

    def _ensure_engine(self) -> None:
        device = next(chain(self.model.parameters(), self.model.buffers()), torch.empty(0)).device
        if self.engine is None or self.engine.device != device:
            if self.engine is not None:
                self.engine.close()
            self.engine = make_engine(self.plan.runtime, device)
            self.pool = make_pool(self.engine, self.plan.runtime.max_host_bytes)
            self._forward_ticks = None

    # ------------------------------------------------------------------ public

    @property
    def stats(self) -> SwapStats:
        """Counters of the last step whose backward ran (or that failed); zeros before any. After
        :meth:`remove`, those the last step had when it was removed (its pool's bytes included)."""
        return self._final_stats if self._final_stats is not None else self._live_stats()

    def _live_stats(self) -> SwapStats:
        step = self._last or self._step
        return step.snapshot() if step is not None else SwapStats()

    @property
    def active(self) -> bool:
        return self._hooks is not None

    def attached_modules(self) -> tuple[list[nn.Module], list[nn.Module]]:
        """The modules carrying swapkit's hooks, and those whose ``forward`` it wrapped
        (swapkit.runtime.detach Note [Copies and pickles of a model swapkit was applied to])."""
        return self.tracker.hooked_modules(), self.recompute.wrapped_modules()

    def remove(self) -> None:
        """Undo everything :func:`swapkit.apply` did: hooks, recompute wrappers, engine, pool."""
        if self._hooks is not None:
            raise RuntimeError("cannot remove a SwapSession inside its `with` block")
        if self._removed:
            return
        self._final_stats = self._live_stats()  # before the pool is emptied: its bytes belong to the last step
        self.tracker.remove()
        self.recompute.remove()
        self.recompute.output_sink = None
        if self._step is not None:
            self._step.close()
        if self.engine is not None:
            self.engine.close()
        if self.pool is not None:
            self.pool.clear()
        unmark(self.model)
        self._removed = True


def active_session() -> SwapSession | None:
    """The swap session whose hooks are innermost on this thread, if any."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    pack = getattr(top[0], "__wrapped__", top[0]) if top else None  # a torch.compiler.disable wrapper or not
    owner = getattr(pack, "__self__", None)
    if not isinstance(owner, SwapSession):
        owner = getattr(owner, "session", None)  # the C++ hooks' Saver (swapkit.runtime.native)
    return owner if isinstance(owner, SwapSession) else None


def late_backward_message(step: int) -> str:
    """Note [A backward after the next forward]"""
    return (f"swapkit: the backward of step {step} began after the next `with session:` block had started a new "
            f"step, which dropped step {step}'s prefetch schedule: its swapped tensors were fetched on demand (late "
            "fetches; gradients are still exact). Run the forwards whose losses are backpropagated together inside "
            "one `with session:` block (Note [A backward after the next forward])")


def _modified_error(saved: Saved) -> RuntimeError:
    where = f"in {saved.frame.label}" if saved.frame is not None else "outside the bound layers"
    now = saved.keeper._version
    return RuntimeError(
        f"swapkit: a tensor saved for backward {where} was modified by an in-place operation after it "
        f"was saved (version {saved.version} -> {now}); backward needs the original values and autograd "
        "would fail here without swapkit too. Make that operation out-of-place (x = x + y instead of "
        "x += y) or clone the tensor before changing it."
    )
