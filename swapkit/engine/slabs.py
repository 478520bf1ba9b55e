"""Best-fit sub-allocation of byte ranges inside slabs: pure offsets and sizes, no memory.

:class:`~swapkit.engine.pool.HostPool` asks the engine for a few large host slabs and hands out
aligned ranges of them; this module only decides *where* a range goes. Nothing here touches torch
or a device, so fragmentation, coalescing and growth are tested exhaustively on CPU.

Note [Slab sizes]
A request no free range fits opens a new slab. Its size decides the bytes held beyond the data:
the unused tail of every slab at the peak of a step. A request of ``exact_from`` (256 KiB) or more
gets a slab of exactly its own size (rounded to the allocator's page): the large activations that
make up nearly all swapped bytes then cost nothing extra, and in the next steps each of them finds
its slab again. The two kinds of slab are searched apart (a small request never takes a large
one's slab, which would make that one open a new slab next step). Smaller requests share slabs of an eighth of what
the pool holds, from ``smallest`` (1 MiB) up to ``largest`` (64 MiB), so their tails stay small next
to the total, and one registration serves many of them. Under ``max_host_bytes`` a shared slab that
would cross the cap is replaced by one of exactly the request, so the cap refuses only what cannot
fit at all. (Measured with ``benchmarks/host_pool.py``: doubling slabs instead held 1.39x the data
of the benchmark model's saved storages; this policy holds 1.01x, power-of-two blocks 1.22x.)
"""
from __future__ import annotations

from bisect import bisect_left, insort

SHARED, EXACT = 0, 1  # kinds of slab (Note [Slab sizes])
SMALLEST_SLAB = 1 << 20
LARGEST_SLAB = 64 << 20
EXACT_FROM = 256 << 10
ALIGNMENT = 512


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def slab_kind(need: int, exact_from: int = EXACT_FROM) -> int:
    """The kind of slab a request of ``need`` bytes is placed in (Note [Slab sizes])."""
    return EXACT if need >= exact_from else SHARED


