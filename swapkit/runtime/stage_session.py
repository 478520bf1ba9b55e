"""The swap session of one pipeline stage: its chunk modules, one micro-step per chunk forward.

``swapkit.apply(modules, config, stage=s)`` returns a :class:`StageSession`. It is a
:class:`~swapkit.runtime.session.SwapSession` whose packs go to the micro-step of the chunk forward
that is running (``swapkit.runtime.microsteps``); one ``with session:`` block around
``schedule.step(...)`` is one optimizer step.

Note [Opening a micro-step lazily]
A forward pre-hook on each chunk module marks "a forward of chunk v is running"; the micro-step
itself opens at the first tensor saved after it, and the forward hook (``always_call``) ends its
forward. So ``PipelineStage``'s shape-inference forward, which runs under ``torch.no_grad()`` and
saves nothing, opens nothing. Tensors saved outside any chunk forward (a loss function on the last
stage) are kept as they are and not counted, like packs during backward
(``swapkit.runtime.session.Note [Packs during backward]``).

Note [Metadata inference is not a micro-step]
``PipelineStage`` without static shapes infers them on its first use by running a real forward
(with grad, when the schedule has a backward) and a real ``torch.autograd.grad`` of each chunk, on
throw-away inputs. That pass is not a micro-batch: the session recognises it by the frame of
torch's ``_forward_metadata_inference`` on the stack when its first tensor is saved, and keeps its
tensors as they are, uncounted, like packs outside a chunk. Passing ``input_args``/``output_args``
to ``PipelineStage`` skips the pass altogether.

Note [micro_batch_num with your own schedule]
``parallel_config.micro_batch_num`` sets the micro-batches of ``swapkit train``'s schedule; with the
user's own schedule its ``n_microbatches`` decides and the key does nothing. Not to leave that
silent, the session compares the key, when the config gives it, with the forwards each chunk ran
in an optimizer step, and warns once per session when they differ. A step in which no chunk saved
a tensor (an evaluation under ``torch.no_grad()``) has nothing to compare.
"""
from __future__ import annotations

import logging
import sys
from collections import Counter
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from swapkit.plan.plan import swap_counts
from swapkit.runtime.binding import container_label
from swapkit.runtime.detach import AttachedHook, unmark
from swapkit.runtime.microsteps import Key, MicroStep, MicroSteps, MicroStepStats
from swapkit.runtime.overrides import entry_cause
from swapkit.runtime.records import Saved, make_saved, storage_key
from swapkit.runtime.scope import Frame
from swapkit.runtime.session import SwapSession
from swapkit.runtime.stats import SwapStats
from swapkit.runtime.step import Step

logger = logging.getLogger(__name__)


