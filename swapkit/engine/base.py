"""The copy-engine protocol: what the swap session needs from a device<->host copier.

The session owns the schedule; an engine only copies bytes and tells when a copy is done. Two
implementations: :class:`~swapkit.engine.cuda.CudaCopyEngine` (side stream, events, pinned
memory) and :class:`~swapkit.engine.thread.ThreadCopyEngine` (a worker thread with injectable
latency and bandwidth, so every scheduling path runs in CPU-only CI).
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol, Tuple

import torch


class StorageChangedError(RuntimeError):
    """A storage queued for an asynchronous copy was resized or freed by another component first."""


def storage_changed(expected_bytes: int, now_bytes: int, where: str = "") -> StorageChangedError:
    """The error for a copy source whose storage changed (``swapkit.runtime.records``
    Note [Storages another component may resize])."""
    place = f" saved in {where}" if where else ""
    return StorageChangedError(
        f"swapkit: the storage of a swapped tensor{place} was resized or freed by another component while its "
        f"copy to host was queued ({expected_bytes} bytes when saved, {now_bytes} now); its host copy cannot be "
        "trusted. If that storage is a parameter (FSDP, a custom sharding wrapper), save the parameter itself or a "
        "view of it so swapkit recognises it; otherwise keep the scope that saves it out of swap_config.")


def check_source(src: torch.Tensor, nbytes: int, data_ptr: int) -> None:
    """Raise if the storage under the copy source ``src`` no longer has the size and address it was queued with."""
    now = src.untyped_storage().nbytes()
    if now != nbytes or src.data_ptr() != data_ptr:
        raise storage_changed(nbytes, now)


#: One storage of a coalesced batch: ``(storage, offset of its slot in the region, its bytes and
#: address when saved)`` (``swapkit.runtime.batch`` Note [Coalesced copies]).
Source = Tuple[torch.UntypedStorage, int, int, int]


def check_storages(sources: list[Source], where: str = "") -> None:
    """Raise if a source storage no longer has the size and address it was saved with (``swapkit.runtime.records``
    Note [Storages another component may resize])."""
    for storage, _, nbytes, data_ptr in sources:
        if storage.nbytes() != nbytes or storage.data_ptr() != data_ptr:
            raise storage_changed(nbytes, storage.nbytes(), where)


def storage_bytes(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A flat ``uint8`` view of a whole storage (``set_``'s one-argument form: its parsing is the cheap one)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def region_pairs(region: torch.Tensor, sources: list[Source],
                 device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(flat uint8 view of each whole source storage on ``device``, its slot of the flat host region)``:
    the slots cut by one ``split_with_sizes`` (data and padding alternate), the views as :func:`storage_bytes`
    builds them, but on empty tensors made by ``Tensor.new`` of one (no argument parsing per storage)."""
    sizes, ends = [], [offset for _, offset, _, _ in sources[1:]] + [region.numel()]
    for (_, offset, nbytes, _), end in zip(sources, ends):
        sizes += [nbytes, end - offset - nbytes]
    new = torch.empty(0, dtype=torch.uint8, device=device).new
    return [(new().set_(storage), slot) for (storage, _, _, _), slot
            in zip(sources, region.split_with_sizes(sizes)[::2])]


class Timing(Protocol):
    """How long compute waited for a copy; may be resolved lazily (CUDA events)."""

    def seconds(self) -> float: ...


class Waited:
    """A timing measured on the host."""

    __slots__ = ("_seconds",)

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds

    def seconds(self) -> float:
        return self._seconds


class Fence(Protocol):
    """A point in an engine's copy queue: passed once every copy queued before it has finished
    (``swapkit.engine.pool`` Note [Slab lifetimes])."""

    def passed(self) -> bool: ...

    def wait(self) -> None: ...


class CopyEngine(Protocol):
    """Asynchronous device<->host copies of flat ``uint8`` buffers."""

    name: str
    device: torch.device
    #: host slabs are multiples of this many bytes (a page when they are registered with CUDA)
    host_granule: int
    #: a due storage may drop its device copy as soon as its copy to host is *queued*: the device
    #: allocator orders the memory's reuse after the copy (``swapkit.runtime.swap_schedule`` Note [Stream-ordered
    #: release]); False: only once the copy has finished (``ready``)
    stream_ordered_release: bool
    #: a copy ``ready`` reported finished is usable as it is: ``wait`` on it would do nothing (thread engine);
    #: False where a reader must still join it (CUDA: the reading stream waits on the copy's event)
    usable_when_ready: bool

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """Allocate a flat ``uint8`` host slab of ``nbytes`` for the pool (pinned on CUDA)."""

    def fence(self) -> Fence | None:
        """A fence after every copy queued so far; ``None`` when none can still be running."""

    def offload(self, src: torch.Tensor, dst: torch.Tensor) -> Any:
        """Start copying device bytes ``src`` into host buffer ``dst``; returns a copy handle."""

    def offload_many(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], producer: Any = None) -> Any:
        """Copy every ``(src, dst)`` pair as one job with one copy handle (a coalesced batch), after
        the work ``producer`` (what :meth:`producer` returned when the sources were saved; ``None``:
        the caller's current stream) has queued so far."""

    def offload_storages(self, region: torch.Tensor, sources: list[Source], producer: Any = None,
                         where: str = "") -> Any:
        """Copy each whole source storage into its slot of the flat host ``region`` as one job with one
        copy handle, after the work ``producer`` has queued so far (as :meth:`offload_many`). The engine
        builds the flat views (:func:`region_pairs`), on its own thread where it has one, so the
        forward thread pays nothing per storage for them (``swapkit.runtime.step`` Note [The cost of a
        save]). ``where`` (the scope's label) names the scope in a storage-changed error."""

    def producer(self) -> Any:
        """Where the caller's tensors are being produced now (the current CUDA stream); ``None`` when a
        saved tensor is always complete when saved (the thread engine). ``swapkit.runtime.batch``
        Note [A batch has one producer]"""

    def reading_sources(self) -> AbstractContextManager:
        """A context in which work reads the source of a queued copy in order with it (the side stream
        on CUDA; nothing on the thread engine, whose releases wait for the copy)."""

    def prefetch(self, src: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Allocate a device buffer and start copying host bytes ``src`` into it."""

    def ready(self, copy: Any) -> bool:
        """Has the copy finished? Never blocks."""

    def wait(self, copy: Any, timed: bool = False) -> Timing:
        """Make the current compute stream (or thread) wait for the copy before using its data;
        ``timed`` asks for the waiting time (late fetches only: timing events cost on CUDA)."""

    def synchronize(self) -> None:
        """Block until every queued copy has finished."""

    def close(self) -> None:
        """Finish queued copies and release the engine's resources."""
