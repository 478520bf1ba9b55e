"""Measure training steps as the swap session sees them: a :class:`~swapkit.plan.trace.Trace`.

The model runs through the real training step (:mod:`swapkit.train.loop`) under a real
:class:`~swapkit.runtime.session.SwapSession`; a :class:`Tracer` watches the session (its
``observer``) and module hooks on every candidate scope. So the bytes are exactly what the session
counts (storage-deduplicated, parameters excluded: the session's records, one per storage), and the
moments are the session's ticks.

Note [Measuring in two modes]
Each layer is measured kept (``swap: false``, no recompute) and fully recomputed (``recompute:
true``), one run each (plus one run per op scope measured select-recomputed, ``select:<scope>``);
the planner composes a candidate plan from these segments (``swapkit.plan.trace``
Note [Composing a planned step from measured segments]); on CPU the runs take turns step by step
(``swapkit.planner.sampling`` Note [Measuring modes side by side]). Every event's share of the step
is its median over the measured steps (after warm-up steps), so a slow outlier step does not skew
one layer (Note [Medians of events and of steps]).

Note [Tracing overhead]
The tracer's hooks and callbacks cost time the planned run will not spend. Traced and untraced
steps alternate, and every traced time is scaled by the ratio of untraced to traced step time (at
most 1; one median ratio for all modes measured side by side): the overhead is assumed spread evenly
over the step, which it roughly is (a few microseconds per
save and per module call).

Note [Clocks on CUDA]
Kernels run asynchronously: the host clock at a save says when it was launched, not when the GPU
got there. When tracing a CUDA model the tracer waits for the compute stream before reading the
clock, so event times are GPU times (the waits are tracing overhead, scaled away with the rest;
Note [Tracing overhead]). The copy stream is not waited for.

Note [Medians of events and of steps]
On a machine other processes share, every step loses a few milliseconds here and there to
preemption, each time in other events. The median of each event over steps removes nearly all of
it, so the medians added up came out 20-25% below the median step (measured on the 4-layer
benchmark model at load average 4 on 2 cores), and every prediction with them. Each event keeps its
median's share, and the shares are scaled to add up to the median step's time of its mode: what a
step costs under the load it was measured in, spread as the quiet-machine times say.

Note [Backward time follows the event]
In backward the work after an unpack is the node that asked for the tensor, and for a checkpointed
region the recompute it triggers (non-reentrant checkpointing recomputes when an inner node first
needs a tensor, right after the session hands out the region's inputs). So a backward event carries
the time until the next event and belongs to the segment of the tensor it unpacked: the recompute
time of layer ``i`` stays with layer ``i`` when plans mix recomputed and kept layers. The time from
the last forward save to the first backward event (the loss, the head's backward) is the same in
every plan and goes with the step's other time.

Note [Records that die in forward]
A record can die before backward: a select-recomputed scope's checkpoint drops what it saved for a
region once its outputs are registered for recompute, and a tensor saved by a node autograd
already freed goes with it. The session takes the bytes off when the record dies, so the trace
puts each such death before the next forward save (``Save.frees``), where the replay takes it off
too; deaths after the last save stay at the start of the backward.

Note [Storages that cross layers]
A storage made before a layer and saved inside it (the layer's inputs: the hidden state, an HF
model's rotary ``position_embeddings`` computed once and saved by every layer) is first saved by
whichever segment saves it first, and that depends on the mode of that segment. So storages a
layer takes in or gives out (as arguments, keyword arguments or outputs of the layer module, in
forward) are named by that boundary, ``("in", layer, position)`` or ``("out", layer, position)``:
the same storage in every mode, counted once in a composed plan whatever mode each layer runs in.

Note [Release lag]
The session releases a swapped storage at a save only if its copy is seen finished then. How late
that is depends on more than the link: on the thread engine the worker needs the interpreter lock
and a core while the forward runs (up to the 5 ms switch interval, far more on a loaded machine).
A third, short run swaps every layer with distance 1 (``PROBE``) and notes, at every save as the
session does, when each offload was last seen *unfinished*: the copy surely ended later than that,
and that is all the saves tell (when it is first seen finished also counts the gap to the next
save, which is no lag: with copies that finish when issued that estimate charged every copy the
gap to the next save, and the planner then predicted swapped storages held long after the session
had released them). Twice the largest lag past the link's prediction (a budget is a hard limit,
and a busy machine's lag varies from run to run) goes into the planner's release rule
(``swapkit.plan.simulate`` Note [Cost model]); a copy never seen unfinished has no lag. The session
coalesces one scope's swapped storages into one copy, issued when the batch is flushed
(``swapkit.runtime.batch`` Note [Coalesced copies]); the replay issues each storage's copy at its
save, so the wait for the flush is part of the lag measured here.
"""
from __future__ import annotations