class StageSession(SwapSession):
    """Swap and recompute on the chunks of one pipeline stage. Create it with ``swapkit.apply(..., stage=s)``.

    Example:
        >>> session = swapkit.apply([chunk], config, layers="layers", stage=rank)  # doctest: +SKIP
        >>> with session:  # one optimizer step
        ...     schedule.step(x) if rank == 0 else schedule.step(target=y, losses=losses)
        >>> session.stats.micro_steps, session.stats.peak_device_bytes  # doctest: +SKIP
    """

    native_supported = False  # saves open micro-steps: swapkit.runtime.native Note [The native save path]

    def __init__(self, chunks: list[nn.Module], stage: int, *args: Any, micro_batch_num: int | None = None) -> None:
        """``args``: :class:`SwapSession`'s; ``micro_batch_num``: the config's, compared with what ran
        (Note [micro_batch_num with your own schedule])."""
        super().__init__(*args)
        self.chunks, self.stage = chunks, stage
        self.micro_batch_num, self._micro_batches_reported = micro_batch_num, False
        self._group: MicroSteps | None = None
        self._final_micro: list[MicroStepStats] | None = None  # micro_step_stats when remove() ran
        self._groups = 0
        self._running: int | None = None  # chunk whose forward is running (Note [Opening a micro-step lazily])
        self._current: MicroStep | None = None
        self._chunk_hooks: list[RemovableHandle] = []
        for v, chunk in enumerate(chunks):
            self._chunk_hooks.append(chunk.register_forward_pre_hook(AttachedHook(self._chunk_hook(v))))
            leave = AttachedHook(self._chunk_hook(None))
            self._chunk_hooks.append(chunk.register_forward_hook(leave, always_call=True))

    # ------------------------------------------------------------------ micro-steps

    def _start_step(self) -> None:  # called by __enter__: a new optimizer step
        previous = self._group
        if previous is not None:
            previous.close()
        self._groups += 1
        self._group = MicroSteps(self._groups, self.pool.allocations, previous)
        self._running = self._current = self._step = None

    def _chunk_hook(self, chunk: int | None) -> Any:
        def hook(_module: nn.Module, *_: Any) -> None:
            if self._hooks is None:
                return
            if chunk is None and self._current is not None:
                self._group.forward_ended(self._current)
            self._running, self._current = chunk, None

        return hook

    def attached_modules(self) -> tuple[list[nn.Module], list[nn.Module]]:
        """The session's, and the chunks, which carry the micro-step hooks."""
        hooked, wrapped = super().attached_modules()
        return hooked + list(self.chunks), wrapped

    def _pack(self, tensor: torch.Tensor) -> Saved:
        if torch._C._current_graph_task_id() != -1 or self._open() is None:  # Note [Opening a micro-step ...]
            return make_saved((tensor.detach(), tensor._version, None, -1, None, None, self.tracker.top))
        return self._current.save(tensor, self.tracker.top)

    def _open(self) -> MicroStep | None:
        """The running chunk forward's micro-step, opened now if needed; ``None`` outside one."""
        if self._current is None and self._running is not None:
            if _in_metadata_inference():  # Note [Metadata inference is not a micro-step]
                self._running = None
            else:
                self._current = self._step = self._group.open(self._running, self._new_micro_step)
        return self._current

    def _swap_scope_entered(self, frame: Frame) -> None:
        """swapkit.runtime.overrides Note [Swaps nobody reports], per micro-step. A grad-disabled
        forward (shape inference) saves nothing and so opens no micro-step (Note [Opening a ...])."""
        if self._outside_block(frame) or torch._C._current_graph_task_id() != -1 or not torch.is_grad_enabled():
            return
        if self._open() is not None:
            self._current.scopes.entered(frame, entry_cause(self._hook_pair[0]))

    def _counting_step(self) -> MicroStep | None:
        return self._open() if self.records_recipes() else None

    def record_recipe(self, *args: Any, **kwargs: Any) -> None:
        if self._open() is not None:  # outside a micro-step the outputs are simply kept
            super().record_recipe(*args, **kwargs)

    def _new_micro_step(self, key: Key, tail_ticks: int | None) -> MicroStep:
        self._steps += 1
        params = {storage_key(t) for t in chain(self.model.parameters(), self.model.buffers())}
        return MicroStep(self._group, key, self._steps, self.engine, self.pool, self.plan.runtime, params,
                         tail_ticks, swap_scopes=tuple(self.tracker.swap_scopes))

    # ------------------------------------------------------------------ context manager

    def _leave(self, exc_type: Any) -> None:  # SwapSession.__exit__ calls it
        self._pop_hooks()
        self.tracker.reset()
        self._running = self._current = None
        group = self._group
        try:
            if exc_type is None:
                group.finish()
                for step in group.steps:  # swaps that saw no tensor in any micro-step's forward
                    self._report_unused(step)
                self._check_idle(group)
                self._check_micro_batches(group)
            else:
                self.engine.synchronize()
        except BaseException:
            group.close(aborted=True)
            if exc_type is None:
                raise
            logger.warning("swapkit: a copy also failed while leaving the block after an error", exc_info=True)
        if exc_type is not None:
            group.close(aborted=True)

    def _unused_swaps(self, step: Step) -> list[tuple[int, str, str | None]]:
        """``step``'s unused swap scopes that no micro-step of its optimizer step reached: the warning says
        "no effect" of the optimizer step (swapkit.runtime.microsteps Note [Unused swaps of an optimizer step])."""
        assert isinstance(step, MicroStep)
        reached = step.group.reached_swap_scopes()
        return [(layer, path, cause) for layer, path, cause in super()._unused_swaps(step)
                if (layer, path) not in reached]

    def _step_number(self, step: Step) -> int:
        """The optimizer step (the ``with`` block), as the idle warning names it, not the micro-step's count."""
        assert isinstance(step, MicroStep)
        return step.group.number

    def _offloaded(self, step: Step) -> bool:
        """Did any micro-step of ``step``'s optimizer step offload anything? The idle warning is for the
        micro-steps added up (``_check_idle``), so a chunk whose swaps all kept small tensors is named even
        when only another chunk's micro-steps moved bytes (overrides Note [Swaps whose tensors are all small])."""
        assert isinstance(step, MicroStep)
        return any(other.stats.offloaded_bytes for other in step.group.steps)

    def _check_idle(self, group: MicroSteps) -> None:
        """overrides Note [Swaps that move nothing], for the micro-steps added up (summed only when none
        of them offloaded anything)."""
        steps = group.steps
        if self.reports.idle_reported or not steps or any(step.stats.offloaded_bytes for step in steps):
            return
        self.reports.idle(group.number, max(step.clock for step in steps), group.snapshot(self.pool.allocations))

    def _check_micro_batches(self, group: MicroSteps) -> None:
        """Note [micro_batch_num with your own schedule]."""
        ran = sorted(set(Counter(step.key[0] for step in group.steps).values()))
        if self.micro_batch_num is None or self._micro_batches_reported or not ran or ran == [self.micro_batch_num]:
            return
        self._micro_batches_reported = True
        logger.warning("parallel_config.micro_batch_num: %d, but stage %d ran %s micro-batches per chunk in "
                       "optimizer step %d: with your own pipeline schedule its n_microbatches decides and this key "
                       "does nothing (swapkit train reads it); set it to your n_microbatches or remove it",
                       self.micro_batch_num, self.stage, " or ".join(map(str, ran)), group.number)

    # ------------------------------------------------------------------ public

    def __repr__(self) -> str:
        """The stage, its global layers per chunk and what they swap and recompute (not the whole model's)."""
        state = "removed" if self._removed else "active" if self._hooks is not None else "ready"
        engine = type(self.engine).__name__ if self.engine is not None else "not started"
        plans = [layer.plan for layer in self.binding.layers]
        swapped = swap_counts(plans)
        recomputed = sum(p.recomputes for p in plans)
        preset = f", preset={self.plan.preset}" if self.plan.preset else ""
        container = container_label(type(self.chunks[0]).__name__, self.binding.layers_path)
        return (f"StageSession(stage {self.stage} of {self.plan.layout.pipeline_stage}: layers "
                f"{self.plan.stage_layers(self.stage)} in {len(self.chunks)} x {container}: {len(plans)} layers"
                f"{preset}, swap on {swapped}, recompute on {recomputed}, engine={engine}, steps={self._groups}, "
                f"micro-steps={self._steps}, {state})")

    def _live_stats(self) -> SwapStats:
        """The last optimizer step's micro-steps added up (``micro_steps``, bytes summed, peak of the sum)."""
        return self._group.snapshot(self.pool.allocations) if self._group is not None else SwapStats()

    @property
    def micro_step_stats(self) -> list[MicroStepStats]:
        """Per micro-step counters of the last optimizer step, in the order their forwards opened (after
        :meth:`remove`, as they were when it ran)."""
        if self._final_micro is not None:
            return self._final_micro
        return self._group.per_micro_step() if self._group is not None else []

    def remove(self) -> None:
        """Undo everything ``swapkit.apply`` did to the stage's chunks."""
        if self._hooks is None and not self._removed:
            self._final_micro = self.micro_step_stats  # before the pool is emptied (as SwapSession.stats)
            for handle in self._chunk_hooks:
                handle.remove()
            self._chunk_hooks.clear()
            if self._group is not None:
                self._group.close()
            for chunk in self.chunks:
                unmark(chunk)
        super().remove()


_INFERENCE_FRAMES = frozenset({"_forward_metadata_inference", "_shape_inference"})


def _in_metadata_inference() -> bool:
    """Is ``torch.distributed.pipelining`` inferring shapes (Note [Metadata inference is not a micro-step])?"""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name in _INFERENCE_FRAMES and "pipelining" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False
