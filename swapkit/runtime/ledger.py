"""The device-bytes ledger: saved bytes a step holds on the device, and their peak.

Note [The device-bytes ledger]
``peak_device_bytes`` (DESIGN §8) is the peak over a step of the saved bytes the session holds on
the device, swapped or kept. Bytes are added by the forward's saves and by prefetches, and taken
off by releases and by records dying, on whatever thread drops autograd's last handle (a CUDA
device thread, the cyclic collector inside any allocation). Each change is one ``deque.append`` of
the signed byte count (:attr:`ByteLedger.changed`): a C call, atomic under the GIL, with no lock and
no Python frame, which is most of what a kept save cost the forward thread beyond the save itself
(``swapkit.runtime.step`` Note [The cost of a save]). The appends form one total order of the
changes, the same order the lock used to give, so :meth:`ByteLedger.settle` replays them in order
and finds the exact running peak: it pops only the changes present when it starts, under its own
lock (two readers must not interleave), and a change appended meanwhile waits for the next settle.
A finalizer running inside ``settle`` (a record dying at one of its allocations) only appends, so
it never waits for that lock. Unsettled changes cost one deque slot each (8 bytes; a freed count is
a new ``int``): the step settles every :data:`SETTLE_TICKS` saves, so a forward that never meets a
backward (a graph dropped each iteration inside one ``with`` block) stays bounded too.
"""
from __future__ import annotations

import threading
from collections import deque
from itertools import accumulate

#: A step settles its ledger once every this many forward ticks (a power of two: ``tick & (SETTLE_TICKS - 1)``).
SETTLE_TICKS = 1 << 14


class ByteLedger:
    """Signed byte changes from any thread, replayed in order for the current total and its peak."""

    __slots__ = ("changed", "_changes", "_lock", "_now", "_peak")

    def __init__(self) -> None:
        self._changes: deque[int] = deque()
        #: ``changed(+nbytes)`` when bytes land on the device, ``changed(-nbytes)`` when they leave
        self.changed = self._changes.append
        self._lock = threading.Lock()
        self._now = self._peak = 0

    def settle(self) -> tuple[int, int]:
        """Replay the changes made so far: ``(bytes held now, peak so far)``."""
        with self._lock:
            changes = self._changes
            pending = [changes.popleft() for _ in range(len(changes))]
            if pending:
                totals = list(accumulate(pending, initial=self._now))
                self._now, self._peak = totals[-1], max(self._peak, max(totals))
            return self._now, self._peak
