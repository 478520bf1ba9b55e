"""The CUDA engine's ordering rules, tested on CPU with engines that behave like it where it matters:
storages released once their copy is queued (swapkit.runtime.swap_schedule Note [Stream-ordered release]), a
batch copied after the stream its storages were saved on (swapkit.runtime.batch Note [A batch has one
producer]), and no finalizer ever waiting for a lock its own thread holds (swapkit.engine.pool Note
[Releases never wait for the pool's lock], swapkit.engine.cuda Note [No lock a finalizer waits on])."""
from __future__ import annotations

import copy
import gc
import threading

import pytest
import torch
from torch import nn

import swapkit
from swapkit.engine.cuda import CudaCopyEngine, Inflight
from swapkit.engine.pool import HostPool
from tests.toys import (
    GatedEngine, ReadyWhenDone, ToyNet, assert_grads_equal, grads, install_engine, layer_swap, toy_config,
)

F32 = 4


pytestmark = pytest.mark.usefixtures("remove_sessions")


# ---------------------------------------------------------------- release once the copy is queued


class GpuFarBehind(GatedEngine):
    """No copy runs before ``gate`` opens, like a GPU far behind the CPU; with ``ordered`` a storage may
    go once its copy is queued, as on CUDA. (The CPU stand-in stays correct: the queued job holds its
    sources, where CUDA's allocator holds the block.) Counts where verify mode reads the sources."""

    def __init__(self, ordered: bool) -> None:
        super().__init__()
        self.stream_ordered_release = ordered
        self.source_reads = 0

    def reading_sources(self):
        self.source_reads += 1
        return super().reading_sources()


def forward_then_backward(model: nn.Module, session, engine: GpuFarBehind | None = None):
    """A forward with every copy held back (``engine``), the step's counters before backward, then backward.

    Returns the counters before backward, and whether the last queued copy was still unrun then."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    with session:
        out = model(x).sum()
        before = copy.copy(session._step.stats)
        unrun = engine is not None and not engine.fence().passed()
        if engine is not None:
            engine.gate.set()
        out.backward()
    return before, unrun


def test_a_stream_ordered_engine_releases_due_storages_before_any_copy_ran():
    reference = ToyNet(layers=4)
    reference(torch.randn(8, 16, generator=torch.Generator().manual_seed(0))).sum().backward()
    expected = grads(reference)
    engines = {"ready": ReadyWhenDone(), "ordered": GpuFarBehind(True), "event": GpuFarBehind(False)}
    runs = {}
    for name, engine in engines.items():
        model = copy.deepcopy(reference)
        model.zero_grad(set_to_none=True)
        session = swapkit.apply(model, toy_config(4, **layer_swap(1, verify=True)), layers="layers")
        install_engine(session, engine)
        before, unrun = forward_then_backward(model, session, None if name == "ready" else engine)
        assert_grads_equal(grads(model), expected)
        runs[name] = (before, session.stats, unrun)
    ready_before, ready, _ = runs["ready"]
    ordered_before, ordered, ordered_unrun = runs["ordered"]
    event_before, event, event_unrun = runs["event"]
    assert ordered_unrun and event_unrun  # the forward ended with its copies still queued, none run
    # released at their horizon although no copy had run: the same releases as copies that finish at once
    assert ordered_before.released_bytes == ready_before.released_bytes == 4 * 8 * 16 * F32  # x, s0, s1, s2
    assert (ordered.released_bytes, ordered.tail_bytes, ordered.skipped, ordered.peak_device_bytes) == (
        ready.released_bytes, ready.tail_bytes, ready.skipped, ready.peak_device_bytes)
    assert ordered.peak_device_bytes < ordered.saved_bytes
    # verify checksummed each device storage where its copy reads it, before the copy ran, and it matched
    assert ordered.verified_tensors == ordered.prefetched_tensors == engines["ordered"].source_reads > 0
    # waiting for finished copies (the thread engine's rule) releases nothing: every copied storage is tail
    assert event_before.released_bytes == event.released_bytes == 0
    assert event.tail_bytes == event.offloaded_bytes > 0 and event.peak_device_bytes == event.saved_bytes


# ---------------------------------------------------------------- a batch waits on its producer stream


class NamedStreams(ReadyWhenDone):
    """Saves run on named streams (``producer()`` is ``current``); each batch copy records the stream it
    was told to wait on, and the one current when it was flushed."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.current = "default"
        self.copies: list[tuple[str, str, int]] = []  # (waited on, current at flush, storages)

    def producer(self) -> str:
        return self.current

    def offload_storages(self, region, sources, producer=None, where=""):
        self.copies.append((producer, self.current, len(sources)))
        return super().offload_storages(region, sources, producer, where)


class TwoStreams(nn.Module):
    """Saves one storage on stream ``s1`` and one on ``s2`` in the same scope, then reads both on the default
    stream: ``sigmoid`` and ``tanh`` save their outputs, ``a * b`` saves both again."""

    def __init__(self, engine: NamedStreams) -> None:
        super().__init__()
        self.engine = [engine]  # not a sub-module
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        engine = self.engine[0]
        engine.current = "s1"
        a = torch.sigmoid(x * self.scale)
        engine.current = "s2"
        b = torch.tanh(a * 2)
        engine.current = "default"
        return a * b


