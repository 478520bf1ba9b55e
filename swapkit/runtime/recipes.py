"""Output recompute: MindSpore's op-level recompute semantics for MindFormers ``select_*`` scopes.

Note [Output recompute]
MindSpore's op recompute drops an op's *output* and recomputes it for the backward of whoever
consumes it. A ``torch.utils.checkpoint`` region cannot express that: it saves its inputs instead
of its internals, but its output is still saved by its consumer (``w2`` saves the output of
``feed_forward.mul``), so a region around one elementwise op frees nothing. For MindFormers
``select_recompute`` / ``select_comm_recompute`` scopes the session therefore also records a
*recipe* after each call: the scope's forward, its inputs (packed through the session, so they
join the storage records that already hold them), the RNG state before the call and the
autocast state. When a later save in forward hits a storage the recipe produced, unchanged
(same version), the session stores a :class:`RecomputedOutput` handle instead of the tensor: no
device memory is held. The consumer's unpack in backward runs the recipe once under
``no_grad`` with the RNG and autocast state restored, and rebuilds the saved view on the result.
The recomputed bytes are identical because the op, its inputs and its random state are.

Note [Inputs changed in place after the scope ran]
PyTorch allows writing in place to a tensor that no backward formula saved: a scope's input may
be changed after the scope ran when nothing but the recipe needs its old values (an op that
saves nothing, like ``x * 2``, whose checkpoint region is then never recomputed). A recipe needs
them, so a save finds a recipe's output only while every input still has the version it had
when the scope ran; otherwise the consumer keeps the output as usual (no error, nothing
dropped). A write that comes *after* the consumer's save cannot be undone: the output is gone,
so replaying raises an error that names the scope and says how to avoid it, rather than
rebuilding the output from changed inputs.

Note [Replay as in forward]
A recipe replays with grad enabled and its inputs' ``requires_grad`` as in forward, and detaches
the outputs: kernel choice may depend on it (on CUDA, ``scaled_dot_product_attention`` picks its
backend partly by ``requires_grad``, and a different backend would draw a different dropout
mask). The small graph the replay builds dies with the detached outputs' producers.

Note [One object per input]
A tensor given to a scope more than once (``attn(x, x, x)``) is one object in forward, and modules
branch on it (``nn.MultiheadAttention`` takes its packed input projection when ``query is key``).
The session packs it once per recipe and the replay unpacks it once, so the replay passes one
object in each of its positions and takes the path forward took (region_inputs Note [A tensor
passed to a region more than once] does the same for the checkpoint region). A list, tuple or dict
argument (a named tuple, an ``OrderedDict``, a ``defaultdict``) holding such a tensor (``f(x, [x])``,
or deeper: ``f(x, [(x, 1)])``) gets the same handle in its place, and the replay passes a copy of it
with the unpacked object.

Recipes exist only while a session is active; outside ``with session:`` a selected scope is a
plain checkpoint region. The Megatron dialect keeps Megatron's semantics (checkpoint regions
only). The cost is one extra forward of the scope in backward, on top of the checkpoint region's
own recomputation.
"""
from __future__ import annotations

import weakref
from functools import partial
from typing import Any, Callable

import torch
from torch.utils.checkpoint import get_device_states, set_device_states

from swapkit.runtime.records import StepState, is_plain, rebuild
from swapkit.runtime.restored import handed_out
from swapkit.runtime.region_inputs import nested_elements, substituted, walked


class Recipe:
    """How to rebuild the outputs of one call of a recomputed scope."""

    __slots__ = ("step", "function", "args", "kwargs", "unpack", "rng", "autocast", "outputs", "nbytes", "label",
                 "__weakref__")

    def __init__(self, step: StepState, function: Callable[..., Any], args: tuple, kwargs: dict,
                 unpack: Callable[[Any], torch.Tensor], rng: tuple, autocast: tuple,
                 label: str = "a selected scope") -> None:
        self.step, self.function, self.args, self.kwargs = step, function, args, kwargs
        self.unpack, self.rng, self.autocast, self.label = unpack, rng, autocast, label
        self.outputs: list[torch.Tensor] | None = None
        self.nbytes = 0

    def materialize(self) -> list[torch.Tensor]:
        """Run the scope again (once) and return its tensor outputs in forward order."""
        with self.step.lock:  # two autograd threads may need the same outputs
            if self.outputs is None:
                self._replay()
            return self.outputs

    def _replay(self) -> None:
        """Note [Replay as in forward]"""
        unpacked: dict[int, Any] = {}  # Note [One object per input]
        copies: dict[int, Any] = {}  # region_inputs.substituted
        args = [self._input(a, unpacked, copies) for a in self.args]
        kwargs = {k: self._input(v, unpacked, copies) for k, v in self.kwargs.items()}
        cpu_state, devices, states = self.rng
        device_type, dtype, enabled = self.autocast
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            torch.set_rng_state(cpu_state)
            set_device_states(devices, states)
            with torch.autocast(device_type, dtype=dtype, enabled=enabled):
                self.outputs = [t.detach() for t in tensor_leaves(self.function(*args, **kwargs))]
        self.nbytes = sum(t.untyped_storage().nbytes() for t in self.outputs if is_plain(t))
        self.step.output_recomputed(self.nbytes)

    def inputs_unchanged(self) -> bool:
        """Every tensor input still holds the values the scope ran on (Note [Inputs changed in place ...])."""
        return all(_unchanged(v) for v in (*self.args, *self.kwargs.values()) if isinstance(v, PackedInput))

    def _input(self, value: Any, unpacked: dict[int, Any], copies: dict[int, Any]) -> Any:
        """``value`` as the replay passes it; ``unpacked``: the inputs of this replay so far, by handle. A
        container holding handles (elements that were also top-level inputs) is copied with them unpacked
        (``copies``: those made so far, one for each container)."""
        if walked(value):
            handles = nested_elements(value, lambda item: item if isinstance(item, PackedInput) else None)
            return substituted(value, {path: self._input(h, unpacked, copies) for path, h in handles.items()},
                               copies) if handles else value
        if not isinstance(value, PackedInput):
            return value
        if id(value) not in unpacked:
            if not _unchanged(value):
                raise _input_changed_error(self.label, value.saved)
            tensor = self.unpack(value.saved).detach()
            unpacked[id(value)] = tensor.requires_grad_() if value.requires_grad else tensor
        return unpacked[id(value)]

    def __del__(self) -> None:
        if self.nbytes:
            self.step.bytes_changed(-self.nbytes)


