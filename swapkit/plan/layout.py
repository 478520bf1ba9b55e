"""Layer layout: which pipeline stage and interleave chunk every layer belongs to (DESIGN §3).

Notation: ``P = pipeline_stage``, ``V = pp_interleave_num``, ``L = num_layers``. Chunks are laid
out row-major, ``(v=0, s=0..P-1), (v=1, s=0..P-1), ...``, and layers fill them in that order.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from swapkit.config import fields as F
from swapkit.config.errors import Problems

Grid = tuple[tuple[int, ...], ...]
OFFSET_PATH = "model.model_config.offset"


@dataclass(frozen=True)
class Layout:
    """The per-chunk layer counts and each layer's (stage, chunk, position in chunk)."""

    num_layers: int
    pipeline_stage: int
    pp_interleave_num: int
    layer_list: Grid  # [V][P] layers per chunk
    layer_accu: Grid  # [V][P] running sum in row-major chunk order
    pp_ids: tuple[int, ...]
    interleave_ids: tuple[int, ...]
    positions: tuple[int, ...]  # index of the layer inside its chunk

    def stage_totals(self) -> tuple[int, ...]:
        """Layers per stage, summed over interleave chunks."""
        return tuple(sum(row[s] for row in self.layer_list) for s in range(self.pipeline_stage))

    def chunk_start(self, chunk: int, stage: int) -> int:
        return self.layer_accu[chunk][stage] - self.layer_list[chunk][stage]

    def chunk_layers(self, chunk: int, stage: int) -> range:
        return range(self.chunk_start(chunk, stage), self.layer_accu[chunk][stage])

    def zeros(self) -> Grid:
        return tuple((0,) * self.pipeline_stage for _ in range(self.pp_interleave_num))

    def log_lines(self) -> list[str]:
        """The four MindFormers layout lines."""
        return [
            f"num_layers per stage: {as_lists(self.layer_list)}",
            f"Accumulated num_layers per stage: {as_lists(self.layer_accu)}",
            f"Pipeline id list with start_stage: {list(self.pp_ids)}",
            f"Interleave id list: {list(self.interleave_ids)}",
        ]


def as_lists(grid: Grid) -> list[list[int]]:
    return [list(row) for row in grid]


def build_layout(
    num_layers: int, pipeline_stage: int, pp_interleave_num: int, offset: Any, problems: Problems
) -> Layout | None:
    """Compute the layout, recording problems (bad offset shape, sums, empty chunks) in ``problems``."""
    stages, chunks = pipeline_stage, pp_interleave_num
    grid = _broadcast_offset(offset, stages, chunks, problems)
    if not _enough_layers(num_layers, stages, chunks, grid, problems) or grid is None:
        return None
    if stages * chunks == 1:
        grid = ((0,),)  # MindFormers master ignores the offset without pipeline or interleave
    average = num_layers // (stages * chunks)
    layer_list = tuple(tuple(average + cell for cell in row) for row in grid)
    if not _check_layer_list(layer_list, num_layers, stages * chunks, problems):
        return None
    return _assign(num_layers, stages, chunks, layer_list)


def _broadcast_offset(offset: Any, stages: int, chunks: int, problems: Problems) -> Grid | None:
    shape = f"an integer, a list of {stages} integers (one per stage) or a [{chunks}][{stages}] grid"
    if F.is_int(offset):
        return tuple((offset,) * stages for _ in range(chunks))
    if isinstance(offset, (list, tuple)) and all(F.is_int(v) for v in offset):
        if len(offset) != stages:
            problems.bad(OFFSET_PATH, offset, shape, f"it has {len(offset)} entries but pipeline_stage is {stages}")
            return None
        return tuple(tuple(offset) for _ in range(chunks))
    rows_ok = isinstance(offset, (list, tuple)) and all(
        isinstance(row, (list, tuple)) and all(F.is_int(v) for v in row) for row in offset
    )
    if not rows_ok:
        problems.bad(OFFSET_PATH, offset, shape)
        return None
    if len(offset) != chunks or any(len(row) != stages for row in offset):
        found = f"{len(offset)} rows of lengths {[len(row) for row in offset]}"
        problems.bad(OFFSET_PATH, offset, shape, f"found {found}")
        return None
    return tuple(tuple(row) for row in offset)