def test_a_save_on_another_stream_closes_the_batch_and_each_copy_waits_on_its_producer():
    engine = NamedStreams()
    reference = ToyNet(layers=2, block=lambda _: TwoStreams(engine))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)).requires_grad_()
    reference(x).sum().backward()
    expected = {**grads(reference), "input": x.grad}
    model = ToyNet(layers=2, block=lambda _: TwoStreams(engine))  # the same weights: scale is 1.5 everywhere
    session = swapkit.apply(model, toy_config(2, **layer_swap(50)), layers="layers")  # nothing comes due
    install_engine(session, engine)
    x = x.detach().requires_grad_()
    with session:  # the last batch is flushed at the block's exit, on the default stream
        out = model(x).sum()
    out.backward()
    assert_grads_equal({**grads(model), "input": x.grad}, expected)
    # per layer: x * scale saves x (and the parameter), sigmoid its output on s1, tanh its output on s2
    assert [(waited, n) for waited, _, n in engine.copies] == [("s1", 2), ("s2", 1)] * 2
    assert engine.copies[-1][1] == "default"  # flushed while another stream was current: waited on s2 anyway
    assert session.stats.offload_copies == 4 and session.stats.offloaded_tensors == 6


def test_the_thread_engine_has_no_producer_and_releases_only_finished_copies():
    from swapkit.engine import ThreadCopyEngine

    engine = ThreadCopyEngine("cpu")
    assert engine.producer() is None and not engine.stream_ordered_release
    engine.close()


# ---------------------------------------------------------------- finalizers never wait for a held lock


class ReleasedByFinalizer:
    """A garbage cycle whose finalizer gives ``buffer`` back to ``pool`` (as ``SwapRecord.__del__`` does)."""

    def __init__(self, pool: HostPool, buffer: torch.Tensor) -> None:
        self.pool, self.buffer, self.me = pool, buffer, self

    def __del__(self) -> None:
        self.pool.release(self.buffer)


def in_thread(fn, timeout: float = 10.0) -> None:
    """Run ``fn`` on a thread; fail (not hang) if it has not returned after ``timeout`` seconds."""
    errors = []
    thread = threading.Thread(target=lambda: _capture(fn, errors), daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{fn.__name__} still blocked after {timeout} s: a lock waited on itself"
    if errors:
        raise errors[0]


def _capture(fn, errors: list) -> None:
    try:
        fn()
    except BaseException as err:  # noqa: BLE001 - re-raised on the test's thread
        errors.append(err)


def test_a_finalizer_releasing_while_the_pool_lock_is_held_is_deferred_then_drained():
    collected = []

    def fence():  # runs under the pool's lock, as the engine's fence does inside release
        gc.collect()  # the collector may run here: the cycle's finalizer gives `second` back re-entrantly
        collected.append(True)
        return None

    pool = HostPool(lambda n: torch.empty(n, dtype=torch.uint8), fence=fence)
    first, second = pool.acquire(4096), pool.acquire(4096)
    addresses, allocations = {first.data_ptr(), second.data_ptr()}, pool.allocations
    was_enabled = gc.isenabled()
    gc.disable()  # only the collection inside the fence may run the finalizer
    try:
        ReleasedByFinalizer(pool, second)
        del second

        def release_first() -> None:
            pool.release(first)

        in_thread(release_first)
    finally:
        if was_enabled:
            gc.enable()
    assert collected and len(pool._deferred) == 1  # the finalizer ran under the lock and did not wait for it
    assert pool.free_bytes == pool.total_bytes  # drained: both ranges are back
    assert not pool._deferred
    again = {pool.acquire(4096).data_ptr(), pool.acquire(4096).data_ptr()}
    assert again == addresses and pool.allocations == allocations  # reused, nothing new allocated


def test_a_release_while_another_thread_holds_the_pool_lock_does_not_wait():
    pool = HostPool(lambda n: torch.empty(n, dtype=torch.uint8))
    buffer = pool.acquire(1000)
    with pool._lock:  # e.g. another thread waiting for a fence inside acquire
        in_thread(lambda: pool.release(buffer))
    assert pool.acquire(1000).data_ptr() == buffer.data_ptr()  # drained by the next acquire


class Event:
    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def test_the_cuda_fence_and_prune_never_wait_for_the_inflight_lock():
    engine = object.__new__(CudaCopyEngine)  # no CUDA needed: only the bookkeeping runs
    engine.inflight = inflight = Inflight()
    done, running = Event(True), Event(False)
    inflight.keep_until(done, "first")
    inflight.keep_until(running, "second")
    with inflight._lock:  # held by this thread, as when the collector runs a finalizer inside keep_until
        def fence_and_prune() -> None:
            assert engine.fence().event is running
            inflight.prune()  # skipped: the lock is taken

        in_thread(fence_and_prune)
        assert inflight.held() == ["first", "second"]
    inflight.prune()
    assert inflight.held() == ["second"]  # the completed copy's references are dropped once the lock is free
    running.done = True
    inflight.prune(blocking=True)
    inflight.forget_last(running)
    assert len(inflight) == 0 and engine.fence() is None


def test_a_completed_copy_lets_go_of_what_it_held_even_where_a_copy_handle_shares_it():
    """swapkit.engine.cuda Note [Host targets outlive their copies]: once pruned, a prefetch's held list
    (shared with its CudaCopy, Note [A joined prefetch target is stream-ordered]) keeps nothing alive."""
    inflight = Inflight()
    held = ["host view", "device target"]
    done = Event(False)
    inflight.keep_until(done, held)
    inflight.prune()
    assert held == ["host view", "device target"]  # still running: both kept
    done.done = True
    inflight.prune()
    assert len(inflight) == 0 and held == []  # a handle that still shares the list reaches nothing
