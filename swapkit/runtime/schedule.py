"""Tick-keyed queues for the swap schedule (DESIGN §4). Pure Python, no torch.

A swapped storage saved last at tick ``t`` with distance ``k`` has horizon ``t + k``:
- forward: it may be released once the clock reaches the horizon (and its copy finished);
- backward: its prefetch is issued when backward first unpacks a tick ``<=`` the horizon.

Note [Lazy re-keying]
A storage saved again later (a view, or Q/K/V reading one input) pushes its horizon out. Rather
than searching the queue, it stores the key it was pushed with and, when that key comes
due, compares it to the item's current key: if the item moved, it is pushed again.

Note [Heap entries the collector does not see]
A queue holds a swap record from its release until backward, across the whole forward. An entry
``(key, seq, record)`` would be one more object the cyclic garbage collector tracks per swapped
storage for that long, and objects that old drive its full collections (``swapkit.runtime.step``
Note [The cost of a save]). So the queue's entries are ``(key, seq)`` pairs of integers, which the
collector untracks at its first look, and the items sit in one dict by ``seq``.

Note [In-order pushes]
The step pushes in tick order almost always: a record enters the release queue at its first save
(horizon ``t + k``, rising with ``t`` for one distance ``k``) and the prefetch queue at its release,
which follows horizon order. So the queue keeps a *run*: a deque of entries in push order that is
also their pop order read from one end, with no heap sift. An ascending queue pops its run from the
left, and a push joins it when it pops after every entry there (a key no lower than the last one);
a descending queue pops from the right, the record released last (the highest horizon) first, and a
push joins when it pops before every entry there (a strictly higher key: a later push loses ties).
Only the other pushes (several distances, re-keyed items, a later save of a released storage) go on
a heap. ``pop_due`` takes the smaller of the two fronts each time, comparing whole ``(key, seq)``
entries, so items pop exactly in key, then push order, wherever each entry was kept.

Note [The prefetch queue holds its records weakly]
A record enters the prefetch queue at its release and leaves it when backward comes due for it. Held
there strongly, a record outlived its graph: in a ``with session:`` block where one forward's graph is
dropped (a loss computed and discarded, an evaluation forward with grad enabled) and another's backward
runs, the dropped graph's records kept their host buffers until that backward, which then copied them
back to the device for nobody and counted them in ``prefetched_bytes``. The prefetch queue (``weak=True``)
therefore keeps weak references: a record lives exactly as long as its graph's handles
(``swapkit.runtime.records`` Note [Record lifetime]), and ``pop_due`` passes over the dead ones. The
weak reference is the one the step's storage index already holds (CPython hands out one plain weak
reference per object), so a release allocates nothing more; ``len`` still counts the dead entries until
they come due, as the strong queue counted their records.
"""
from __future__ import annotations

import heapq
import weakref
from collections import deque
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class TickQueue(Generic[T]):
    """Items keyed by a tick; ``pop_due`` returns those whose (current) key is due, in key order and,
    for equal keys, in push order.

    Args:
        key: reads an item's current tick.
        descending: due means ``key >= bound`` (backward walks ticks downwards) instead of ``<=``.
        weak: hold the items by weak reference; one that died is never returned (Note [The prefetch
            queue holds its records weakly]).
    """

    def __init__(self, key: Callable[[T], int], descending: bool = False, weak: bool = False) -> None:
        self._key = key
        self._weak = weak
        self._sign = -1 if descending else 1
        self._descending = descending
        self._run: deque[tuple[int, int]] = deque()  # (signed key when pushed, seq): Note [In-order pushes]
        self._front = -1 if descending else 0  # the end of the run that pops first
        self._pop_run = self._run.pop if descending else self._run.popleft
        self._heap: list[tuple[int, int]] = []  # the entries pushed out of order
        self._items: dict[int, T] = {}  # seq -> item (Note [Heap entries the collector does not see])
        self._pushes = 0  # the next seq: ties pop in push order

    def __len__(self) -> int:
        return len(self._items)

    def push(self, item: T) -> None:
        seq = self._pushes
        self._pushes = seq + 1
        self._items[seq] = weakref.ref(item) if self._weak else item
        entry, run = (self._sign * self._key(item), seq), self._run
        if not run or (entry < run[-1] if self._descending else entry > run[-1]):  # Note [In-order pushes]
            run.append(entry)
        else:
            heapq.heappush(self._heap, entry)

    def pop_due(self, bound: int) -> list[T] | tuple[()]:
        run, heap, front = self._run, self._heap, self._front
        limit = self._sign * bound
        if not (run and run[front][0] <= limit or heap and heap[0][0] <= limit):
            return ()  # the common case on every tick: nothing due, nothing built
        due: list[T] = []
        key, sign, items = self._key, self._sign, self._items
        while True:
            if run and run[front][0] <= limit and not (heap and heap[0] < run[front]):
                pushed, seq = self._pop_run()
            elif heap and heap[0][0] <= limit:
                pushed, seq = heapq.heappop(heap)
            else:
                return due
            item = items[seq]
            del items[seq]
            if self._weak and (item := item()) is None:
                continue  # its graph was dropped (Note [The prefetch queue holds its records weakly])
            if sign * key(item) != pushed:  # Note [Lazy re-keying]
                self.push(item)
            else:
                due.append(item)

    def drain(self) -> list[T]:
        """Every item still queued, in push order; the queue is left empty."""
        items = list(self._items.values())
        self._run.clear()
        self._heap.clear()
        self._items.clear()
        return [item for item in (ref() for ref in items) if item is not None] if self._weak else items
