"""Pure pieces of the runtime: the tick queues, the host pool, the thread engine, the scope stack."""
from __future__ import annotations

import random
import time
from types import SimpleNamespace

import pytest
import torch

from swapkit.config.types import EngineOptions, RuntimeConfig
from swapkit.engine import HostPool, ThreadCopyEngine, make_engine, unused_engine_options
from swapkit.runtime.schedule import TickQueue


def test_tick_queue_ascending_pops_due_in_key_then_push_order():
    items = [SimpleNamespace(name=n, key=k) for n, k in [("a", 5), ("b", 2), ("c", 5), ("d", 9)]]
    queue = TickQueue(lambda item: item.key)
    for item in items:
        queue.push(item)
    assert [i.name for i in queue.pop_due(1)] == []
    assert [i.name for i in queue.pop_due(5)] == ["b", "a", "c"]
    assert len(queue) == 1 and [i.name for i in queue.drain()] == ["d"]


def test_tick_queue_descending_for_backward():
    items = [SimpleNamespace(name=n, key=k) for n, k in [("a", 3), ("b", 8), ("c", 5)]]
    queue = TickQueue(lambda item: item.key, descending=True)
    for item in items:
        queue.push(item)
    assert [i.name for i in queue.pop_due(6)] == ["b"]
    assert [i.name for i in queue.pop_due(0)] == ["c", "a"]


def test_tick_queue_lazily_rekeys_items_whose_key_moved():
    item = SimpleNamespace(key=2)
    queue = TickQueue(lambda i: i.key)
    queue.push(item)
    item.key = 6  # saved again later: its horizon moved out
    assert queue.pop_due(3) == [] and len(queue) == 1
    assert queue.pop_due(6) == [item]


def test_tick_queue_mixes_in_order_and_out_of_order_pushes_in_key_then_push_order():
    """swapkit.runtime.schedule Note [In-order pushes]: entries kept in the run or on the heap pop as one
    order, equal keys in push order wherever each was kept."""
    pushes = [("a", 1), ("b", 3), ("c", 3), ("d", 2), ("e", 3), ("f", 5), ("g", 2), ("h", 5), ("i", 4)]
    up, down = TickQueue(lambda i: i.key), TickQueue(lambda i: i.key, descending=True)
    for name, key in pushes:
        up.push(SimpleNamespace(name=name, key=key))
        down.push(SimpleNamespace(name=name, key=key))
    assert [i.name for i in up.pop_due(2)] == ["a", "d", "g"]
    assert [i.name for i in up.pop_due(4)] == ["b", "c", "e", "i"]
    up.push(SimpleNamespace(name="j", key=5))  # behind the run's last 5: in order again
    up.push(SimpleNamespace(name="k", key=0))  # long due: popped first
    assert [i.name for i in up.pop_due(9)] == ["k", "f", "h", "j"] and len(up) == 0
    assert [i.name for i in down.pop_due(3)] == ["f", "h", "i", "b", "c", "e"]
    assert [i.name for i in down.pop_due(0)] == ["d", "g", "a"] and len(down) == 0


def test_tick_queue_descending_in_release_order_and_rekeyed():
    """The prefetch queue's common case, pushed with rising keys and popped from the highest down; an
    item whose key moved is pushed again when its old key comes due, and pops at once if due."""
    items = [SimpleNamespace(name=n, key=k) for n, k in [("a", 1), ("b", 2), ("c", 4), ("d", 6)]]
    queue = TickQueue(lambda i: i.key, descending=True)
    for item in items:
        queue.push(item)
    items[0].key = 3
    assert [i.name for i in queue.pop_due(5)] == ["d"]
    assert [i.name for i in queue.pop_due(2)] == ["c", "b"]  # a still sits at the key it was pushed with
    assert len(queue) == 1 and [i.name for i in queue.pop_due(1)] == ["a"]


class ReferenceQueue:
    """What a heap of ``(key when pushed, push order)`` pops, with lazy re-keying (a moved item is pushed
    again, with a new push order): the tick queue before its in-order run, as a sorted list."""

    def __init__(self, descending: bool) -> None:
        self.sign, self.entries, self.pushes = (-1 if descending else 1), [], 0

    def push(self, item) -> None:
        self.entries.append((self.sign * item.key, self.pushes, item))
        self.pushes += 1

    def pop_due(self, bound: int) -> list:
        due = []
        while self.entries:
            self.entries.sort(key=lambda e: e[:2])
            pushed, _, item = self.entries[0]
            if pushed > self.sign * bound:
                break
            self.entries.pop(0)
            if self.sign * item.key != pushed:
                self.push(item)
            else:
                due.append(item.name)
        return due


