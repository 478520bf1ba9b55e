"""Coalesced copies (swapkit.runtime.batch Note [Coalesced copies]): views, shared storages, mixed
dtypes, late fetches, injected copy failures and the host cap, each against an unwrapped reference."""
from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from torch import nn

import swapkit
from swapkit.engine import ThreadCopyEngine
from swapkit.runtime.batch import ALIGN
from swapkit.engine.base import StorageChangedError
from swapkit.engine.pool import HostPool
from tests.toys import (
    FailsOnSecondCopy, GatedEngine, ReadyWhenDone, ToyNet, assert_grads_equal, grads, install_engine, layer_swap,
    open_gate_when_blocked, require_native, toy_config,
)


class Mixed(torch.autograd.Function):
    """Saves views of one storage, float64, bfloat16 and odd sizes; backward reads every one of them."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        wide = x.double() * 1.5
        half = (x * 0.5).to(torch.bfloat16)
        ctx.save_for_backward(x, x.t(), x[1:, 2:], wide, half, wide[:, ::2])
        return x.sin() + wide.float() + half.float()

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        x, xt, corner, wide, half, strided = ctx.saved_tensors
        out = g * x.cos() + g * xt.t()
        out[1:, 2:] += corner
        out += wide.float() * half.float()
        out[:, ::2] += strided.float()
        return out


class MixedBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Mixed.apply(x * self.weight)


class MixedNet(nn.Module):
    def __init__(self, layers: int = 3, dim: int = 5) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MixedBlock(dim) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.sum()


pytestmark = pytest.mark.usefixtures("remove_sessions")


def run(model: nn.Module, session=None, x=None):
    x = torch.linspace(-1, 1, 15).reshape(3, 5).requires_grad_() if x is None else x
    if session is None:
        model(x).backward()
    else:
        with session:
            model(x).backward()
    return {**grads(model), "input": x.grad.clone()}


def swapped(model: nn.Module, engine: ThreadCopyEngine | None = None, k: int = 1, **runtime):
    session = swapkit.apply(model, toy_config(len(model.layers), **layer_swap(k, **runtime)), layers="layers")
    install_engine(session, engine or ReadyWhenDone())
    return session


@pytest.mark.parametrize("k", [2, 3, 5])
def test_views_shared_storages_and_mixed_dtypes_are_bit_identical_with_coalescing(k):
    reference = MixedNet()
    expected = run(reference)
    stats = {}
    for coalesce in (0, 1 << 20):
        model = copy.deepcopy(reference)
        model.zero_grad(set_to_none=True)
        session = swapped(model, k=k, offload_batch_bytes=coalesce)
        assert_grads_equal(run(model, session), expected)
        stats[coalesce] = session.stats
    alone, coalesced = stats[0], stats[1 << 20]
    assert alone.offload_copies == alone.offloaded_tensors  # one copy per storage without coalescing
    # still one move per storage; what coalescing did not copy is the batch still open when backward began,
    # discarded and kept as tail (swapkit.runtime.batch Note [Coalesced copies])
    assert coalesced.offloaded_bytes + coalesced.skipped.get("tail", 0) == alone.offloaded_bytes
    assert coalesced.offloaded_tensors <= alone.offloaded_tensors
    assert coalesced.released_bytes == alone.released_bytes and coalesced.prefetched_bytes == alone.prefetched_bytes
    for stats in (alone, coalesced):  # every byte copied came back or was used in place
        assert stats.offloaded_bytes == stats.released_bytes + stats.tail_bytes
    assert 0 < coalesced.offload_copies < coalesced.offloaded_tensors
    assert 0 < coalesced.prefetch_copies < coalesced.prefetched_tensors
    assert coalesced.prefetched_tensors == alone.prefetched_tensors > 0


def test_the_host_region_is_one_buffer_of_aligned_slots_reused_next_step(monkeypatch):
    requested = []
    acquire = HostPool.acquire
    monkeypatch.setattr(HostPool, "acquire", lambda pool, nbytes: requested.append(nbytes) or acquire(pool, nbytes))
    model = MixedNet(layers=1)
    session = swapped(model, k=50, skip_tail_offload=False)  # nothing comes due before the forward ends:
    backward_after_the_block(model, session)  # one batch for the layer, flushed at the exit, in every step
    first = session.stats
    assert first.offload_copies == 1 and first.host_allocations == 1
    sizes = (15 * 4, 15 * 4, 15 * 8, 15 * 2)  # the layer's input, x, wide, half: odd sizes get aligned slots
    assert requested == [sum(-(-n // ALIGN) * ALIGN for n in sizes)] and requested[0] > sum(sizes)
    assert first.host_pool_bytes >= requested[0]  # the slab that holds it (swapkit.engine.slabs)
    backward_after_the_block(model, session)
    assert requested[1:] == requested[:1] and session.stats.offload_copies == 1
    assert session.stats.host_allocations == 0  # the same region size comes back: reused


def backward_after_the_block(model: nn.Module, session) -> None:
    """A forward whose batches are all flushed (at the block's exit), then its backward."""
    with session:
        out = model(torch.linspace(-1, 1, 15).reshape(3, 5).requires_grad_())
    out.backward()


def test_the_batch_open_when_backward_begins_is_never_copied(monkeypatch):
    """swapkit.runtime.batch Note [Coalesced copies]: no copy, no host region, counted as tail, not offloaded."""
    requested = []
    acquire = HostPool.acquire
    monkeypatch.setattr(HostPool, "acquire", lambda pool, nbytes: requested.append(nbytes) or acquire(pool, nbytes))
    reference = MixedNet(layers=1)
    expected = run(reference)
    model = copy.deepcopy(reference)
    model.zero_grad(set_to_none=True)
    session = swapped(model, k=50, skip_tail_offload=False)  # nothing comes due: the one batch stays open
    assert_grads_equal(run(model, session), expected)  # backward inside the block
    stats = session.stats
    assert requested == [] and stats.offload_copies == stats.prefetch_copies == 0
    assert stats.offloaded_bytes == stats.offloaded_tensors == stats.tail_bytes == 0 and not stats.offloaded_by_scope
    assert stats.skipped == {"parameter": 5 * 4, "tail": stats.saved_bytes}
    assert stats.peak_device_bytes == stats.saved_bytes


def test_late_fetches_wait_for_the_batch_copy_and_stay_exact():
    reference = MixedNet()
    expected = run(reference)
    model = copy.deepcopy(reference)
    model.zero_grad(set_to_none=True)
    engine = GatedEngine()
    session = swapped(model, engine, k=2)
    x = torch.linspace(-1, 1, 15).reshape(3, 5).requires_grad_()
    engine.gate.set()
    with session:
        out = model(x)
    assert session._step.stats.released_bytes > 0  # the exit waited for the copies and released
    engine.gate.clear()  # every prefetch now blocks until the gate opens, 50 ms after backward first waits
    open_gate_when_blocked(engine, 0.05)
    out.backward()
    assert_grads_equal({**grads(model), "input": x.grad}, expected)
    stats = session.stats
    assert stats.late_fetches >= 1 and stats.wait_seconds >= 0.03
    assert 0 < stats.prefetch_copies < stats.prefetched_tensors


def test_an_injected_copy_failure_fails_the_whole_batch_and_the_next_step_is_exact():
    reference = MixedNet()
    expected = run(reference)
    model = copy.deepcopy(reference)
    model.zero_grad(set_to_none=True)
    session = swapped(model, FailsOnSecondCopy(), k=1)
    with pytest.raises(MemoryError, match="host copy failed") as failure:
        run(model, session)
    failure.value.__traceback__ = None  # its frames hold the failed step's graph; later tests count records
    del failure
    assert session.stats.aborted and not session.active
    model.zero_grad(set_to_none=True)
    assert_grads_equal(run(model, session), expected)  # the third and later copies succeed
    assert session.stats.offload_copies > 0 and not session.stats.aborted


def test_a_batch_the_host_cap_refuses_stays_on_the_device_and_is_reported():
    reference = MixedNet(layers=1)
    expected = run(reference)
    model = copy.deepcopy(reference)
    model.zero_grad(set_to_none=True)
    session = swapped(model, k=50, max_host_bytes=64)  # the layer's one region needs more
    with session:  # flushed at the block's exit (one open at backward would be discarded, never asking the pool)
        out = model(torch.linspace(-1, 1, 15).reshape(3, 5).requires_grad_())
    out.backward()
    expected.pop("input")
    assert_grads_equal(grads(model), expected)
    stats = session.stats
    assert stats.offloaded_tensors == stats.offload_copies == stats.prefetched_tensors == 0
    assert stats.skipped["host_cap"] == stats.saved_bytes and stats.host_pool_bytes == 0
    assert stats.peak_device_bytes == stats.saved_bytes


def test_each_scope_gets_its_own_batch():
    model = MixedNet(layers=3)
    session = swapped(model, k=50)  # nothing due before the forward ends: only scope changes flush
    backward_after_the_block(model, session)  # and the block's exit
    assert session.stats.offload_copies == 3


class CountsReady(ReadyWhenDone):
    """Counts ``ready`` calls on copies to host (``offload_storages``) and on prefetches."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.offloads: list = []
        self.asked = {"offload": 0, "prefetch": 0}

    def offload_storages(self, region, sources, producer=None, where=""):
        copy = super().offload_storages(region, sources, producer, where)
        self.offloads.append(copy)
        return copy

    def ready(self, copy) -> bool:
        self.asked["offload" if any(copy is c for c in self.offloads) else "prefetch"] += 1
        return super().ready(copy)


def test_the_engine_is_asked_once_per_batch_whether_its_copy_finished():
    """swapkit.runtime.swap_schedule Note [Releases never stall compute]: a batch remembers a copy seen finished,
    in forward (its copy to host) and in backward (its prefetch), so the engine is asked once per
    batch, not once per storage."""
    reference = MixedNet(layers=4)
    expected = run(reference)
    model = copy.deepcopy(reference)
    model.zero_grad(set_to_none=True)
    engine = CountsReady()
    session = swapped(model, engine, k=2)
    assert_grads_equal(run(model, session), expected)
    stats = session.stats
    assert stats.prefetch_copies < stats.prefetched_tensors  # batches of several storages came back
    assert engine.asked == {"offload": stats.offload_copies, "prefetch": stats.prefetch_copies}


class TwoOps(nn.Module):
    """``tanh(sigmoid(x))`` as two scopes ``a`` and ``b``; each saves its own output, once."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.a, self.b = nn.Sigmoid(), nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


class Lagging(ReadyWhenDone):
    """A copy to host counts as finished ``lag`` saves after it was queued (copies still finish in queue
    order), read from the session's forward clock: deterministic, unlike a real link."""

    def __init__(self, lag: int) -> None:
        super().__init__("cpu")
        self.lag, self.session, self.queued = lag, None, []

    def offload_storages(self, region, sources, producer=None, where=""):
        copy = super().offload_storages(region, sources, producer, where)
        self.queued.append((copy, self.session._step.clock))
        return copy

    def ready(self, copy) -> bool:
        super().ready(copy)
        clock = next((at for queued, at in self.queued if queued is copy), None)
        return clock is None or self.session._step.clock - clock >= self.lag


def test_a_due_storage_whose_copy_finished_is_not_held_behind_a_later_copy_that_came_due_first(monkeypatch):
    """swapkit.runtime.swap_schedule Note [Releases never stall compute]: with two distances, storages come due
    out of copy order (``b``'s output, saved after ``a``'s with k=1, is due before it, k=4). Waiting
    records are kept in copy order, so each is released at the first save that finds it due and its
    copy finished, never later."""
    from swapkit.runtime.records import SwapRecord

    released = []
    release = SwapRecord.release
    monkeypatch.setattr(SwapRecord, "release", lambda record: released.append(
        (record.step.clock, record.horizon, record.batch.d2h)) or release(record))
    reference = ToyNet(layers=6, block=TwoOps)
    x = torch.linspace(-1, 1, 48).reshape(3, 16).requires_grad_()
    reference(x).sum().backward()
    expected = {"input": x.grad.clone()}
    model = ToyNet(layers=6, block=TwoOps)
    engine = Lagging(lag=3)
    config = toy_config(6, swap_config={"swap": True, "op_swap": [
        {"op_name": "a", "backward_prefetch": 4, "layers": True},
        {"op_name": "b", "backward_prefetch": 1, "layers": True}]}, runtime={"min_offload_bytes": 0})
    session = swapkit.apply(model, config, layers="layers")
    install_engine(session, engine)
    engine.session = session
    x = x.detach().requires_grad_()
    with session:
        model(x).sum().backward()
    assert_grads_equal({"input": x.grad}, expected)
    queued = {id(copy): clock for copy, clock in engine.queued}
    # released at the save of tick `clock - 1`: the first with tick >= horizon and the copy `lag` saves old
    assert [clock for clock, _, _ in released] == [max(horizon + 1, queued[id(d2h)] + engine.lag)
                                                   for _, horizon, d2h in released]
    horizons = [horizon for _, horizon, d2h in sorted(released, key=lambda r: queued[id(r[2])])]
    assert horizons != sorted(horizons) and len(released) >= 6  # some came due before one copied earlier


def test_a_negative_batch_size_is_a_config_error_naming_the_key():
    with pytest.raises(swapkit.ConfigError, match=r"runtime\.offload_batch_bytes: got -1"):
        swapkit.load_config({**toy_config(1), "runtime": {"offload_batch_bytes": -1}})


class CountsJobs(ThreadCopyEngine):
    def __init__(self, **link) -> None:
        super().__init__("cpu", **link)
        self.jobs = 0

    def _execute(self, job, copy) -> None:
        self.jobs += 1
        super()._execute(job, copy)


def test_grouped_copies_are_one_job_and_every_byte_arrives():
    engine = CountsJobs(latency_s=0.02)
    sources = [torch.arange(n, dtype=torch.uint8) for n in (3, 17, 64)]
    targets = [torch.zeros(n, dtype=torch.uint8) for n in (3, 17, 64)]
    start = time.perf_counter()
    engine.wait(engine.offload_many(list(zip(sources, targets))))
    elapsed = time.perf_counter() - start
    engine.close()
    assert all(torch.equal(s, t) for s, t in zip(sources, targets))
    assert engine.jobs == 1 and elapsed >= 0.02  # one hand-off to the worker; the emulated link still delays it


class GatedBatches(ThreadCopyEngine):
    """The one-job batch copy (``_copy_region``, Note [Grouped copies]) waits for ``gate``."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.gate = threading.Event()

    def _copy_region(self, *args) -> None:
        self.gate.wait(timeout=30)
        super()._copy_region(*args)


@pytest.mark.parametrize("native", [False, True])
def test_a_storage_freed_while_its_batch_copy_waits_in_the_queue_raises(native):
    """Also where the C++ region copy checks the storages (swapkit.engine.thread Note [Region copies without
    the interpreter lock]): it names the freed one, and the job raises the same error."""
    from tests.test_lifecycle import FreedByAnother

    if native:
        require_native()
    engine = GatedBatches()
    found = []  # what the C++ copies returned: -1, or the index of a changed storage
    use = engine.use_native_copies
    engine.use_native_copies = lambda copy: use(lambda region, sources: found.append(copy(region, sources)) or found[-1])
    model = ToyNet(layers=1, block=FreedByAnother)
    runtime = {"offload_batch_bytes": 0, "native_save": native}
    session = swapkit.apply(model, toy_config(1, **layer_swap(1, **runtime)), layers="layers")
    install_engine(session, engine)  # offload_batch_bytes 0: each copy is queued when its tensor is saved
    with pytest.raises(StorageChangedError, match="resized or freed by another component"):
        with session:
            model(torch.randn(4, 16)).sum()
            engine.gate.set()  # the batch job runs now, after the storage was freed
    assert session.stats.aborted
    assert (0 in found) if native else not found  # one storage per batch: the freed one is its first


class CorruptsOneSlot(ReadyWhenDone):
    """After the first batch of several storages is copied, one byte of its second slot is overwritten."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.corrupted = False

    def _copy_region(self, region, sources, where="") -> None:
        super()._copy_region(region, sources, where)
        if len(sources) > 1 and not self.corrupted:
            self.corrupted = True
            offset = sources[1][1]
            region[offset:offset + 1].add_(1)


def test_verify_checks_each_storage_of_a_coalesced_batch():
    reference = MixedNet()
    expected = run(reference)
    model = copy.deepcopy(reference)
    model.zero_grad(set_to_none=True)
    session = swapped(model, ReadyWhenDone("cpu"), k=2, verify=True)
    assert_grads_equal(run(model, session), expected)
    stats = session.stats
    assert stats.verified_tensors == stats.prefetched_tensors > stats.prefetch_copies > 0
    assert stats.offload_copies < stats.offloaded_tensors
    corrupted = swapped(copy.deepcopy(reference), CorruptsOneSlot(), k=2, verify=True)
    with pytest.raises(RuntimeError, match=r"swapkit verify: .* saved in layer \d during step 1 differ"):
        run(corrupted.model, corrupted)


def test_an_offload_wrapped_on_the_instance_sees_every_copy_of_a_batch():
    model = MixedNet()
    session = swapped(model, ThreadCopyEngine("cpu"), k=50)
    seen = []
    original = session.engine.offload
    session.engine.offload = lambda src, dst: seen.append(src.numel()) or original(src, dst)
    run(model, session)
    stats = session.stats
    assert len(seen) == stats.offloaded_tensors > stats.offload_copies and sum(seen) == stats.offloaded_bytes


class CountsBatches(ReadyWhenDone):
    """An engine written against ``offload_many`` (Note [Grouped copies] in swapkit.engine.thread)."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.batches = 0

    def offload_many(self, pairs, producer=None):
        self.batches += 1
        return super().offload_many(pairs, producer)


def test_an_engine_that_replaces_offload_many_sees_every_batch_copy():
    model = ToyNet(layers=3)
    session = swapkit.apply(model, toy_config(3, **layer_swap(1)), layers="layers")
    engine = CountsBatches()
    install_engine(session, engine)
    with session:
        model(torch.randn(8, 16)).sum().backward()
    assert session.stats.offload_copies > 0
    assert engine.batches == session.stats.offload_copies


def test_a_storage_changed_on_the_copy_thread_names_its_scope():
    engine = ThreadCopyEngine("cpu")
    data = torch.ones(64, dtype=torch.uint8)
    storage = data.untyped_storage()
    sources = [(storage, 0, 64, data.data_ptr())]
    storage.resize_(0)  # freed by another component after the batch was flushed
    copy = engine.offload_storages(torch.empty(64, dtype=torch.uint8), sources, None, "layer 3: mlp")
    with pytest.raises(StorageChangedError, match="saved in layer 3: mlp"):
        engine.wait(copy)
    engine.close()


class ReadyWithoutWait(ThreadCopyEngine):
    """``ready`` blocks until the copy is done (deterministic), through ``wait_done``, not ``wait``."""

    def ready(self, copy) -> bool:
        self.wait_done(copy)
        return super().ready(copy)


class WaitsCounted(ReadyWithoutWait):
    """Replaces ``wait``: the engine no longer says a ready copy is usable without it."""

    def wait(self, copy, timed=False):
        return super().wait(copy, timed)


@pytest.mark.parametrize("engine_type", [ReadyWithoutWait, WaitsCounted])
def test_a_restore_skips_the_wait_on_a_prefetch_seen_finished_only_where_the_engine_allows(monkeypatch, engine_type):
    """CopyEngine.usable_when_ready: the thread engine's wait on a finished copy does nothing, so a restore whose
    batch was seen arrived skips it; an engine that replaces wait (CUDA joins streams there; tests gate and
    count) gets every restore's wait."""
    prefetched, waits = set(), []
    original_prefetch, original_wait = ThreadCopyEngine.prefetch, ThreadCopyEngine.wait

    def prefetch(self, src):
        buffer, copy = original_prefetch(self, src)
        prefetched.add(id(copy))
        return buffer, copy

    def wait(self, copy, timed=False):
        waits.append(id(copy) in prefetched)
        return original_wait(self, copy, timed)

    monkeypatch.setattr(ThreadCopyEngine, "prefetch", prefetch)
    monkeypatch.setattr(ThreadCopyEngine, "wait", wait)
    reference = MixedNet(layers=4)
    expected = run(reference)
    model = copy.deepcopy(reference)
    model.zero_grad(set_to_none=True)
    engine = engine_type("cpu")
    session = swapped(model, engine, k=2)
    assert_grads_equal(run(model, session), expected)
    stats = session.stats
    assert stats.late_fetches == 0 and stats.prefetched_tensors > 0
    if engine_type is ReadyWithoutWait:
        assert engine.usable_when_ready and sum(waits) == 0
    else:
        assert not engine.usable_when_ready and sum(waits) >= stats.prefetched_tensors
