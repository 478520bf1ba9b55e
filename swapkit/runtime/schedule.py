"""Tick-keyed queues for the swap schedule (DESIGN §4). Pure Python, no torch.

A swapped storage saved last at tick ``t`` with distance ``k`` has horizon ``t + k``:
- forward: it may be released once the clock reaches the horizon (and its copy finished);
- backward: its prefetch is issued when backward first unpacks a tick ``<=`` the horizon.

Note [Lazy re-keying]
A storage saved again later (a view, or Q/K/V reading one input) pushes its horizon out. Rather
than searching the heap, the queue stores the key it was pushed with and, when that key comes
due, compares it to the item's current key: if the item moved, it is pushed again.

Note [Heap entries the collector does not see]
A queue holds a swap record from its release until backward, across the whole forward. A heap
entry ``(key, seq, record)`` would be one more object the cyclic garbage collector tracks per
swapped storage for that long, and objects that old drive its full collections
(``swapkit.runtime.step`` Note [The cost of a save]). So the heap holds ``(key, seq)`` pairs of
integers, which the collector untracks at its first look, and the items sit in one dict by ``seq``.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class TickQueue(Generic[T]):
    """Items keyed by a tick; ``pop_due`` returns those whose (current) key is due.

    Args:
        key: reads an item's current tick.
        descending: due means ``key >= bound`` (backward walks ticks downwards) instead of ``<=``.
    """

    def __init__(self, key: Callable[[T], int], descending: bool = False) -> None:
        self._key = key
        self._sign = -1 if descending else 1
        self._heap: list[tuple[int, int]] = []  # (signed key when pushed, seq)
        self._items: dict[int, T] = {}  # seq -> item (Note [Heap entries the collector does not see])
        self._seq = itertools.count()  # ties pop in push order

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, item: T) -> None:
        seq = next(self._seq)
        self._items[seq] = item
        heapq.heappush(self._heap, (self._sign * self._key(item), seq))

    def pop_due(self, bound: int) -> list[T] | tuple[()]:
        heap = self._heap
        limit = self._sign * bound
        if not heap or heap[0][0] > limit:
            return ()  # the common case on every tick: nothing due, nothing built
        due: list[T] = []
        key, sign, pop, items = self._key, self._sign, heapq.heappop, self._items
        while heap and heap[0][0] <= limit:
            pushed, seq = pop(heap)
            item = items.pop(seq)
            if sign * key(item) != pushed:  # Note [Lazy re-keying]
                self.push(item)
            else:
                due.append(item)
        return due

    def drain(self) -> list[T]:
        items = list(self._items.values())
        self._heap.clear()
        self._items.clear()
        return items