def _enough_layers(num_layers: int, stages: int, chunks: int, grid: Grid | None, problems: Problems) -> bool:
    """Fewer layers than chunks, said before any offset arithmetic (whose sums would read ``add up to 0``).

    With offset 0 every chunk holds ``num_layers // (P*V)`` layers, so ``num_layers >= P*V``; whatever
    the offset only the first and the last chunk may be empty, so never fewer than ``P*V - 2``
    (``grid`` is ``None`` when the offset is malformed: then only that bound is known).
    """
    n_chunks = stages * chunks
    zero_offset = grid is not None and not any(cell for row in grid for cell in row)
    need, why = (n_chunks, "one layer per chunk with offset 0") if zero_offset else (
        n_chunks - 2, "whatever the offset, only the first and the last chunk may be empty")
    if n_chunks == 1 or num_layers >= need:
        return True
    cap = num_layers + n_chunks - need  # the most chunks num_layers can fill
    lower = (f"parallel_config.pipeline_stage to at most {cap // chunks}" if cap // chunks >= 1 else
             f"pipeline_stage x pp_interleave_num to at most {cap}")
    also = " (or lower model.model_config.pp_interleave_num)" if chunks > 1 else ""
    problems.bad("parallel_config.pipeline_stage", stages,
                 f"no more chunks (pipeline_stage x pp_interleave_num = {stages} x {chunks} = {n_chunks}) than "
                 f"model.model_config.num_layers ({num_layers}) can fill: {n_chunks} chunks need num_layers >= "
                 f"{need}, {why}", f"set {lower}{also}, or num_layers to at least {need}")
    return False


def _check_layer_list(layer_list: Grid, num_layers: int, n_chunks: int, problems: Problems) -> bool:
    flat = [cell for row in layer_list for cell in row]
    ok = True
    if any(cell < 0 for cell in flat):
        problems.bad(OFFSET_PATH, as_lists(layer_list), "no chunk with a negative number of layers",
                     "lower the negative offsets")
        ok = False
    if sum(flat) != num_layers:
        remainder = num_layers % n_chunks
        problems.add(OFFSET_PATH, f"layers per chunk {as_lists(layer_list)} add up to {sum(flat)}, not "
                     f"num_layers ({num_layers}); the offsets must add up to num_layers % "
                     f"(pipeline_stage * pp_interleave_num) = {remainder} after broadcasting")
        ok = False
    empty = [k for k, cell in enumerate(flat[1:-1], start=1) if cell == 0]
    if ok and empty:
        problems.add(OFFSET_PATH, f"layers per chunk {as_lists(layer_list)} leave chunk(s) {empty} (row-major) "
                     "empty between the first and the last chunk; every such chunk needs at least one layer")
        ok = False
    return ok


def _assign(num_layers: int, stages: int, chunks: int, layer_list: Grid) -> Layout:
    flat = [cell for row in layer_list for cell in row]
    accu_flat = list(accumulate(flat))
    layer_accu = tuple(tuple(accu_flat[v * stages:(v + 1) * stages]) for v in range(chunks))
    pp_ids, interleave_ids, positions = [], [], []
    k = 0
    for layer in range(num_layers):
        while accu_flat[k] <= layer:  # first chunk whose running sum exceeds the layer index
            k += 1
        pp_ids.append(k % stages)
        interleave_ids.append(k // stages)
        positions.append(layer - (accu_flat[k] - flat[k]))
    return Layout(num_layers, stages, chunks, layer_list, layer_accu, tuple(pp_ids), tuple(interleave_ids),
                  tuple(positions))