import dataclasses
import time
import weakref
from typing import Any

import torch
from torch import nn

from swapkit.config.types import Config, MindFormersRecompute, RuntimeConfig, SwapConfig, SwapEntry
from swapkit.plan import patterns
from swapkit.plan.simulate import Links
from swapkit.plan.emit import op_pattern
from swapkit.plan.trace import PRE, RECOMPUTE, SELECT
from swapkit.runtime.binding import module_tree
from swapkit.runtime.records import SwapRecord

PROBE = "probe"
PROBE_DISTANCE = 1  # the probe swaps every layer with this backward_prefetch


class Tracer:
    """Records one step's saves, unpacks and record deaths with their segment, scope and time.

    Args:
        layers: the bound layer modules, in global order.
        scopes: per layer, the candidate scope paths to tell apart (``""`` is the layer itself).
    """

    def __init__(self, layers: list[nn.Module], scopes: list[list[str]], device: torch.device | None = None) -> None:
        self.num_layers = len(layers)
        self._cuda = device is not None and device.type == "cuda"
        self._stack: list[tuple[int, str]] = []
        self._handles: list[Any] = []
        self.scope_seconds: dict[tuple[int, str], list[float]] = {}
        for index, layer in enumerate(layers):
            for path in scopes[index]:
                self._hook(layer.get_submodule(path) if path else layer, index, path)
            self._hook_boundary(layer, index)
        self.start_step()

    def start_step(self) -> None:
        """Forget the last step; time starts now."""
        self.saves: list[tuple[int, tuple[int, int] | None, int, str | None, float]] = []
        self.events: list[tuple[str, Any, float]] = []
        self._names: dict[int, tuple[int, int]] = {}  # id(record) -> (segment, ordinal)
        self._ordinals: dict[int, int] = {}
        self._where: dict[int, tuple[int, int]] = {}  # id(Saved) -> (segment, index in segment)
        self._counts: dict[int, int] = {}
        self._entered = False
        self._backward = False
        self.bounds: dict[int, float] = {}  # segment -> when its forward ended (Note [Forward time is tiled ...])
        self._copies: list[list] = []  # [record, issued at, seen finished at, nbytes, last seen unfinished]
        self._boundary: dict[int, tuple[weakref.ref, tuple]] = {}  # id(storage) -> (storage, layer-boundary name)
        self.start = time.perf_counter()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ------------------------------------------------------------------ session observer

    def saved(self, saved: Any) -> None:
        """A forward save (``SwapSession.observer``)."""
        now = self._now()
        self._watch_copies(saved.record, now)
        segment = self._stack[-1][0] if self._stack else (self.num_layers if self._entered else PRE)
        scope = self._stack[-1][1] if self._stack else None
        name, nbytes = self._storage(saved, segment)
        index = self._counts.get(segment, 0)
        self._counts[segment] = index + 1
        self._where[id(saved)] = (segment, index)
        self.saves.append((segment, name, nbytes, scope, now))

    def unpacked(self, saved: Any) -> None:
        """A backward unpack, after its restore (``SwapSession.observer``)."""
        where = self._where.get(id(saved))
        if where is None:
            return
        now = self._now()
        self._backward = True
        self.events.append(("u", where, now))
        recipe = getattr(saved.record, "recipe", None)  # a selected op's output, rebuilt by its recipe
        if recipe is not None and recipe.nbytes and id(recipe) not in self._names:
            name = self._names[id(recipe)] = (where[0], "recipe", len(self._names))
            self.events.append(("a", (name, recipe.nbytes), now))
            weakref.finalize(recipe, self._freed, name)

    def _now(self) -> float:
        """The clock at an event; on CUDA after the queued kernels ran (Note [Clocks on CUDA])."""
        if self._cuda:
            torch.cuda.current_stream().synchronize()
        return time.perf_counter()

    def _storage(self, saved: Any, segment: int) -> tuple[tuple | None, int]:
        record = saved.record
        if record is None or hasattr(record, "recipe"):  # a recomputed output holds nothing in forward
            return None, 0
        name = self._names.get(id(record))
        if name is None:
            name = self._boundary_name(saved.keeper)
            if name is None:
                ordinal = self._ordinals.get(segment, 0)
                self._ordinals[segment] = ordinal + 1
                name = (segment, ordinal)
            self._names[id(record)] = name
            weakref.finalize(record, self._freed, name)
        return name, record.nbytes

    def _boundary_name(self, tensor: torch.Tensor) -> tuple | None:
        """The layer-boundary name of ``tensor``'s storage, if it crossed one (Note [Storages that cross layers])."""
        found = self._boundary.get(id(tensor.untyped_storage()))
        if found is None or found[0]() is not tensor.untyped_storage():
            return None
        return found[1]

    def _watch_copies(self, record: Any, now: float) -> None:
        """At every save, as the session does, note when each offload was last seen unfinished and
        first seen finished (Note [Release lag])."""
        for copy in self._copies:
            if copy[2] is None and copy[0] is not None:
                d2h = copy[0].batch.d2h  # None until the record's batch is flushed (its copy issued)
                if d2h is not None and copy[0].step.engine.ready(d2h):
                    copy[2], copy[0] = now, None
                else:
                    copy[4] = now
        if isinstance(record, SwapRecord) and id(record) not in self._names:
            self._copies.append([record, now, None, record.nbytes, None])

    def copy_times(self) -> list[tuple[float, float | None, int]]:
        """``(issued, last seen unfinished or None, nbytes)`` of every offload of the last step."""
        return [(issued, unfinished, nbytes) for _, issued, _, nbytes, unfinished in self._copies]

    def _freed(self, name: tuple[int, int]) -> None:
        self.events.append(("f", name, time.perf_counter()))

    # ------------------------------------------------------------------ scopes

    def _hook_boundary(self, layer: nn.Module, index: int) -> None:
        """Name the storages a layer takes in and gives out (Note [Storages that cross layers])."""
        def enter(_module: nn.Module, args: Any, kwargs: Any) -> None:
            if index == 0:
                self._bound(PRE)
            self._name_boundary((args, kwargs), ("in", index))

        def leave(_module: nn.Module, _args: Any, output: Any) -> None:
            self._bound(index)
            self._name_boundary(output, ("out", index))

        self._handles.append(layer.register_forward_pre_hook(enter, with_kwargs=True))
        self._handles.append(layer.register_forward_hook(leave))

    def _bound(self, segment: int) -> None:
        """``segment``'s forward ends now (the first time in this step's forward)."""
        if not self._backward and torch.is_grad_enabled() and segment not in self.bounds:
            self.bounds[segment] = self._now()

    def _name_boundary(self, value: Any, prefix: tuple) -> None:
        if self._backward or not torch.is_grad_enabled():  # a recompute in backward makes new storages
            return
        for position, tensor in enumerate(_tensors(value)):
            storage = tensor.untyped_storage()
            found = self._boundary.get(id(storage))
            if found is None or found[0]() is not storage:
                self._boundary[id(storage)] = (weakref.ref(storage), (*prefix, position))

    def _hook(self, module: nn.Module, layer: int, path: str) -> None:
        starts: list[float] = []

        def enter(_module: nn.Module, _args: Any) -> None:
            self._entered = True
            self._stack.append((layer, path))
            starts.append(time.perf_counter())

        def leave(_module: nn.Module, _args: Any, _output: Any) -> None:
            if self._stack and self._stack[-1] == (layer, path):
                self._stack.pop()
            if starts and torch.is_grad_enabled():
                self.scope_seconds.setdefault((layer, path), []).append(time.perf_counter() - starts.pop())

        self._handles.append(module.register_forward_pre_hook(enter))
        self._handles.append(module.register_forward_hook(leave, always_call=True))


