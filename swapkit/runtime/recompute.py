"""Activation checkpointing from the plan: full layers, Megatron uniform units, selected ops.

Wrapping replaces the instance's ``forward`` with one that calls ``torch.utils.checkpoint``; no
module is inserted, so ``state_dict`` keys never change and :meth:`Recompute.remove` restores the
model exactly. Recompute happens only in training mode with grad enabled. The wrapper is an
``AttachedForward``: a copy or a pickle of the model gets the forward it replaced
(``swapkit.runtime.detach`` Note [Copies and pickles of a model swapkit was applied to]).

Note [Recompute in eval mode]
As HF's gradient checkpointing, a wrapped region runs plainly in eval mode, so an evaluation
forward under ``torch.no_grad()`` costs nothing extra. A forward with grad enabled in eval mode is
different: it saves everything for a backward (training with dropout turned off through
``model.eval()``, as some fine-tuning recipes do), and the recompute the config asks for silently
did not happen, nor the swaps it overrides. The first such call of a wrapped region logs one WARNING
per session naming the region and the fix (``model.train()``, with dropout off in the model's config).

Note [Outermost scope wins]
A layer that is fully recomputed gets no op-level wrappers. Among selected op scopes, a scope
nested inside (or equal to) another selected scope is dropped: its tensors are already recomputed
by the outer region, and checkpointing twice would only recompute twice. The choice depends only
on the paths, so it is deterministic.

Note [Uniform units]
Megatron's ``uniform`` method checkpoints N consecutive layers as one unit: only the unit's input
is saved. The first layer of the unit runs all N layers' forwards inside one checkpoint and the
other layers become pass-throughs that check they received the unit's output. This needs the
usual decoder loop, ``h = layer(h, *args)`` with the same extra arguments and nothing in
between, and layers that return the hidden-states tensor itself; anything else (a layer that
returns a tuple, as Falcon's and T5's do) raises swapkit's error instead of computing the wrong
thing. The last pass-through of a
unit lets go of the unit's output and arguments, so no tensor (nor the graph behind it) outlives
the forward that made it; a pass-through called outside a unit's forward computes its layer.
A model that skips a layer (LayerDrop, stochastic depth, an early exit) cannot be told in advance:
the unit has already run the skipped layer when the loop moves on, so the forward's output is not the
model's. Each pass-through records that it was called, and a hook on the unit's output checks in
backward, before any gradient flows through the unit, that every later layer of the unit was, and
raises naming the skipped layer otherwise (before, the loss and gradients were silently another model's).
The hook also lets go of the unit's output that skipped pass-through never collected, so the next
forward's pass-throughs do not compare their input with it.

Note [Uniform units under FSDP2]
FSDP2 gathers a module's sharded weights in the pre-forward hook of the module ``fully_shard`` was
called on, when that module is called. A unit's later layers are called only as pass-throughs, after
the first layer's call ran their forwards, so a later layer sharded by a ``fully_shard`` call of its
own ran with sharded ``DTensor`` weights and failed inside the region with torch's "got mixed
torch.Tensor and DTensor". Sharding the unit's layers as one group (``fully_shard([layer_a,
layer_b])``) gathers them together before the first one runs. The first layer's wrapper therefore
compares, on every training call, the FSDP2 state of each later layer with the first layer's (one
state per ``fully_shard`` call) and raises naming the layers and the fix; ``swapkit train`` shards
units this way (``swapkit.distributed.train`` Note [A uniform unit is one FSDP2 group]). A model
sharded only at its root gathers everything before the unit runs and passes.

Note [What an op-level region saves]
A checkpointed op scope saves its inputs instead of what it saves inside; its output is saved
(or not) by its consumers as usual. So a region around one elementwise op (MindFormers' default
``feed_forward.mul`` and ``feed_forward.w1.activation.silu``) frees nothing by itself: its inputs
are what it saved anyway, and the consumer still saves its output. For MindFormers scopes the
swap session therefore also drops the output (``swapkit.runtime.recipes.Note [Output recompute]``);
Megatron scopes keep Megatron's checkpoint-region semantics.

Note [Keyword arguments of checkpointed modules]
``torch.utils.checkpoint`` takes keyword arguments of its own (``debug``, ``early_stop``,
``context_fn``, ``determinism_check``, ...). A module keyword with one of those names would be
swallowed by ``checkpoint`` and never reach the module, so the keywords travel to the region as
one positional dict. They are not saved as region inputs either way (non-reentrant checkpointing
keeps its keyword tensors by reference; a write to one before the re-run raises, region_inputs Note
[Keyword tensors written after the region]); reentrant checkpointing refuses them.

Note [Two checkpoints of one layer]
Hugging Face's gradient checkpointing (``model.gradient_checkpointing_enable()``, or
``TrainingArguments(gradient_checkpointing=True)``, which enables it inside ``trainer.train()``, after
``attach``) sets each decoder layer's ``gradient_checkpointing`` attribute, and the class's ``forward``
(wrapped by ``GradientCheckpointingLayer``) then checkpoints the layer. swapkit's wrappers replace the instance's
``forward`` and call that one, so a region swapkit recomputes in such a layer runs inside HF's
checkpoint: gradients stay exact (nested checkpoints), but the region frees nothing HF's checkpoint
has not already freed, and its forward can run once more in backward (counted with a matmul counter: a
select-recomputed op or a Megatron uniform unit inside a non-reentrant HF checkpoint, any region inside a
reentrant one; a full layer inside a non-reentrant one adds nothing). Nothing said so. The first training
call of a region whose layer HF checkpoints logs one WARNING per session naming the layer, the region
and the fix (one of the two mechanisms). swapkit's own stats cannot see HF's recompute; op swaps in
such layers are reported separately (``swapkit.runtime.overrides`` Note [Swaps nobody reports]).

Note [Regions that write their inputs]
A region re-runs in backward from the inputs it was given, which checkpointing saves (and checks,
by version counter, when it unpacks them). A region that changes one of its inputs in place - an
activation with ``inplace=True``, as in torchvision's blocks - cannot be replayed: plain
``torch.utils.checkpoint`` fails in backward with autograd's in-place error, and under a swap
session the saved input failed swapkit's own check, whose message blamed an in-place write that
"would fail without swapkit too", although the model trains without recompute. So the wrapper
compares its tensor inputs' version counters before and after the region's forward and raises at
once, naming the region and the fix. Reading a counter costs nothing next to a checkpoint call.
A region that writes its input in place and saves nothing for backward would have worked; it
is refused too (checkpointing it frees nothing).

Note [Checkpoint regions under torch.compile]
Dynamo puts a ``torch.utils.checkpoint`` call in a graph only when it can trace the whole region as
one higher-order op; swapkit's region (version checks, the replay guard, ``call_region``) breaks the
graph, and ``checkpoint`` then runs under ``torch._disable_dynamo``: the region's forward, and its
re-run in backward, run eagerly, whether the whole model or the layer was compiled (a compiled HF
Llama layer with full recompute captured no op). Dynamo still compiled the part of
``Recompute._checkpoint`` before that graph break as a frame of its own, with a guard on the identity
of the region's input tensor (``distinct_inputs`` looks tensors up by ``id``): every recomputed call,
each layer and each step, missed the guard and recompiled it, until ``recompile_limit`` (8) with a
warning, for graphs that were never run again. So ``_checkpoint`` is called through ``eager``: the
graph break comes at its call, as before, and nothing in it is compiled. What runs compiled is
unchanged: the code around the region (a layer's norm, its select-recomputed op's neighbours).
"""
from __future__ import annotations

