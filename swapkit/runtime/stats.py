"""What a swap session did in one step: bytes moved, prefetch timing, device memory held."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SwapStats:
    """Counters for one step (one forward and its backward).

    Memory figures are the session's own accounting of *device-resident saved bytes*: the
    storages it holds for backward, swapped or kept (parameters and buffers excluded). On CPU the
    "device" and the host share RAM, so these are accounting figures, not the process's RSS.
    Activations a checkpoint region re-materializes during backward are not saved tensors of the
    session and are not counted; ``torch.cuda.max_memory_allocated`` sees them.
    """

    step: int = 0
    ticks: int = 0  # tensors saved in forward (the forward clock)
    saved_bytes: int = 0  # distinct activation storages saved on the device
    offloaded_tensors: int = 0  # storages copied device -> host
    offloaded_bytes: int = 0
    released_bytes: int = 0  # device bytes dropped after their copy finished
    offload_copies: int = 0  # device -> host copy jobs: one per coalesced batch (runtime.offload_batch_bytes)
    prefetched_tensors: int = 0  # storages copied host -> device in backward
    prefetched_bytes: int = 0
    prefetch_copies: int = 0  # host -> device copy jobs: one per batch brought back
    tail_bytes: int = 0  # offloaded but still on the device when backward began (used as is)
    prefetch_lead_ticks: int = 0  # sum over prefetches of (issue tick - first-use tick)
    recomputed_output_bytes: int = 0  # saves of selected ops' outputs replaced by a recipe (not held)
    output_recomputes: int = 0  # recipes run in backward to rebuild those outputs
    verified_tensors: int = 0  # restored storages whose checksum was checked (runtime.verify)
    late_fetches: int = 0  # unpacks that had to wait for (or issue) their copy
    wait_seconds: float = 0.0  # time those unpacks waited
    peak_device_bytes: int = 0
    resident_bytes: int = 0  # device-resident saved bytes still held when the stats were read
    host_pool_bytes: int = 0  # pinned/pooled host memory owned by the session
    host_allocations: int = 0  # new host buffers allocated during this step
    skipped: dict[str, int] = field(default_factory=dict)  # swap candidates kept, reason -> bytes
    offloaded_by_scope: dict[str, int] = field(default_factory=dict)  # "layer 0: attention" -> bytes
    # checkpoint regions run in forward, to be recomputed in backward: "layer 0", "layer 1: mlp", "layers 0-1" -> calls
    recomputed_by_scope: dict[str, int] = field(default_factory=dict)
    aborted: bool = False  # the step ended with an exception
    # swap scopes entered in forward under which no tensor reached the session ("layer 1: self_attn"):
    # something else checkpoints them (swapkit.runtime.overrides Note [Swaps nobody reports])
    unused_swaps: list[str] = field(default_factory=list)
    micro_steps: int = 0  # forwards counted here: 1 per step; per chunk and micro-batch in a pipeline stage

    @property
    def mean_prefetch_lead(self) -> float:
        """How many ticks ahead of first use, on average, prefetches were issued (0: on demand)."""
        return self.prefetch_lead_ticks / self.prefetched_tensors if self.prefetched_tensors else 0.0

    @property
    def memory_saved_bytes(self) -> int:
        """Saved bytes that did not sit on the device at the peak, relative to keeping all."""
        return max(self.saved_bytes - self.peak_device_bytes, 0)

    def __str__(self) -> str:
        """A small table in MiB (``print(session.stats)``); see the README for every field."""
        return format_stats(self)


MIB = float(1 << 20)


def format_stats(stats: SwapStats) -> str:
    """``SwapStats`` as aligned ``name  value`` rows, bytes in MiB."""
    rows = [
        ("saved (device-resident, peak)", _peak(stats)),
        ("offloaded", f"{_mib(stats.offloaded_bytes)} in {stats.offloaded_tensors} tensors"),
        ("released after copy", _mib(stats.released_bytes)),
        ("prefetched", f"{_mib(stats.prefetched_bytes)} in {stats.prefetched_tensors} tensors"),
        ("tail (used in place)", _mib(stats.tail_bytes)),
        ("late fetches", f"{stats.late_fetches} (waited {stats.wait_seconds * 1e3:.2f} ms)"),
        ("mean prefetch lead", f"{stats.mean_prefetch_lead:.1f} ticks of {stats.ticks}"),
        ("recomputed outputs", f"{_mib(stats.recomputed_output_bytes)} ({stats.output_recomputes} recipes)"),
        ("host pool", f"{_mib(stats.host_pool_bytes)} ({stats.host_allocations} new buffers)"),
    ]
    rows += [(f"kept: {reason}", _mib(size)) for reason, size in sorted(stats.skipped.items())]
    rows += _optional_rows(stats)
    width = max(len(name) for name, _ in rows)
    title = (f"swapkit step {stats.step}{' (aborted)' if stats.aborted else ''}: session accounting, not RSS or "
             f"the allocator's totals")
    return "\n".join([title] + [f"  {name.ljust(width)}  {value}" for name, value in rows])


def _optional_rows(stats: SwapStats) -> list[tuple[str, str]]:
    """Rows shown only when they say something: a swap that moved nothing above all."""
    rows = []
    if stats.offloaded_by_scope:
        scopes = sorted(stats.offloaded_by_scope.items(), key=lambda item: -item[1])
        shown = ", ".join(f"{scope} {_mib(size)}" for scope, size in scopes[:3])
        rows.append(("offloaded by scope", shown + (f" (+{len(scopes) - 3} more)" if len(scopes) > 3 else "")))
    if stats.recomputed_by_scope:
        regions = sorted(stats.recomputed_by_scope)
        shown = ", ".join(regions[:3]) + (f" (+{len(regions) - 3} more)" if len(regions) > 3 else "")
        rows.append(("recomputed regions", f"{sum(stats.recomputed_by_scope.values())}: {shown}"))
    if stats.unused_swaps:
        rows.append(("UNUSED swaps (no effect)", ", ".join(stats.unused_swaps) + " (see the warning)"))
    if stats.resident_bytes:
        rows.append(("still held", _mib(stats.resident_bytes)))
    if stats.verified_tensors:
        rows.append(("verified (checksums)", f"{stats.verified_tensors} tensors"))
    if stats.micro_steps > 1:
        rows.append(("micro-steps", str(stats.micro_steps)))
    return rows


def _peak(stats: SwapStats) -> str:
    """The peak beside what forward saved. Outputs that select-recompute recipes rebuild in backward are
    resident at the peak but were never held in forward (``saved_bytes`` leaves them out), so the peak
    can exceed the saved bytes; the row says why instead of reading "2.77 MiB of 2.58 MiB"."""
    peak, saved = _mib(stats.peak_device_bytes), _mib(stats.saved_bytes)
    if stats.peak_device_bytes <= stats.saved_bytes:
        return f"{peak} of {saved} saved"
    return f"{peak}: {saved} saved in forward plus outputs recomputed in backward"


def _mib(size: int) -> str:
    return f"{size / MIB:.2f} MiB"
