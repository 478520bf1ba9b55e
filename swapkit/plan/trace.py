"""A measured step as the swap session sees it, and the composition of a planned step from it.

Pure Python (no torch): :mod:`swapkit.planner.measure` records the traces on the real device,
:mod:`swapkit.plan.simulate` replays a composed one under a candidate plan.

Note [Composing a planned step from measured segments]
Selected (op-level) recompute of one scope is a third kind of mode, ``select:<scope>``: the scope
is a checkpoint region and its outputs are rebuilt by recipes in backward (``Alloc`` events).
The time outside session events is taken from the ``keep`` run for every plan.

A step is cut into segments: the code before the first layer (``PRE``), each layer, and the code
after the last one (``post``, index ``num_layers``). Each segment is measured once per *mode*: ``keep``
(the session saves every tensor the layer saves) and ``recompute`` (the layer is a checkpoint region,
the session sees only its inputs). A planned step is the concatenation, in forward order, of every
segment in the mode the plan gives its layer; its backward is the concatenation of the segments'
backward events in the measured backward order of the segments. Tick numbers are recomputed on the
composed sequence, so a ``backward_prefetch`` distance counts exactly the saves the planned run
will make. Storages are named by (segment, ordinal of first save in that segment, mode): a save
that refers to a storage first saved by another segment measured in a different mode than the
plan uses there is treated as a new storage (it counts its bytes again: never an underestimate).
Note [Forward time is tiled by segment]
A save's ``seconds`` is the compute since the previous save *in its segment* (or since the segment
began), and a segment's ``tail`` the compute after its last save until it ends; segments tile the
forward (PRE ends when layer 0 is entered, layer ``i`` when its forward returns, ``post`` at the
last save). So a layer's forward time stays with the layer in every mode: a recomputed layer saves
only its inputs, at its start, and its whole forward is its tail (charging the time since the
previous save to the next save would give it to the next segment, counted twice or not at all
when neighbours run in other modes).
Where it is wrong: autograd may interleave the backward of two neighbouring segments (both branches
of a residual add are ready at once); the composition keeps each segment's events together.
"""
from __future__ import annotations

from dataclasses import dataclass, field

PRE = -1
KEEP, RECOMPUTE, SELECT = "keep", "recompute", "select:"


@dataclass(frozen=True)
class Save:
    """One tensor the session saw saved in forward.

    ``storage`` is ``(segment, ordinal)`` of the storage's first save in this mode's run, or ``None``
    for saves the session does not count (parameters, other devices, non-dense tensors).
    ``scope`` is the innermost candidate scope inside the layer (``""``: the layer itself; ``None``
    outside layers); ``seconds`` the compute time since the previous forward save.
    """

    storage: tuple | None
    nbytes: int
    scope: str | None
    seconds: float
    frees: tuple[tuple, ...] = ()  # records that died since the previous save (in this mode's run)


@dataclass(frozen=True)
class Unpack:
    """Backward read the save number ``save`` of segment ``segment`` (``seconds``: until the next event)."""

    segment: int
    save: int
    seconds: float


@dataclass(frozen=True)
class Free:
    """The session's record of ``storage`` died (autograd released every handle of it)."""

    storage: tuple[int, int]
    seconds: float = 0.0


@dataclass(frozen=True)
class Alloc:
    """A recipe rebuilt a selected op's outputs in backward: ``nbytes`` more on the device until
    the recipe dies (a :class:`Free` of the same ``name``)."""

    name: tuple
    nbytes: int
    seconds: float = 0.0


@dataclass(frozen=True)
class Segment:
    """A segment's events in one mode: forward saves in order, then its share of the backward."""

    forward: tuple[Save, ...]
    backward: tuple[Unpack | Free | Alloc, ...]
    tail: float = 0.0  # forward seconds after the segment's last save, until the segment ends


@dataclass(frozen=True)
class Trace:
    """Every segment measured in each mode, plus what a step spends outside the saves.

    Args:
        modes: mode -> segment index -> :class:`Segment`.
        backward_order: segment indices in the order backward reaches them.
        other_seconds: mode -> seconds of a step not between two session events (optimizer, loss).
        scope_seconds: ``(layer, scope)`` -> forward seconds of that scope (its recompute cost).
        micro_batches: ``gradient_accumulation_steps``: the segments are one micro-batch's.
    """

    num_layers: int
    modes: dict[str, dict[int, Segment]]
    backward_order: tuple[int, ...]
    other_seconds: dict[str, float]
    scope_seconds: dict[tuple[int, str], float] = field(default_factory=dict)
    micro_batches: int = 1  # micro-batches per training step (each one measured step, its own swap step)

    def segments(self) -> list[int]:
        return [PRE, *range(self.num_layers), self.num_layers]