def _tensors(value: Any) -> list[torch.Tensor]:
    """The dense tensors in ``value`` (nested tuples, lists and dicts), in order."""
    if isinstance(value, torch.Tensor):
        return [value] if value.layout == torch.strided and not value.is_meta else []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []


def candidate_scopes(layer: nn.Module, config_patterns: tuple[str, ...] = ()) -> list[str]:
    """The layer, its children and grandchildren, and the scopes the config's patterns name."""
    tree = module_tree(layer)
    found = [""] + [c for c in tree] + [f"{c}.{g}" for c, sub in tree.items() for g in sub]
    for pattern in config_patterns:
        found += [p for p in patterns.resolve(tree, pattern) if p not in found]
    return found


def mode_config(config: Config, mode: str) -> Config:
    """The config a measurement run uses: every layer kept, recomputed, one scope select-recomputed
    (``select:<scope>``), or (``PROBE``) swapped with distance 1 to see when copies are seen finished."""
    select = {op_pattern(mode[len(SELECT):]): True} if mode.startswith(SELECT) else False
    recompute = MindFormersRecompute(recompute=mode == RECOMPUTE, select_recompute=select)
    swap = SwapConfig(swap=mode == PROBE, layer_swap=(SwapEntry(PROBE_DISTANCE, True),) if mode == PROBE else None)
    train = dataclasses.replace(config.train, resume=False, save_dir=None, save_interval=None,
                                gradient_accumulation_steps=1)  # one micro-batch per measured step
    # ``runtime`` tunes swapping: a run that swaps nothing takes the defaults (the user's settings
    # would only be warned about there as doing nothing), but saves with the hooks the planned run has,
    # whose cost per save its times include: the C++ ones only in one process (every rank of a
    # multi-process run is a pipeline stage, swapkit.runtime.native Note [The native save path]). The
    # probe swaps under the user's settings but an unbounded pool: under max_host_bytes the batches the
    # pool refuses would never be seen finished, read as a huge release lag; the replay keeps them on the
    # device itself (swapkit.plan.hostpool Note [The host pool in the replay])
    native = config.runtime.native_save and config.parallel.pipeline_stage * config.parallel.data_parallel == 1
    runtime = dataclasses.replace(config.runtime, max_host_bytes=None, native_save=native) if mode == PROBE \
        else RuntimeConfig(native_save=native)
    return dataclasses.replace(config, recompute=recompute, swap=swap, train=train, runtime=runtime)


def release_lag(copies: list[tuple[float, float | None, int]], links: Links, quantile: float = 1.0) -> float:
    """The ``quantile`` of how much later than the link predicts an offload was still seen
    unfinished (Note [Release lag])."""
    lags, queue_free = [], 0.0
    for issued, unfinished, nbytes in sorted(copies, key=lambda copy: copy[0]):
        queue_free = max(issued, queue_free) + links.d2h.seconds(nbytes)
        lags.append(max(unfinished - queue_free, 0.0) if unfinished is not None else 0.0)
    if not lags:
        return 0.0
    lags.sort()
    return lags[min(int(quantile * len(lags)), len(lags) - 1)]