def _unchanged(value: PackedInput) -> bool:
    return value.saved.keeper._version == value.saved.version


def _input_changed_error(label: str, saved: Any) -> RuntimeError:
    """Note [Inputs changed in place after the scope ran]"""
    return RuntimeError(
        f"swapkit: an input of {label} was modified in place (version {saved.version} -> {saved.keeper._version}) "
        "after a later op saved the scope's output for backward; swapkit dropped that output to recompute it from "
        "the scope's inputs (MindFormers select_recompute semantics), which are gone now. Make the in-place "
        "operation out-of-place, do it before the output is used, or remove the scope from select_recompute.")


class PackedInput:
    """A tensor input of a recipe: its session handle and whether it required grad in forward. Not a named tuple:
    region_inputs walks those for repeated tensors, and a handle is a leaf."""

    __slots__ = ("saved", "requires_grad")

    def __init__(self, saved: Any, requires_grad: bool) -> None:
        self.saved, self.requires_grad = saved, requires_grad


class RecomputedOutput:
    """A storage a recipe produced; stands in for it in every save that finds it unchanged."""

    __slots__ = ("recipe", "index", "version", "nbytes", "counted", "restored", "__weakref__")
    swapped = True
    released = True  # never held on the device: every unpack goes through restore()

    def __init__(self, recipe: Recipe, index: int, version: int, nbytes: int) -> None:
        self.recipe, self.index, self.version, self.nbytes = recipe, index, version, nbytes
        self.counted = False  # in the step's recomputed_output_bytes
        self.restored: dict[tuple, tuple[torch.Tensor, int]] = {}  # swapkit.runtime.restored

    def restore(self, meta: tuple, tick: int) -> torch.Tensor:
        output = self.recipe.materialize()[self.index]
        if output.untyped_storage().nbytes() != self.nbytes:
            raise RuntimeError("swapkit: recomputing a selected op gave a storage of "
                               f"{output.untyped_storage().nbytes()} bytes, not {self.nbytes}; the op is not "
                               "deterministic in its layout and cannot be recomputed for its consumers")
        step = self.recipe.step
        with step.lock:  # swapkit.runtime.restored Note [Writes to restored tensors]
            return handed_out(self.restored, meta, self.recipe.label, step.number, rebuild, output, meta,
                              step.empties)


class RecomputableOutputs:
    """The outputs of a step's selected scopes that a later save may stand in for, by storage: its key
    (:func:`~swapkit.runtime.records.storage_key`) -> a weak reference to the storage (a recycled key is
    caught) and its :class:`RecomputedOutput`."""

    __slots__ = ("device", "entries")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.entries: dict[int, tuple[weakref.ref, RecomputedOutput]] = {}

    def register(self, recipe: Recipe, outputs: list[torch.Tensor], inputs: set[int], parameters: set[int]) -> None:
        """The plain outputs of ``recipe`` on the step's device that hold memory of their own (not an input
        passed through, not a parameter's storage)."""
        for index, output in enumerate(outputs):
            if not is_plain(output):
                continue
            storage = output.untyped_storage()
            key = storage._cdata  # records.storage_key
            if key in inputs or key in parameters or output.device != self.device or not storage.nbytes():
                continue  # an input passed through, or nothing to free
            entry = RecomputedOutput(recipe, index, output._version, storage.nbytes())
            self.entries[key] = (weakref.ref(storage, partial(self.forget, key)), entry)

    def forget(self, key: int, ref: weakref.ref) -> None:
        """The storage died: no later save can find it (a weak-reference callback, one code object for all
        of them: swapkit.runtime.dynamo Note [Saved-tensor hooks stay out of Dynamo])."""
        found = self.entries.get(key)
        if found is not None and found[0] is ref:
            del self.entries[key]

    def find(self, key: int, storage: torch.UntypedStorage, version: int) -> RecomputedOutput | None:
        """The output a save of ``storage`` at ``version`` can stand in for, if it is unchanged."""
        found = self.entries.get(key)
        if found is None or found[0]() is not storage or found[1].version != version:
            return None  # unknown, recycled id, or changed in place after the op produced it
        if not found[1].recipe.inputs_unchanged():
            return None  # Note [Inputs changed in place after the scope ran]
        return found[1]

    def clear(self) -> None:
        self.entries.clear()


def capture_state(args: tuple, kwargs: dict) -> tuple[tuple, tuple]:
    """RNG and autocast state before a scope runs, to replay it exactly."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    devices, states = get_device_states(*tensors)
    device_type = tensors[0].device.type if tensors else "cpu"
    autocast = (device_type, torch.get_autocast_dtype(device_type), torch.is_autocast_enabled(device_type))
    return (torch.get_rng_state(), devices, states), autocast


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in tensor_leaves(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in tensor_leaves(item)]
    return []


