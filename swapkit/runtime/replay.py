"""What a recomputed region's re-run in backward may see: module state and random numbers as in forward.

``torch.utils.checkpoint`` re-runs a region in backward from its saved inputs; everything else it reads
(parameters, buffers, generators) is read as it is then. The wrappers of ``swapkit.runtime.recompute``
run each region through the functions here, which keep what the re-run sees equal to what the forward
saw, or raise naming what changed.

Note [Norm statistics in recomputation]
A batch norm in training mode updates its running statistics (``running_mean``, ``running_var``,
``num_batches_tracked``) as a side effect of its forward, and recomputation runs that forward a
second time on the same batch: with plain ``torch.utils.checkpoint`` the statistics move twice per
step (the momentum is effectively doubled and ``num_batches_tracked`` counts two), so a model trained
with recompute evaluates differently from the same model trained without it, silently. The gradients
are unaffected: in training mode the output uses the batch's own statistics. Every function swapkit
re-runs in backward (a recomputed layer, unit or op scope, and an op scope's output recipe) therefore
puts back, when the re-run ends (also when it ends early: non-reentrant checkpointing stops a
recomputation once it has what backward needs), the running statistics of the norm modules inside it
that are in training mode and track them (``_NormBase``: batch and instance norms). Switching
``track_running_stats`` off for the re-run instead would change what the norm saves for backward,
which ``torch.utils.checkpoint`` rejects (a different number of saved tensors). The values go back
through ``.data``, as the norm kernel writes them, without bumping the buffers' version counters:
the re-run saved them for its own backward (reentrant checkpointing), and a bump would fail their
version check there. A re-run is recognised by running inside autograd's backward
(``torch._C._current_graph_task_id() != -1``), which covers reentrant and non-reentrant
checkpointing and the recipes alike; the first forward is never inside a backward.

Note [Regions that write module state]
A region's re-run in backward reads its modules' buffers as they are then, not as the forward read
them. A buffer the forward changes in place - the power iteration of
``torch.nn.utils.parametrizations.spectral_norm`` (its ``_u`` and ``_v``), a step counter, a running
average or an expert-load count of the model's own - has moved on by then: the re-run starts from
the changed value and changes it once more. With spectral norm the recomputed weight differs from the
one the forward used, so the gradients differ from the model without recompute; with a counter the
buffer moves twice per step. Nothing fails: plain ``torch.utils.checkpoint`` does the same, silently.
Putting the values back exactly would need a copy of every buffer of the region at each forward (which
buffers a forward writes is known only after it ran). So, as with written inputs (recompute Note
[Regions that write their inputs]), the wrapper reads
the version counters of the region's buffers before and after the region's forward and raises at
once, naming the region, the buffer and the fix (leave the region out of recompute; a swap keeps the
gradients exact). Norm statistics are left out: they are not read by a training forward, and
``replay_safe`` puts them back (Note [Norm statistics in recomputation]). A buffer *replaced* by a new
tensor (Hugging Face's dynamic rotary embeddings re-register ``inv_freq``) is not written in place, and
its re-run reads the same new tensor the forward went on with: it is not reported.

Note [Module state changed before the re-run]
The same holds for a change *after* the region's forward and before its re-run in backward: a weight
clipped or renormalised in place by a later part of the forward, an ``optimizer.step()`` between a
forward and its backward, a buffer the model updates after the region ran. Without recompute, autograd
raises its in-place error wherever it saved the changed tensor (and a parameter it did not save, such as
a bias, changes no gradient); with recompute the re-run reads the new values and the gradients are those
of another forward, silently (as with plain ``torch.utils.checkpoint``, which saves no parameter). So
after the region's forward the wrapper records the version counters of the region's parameters and
buffers (norm statistics aside), and the re-run compares them first and raises naming the tensor and the
region. Writes the region itself makes in forward are covered above for buffers; a parameter the
forward itself writes (``nn.Embedding(max_norm=...)`` renormalises rows in place) is allowed, as its
re-run starts from the version the forward left. The versions are read at the region's forward and in
its re-runs only (the checkpoint's, and an output recipe's: recompute Note [What an op-level region
saves]): no
work per saved tensor.

Note [Generators of the region's modules]
``torch.utils.checkpoint(preserve_rng_state=True)`` replays the default CPU and device generators, so
dropout drawn from them gets the same mask in the re-run. A module that draws from a
``torch.Generator`` of its own (reproducible noise per module, ``torch.bernoulli(p, generator=g)``) got
other numbers in the re-run: another mask, and gradients of another forward, silently. The wrapper
looks for generators among the attributes of the region's modules when it wraps the region, records
each one's state before the region's forward, sets it back for every re-run (the checkpoint's and an
output recipe's) and, after the re-run, puts back the state the generator had reached, so draws after
the re-run go on as without recompute. A generator the region reaches another way (a global, an
argument) is not seen: README, Limitations. Dynamo cannot trace ``Generator.get_state``: under
``torch.compile`` the wrapper broke the graph there and Dynamo compiled the rest of the wrapper as a
frame of its own, guarded on the identity of each input tensor, so it recompiled at every call until
``recompile_limit`` (8) with a warning. The wrapper of a region holding a generator therefore runs
eagerly (``torch.compiler.disable``); a draw with ``generator=`` breaks the graph anyway.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from swapkit.runtime.scope import eager


def replay_safe(function: Callable[..., Any], modules: list[nn.Module]) -> Callable[..., Any]:
    """``function``, which leaves norm statistics alone when it is re-run in backward.

    Note [Norm statistics in recomputation]

    Args:
        function: the region's forward (a module's ``forward`` or a unit's loop over its layers).
        modules: the modules the region runs; their norm modules are looked up at each re-run.

    Returns:
        A function with ``function``'s signature and result.
    """
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch._C._current_graph_task_id() == -1:  # the first forward: statistics move once, here
            return function(*args, **kwargs)
        kept = [(buffer, buffer.clone()) for buffer in _norm_statistics(modules)]
        try:
            return function(*args, **kwargs)
        finally:
            for buffer, value in kept:  # as the norm kernel updates them: no version bump, which would
                buffer.data.copy_(value)  # fail the version check of the tensors the re-run saved

    return run


def _norm_statistics(modules: list[nn.Module]) -> list[torch.Tensor]:
    """The running statistics that the norms inside ``modules`` update in a training forward (batch and
    instance norms in training mode that track them): Note [Norm statistics in recomputation]."""
    return [buffer for module in modules for norm in module.modules()
            if isinstance(norm, _NormBase) and norm.training and norm.track_running_stats
            for buffer in (norm.running_mean, norm.running_var, norm.num_batches_tracked) if buffer is not None]


class RegionState:
    """The parameters and buffers of a region's modules, read by name at each call: Note [Regions that
    write module state] and Note [Module state changed before the re-run]. The modules are listed once,
    when the region is wrapped; their ``_parameters`` and ``_buffers`` dicts are read at each call
    (FSDP2 swaps the parameter objects in them)."""

    def __init__(self, members: list[tuple[str, nn.Module]]) -> None:
        """``members``: ``(prefix, module)`` pairs, the prefix naming the layer of a unit's module."""
        self.modules = [(f"{prefix}{name}." if name else prefix, module) for prefix, layer in members
                        for name, module in layer.named_modules()]
        self.generators = list({id(value): value for _, module in self.modules for value in vars(module).values()
                                if isinstance(value, torch.Generator)}.values())  # Note [Generators of the ...]

    def eager(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        """``forward``, kept out of Dynamo's traces when the region holds a generator (Note [Generators of
        the region's modules])."""
        return eager(forward) if self.generators else forward

    def buffers(self) -> list[tuple[str, torch.Tensor, int]]:
        """``(name, buffer, version)``, norm statistics aside (Note [Norm statistics in recomputation])."""
        return [(prefix + name, buffer, buffer._version) for prefix, module in self.modules
                for name, buffer in module._buffers.items() if buffer is not None and not _statistic(module, name)]

    def parameters(self) -> list[tuple[str, torch.Tensor, int]]:
        """``(name, parameter, version)``."""
        return [(prefix + name, parameter, parameter._version) for prefix, module in self.modules
                for name, parameter in module._parameters.items() if parameter is not None]


def _statistic(module: nn.Module, name: str) -> bool:
    """``module.<name>`` is a running statistic a training forward updates (as :func:`_norm_statistics`)."""
    return (isinstance(module, _NormBase) and module.training and module.track_running_stats
            and name in ("running_mean", "running_var", "num_batches_tracked"))


def checked_replay(function: Callable[..., Any], expected: list[tuple[str, torch.Tensor, int]], label: str,
                    drawn: list[tuple[torch.Generator, torch.Tensor]]) -> Callable[..., Any]:
    """``function``, whose re-run in backward first checks that the region's parameters and buffers are
    still at the versions in ``expected`` (filled once the forward ran: Note [Module state changed before
    the re-run]) and draws from the region's own generators what the forward drew (``drawn``: each
    generator with its state before the forward; Note [Generators of the region's modules])."""
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch._C._current_graph_task_id() == -1:  # the first forward (Note [Norm statistics in ...])
            return function(*args, **kwargs)
        for name, tensor, version in expected:
            if tensor._version != version:
                raise changed_state_error(label, name, version, tensor._version)
        after = [(generator, generator.get_state()) for generator, _ in drawn]
        try:
            for generator, state in drawn:
                generator.set_state(state)
            return function(*args, **kwargs)
        finally:
            for generator, state in after:  # later draws go on from where the forward left them
                generator.set_state(state)

    return run


def written_buffer_error(label: str, module: nn.Module, name: str, before: int, after: int) -> RuntimeError:
    """Note [Regions that write module state]"""
    return RuntimeError(
        f"swapkit: the recomputed region {label} ({type(module).__name__}) changed its buffer {name} in place in "
        f"forward (version {before} -> {after}; spectral_norm's power iteration, or a counter or running average of "
        "the model's own, does this). Recompute re-runs the region in backward, where it would read the changed "
        "value and change it once more: the gradients (spectral_norm) or the buffer (a counter) would differ from "
        "the model without recompute, silently, as with plain torch.utils.checkpoint. Leave this layer or op out "
        "of recompute_config (swap it instead: swapped gradients stay exact), or move the update out of the region "
        "(Note [Regions that write module state])")


def changed_state_error(label: str, name: str, before: int, after: int) -> RuntimeError:
    """Note [Module state changed before the re-run]"""
    return RuntimeError(
        f"swapkit: {name} of the recomputed region {label} was changed in place between the region's forward and "
        f"its recomputation in backward (version {before} -> {after}; an optimizer step or a weight clip before "
        "backward, or a later part of the forward writing it). Recompute re-runs the region with the values as "
        "they are now, so the gradients would differ from those of the forward that ran (without recompute, "
        "autograd raises its in-place error wherever it saved the tensor). Change parameters and buffers only "
        "after backward, or leave this layer or op out of recompute_config "
        "(Note [Module state changed before the re-run])")
