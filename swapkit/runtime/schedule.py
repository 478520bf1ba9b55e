"""Tick-keyed queues for the swap schedule (DESIGN §4). Pure Python, no torch.

A swapped storage saved last at tick ``t`` with distance ``k`` has horizon ``t + k``:
- forward: it may be released once the clock reaches the horizon (and its copy finished);
- backward: its prefetch is issued when backward first unpacks a tick ``<=`` the horizon.

Note [Lazy re-keying]
A storage saved again later (a view, or Q/K/V reading one input) pushes its horizon out. Rather
than searching the heap, the queue stores the key it was pushed with and, when that key comes
due, compares it to the item's current key: if the item moved, it is pushed again.
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
        self._heap: list[tuple[int, int, T]] = []
        self._seq = itertools.count()  # ties pop in push order

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, item: T) -> None:
        heapq.heappush(self._heap, (self._sign * self._key(item), next(self._seq), item))

    def pop_due(self, bound: int) -> list[T] | tuple[()]:
        heap = self._heap
        limit = self._sign * bound
        if not heap or heap[0][0] > limit:
            return ()  # the common case on every tick: nothing due, nothing built
        due: list[T] = []
        key, sign, pop = self._key, self._sign, heapq.heappop
        while heap and heap[0][0] <= limit:
            pushed, _, item = pop(heap)
            if sign * key(item) != pushed:  # Note [Lazy re-keying]
                self.push(item)
            else:
                due.append(item)
        return due

    def drain(self) -> list[T]:
        items = [item for _, _, item in self._heap]
        self._heap.clear()
        return items
