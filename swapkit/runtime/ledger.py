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
backward (a graph dropped each iteration inside one ``with`` block) stays bounded too; a pipeline's
micro-step also settles its optimizer step's ledger then, and both when its forward ends.

Note [Settling survives interrupts]
``settle`` runs on the main thread, where a signal handler may raise (Ctrl-C, ``swapkit train``'s
``Interrupted``: ``swapkit.distributed.signals``) at any bytecode boundary. So no popped change is ever
held only by a local: the changes are popped by one C call (``list.extend`` of a ``starmap`` over
``popleft``, which runs no bytecode) into the carry list kept in the ledger's state, and the new
total, peak and an empty carry replace the state in one store. An interrupt before that store leaves
the carry for the next settle to replay; none loses or counts a change twice.
"""
from __future__ import annotations

import threading
from collections import deque
from itertools import accumulate, repeat, starmap

#: A step settles its ledger once every this many forward ticks (a power of two: ``tick & (SETTLE_TICKS - 1)``).
SETTLE_TICKS = 1 << 14


class ByteLedger:
    """Signed byte changes from any thread, replayed in order for the current total and its peak."""

    __slots__ = ("changed", "_changes", "_lock", "_state")

    def __init__(self) -> None:
        self._changes: deque[int] = deque()
        #: ``changed(+nbytes)`` when bytes land on the device, ``changed(-nbytes)`` when they leave
        self.changed = self._changes.append
        self._lock = threading.Lock()
        self._state: tuple[int, int, list[int]] = (0, 0, [])  # now, peak, changes popped but not yet replayed

    def settle(self) -> tuple[int, int]:
        """Replay the changes made so far: ``(bytes held now, peak so far)``."""
        with self._lock:
            now, peak, carry = self._state
            changes = self._changes
            carry.extend(starmap(changes.popleft, repeat((), len(changes))))  # Note [Settling survives interrupts]
            if carry:
                totals = list(accumulate(carry, initial=now))
                self._state = (totals[-1], max(peak, max(totals)), [])
            return self._state[:2]
