"""The native save path: a session's saved-tensor hooks in C++ (``runtime.native_save: true``).

Note [The native save path]
A session's pack and unpack hooks run once per saved tensor, and most saves of a step are plain
keeps: a new storage outside every swap scope, or a storage the step already keeps. In Python
each costs the hook frames and the torch calls through Python objects (making the storage's Python
object, ``id``, ``nbytes``): a keep-only session measured about 3.7x the identity hooks per saved
tensor on a 2-core CPU (``benchmarks/results/overhead``). With ``runtime.native_save`` the session
installs two C functions instead (``native_save.cpp``, built on first use by
``torch.utils.cpp_extension``, cached in ``TORCH_EXTENSIONS_DIR``). A save reaches them while the step
runs its forward, with no observer, in the frame of the previous save. Of those saves they serve,
doing what the Python does on the same objects (once a swap record was queued in the step, the
clock's tick is followed by ``SwapSchedule.advance``, the releases due, as in ``Step.save``):
- outside a swap scope, a new storage that ``Step.save`` would keep with a new
  :class:`~swapkit.runtime.records.KeptRecord`: a plain ``torch.Tensor`` (not a view, no attributes, a
  storage with bytes on the step's device, no recomputable output registered): the step's clock ticks,
  the stats and the device-bytes ledger count the storage, and a :class:`NativeKeptRecord` is made, a
  ``KeptRecord`` whose finalizer (which takes its bytes off the ledger) is C, not a Python frame, indexed
  apart from the step's own index, in the step's ``kept_natively``, where the Python looks too
  (``native_save.cpp`` Note [The records kept in C++]; the handle and the record are untracked: Note
  [Objects the collector need not see]);
- outside a swap scope, a new storage that ``Step.save`` keeps without a record: one the step knows as
  a parameter's, an empty storage, one on another device;
- a storage whose live ``KeptRecord`` the step has, at the same version, in any scope (as the Python,
  which does not move a kept storage): a handle of that record;
- in a swap scope, a new storage of the same kind (plain, on the device, not half precision, at least
  ``runtime.min_offload_bytes``, not in the tail the step skips) that ``Step.save`` would swap: its swap
  record, made by ``SwapSchedule.add`` as the Python makes it (``native_save.cpp`` Note [Swaps served in
  C++]).
They also serve an unpack of a handle with a kept record (or none) whose keeper was not written in
place, once the step stopped watching unpacks (``swapkit.runtime.step`` Note [The cost of a save])
and with no observer: the keeper; and an unpack of a handle with a swap record of a step (not a
micro-step) whose keeper was not written in place, with no observer: ``Step.unpacked`` while the step
watches unpacks, then the keeper or ``SwapRecord.restore``.
Everything else (a parameter the step does not know yet, views and tensors with attributes of a new
storage, swap candidates the step keeps (small, tail, autocast's dtypes), later saves of a swapped
storage, recomputable outputs, backward's packs, micro-steps, the first unpacks of a backward of a
keep, a modified keeper's error) goes to the session's own Python hooks, unchanged.
Neither path knows which one made a handle or a record, so mixing them changes nothing: both indexes are
keyed by the ``StorageImpl`` address (:func:`~swapkit.runtime.records.storage_key`) that both can read,
both paths look up both, and a ``KeptRecord`` holds its first keeper, not the Python storage object,
which the C++ never makes. The C++ reads the attributes it needs from the objects' instance dicts
(``native_save.cpp`` Note [Attributes read from the instance dict]). ``SwapSession.native_counts`` says
how many saves and unpacks the C++ served, ``SwapSession.native_swap_counts`` how many of them were swapped
storages'.

Note [Objects the collector need not see]
Python's cyclic collector runs after every 700 allocations of the objects it tracks, and each run walks
every tracked object of the generations it collects; the objects a step's saves leave alive until
backward are promoted to the older generations, whose runs walk them again. A kept save makes four in
the Python: the keeper, the handle, the record and the index's weak reference to it. With all four
tracked, the collector took about a fifth of a keep-only step's CPU time on the benchmark's process
(``perf``), against 1% with identity hooks. The C++ makes no weak reference (its records are in a
``KeptIndex``, which holds them borrowed and takes no part in any cycle) and untracks the handle and the
record, which the collector need not see, because no reference cycle can pass through them: a handle
refers to its keeper, its step, its record and its frame; a record to its step, its keeper and its
``KeptIndex``. None of those refers back to a handle or a record (the step's index holds weak
references, the ``KeptIndex`` borrowed ones, its queues hold swap records, a frame holds none), so their
reference counts alone free them, as they free an untracked tuple. They still count towards the
collector's next run (CPython counts allocations, not tracked objects). ``gc.get_objects()`` no longer
lists them: the tests find them through the step's ``kept_natively`` instead.

The C functions are builtins: Dynamo never traces them (no Python frame); the Python they call, the
hooks they fall back to, ``Step.settle`` (at a keep's tick 0, every ``SETTLE_TICKS``) and
``SwapSchedule.advance`` (at every tick once a swap record was queued), and for the swaps it serves
``SwapSchedule.add``, ``Step.unpacked`` and ``SwapRecord.restore``, is what
``swapkit.runtime.dynamo`` keeps out of Dynamo as before: marked, or on an older torch its
``torch.compiler.disable`` wrappers (Note [Saved-tensor hooks stay out of Dynamo]). Pipeline stages
keep the Python hooks: a stage's saves open micro-steps (``swapkit.runtime.stage_session``), which
the C++ does not know. Every rank of a multi-process ``swapkit train`` runs a stage, a data-parallel
one included (``swapkit.distributed.train``).
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from swapkit.runtime.dynamo import kept_out_of_dynamo
from swapkit.runtime.ledger import SETTLE_TICKS
from swapkit.runtime.records import KeptRecord, Saved, SwapRecord
from swapkit.runtime.step import Step
from swapkit.runtime.swap_schedule import SwapSchedule

SOURCE = Path(__file__).with_name("native_save.cpp")
#: the module's other sources: the thread engine's region copy (swapkit.engine.thread Note [Region copies ...]) and
#: a swap record's torch calls (swapkit.runtime.records Note [A record's torch calls in C++])
SOURCES = (SOURCE, Path(__file__).with_name("region_copy.cpp"), Path(__file__).with_name("record_ops.cpp"))
NAME = "swapkit_native_save"

_lock = threading.Lock()
_built: list[Any] = []  # the module, or the error its build raised: one build per process


class NativeBuildError(RuntimeError):
    """``runtime.native_save: true``, and the C++ hooks could not be built or loaded."""


class NativeKeptRecord(KeptRecord):
    """A :class:`~swapkit.runtime.records.KeptRecord` the C++ hooks made: the same record, whose ``__del__``
    (set when the module is built, Note [The native save path]) is C, with no Python frame."""

    __slots__ = ()


def native_module() -> Any:
    """The built extension (Note [The native save path]); built once per process, its failure remembered.

    Raises:
        NativeBuildError: no C++ compiler, ninja or torch headers, or the build failed; says which and the fix.
    """
    with _lock:
        if not _built:
            _built.append(_build())
        found = _built[0]
    if isinstance(found, NativeBuildError):
        raise found
    return found


def _build() -> Any:
    try:
        from torch.utils.cpp_extension import load

        module = load(name=NAME, sources=[str(source) for source in SOURCES], extra_cflags=["-O2"])
        module.install_finalizer(NativeKeptRecord)
        return module
    except Exception as err:  # noqa: BLE001 - the build's own errors are many kinds; each is reported as one
        lines = str(err).strip().splitlines() or [type(err).__name__]
        return NativeBuildError(
            f"runtime.native_save: true, but swapkit's C++ save hooks ({SOURCE.name}) could not be built: "
            f"{lines[-1][:400]}. They need a C++ compiler, ninja (pip install ninja) and torch's headers, as any "
            "torch.utils.cpp_extension build does; install those, or set runtime.native_save: false (the Python "
            "hooks do the same work, slower per saved tensor)")


def native_copies(engine: Any) -> None:
    """Give ``engine``, where it takes them (the CPU thread engine), the C++ region copies
    (``swapkit.engine.thread`` Note [Region copies without the interpreter lock])."""
    use = getattr(engine, "use_native_copies", None)
    if use is not None:
        use(native_module().copy_region)


def native_record_ops() -> tuple[Any, Any]:
    """The module's ``(view_on, empty_keeper)`` (``swapkit.runtime.records`` Note [A record's torch calls in C++])."""
    module = native_module()
    return module.view_on, module.empty_keeper


def native_hooks(session: Any, pack: Any, unpack: Any) -> tuple[Any, Any, Any]:
    """``(pack, unpack, saver)`` for ``session``, falling back to its Python hooks ``pack`` and ``unpack`` as
    :func:`~swapkit.runtime.dynamo.out_of_dynamo` returned them (Note [The native save path]); the step's
    ``settle`` and unpack, its schedule's ``advance`` and ``add`` and a swap record's ``restore``, which the C++
    calls, are kept out of Dynamo the same way."""
    module = native_module()
    called = (Step.settle, SwapSchedule.advance, SwapSchedule.add, Step.unpacked, SwapRecord.restore)
    return module.make_hooks(session, session.tracker, pack, unpack, *map(kept_out_of_dynamo, called), Saved,
                             NativeKeptRecord, SwapRecord, Step, SETTLE_TICKS)