@dataclass(frozen=True)
class FlatSave:
    """A save of the composed step; ``storage`` is a global name, ``layer`` ``None`` outside layers."""

    storage: tuple | None
    nbytes: int
    layer: int | None
    scope: str | None
    seconds: float
    frees: tuple[tuple, ...] = ()  # global names of storages that died just before this save


@dataclass(frozen=True)
class FlatStep:
    """A composed step: forward saves (tick = index, each with the seconds before it) and backward
    events (``("u", tick, s)``, ``("f", storage, s)``, ``("a", name, nbytes, s)``), each with the
    seconds of backward work after it (``swapkit.planner.measure`` Note [Backward time follows the event])."""

    forward: tuple[FlatSave, ...]
    backward: tuple[tuple, ...]
    other_seconds: float
    micro_batches: int = 1  # the step repeats forward and backward this many times (gradient accumulation)


def compose(trace: Trace, recomputed: frozenset[int] = frozenset(), modes: tuple[str, ...] | None = None) -> FlatStep:
    """The step the session will see when the layers in ``recomputed`` are checkpointed, or when
    layer ``i`` runs as measured in ``modes[i]`` (``keep``, ``recompute``, ``select:<scope>``)
    (Note [Composing a planned step from measured segments])."""
    if modes is None:
        modes = tuple(RECOMPUTE if i in recomputed else KEEP for i in range(trace.num_layers))
    mode_of = {s: modes[s] if 0 <= s < trace.num_layers else KEEP for s in trace.segments()}
    forward, offsets, left = _forward(trace, mode_of)
    backward = tuple(event for s in trace.backward_order
                     for event in _backward(trace.modes[mode_of[s]][s], offsets, mode_of, s))
    return FlatStep(tuple(forward), backward, trace.other_seconds[KEEP] + left, trace.micro_batches)


def _forward(trace: Trace, mode_of: dict[int, str]) -> tuple[list[FlatSave], dict[int, int], float]:
    """The composed forward saves, each segment's first tick, and the forward seconds left after the
    last save (a segment's ``tail`` goes with the next save: Note [Forward time is tiled by segment])."""
    forward: list[FlatSave] = []
    offsets: dict[int, int] = {}
    carried = 0.0
    for s in trace.segments():
        offsets[s] = len(forward)
        layer = s if 0 <= s < trace.num_layers else None
        segment = trace.modes[mode_of[s]][s]
        for index, save in enumerate(segment.forward):
            name = _global(save.storage, mode_of, mode_of[s], (s, index))
            frees = tuple(_freed(f, mode_of[s]) for f in save.frees)
            forward.append(FlatSave(name, save.nbytes, layer, save.scope, save.seconds + carried, frees))
            carried = 0.0
        carried += segment.tail
    return forward, offsets, carried


def _global(storage: tuple | None, mode_of: dict[int, str], mode: str, here: tuple[int, int]) -> tuple | None:
    if storage is None or is_boundary(storage):
        return storage  # the same storage in every mode (Note [Storages that cross layers])
    if mode_of.get(storage[0]) != mode:  # first saved by a segment taken from another run: a new storage
        return ("alias", *here, mode)
    return (*storage, mode)


def _backward(segment: Segment, offsets: dict[int, int], mode_of: dict[int, str], s: int) -> list[tuple]:
    events: list[tuple] = []
    mode = mode_of[s]
    for event in segment.backward:
        if isinstance(event, Unpack):
            save = segment_save(event, offsets)
            events.append(("u", save, event.seconds))
        elif isinstance(event, Alloc):
            events.append(("a", (*event.name, mode), event.nbytes, event.seconds))
        else:
            events.append(("f", _freed(event.storage, mode), event.seconds))
    return events


def _freed(storage: tuple, mode: str) -> tuple:
    """The global name of a storage whose death a segment measured in ``mode`` saw."""
    return storage if is_boundary(storage) else (*storage, mode)


def is_boundary(storage: tuple) -> bool:
    """A storage named by the layer boundary it crossed (``("in"|"out", layer, position)``)."""
    return isinstance(storage[0], str)


def segment_save(event: Unpack, offsets: dict[int, int]) -> int:
    """The composed tick of an unpacked save."""
    return offsets[event.segment] + event.save
