"""The device-bytes ledger (swapkit.runtime.ledger Note [The device-bytes ledger]): exact totals and
peaks from changes made on any thread without a lock, and a bounded backlog."""
from __future__ import annotations

import gc
import signal
import threading
import time

import pytest

import torch
from torch import nn

import swapkit
from swapkit.runtime import step as step_module
from swapkit.runtime.ledger import ByteLedger


def test_settle_replays_the_changes_in_order_for_the_total_and_its_running_peak():
    ledger = ByteLedger()
    for delta in (5, 3, -4, 10, -14):
        ledger.changed(delta)
    assert ledger.settle() == (0, 14)  # 5, 8, 4, 14, 0
    ledger.changed(6)
    assert ledger.settle() == (6, 14)  # the peak carries over settles
    for delta in (20, -26):
        ledger.changed(delta)
    assert ledger.settle() == (0, 26)


def test_changes_from_many_threads_while_another_settles_are_neither_lost_nor_counted_twice():
    ledger, stop = ByteLedger(), threading.Event()
    per_thread, threads = 20_000, 4
    peaks: list[int] = []

    def add() -> None:
        for _ in range(per_thread):
            ledger.changed(3)
            ledger.changed(-1)

    def settle() -> None:
        while not stop.is_set():
            peaks.append(ledger.settle()[1])

    settler = threading.Thread(target=settle)
    settler.start()
    workers = [threading.Thread(target=add) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    stop.set()
    settler.join()
    now, peak = ledger.settle()
    assert now == 2 * per_thread * threads
    assert now + 1 <= peak <= now + threads  # at most one +3 per thread still waits for its -1
    assert peaks == sorted(peaks)  # a settle never loses what an earlier one saw


class _Interrupt(Exception):
    pass


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer")
def test_an_interrupt_inside_settle_neither_loses_nor_repeats_a_change():
    """Note [Settling survives interrupts]: a signal handler raising at any point of settle (Ctrl-C, swapkit
    train's Interrupted) leaves every change to be replayed once."""
    def interrupt(*_):
        raise _Interrupt

    ledger, per_round, rounds, interrupted = ByteLedger(), 50_000, 20, 0
    for _ in range(per_round):
        ledger.changed(1)
    start = time.perf_counter()
    ledger.settle()
    takes = time.perf_counter() - start  # how long one round's settle runs here
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        for turn in range(rounds):
            for _ in range(per_round):
                ledger.changed(1)
            settled = False
            try:  # armed inside the try: on a busy machine the alarm can come before settle is even called
                signal.setitimer(signal.ITIMER_REAL, takes * (turn + 1) / (rounds + 1))  # somewhere inside it
                ledger.settle()
                settled = True
                time.sleep(5)  # the timer ends this if settle finished first
            except _Interrupt:
                interrupted += not settled
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert ledger.settle() == ((rounds + 1) * per_round,) * 2
    assert interrupted > 0  # some settles were cut short (else this test tested nothing)


class _Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Identity()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(100):
            x = torch.sin(x)
        return x.sum()


def test_forwards_whose_graphs_are_dropped_inside_one_block_keep_the_backlog_bounded(monkeypatch):
    """No backward ever comes, so nothing reads the stats: the saves settle every SETTLE_TICKS ticks."""
    monkeypatch.setattr(step_module, "_SETTLE_MASK", 63)
    model = _Chain()
    session = swapkit.apply(model, {"model": {"model_config": {"num_layers": 1}}}, layers="layers")
    x = torch.randn(8, requires_grad=True)
    with session:
        for _ in range(30):
            model(x)  # 100 saves; the graph (and its records) dies at once
        gc.collect()
        step = session._step
        backlog = len(step.ledger._changes)
        # unsettled: the saves since the last settle (< 64) and the deaths of about one forward, not 6000
        assert step.clock == 3000 and backlog < 64 + 2 * 100, backlog
        assert step.device_bytes == 0  # every record died: the ledger is back to zero
        assert step.ledger.settle()[1] == 100 * 8 * 4  # one forward's saves at most, never two
    session.remove()


def test_kept_records_that_die_in_a_garbage_cycle_after_their_step_closed_still_leave_its_ledger():
    """A record's death takes its bytes off the ledger wherever it dies (swapkit.runtime.records Note [Record
    lifetime]), the cyclic collector included, after its step closed: handles sit in Python containers that way
    when a recipe holds its packed inputs (swapkit.runtime.recipes). A weak-reference callback the index dropped
    at close would never run there (the collector skips callbacks of refs inside the garbage)."""
    model = _Chain()
    session = swapkit.apply(model, {"model": {"model_config": {"num_layers": 1}}}, layers="layers")
    gc.disable()  # the cycle must die in the collect below, not in one the saves trigger
    try:
        with session:
            holder: list = [session._pack(torch.randn(8)) for _ in range(3)]
        first = session._step
        holder.append(holder)  # the handles, and only they, hold the records: now in a reference cycle
        with session:  # the next step: the first one closes (superseded) while its records live on
            pass
        assert first.closed and first.device_bytes == 3 * 8 * 4
        del holder
        gc.collect()
    finally:
        gc.enable()
    assert first.device_bytes == 0  # every kept record died inside the cycle and left the ledger
    session.remove()


def test_a_pipeline_stage_settles_its_micro_steps_and_their_optimizer_step_as_forwards_go_on():
    """Each forward of a stage is a micro-step with its own ledger, all feeding the optimizer step's: a forward
    settles them when it ends and when the next one opens, so dropped graphs leave no backlog behind."""
    from tests.test_pipeline import _forward, tiny_stage

    config, (chunk,) = tiny_stage(stage=1, runtime={"min_offload_bytes": 0})
    session = swapkit.apply(chunk, config, layers="layers", stage=1)
    x = torch.randn(2, 16, 32)
    with session:
        for _ in range(40):
            _forward(chunk, x)  # the graph dies at once
        gc.collect()
        group = session._group
        saved_per_forward = group.steps[0].stats.saved_bytes
        backlog = [len(step.ledger._changes) for step in group.steps]
        assert len(group.steps) == 40 and max(backlog[:-1]) == 0, backlog  # settled when the next forward opened
        assert len(group.ledger._changes) <= 2 * group.steps[-1].clock  # at most the last forward's changes
    stats = session.stats
    assert stats.peak_device_bytes == saved_per_forward and stats.resident_bytes == 0  # never two forwards at once
    session.remove()