import logging
import sys
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from swapkit.runtime.binding import Binding, BoundLayer
from swapkit.runtime.detach import AttachedForward
from swapkit.runtime.kv_cache import CacheArguments, cache_warning
from swapkit.runtime.recipes import capture_state
from swapkit.runtime.replay import RegionState, checked_replay, replay_safe, written_buffer_error
from swapkit.runtime.region_inputs import call_region, distinct_inputs, nothing_to_differentiate, unsaved_keywords
from swapkit.runtime.scope import eager

logger = logging.getLogger(__name__)
TWICE = ("is also checkpointed by Hugging Face's gradient checkpointing (model.gradient_checkpointing_enable() or "
         "TrainingArguments(gradient_checkpointing=True))")


class Recompute:
    """Applies and removes the recompute wrappers of a binding."""

    def __init__(self, binding: Binding, use_reentrant: bool = False, recompute_outputs: bool = False) -> None:
        self.binding = binding
        self.use_reentrant = use_reentrant
        self.recompute_outputs = recompute_outputs  # MindFormers op semantics, Note [What an op-level ...]
        self.output_sink: Any = None  # the swap session, which records recipes while it is active
        self._restore: list[tuple[nn.Module, Any]] = []
        self.wrapped: list[str] = []  # "layer 2: feed_forward", "layers 0-1" ... in apply order
        self._wrapped_ids: set[int] = set()  # binding Note [One module at several layer positions]
        self._cache_warned = False  # Note [Caches in recomputed regions]: one warning per session
        self._eval_warned = False  # Note [Recompute in eval mode]: one warning per session
        self._twice_warned = False  # Note [Two checkpoints of one layer]: one warning per session
        # swapkit.runtime.scope Note [Bookkeeping stays out of compiled graphs]
        self._counted = eager(self._count)
        self._checkpointed = eager(self._checkpoint)  # Note [Checkpoint regions under torch.compile]

    def apply(self) -> None:
        for layer in self.binding.layers:
            plan = layer.plan
            if plan.full:
                first, last = plan.unit or (layer.index, layer.index)
                if first == last:
                    self._wrap(layer.module, f"layer {layer.index}", layer=layer)
                elif layer.index == first:
                    self._wrap_unit([b for b in self.binding.layers if first <= b.index <= last])  # global ids
                continue
            for path in outermost(layer.scopes.select + layer.scopes.comm):  # Note [Outermost scope wins]
                self._wrap(layer.submodule(path), f"layer {layer.index}: {path}", self.recompute_outputs, layer)

    def remove(self) -> None:
        for module, previous in reversed(self._restore):
            if previous is None:
                del module.forward  # back to the class's forward
            else:
                module.forward = previous
        self._restore.clear()
        self.wrapped.clear()
        self._wrapped_ids.clear()

    def wrapped_modules(self) -> list[nn.Module]:
        """The modules whose ``forward`` is wrapped (detach Note [Copies and pickles of a model ...])."""
        return [module for module, _ in self._restore]

    def _replace_forward(self, module: nn.Module, forward: Callable[..., Any], label: str) -> None:
        previous = module.__dict__.get("forward")
        self._restore.append((module, previous))
        module.forward = AttachedForward(forward, module, previous)
        self.wrapped.append(label)

    def _wrap(self, module: nn.Module, label: str, outputs: bool = False, layer: BoundLayer | None = None) -> None:
        if id(module) in self._wrapped_ids:  # binding Note [One module at several layer positions]
            return
        self._wrapped_ids.add(id(module))
        original = module.forward
        cache = CacheArguments(original)
        region = RegionState([("", module)])  # replay Note [Regions that write module state]
        # swapkit.runtime.scope Note [Bookkeeping stays out of compiled graphs]
        capture, record = eager(self._capture), eager(self._record)

        replayable = replay_safe(original, [module])  # replay Note [Norm statistics in recomputation]

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not (module.training and torch.is_grad_enabled()):
                self._check_eval(label)
                return original(*args, **kwargs)
            if nothing_to_differentiate(args, kwargs, [module]):  # region_inputs Note [Regions with nothing ...]
                return original(*args, **kwargs)
            if layer is not None:
                self._check_hf_checkpoint(layer, label)
            args, kwargs = self._no_cache(cache, args, kwargs, label)
            state = capture(args, kwargs) if outputs else None
            out, checked = self._checkpointed(replayable, args, kwargs, label, module, region)
            if state is not None:
                record(checked, args, kwargs, state, out, label)
            return out

        self._replace_forward(module, region.eager(forward), label)

    def _capture(self, args: tuple, kwargs: dict) -> tuple | None:
        """RNG and autocast state for a recipe, when the session records recipes (Note [What an op-level ...])."""
        sink = self.output_sink
        return capture_state(args, kwargs) if sink is not None and sink.records_recipes() else None

    def _record(self, function: Callable[..., Any], args: tuple, kwargs: dict, state: tuple, out: Any,
                label: str) -> None:
        if self.output_sink is not None:
            self.output_sink.record_recipe(function, args, kwargs, state, out, label)

    def _wrap_unit(self, layers: list[BoundLayer]) -> None:
        """Note [Uniform units]"""
        first, last = layers[0].index, layers[-1].index
        label = f"layers {first}-{last}"
        originals = [layer.module.forward for layer in layers]
        head = layers[0].module
        cache = CacheArguments(originals[0])
        state: dict[str, Any] = {"output": None, "inputs": None, "called": []}  # output None: pass-throughs compute

        def run_unit(h: Any, *args: Any, **kwargs: Any) -> Any:
            for layer, forward in zip(layers, originals):
                h = forward(h, *args, **kwargs)
                if not isinstance(h, torch.Tensor):
                    raise _unit_error(label, layer.index, f"returned a {type(h).__name__}, not the hidden-states "
                                      "tensor; use recompute_method: block (or MindFormers' "
                                      "recompute) for layers that return tuples")
            return h

        replayable = replay_safe(run_unit, [layer.module for layer in layers])  # replay Note [Norm statistics ...]
        region = RegionState([(f"layer {layer.index}: ", layer.module) for layer in layers])

        def head_forward(h: Any, *args: Any, **kwargs: Any) -> Any:
            state["output"] = state["inputs"] = None
            if not (head.training and torch.is_grad_enabled()):
                self._check_eval(label)
                return originals[0](h, *args, **kwargs)
            if nothing_to_differentiate((h, *args), kwargs, [layer.module for layer in layers]):  # as in _wrap
                return originals[0](h, *args, **kwargs)
            _check_unit_sharding(layers, label)  # Note [Uniform units under FSDP2]
            for layer in layers:
                self._check_hf_checkpoint(layer, label)
            clean_args, clean_kwargs = self._no_cache(cache, (h, *args), kwargs, label)
            output, _ = self._checkpointed(replayable, clean_args, clean_kwargs, label, head, region)
            called: list[int] = []  # this forward's pass-throughs: Note [Uniform units]
            state["output"], state["inputs"], state["called"] = output, (args, kwargs), called
            output.register_hook(_unit_complete(state, called, layers, label))
            return output

        self._replace_forward(head, region.eager(head_forward), label)
        for position, layer in enumerate(layers[1:], start=1):
            forward = _pass_through(state, originals[position], layer.index, label, position == len(layers) - 1)
            self._replace_forward(layer.module, forward, f"{label} (pass-through {layer.index})")

    def _count(self, label: str) -> None:
        """``SwapStats.recomputed_by_scope``: the region ran in forward while the session is active."""
        if self.output_sink is not None:
            self.output_sink.region_checkpointed(label)

    def _check_eval(self, label: str) -> None:
        """Note [Recompute in eval mode]: called when a region runs plainly."""
        if torch.is_grad_enabled() and not self._eval_warned:
            self._eval_warned = True
            logger.warning(f"swapkit: {label} ran a forward with grad enabled in eval mode, so it is not "
                           "recomputed (swapkit recomputes only in training mode, as HF's gradient checkpointing "
                           "does) and saves everything for backward. Call model.train() before training forwards "
                           "(turn dropout off in the model's config instead of with model.eval()) "
                           "(Note [Recompute in eval mode])")

    def _check_hf_checkpoint(self, layer: BoundLayer, label: str) -> None:
        """Note [Two checkpoints of one layer]: called on a region's training call."""
        if self._twice_warned or getattr(layer.module, "gradient_checkpointing", False) is not True:
            return
        self._twice_warned = True
        logger.warning(f"swapkit: layer {layer.index} {TWICE}, which recomputes the whole layer in backward: "
                       f"swapkit's recompute of {label} inside it frees no more memory and can run its forward once "
                       "more in backward (gradients stay exact). Use one of the two: call "
                       "model.gradient_checkpointing_disable() (or leave gradient_checkpointing off in "
                       "TrainingArguments) and set recompute_config.recompute: true for the same full-layer "
                       "recompute, or drop recompute_config (Note [Two checkpoints of one layer])")

    def _no_cache(self, cache: CacheArguments, args: tuple, kwargs: dict, label: str) -> tuple[tuple, dict]:
        """Note [Caches in recomputed regions]"""
        args, kwargs, changed = cache.disable(args, kwargs)
        if changed and not self._cache_warned:
            self._cache_warned = True
            logger.warning(cache_warning(label, changed))
        return args, kwargs

    def _checkpoint(self, function: Callable[..., Any], args: tuple, kwargs: dict, label: str,
                    module: nn.Module, region: RegionState) -> tuple[Any, Callable]:
        """Run ``function`` as a checkpoint region; returns its output and the function its re-runs call
        (an output recipe re-runs that one too: replay Note [Module state changed before the re-run])."""
        versions = [(t, t._version) for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        buffers = region.buffers()  # replay Note [Regions that write module state]
        expected: list[tuple[str, torch.Tensor, int]] = []  # replay Note [Module state changed ...]
        drawn = [(generator, generator.get_state()) for generator in region.generators]  # replay Note [Generators ...]
        function = checked_replay(function, expected, label, drawn)
        inputs, shape = distinct_inputs(args, kwargs)  # region_inputs Note [A tensor passed ...]
        if self.use_reentrant:
            _check_reentrant(args, kwargs, label)
            out = checkpoint(call_region, function, {}, shape, (), label, *inputs, use_reentrant=True,
                             preserve_rng_state=True)
        else:  # see Note [Keyword arguments of checkpointed modules]
            unsaved = unsaved_keywords(kwargs, shape.aliases)  # region_inputs Note [Keyword tensors written ...]
            out = checkpoint(call_region, function, kwargs, shape, unsaved, label, *inputs,
                             use_reentrant=False, preserve_rng_state=True)
        for tensor, version in versions:  # Note [Regions that write their inputs]
            if tensor._version != version:
                raise _written_input_error(label, module, version, tensor._version)
        for name, buffer, version in buffers:  # replay Note [Regions that write module state]
            if buffer._version != version:
                raise written_buffer_error(label, module, name, version, buffer._version)
        expected += region.parameters() + buffers
        self._counted(label)
        return out, function


def _pass_through(state: dict[str, Any], original: Callable[..., Any], index: int, label: str,
                  last: bool) -> Callable[..., Any]:
    """A unit member's forward: hand back the unit's output (Note [Uniform units])."""
    def forward(h: Any, *args: Any, **kwargs: Any) -> Any:
        if state["output"] is None:  # eval / no-grad (the head ran only itself), or no unit running
            return original(h, *args, **kwargs)
        if h is not state["output"]:
            raise _unit_error(label, index, "was called with a tensor other than the previous layer's output")
        if not _same_arguments((args, kwargs), state["inputs"]):
            raise _unit_error(label, index, "was called with other extra arguments than the first layer of the unit")
        state["called"].append(index)
        if last:
            state["output"] = state["inputs"] = None
        return h

    return forward


def _unit_complete(state: dict[str, Any], called: list[int], layers: list[BoundLayer],
                   label: str) -> Callable[[torch.Tensor], None]:
    """A hook on a unit's output, run in backward: every later layer of the unit was called in that forward
    (``called`` lists them), or the unit ran a layer the model skipped (Note [Uniform units])."""
    def check(grad: torch.Tensor) -> None:
        missing = [layer.index for layer in layers[1:] if layer.index not in called]
        if missing and state["called"] is called:  # still waiting for that forward's pass-throughs
            state["output"] = state["inputs"] = None
        if missing:
            first = layers[0].index
            raise _unit_error(label, missing[0], f"was not called after layer {first} in that forward (the model "
                              "skipped it, as LayerDrop or an early exit does), but the unit had already run it inside "
                              f"layer {first}'s checkpoint, so that forward's output and these gradients are not the "
                              "model's; use recompute_method: block for a model that skips layers")

    return check


def _check_unit_sharding(layers: list[BoundLayer], label: str) -> None:
    """Note [Uniform units under FSDP2]"""
    head = _fsdp_state(layers[0].module)
    for layer in layers[1:]:
        state = _fsdp_state(layer.module)
        if state is not None and state is not head:
            members = ", ".join(f"layers[{b.index}]" for b in layers)
            raise RuntimeError(
                f"swapkit: uniform recompute unit {label}: layer {layer.index} is sharded by a fully_shard call of "
                f"its own, so FSDP2 gathers its weights only when the layer is called, after the unit has already "
                f"run it with sharded weights; shard the unit's layers as one group, fully_shard([{members}]) (the "
                "container's entries), as swapkit train does, or use recompute_method: block "
                "(Note [Uniform units under FSDP2])")


def _fsdp_state(module: nn.Module) -> Any:
    """The FSDP2 state ``fully_shard`` gave ``module`` (one per ``fully_shard`` call), or None. A process
    that never imported ``torch.distributed.fsdp`` has sharded nothing (and swapkit does not import it:
    about a second)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None or not isinstance(module, fsdp.FSDPModule):
        return None
    return fsdp.fully_shard.state(module)


def _unit_error(label: str, index: int, what: str) -> RuntimeError:
    return RuntimeError(f"swapkit: uniform recompute unit {label}: layer {index} {what}; uniform "
                        "units need the layers called back to back as h = layer(h, ...) with the same extra "
                        "arguments (see Note [Uniform units])")


def _same_arguments(a: Any, b: Any) -> bool:
    """The same objects (tensors by identity), or equal plain values, nested in tuples/lists/dicts."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same_arguments(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_arguments(a[k], b[k]) for k in a)
    return isinstance(a, (bool, int, float, complex, str, bytes)) and a == b


def _written_input_error(label: str, module: nn.Module, before: int, after: int) -> RuntimeError:
    """Note [Regions that write their inputs]"""
    return RuntimeError(f"swapkit: the recomputed region {label} ({type(module).__name__}) changed its input in place "
                        f"(version {before} -> {after}; an activation with inplace=True does this). Recompute "
                        "re-runs the region in backward from its inputs, so they must stay unchanged and backward "
                        "would fail. Set inplace=False on the modules inside the region, or leave it out of "
                        "recompute_config")


def _check_reentrant(args: tuple, kwargs: dict, label: str) -> None:
    """Reentrant checkpointing's limits (seed 003), checked before they bite."""
    fix = "or set recompute_config.use_reentrant: false"
    if kwargs:
        raise ValueError(f"swapkit: recompute of {label} with use_reentrant=True cannot pass keyword arguments "
                         f"({', '.join(kwargs)}); call the module with positional arguments {fix}")
    if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        raise ValueError(f"swapkit: recompute of {label} with use_reentrant=True needs a tensor input that "
                         f"requires grad, otherwise the region's parameters get no gradient; {fix}")


def outermost(paths: list[str]) -> list[str]:
    """Drop paths equal to or nested inside another path of the list (Note [Outermost scope wins])."""
    kept: list[str] = []
    for path in paths:
        if path in kept or any(path.startswith(other + ".") for other in paths if other != path):
            continue
        kept.append(path)
    return kept