def test_tick_queue_pops_as_a_sorted_reference_under_random_pushes_and_rekeys():
    rng = random.Random(0)
    for descending in (False, True):
        sign = -1 if descending else 1
        queue, reference, items, clock = TickQueue(lambda i: i.key, descending), ReferenceQueue(descending), [], 0
        for _ in range(600):
            roll = rng.random()
            if roll < 0.55:  # mostly in tick order, with ties, sometimes behind
                ahead = rng.choice([0, 0, 1, 3]) if rng.random() < 0.8 else -rng.randint(1, 6)
                item = SimpleNamespace(key=(clock + ahead) * sign, name=len(items))
                items.append(item)
                queue.push(item)
                reference.push(item)
            elif roll < 0.7 and items:  # a later save moves an item's key (either way: the queue does not care)
                rng.choice(items).key += rng.choice([-2, -1, 1, 2, 4]) * sign
            else:
                clock += 1
                assert [i.name for i in queue.pop_due(clock * sign)] == reference.pop_due(clock * sign)
                assert len(queue) == len(reference.entries)
        in_push_order = sorted(reference.entries, key=lambda e: e[1])
        assert [i.name for i in queue.drain()] == [item.name for _, _, item in in_push_order]
        assert len(queue) == 0 and queue.pop_due(clock * sign) == ()


def test_host_pool_reuses_buffers_by_size_and_respects_the_cap():
    made = []
    pool = HostPool(lambda n: made.append(n) or torch.empty(n, dtype=torch.uint8), max_bytes=300)
    a, b = pool.acquire(100), pool.acquire(150)
    assert made == [100, 150] and pool.total_bytes == 250 and pool.allocations == 2
    assert pool.acquire(100) is None  # 350 > cap
    pool.release(a)
    assert pool.acquire(100) is a and made == [100, 150]  # reused, not allocated
    pool.release(a), pool.release(b)
    assert pool.free_bytes == 250
    pool.clear()
    assert pool.total_bytes == 0 and pool.free_bytes == 0


def test_thread_engine_copies_round_trip_in_fifo_order():
    engine = ThreadCopyEngine("cpu")
    src = torch.arange(64, dtype=torch.uint8)
    host = engine.host_buffer(64)
    copy = engine.offload(src, host)
    back, fetched = engine.prefetch(host)  # queued after the offload: sees its bytes
    engine.wait(fetched)
    assert engine.ready(copy) and torch.equal(back, src)
    engine.close()


def test_thread_engine_injects_latency_and_throttles_bandwidth():
    engine = ThreadCopyEngine("cpu", latency_s=0.02, bandwidth_gbps=0.001)  # 1 MB/s
    src = torch.zeros(10_000, dtype=torch.uint8)  # 10 KB -> 10 ms at 1 MB/s
    start = time.perf_counter()
    copy = engine.offload(src, engine.host_buffer(src.numel()))
    done_early = engine.ready(copy)
    # a copy is never done before its emulated 30 ms (checked against the clock: a loaded machine may
    # suspend this thread for that long between the two lines above)
    assert not done_early or time.perf_counter() - start >= 0.03
    waited = engine.wait(copy).seconds()
    assert time.perf_counter() - start >= 0.03 and waited > 0
    engine.close()


def test_thread_engine_reports_copy_errors_to_the_waiter():
    engine = ThreadCopyEngine("cpu")
    copy = engine.offload(torch.zeros(4, dtype=torch.uint8), torch.empty(3, dtype=torch.uint8))
    with pytest.raises(RuntimeError):
        engine.wait(copy)
    engine.synchronize()  # the worker survives a failed copy, and the error was already reported
    engine.close()


def test_make_engine_picks_by_device_and_refuses_cuda_for_cpu_models():
    runtime = RuntimeConfig(engine_options=EngineOptions(latency_s=0.5))
    engine = make_engine(runtime, torch.device("cpu"))
    assert engine.name == "thread" and engine.latency_s == 0.5
    with pytest.raises(ValueError, match="runtime.engine is 'cuda' but the model is on cpu"):
        make_engine(RuntimeConfig(engine="cuda"), torch.device("cpu"))


def test_link_emulation_options_are_warned_about_where_the_cuda_engine_ignores_them():
    options = EngineOptions(latency_s=0.002, bandwidth_gbps=8.0)
    assert unused_engine_options(options, "thread") == []
    assert unused_engine_options(EngineOptions(), "cuda") == []
    assert unused_engine_options(options, "cuda") == [
        f"runtime.engine_options.{name}: {value} has no effect with the CUDA engine (it emulates a slower link "
        "for the thread engine on CPU); remove it, or set runtime.engine: thread to emulate that link"
        for name, value in (("latency_s", 0.002), ("bandwidth_gbps", 8.0))]


@pytest.mark.cuda
def test_make_engine_warns_once_per_cuda_engine_about_link_emulation_options(caplog):
    with caplog.at_level("WARNING", logger="swapkit"):
        engine = make_engine(RuntimeConfig(engine_options=EngineOptions(latency_s=0.002)), torch.device("cuda"))
    assert engine.name == "cuda"
    assert [r.getMessage() for r in caplog.records] == unused_engine_options(EngineOptions(latency_s=0.002), "cuda")


def test_thread_engine_synchronize_raises_a_failure_nobody_waited_for():
    engine = ThreadCopyEngine("cpu")
    engine.offload(torch.zeros(4, dtype=torch.uint8), torch.empty(3, dtype=torch.uint8))
    with pytest.raises(RuntimeError):
        engine.synchronize()
    engine.synchronize()  # reported once
    engine.close()