def next_slab_bytes(need: int, held: int, cap: int | None, granule: int = 1, smallest: int = SMALLEST_SLAB,
                    largest: int = LARGEST_SLAB, exact_from: int = EXACT_FROM) -> int | None:
    """Size of the slab to open for a request of ``need`` bytes (Note [Slab sizes]).

    Args:
        need: bytes of the request no free range fits.
        held: bytes of every slab held now.
        cap: most bytes the slabs may hold together; ``None`` is unbounded.
        granule: the allocator's unit (a page for registered host memory); sizes are multiples of it.
        smallest: the smallest shared slab.
        largest: the largest shared slab.
        exact_from: requests of at least this many bytes get a slab of their own size.

    Returns:
        The slab size, or ``None`` when even a slab of exactly ``need`` bytes would cross ``cap``.
    """
    exact = round_up(need, granule)
    shared = round_up(min(largest, max(smallest, held // 8)), granule)
    size = exact if slab_kind(need, exact_from) == EXACT else max(exact, shared)
    if cap is None or held + size <= cap:
        return size
    return exact if held + exact <= cap else None


class Block:
    """One allocated range: ``nbytes`` asked for at ``offset`` of slab ``slab``; it occupies
    ``span`` bytes (``nbytes`` rounded up to the alignment, or to the slab's end)."""

    __slots__ = ("slab", "offset", "nbytes", "span")

    def __init__(self, slab: int, offset: int, nbytes: int, span: int) -> None:
        self.slab, self.offset, self.nbytes, self.span = slab, offset, nbytes, span

    def __repr__(self) -> str:
        return f"Block(slab={self.slab}, offset={self.offset}, nbytes={self.nbytes}, span={self.span})"


class SlabAllocator:
    """Best-fit free list of ranges over slabs, coalescing a freed range with its free neighbours.

    Every range starts at a multiple of ``alignment`` from its slab's start. Each slab has a kind
    (:data:`SHARED` or :data:`EXACT`) and a request is placed in a slab of the kind it names. Free
    ranges are kept sorted by (kind, length, slab, offset), so the best fit is one bisection and ties
    go to the oldest slab's lowest offset: the layout is a pure function of the sequence of calls.

    Args:
        alignment: a power of two; every range starts at a multiple of it.

    Example:
        >>> slabs = SlabAllocator(alignment=512)
        >>> slabs.add_slab(4096)
        0
        >>> a = slabs.allocate(100); (a.offset, a.span)
        (0, 512)
        >>> slabs.free(a); slabs.free_bytes
        4096
    """

    def __init__(self, alignment: int = ALIGNMENT) -> None:
        if alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"slab alignment: got {alignment!r}; expected a power of two")
        self.alignment = alignment
        self.sizes: dict[int, int] = {}  # slab id -> bytes
        self.kinds: dict[int, int] = {}  # slab id -> SHARED or EXACT
        self._next_id = 0
        self._by_length: list[tuple[int, int, int, int]] = []  # (kind, length, slab, start) of every free range
        self._ends: dict[tuple[int, int], int] = {}  # (slab, start) -> end of a free range
        self._starts: dict[tuple[int, int], int] = {}  # (slab, end) -> start of a free range
        self.held_bytes = 0
        self.free_bytes = 0

    def add_slab(self, nbytes: int, kind: int = SHARED) -> int:
        """Add a free slab of ``nbytes`` and ``kind``; returns its id."""
        if nbytes < 1:
            raise ValueError(f"slab size: got {nbytes!r}; expected at least 1 byte")
        slab, self._next_id = self._next_id, self._next_id + 1
        self.sizes[slab], self.kinds[slab] = nbytes, kind
        self.held_bytes += nbytes
        self._insert(slab, 0, nbytes)
        return slab

    def allocate(self, nbytes: int, kind: int = SHARED) -> Block | None:
        """The smallest free range of a ``kind`` slab that fits ``nbytes`` (>= 1), split; ``None`` if none fits."""
        if nbytes < 1:
            raise ValueError(f"slab allocation: got {nbytes!r} bytes; expected at least 1")
        i = bisect_left(self._by_length, (kind, nbytes, -1, -1))
        if i == len(self._by_length) or self._by_length[i][0] != kind:
            return None
        _, length, slab, start = self._by_length[i]
        self._remove(slab, start, start + length, i)
        cut = start + round_up(nbytes, self.alignment)
        if cut < start + length:
            self._insert(slab, cut, start + length)
        else:
            cut = start + length
        return Block(slab, start, nbytes, cut - start)

    def free(self, block: Block) -> None:
        """Give a range back, merged with the free ranges just before and after it."""
        slab, start, end = block.slab, block.offset, block.offset + block.span
        before = self._starts.get((slab, start))
        if before is not None:
            self._remove(slab, before, start)
            start = before
        after = self._ends.get((slab, end))
        if after is not None:
            self._remove(slab, end, after)
            end = after
        self._insert(slab, start, end)

    def is_free(self, slab: int) -> bool:
        """Is all of ``slab`` one free range?"""
        return self._ends.get((slab, 0)) == self.sizes[slab]

    def remove_slab(self, slab: int) -> int:
        """Forget a wholly free slab; returns its size."""
        if not self.is_free(slab):
            raise ValueError(f"slab {slab} still has allocated ranges")
        self._remove(slab, 0, self.sizes[slab])
        nbytes = self.sizes.pop(slab)
        del self.kinds[slab]
        self.held_bytes -= nbytes
        return nbytes

    def free_ranges(self) -> list[tuple[int, int, int]]:
        """Every free range as (slab, start, end), sorted: what the tests inspect."""
        return sorted((slab, start, start + length) for _, length, slab, start in self._by_length)

    def _insert(self, slab: int, start: int, end: int) -> None:
        insort(self._by_length, (self.kinds[slab], end - start, slab, start))
        self._ends[(slab, start)] = end
        self._starts[(slab, end)] = start
        self.free_bytes += end - start

    def _remove(self, slab: int, start: int, end: int, index: int | None = None) -> None:
        if index is None:
            index = bisect_left(self._by_length, (self.kinds[slab], end - start, slab, start))
        del self._by_length[index]
        del self._ends[(slab, start)], self._starts[(slab, end)]
        self.free_bytes -= end - start


class SlabLedger:
    """The placement decisions of :class:`~swapkit.engine.pool.HostPool`, on offsets only: what the
    budget planner replays to predict ``host_pool_bytes`` and the batches ``max_host_bytes`` refuses
    (``swapkit.plan.hostpool`` Note [The host pool in the replay]).

    It takes the same steps as the pool: a freed range is kept whole for its exact size (Note [Same-size
    reuse] in ``swapkit.engine.pool``); a request no kept range serves merges them back and takes the
    best fit in a slab of its kind, else opens a slab sized by :func:`next_slab_bytes`, else (at the cap)
    takes room in a slab of the other kind. Unlike the pool it has no fences: a range given back is free
    at once (the replay gives ranges back only where their copies have finished).

    Args:
        max_bytes: ``runtime.max_host_bytes``; ``None`` is unbounded.
        granule: the engine's ``host_granule`` (slab sizes are multiples of it).
        alignment: as the pool's.

    Example:
        >>> ledger = SlabLedger(max_bytes=4096)
        >>> ledger.acquire(3000) is not None, ledger.acquire(3000), ledger.held_bytes
        (True, None, 3000)
    """

    def __init__(self, max_bytes: int | None = None, granule: int = 1, alignment: int = ALIGNMENT) -> None:
        self.max_bytes, self.granule = max_bytes, granule
        self.slabs = SlabAllocator(alignment)
        self._kept: dict[int, list[Block]] = {}

    @property
    def held_bytes(self) -> int:
        """Bytes of every slab opened (the pool's ``total_bytes``)."""
        return self.slabs.held_bytes

    @property
    def free_bytes(self) -> int:
        """Bytes in free or kept ranges (the pool's ``free_bytes``)."""
        return self.slabs.free_bytes + sum(block.span for kept in self._kept.values() for block in kept)

    def acquire(self, nbytes: int) -> Block | None:
        """The range a request of ``nbytes`` (>= 1) gets, or ``None`` where the pool refuses it."""
        kept = self._kept.get(nbytes)
        if kept:
            return kept.pop()
        kind = slab_kind(nbytes)
        self._merge_kept()
        return self.slabs.allocate(nbytes, kind) or self._grow(nbytes, kind) or self.slabs.allocate(nbytes, 1 - kind)

    def release(self, block: Block) -> None:
        """Give a range back (kept whole for its size, as the pool keeps it)."""
        self._kept.setdefault(block.nbytes, []).append(block)

    def _merge_kept(self) -> None:
        for kept in self._kept.values():
            for block in kept:
                self.slabs.free(block)
        self._kept.clear()

    def _grow(self, nbytes: int, kind: int) -> Block | None:
        size = next_slab_bytes(nbytes, self.slabs.held_bytes, self.max_bytes, self.granule)
        if size is None:
            return None
        self.slabs.add_slab(size, kind)
        return self.slabs.allocate(nbytes, kind)
