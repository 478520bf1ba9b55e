"""The host pool's slabs: best-fit placement, coalescing, exact accounting, the cap, fences, steady
state, views of any dtype, and the exact-size pinned memory (CUDA calls faked on CPU)."""
from __future__ import annotations

import gc
import json
import random
import sys
import threading

import pytest
import torch

import swapkit
from swapkit.engine import HostPool, ThreadCopyEngine, make_pool
from swapkit.engine.pinned import PAGE, pinned_host_memory
from swapkit.engine.slabs import (EXACT, EXACT_FROM, LARGEST_SLAB, SHARED, SMALLEST_SLAB, SlabAllocator,
                                  next_slab_bytes, round_up, slab_kind)
from tests.toys import (GatedEngine, ToyNet, bench_module, install_engine, layer_swap, llama, llama_batch, llama_step,
                        toy_config)

MiB = 1 << 20


# ---------------------------------------------------------------- pure allocator

def test_best_fit_takes_the_smallest_free_range_that_fits():
    slabs = SlabAllocator(alignment=512)
    slabs.add_slab(8192)
    a, b, c, d = (slabs.allocate(n) for n in (1024, 2048, 512, 1024))
    slabs.free(a)  # hole of 1024 at 0
    slabs.free(c)  # hole of 512 at 3072
    got = slabs.allocate(500)
    assert (got.offset, got.span) == (3072, 512)  # the 512 hole, not the 1024 one nor the tail
    got = slabs.allocate(1000)
    assert (got.offset, got.span) == (0, 1024)
    assert slabs.allocate(3585) is None  # the tail after d holds 3584 bytes
    assert slabs.allocate(3584).offset == 4608 and slabs.allocate(1) is None  # everything is taken now
    assert (b.offset, d.offset) == (1024, 3584)


def test_freed_ranges_coalesce_with_both_neighbours_into_one():
    slabs = SlabAllocator(alignment=512)
    slabs.add_slab(4096)
    blocks = [slabs.allocate(1024) for _ in range(4)]
    for i in (0, 2, 1, 3):  # the middle one last joins its left and right neighbours
        slabs.free(blocks[i])
    assert slabs.free_ranges() == [(0, 0, 4096)] and slabs.is_free(0)
    assert slabs.allocate(4096).span == 4096  # one range again: the whole slab fits


def test_fragmentation_refuses_until_neighbours_are_freed():
    slabs = SlabAllocator(alignment=512)
    slabs.add_slab(8 * 512)
    blocks = [slabs.allocate(512) for _ in range(8)]
    for block in blocks[::2]:
        slabs.free(block)  # four holes of 512: 2048 bytes free, none contiguous
    assert slabs.free_bytes == 2048 and slabs.allocate(1024) is None
    slabs.free(blocks[1])  # joins holes 0, 1 and 2
    assert slabs.free_ranges()[0] == (0, 0, 1536) and slabs.allocate(1024).offset == 0


def test_offsets_are_aligned_and_a_range_at_the_slab_end_is_clipped():
    slabs = SlabAllocator(alignment=512)
    slabs.add_slab(1000)  # not a multiple of the alignment
    first = slabs.allocate(10)
    last = slabs.allocate(400)
    assert (first.offset, first.span) == (0, 512) and (last.offset, last.span) == (512, 488)
    assert slabs.free_bytes == 0
    slabs.free(first), slabs.free(last)
    assert slabs.free_ranges() == [(0, 0, 1000)]


def test_random_sequences_keep_exact_accounting_and_never_overlap():
    rng = random.Random(0)
    slabs = SlabAllocator(alignment=512)
    for size in (64 * 1024, 96 * 1024 + 100):
        slabs.add_slab(size)
    live = []
    for _ in range(3000):
        if live and rng.random() < 0.45:
            slabs.free(live.pop(rng.randrange(len(live))))
        else:
            block = slabs.allocate(rng.choice([1, 100, 512, 513, 4000, 10_000, 30_000]))
            if block is not None:
                live.append(block)
        _check_layout(slabs, live)
    for block in live:
        slabs.free(block)
    assert slabs.free_ranges() == [(0, 0, 64 * 1024), (1, 0, 96 * 1024 + 100)]  # fully coalesced again
    assert slabs.remove_slab(1) == 96 * 1024 + 100 and slabs.held_bytes == 64 * 1024


def _check_layout(slabs: SlabAllocator, live: list) -> None:
    spans = sorted((b.slab, b.offset, b.offset + b.span) for b in live) + slabs.free_ranges()
    spans.sort()
    for slab, size in slabs.sizes.items():
        mine = [(s, e) for sl, s, e in spans if sl == slab]
        assert mine[0][0] == 0 and mine[-1][1] == size  # allocated + free ranges tile the slab exactly
        assert all(prev[1] == nxt[0] for prev, nxt in zip(mine, mine[1:]))
    assert all(b.offset % 512 == 0 and b.span >= b.nbytes for b in live)
    assert slabs.free_bytes + sum(b.span for b in live) == slabs.held_bytes


def test_requests_stay_in_slabs_of_their_kind():
    slabs = SlabAllocator()
    big = slabs.add_slab(300 * 1024, EXACT)
    small = slabs.add_slab(MiB, SHARED)
    assert slabs.allocate(200 * 1024).slab == small  # the smaller exact slab is not taken
    assert slabs.allocate(300 * 1024, EXACT).slab == big
    assert slabs.allocate(1, EXACT) is None and slabs.kinds == {big: EXACT, small: SHARED}
    assert slab_kind(EXACT_FROM) == EXACT and slab_kind(EXACT_FROM - 1) == SHARED


def test_a_slab_with_allocated_ranges_cannot_be_removed():
    slabs = SlabAllocator()
    slabs.add_slab(4096)
    block = slabs.allocate(1)
    with pytest.raises(ValueError, match="still has allocated ranges"):
        slabs.remove_slab(0)
    slabs.free(block)
    assert slabs.remove_slab(0) == 4096 and slabs.held_bytes == slabs.free_bytes == 0


@pytest.mark.parametrize("bad", [0, 3, 768])
def test_alignment_must_be_a_power_of_two(bad):
    with pytest.raises(ValueError, match=f"slab alignment: got {bad}; expected a power of two"):
        SlabAllocator(alignment=bad)


def test_large_requests_get_exact_slabs_and_small_ones_share_slabs_of_an_eighth_of_the_pool():
    assert next_slab_bytes(1000, 0, None) == SMALLEST_SLAB
    assert next_slab_bytes(1000, 80 * MiB, None) == 10 * MiB  # an eighth of what is held
    assert next_slab_bytes(1000, 4096 * MiB, None) == LARGEST_SLAB
    assert next_slab_bytes(EXACT_FROM, 80 * MiB, None) == EXACT_FROM  # a slab of its own, exactly
    assert next_slab_bytes(EXACT_FROM - 1, 0, None) == SMALLEST_SLAB
    assert next_slab_bytes(100 * MiB + 1, 0, None) == 100 * MiB + 1
    assert next_slab_bytes(100 * MiB + 1, 0, None, granule=PAGE) == round_up(100 * MiB + 1, PAGE)
    assert next_slab_bytes(1000, 80 * MiB + 1, None, granule=PAGE) == 10 * MiB  # rounded to the granule


def test_slab_size_under_the_cap_is_exact_or_refused():
    assert next_slab_bytes(512, 0, cap=1100) == 512  # a standard 1 MiB slab would cross the cap
    assert next_slab_bytes(512, 1024, cap=1100) is None  # not even the exact request fits
    assert next_slab_bytes(512, 0, cap=2 * MiB) == MiB  # a standard slab fits under this cap
    assert next_slab_bytes(100, 0, cap=4096, granule=PAGE) == PAGE
    assert next_slab_bytes(100, 1, cap=4096, granule=PAGE) is None  # the page would cross the cap


# ---------------------------------------------------------------- the pool

class Recorder:
    """Host slabs as plain CPU tensors, recording what was asked and returned."""

    def __init__(self, extra: int = 0) -> None:
        self.asked: list[int] = []
        self.made: list[torch.Tensor] = []
        self.extra = extra  # an allocator that rounds up (a page), returning more than asked

    def __call__(self, nbytes: int) -> torch.Tensor:
        self.asked.append(nbytes)
        self.made.append(torch.empty(nbytes + self.extra, dtype=torch.uint8))
        return self.made[-1]


def test_pool_places_buffers_in_one_slab_and_counts_its_exact_bytes():
    alloc = Recorder()
    pool = HostPool(alloc)
    buffers = [pool.acquire(n) for n in (100, 5000, 3, 70_000)]
    assert alloc.asked == [SMALLEST_SLAB] and pool.allocations == 1
    assert pool.total_bytes == SMALLEST_SLAB and [b.numel() for b in buffers] == [100, 5000, 3, 70_000]
    base = alloc.made[0].data_ptr()
    assert [b.data_ptr() - base for b in buffers] == [0, 512, 5632, 6144]
    assert pool.free_bytes == SMALLEST_SLAB - 6144 - 70_144
    for buffer in buffers:
        pool.release(buffer)
    assert pool.free_bytes == pool.total_bytes == SMALLEST_SLAB


def test_buffers_are_correct_views_of_any_dtype_and_never_overlap():
    pool = HostPool(Recorder())
    dtypes = [torch.float64, torch.complex128, torch.bfloat16, torch.int8, torch.float32, torch.int64, torch.bool]
    views = []
    for i, dtype in enumerate(dtypes):
        itemsize = torch.empty(0, dtype=dtype).element_size()
        host = pool.acquire(itemsize * (37 + i))
        assert host.data_ptr() % 64 == 0 and host.is_contiguous()  # aligned for every dtype
        typed = host.view(dtype)
        typed.copy_(torch.full((37 + i,), i + 1).to(dtype))
        views.append((typed, i + 1, dtype))
    for typed, value, dtype in views:  # no write spilled into a neighbour
        assert torch.equal(typed, torch.full((typed.numel(),), value).to(dtype))


def test_a_released_buffer_is_reused_as_the_same_tensor_without_allocating():
    alloc = Recorder()
    pool = HostPool(alloc)
    a = pool.acquire(100)
    pool.release(a)
    assert pool.acquire(100) is a and len(alloc.asked) == 1  # Note [Same-size reuse]
    pool.release(a)
    b = pool.acquire(60)  # another size: the kept range is merged back, then best fit finds it
    assert b is not a and b.data_ptr() == a.data_ptr() and b.numel() == 60
    assert pool._slabs.free_ranges() == [(0, 512, SMALLEST_SLAB)]  # one range after b, coalesced


def test_kept_ranges_are_merged_back_before_the_pool_would_grow():
    alloc = Recorder()
    pool = HostPool(alloc)
    small = [pool.acquire(100_000) for _ in range(10)]  # ten ranges fill most of the first 1 MiB slab
    for buffer in small:
        pool.release(buffer)  # kept whole, by size (Note [Same-size reuse])
    assert pool.free_bytes == SMALLEST_SLAB and pool._slabs.free_bytes < SMALLEST_SLAB
    big = pool.acquire(250_000)  # no kept range of this size: all are merged, then best fit
    assert big.data_ptr() == alloc.made[0].data_ptr() and pool.allocations == 1
    assert pool._kept == {} and pool._slabs.free_ranges() == [(0, 250_368, SMALLEST_SLAB)]


def test_pool_cap_applies_to_the_bytes_the_allocator_returns():
    alloc = Recorder(extra=100)  # every slab comes back 100 bytes larger (page rounding)
    pool = HostPool(alloc, max_bytes=1000)
    assert pool.acquire(400) is not None and pool.total_bytes == 500
    assert pool.acquire(450) is None  # 450 + 100 more would hold 1050 > 1000: given back, refused
    assert pool.total_bytes == 500 and pool.allocations == 1
    assert pool.acquire(100) is not None  # the first slab is full: a second one of 100 + 100 bytes
    assert pool.total_bytes == 700 and pool.allocations == 2  # what the allocator returned, not what was asked
    assert pool.acquire(201) is None and pool.total_bytes == 700


def test_pool_rounds_slabs_to_the_granule_before_checking_the_cap():
    alloc = Recorder()
    pool = HostPool(alloc, max_bytes=3 * PAGE, granule=PAGE)
    assert pool.acquire(10) is not None and pool.acquire(PAGE + 1) is not None
    assert alloc.asked == [PAGE, 2 * PAGE] and pool.total_bytes == 3 * PAGE
    assert pool.acquire(1) is not None  # fits in the first page
    assert pool.acquire(PAGE) is None and pool.total_bytes == pool.max_bytes  # a fourth page would cross it


def test_pool_refuses_foreign_and_twice_released_buffers():
    pool = HostPool(Recorder())
    host = pool.acquire(10)
    with pytest.raises(ValueError, match="was not handed out by this pool"):
        pool.release(torch.empty(10, dtype=torch.uint8))
    pool.release(host)
    with pytest.raises(ValueError, match="given back twice"):
        pool.release(host)


def test_pool_rejects_an_engine_buffer_that_is_not_flat_uint8():
    pool = HostPool(lambda n: torch.empty(n, dtype=torch.float32))
    with pytest.raises(TypeError, match=r"host_buffer\(1048576\) returned torch.float32"):
        pool.acquire(10)


def test_clear_frees_idle_slabs_at_once_and_busy_ones_when_their_last_buffer_returns():
    pool = HostPool(Recorder())
    kept = pool.acquire(2 * MiB)  # a slab of exactly 2 MiB
    other = pool.acquire(10)  # a shared slab of 1 MiB
    pool.release(other)
    assert pool.total_bytes == 3 * MiB and pool.allocations == 2
    pool.clear()
    assert pool.total_bytes == 2 * MiB  # the idle slab is gone; the busy one stays counted
    with pytest.raises(ValueError, match="was cleared"):
        pool.acquire(10)
    pool.release(kept)
    assert pool.total_bytes == 0 and pool.free_bytes == 0


# ---------------------------------------------------------------- fences (Note [Slab lifetimes])

class FakeFence:
    def __init__(self) -> None:
        self.done, self.waited = False, 0

    def passed(self) -> bool:
        return self.done

    def wait(self) -> None:
        self.waited += 1
        self.done = True


def test_a_range_is_reused_only_after_its_fence_passed():
    fences: list[FakeFence] = []

    def fence() -> FakeFence:
        fences.append(FakeFence())
        return fences[-1]

    pool = HostPool(Recorder(), fence=fence)
    a, b = pool.acquire(512), pool.acquire(512)
    pool.release(a)
    assert pool.free_bytes == SMALLEST_SLAB - 1024  # parked, not free
    c = pool.acquire(512)
    assert c.data_ptr() not in (a.data_ptr(), b.data_ptr())  # a free range was used instead of a's
    fences[0].done = True
    assert pool.acquire(512).data_ptr() == a.data_ptr()  # reclaimed once its copies finished
    assert fences[0].waited == 0


def test_the_pool_waits_for_parked_ranges_rather_than_grow():
    fences: list[FakeFence] = []
    alloc = Recorder()
    pool = HostPool(alloc, fence=lambda: fences.append(FakeFence()) or fences[-1])
    whole = pool.acquire(SMALLEST_SLAB)
    pool.release(whole)
    again = pool.acquire(SMALLEST_SLAB)  # nothing free: waits for the parked slab instead of a new one
    assert fences[0].waited == 1 and len(alloc.asked) == 1 and again.data_ptr() == whole.data_ptr()


def test_thread_engine_fence_passes_once_every_earlier_copy_finished():
    engine = GatedEngine()
    assert engine.fence() is None  # nothing queued
    host = torch.empty(64, dtype=torch.uint8)
    copy = engine.offload(torch.ones(64, dtype=torch.uint8), host)
    fence = engine.fence()
    assert not fence.passed()
    waiter = threading.Thread(target=fence.wait)
    waiter.start()
    engine.gate.set()
    waiter.join(timeout=30)
    assert fence.passed() and copy.done and torch.equal(host, torch.ones(64, dtype=torch.uint8))
    assert engine.fence() is None  # the last copy is done
    engine.close()


def test_thread_engine_pool_parks_a_range_until_its_copy_ran():
    engine = GatedEngine()
    pool = make_pool(engine, None)
    host = pool.acquire(4096)
    engine.offload(torch.full((4096,), 7, dtype=torch.uint8), host)
    pool.release(host)  # the copy still waits on the gate: the range must not be handed out
    other = pool.acquire(4096)
    assert other.data_ptr() != host.data_ptr()
    engine.gate.set()
    engine.synchronize()
    assert pool.free_bytes == pool.total_bytes - 4096  # reclaimed after the copy ran
    assert torch.equal(host, torch.full((4096,), 7, dtype=torch.uint8))
    engine.close()


# ---------------------------------------------------------------- steady state

SIZES = [3 * 4096, 777, 1 << 18, 4096, 3 * MiB + 5, 12_345, 1 << 16, 100, 1 << 18, 50_000]


def test_many_simulated_steps_reach_a_steady_state_after_the_first():
    engine = ThreadCopyEngine("cpu")
    pool = make_pool(engine, None)
    src = {n: torch.randint(0, 255, (n,), dtype=torch.uint8) for n in set(SIZES)}
    seen = []
    for step in range(60):
        hosts = [pool.acquire(n) for n in SIZES]  # forward: one range per swapped storage
        copies = [engine.offload(src[n], host) for n, host in zip(SIZES, hosts)]
        for i in reversed(range(len(SIZES))):  # backward: prefetch in reverse, release at once
            back, fetched = engine.prefetch(hosts[i])
            pool.release(hosts[i])
            engine.wait(fetched)
            assert torch.equal(back, src[SIZES[i]]) and engine.ready(copies[i])
        if step % 7 == 3:
            engine.synchronize()  # some steps end with every fence passed, some do not
        seen.append((pool.allocations, pool.total_bytes, len(pool._live)))
        assert len(pool._parked) + sum(map(len, pool._kept.values())) <= len(SIZES)  # nothing piles up
    engine.close()
    # one shared slab holds the small buffers, each buffer of 256 KiB or more has an exact slab;
    # no growth after step 1
    assert seen[0] == (4, SMALLEST_SLAB + 2 * (1 << 18) + 3 * MiB + 5, 0) and len(set(seen)) == 1


def test_session_pool_holds_one_slab_and_stays_flat_over_many_steps():
    model = llama()
    session = swapkit.apply(model, toy_config(4, **layer_swap(2)), layers="layers")
    batch = llama_batch()
    seen = []
    for _ in range(6):  # tests/test_session.py runs 50 steps for the step-level accounting
        model.zero_grad(set_to_none=True)
        with session:
            llama_step(model, batch)
        stats = session.stats
        seen.append((stats.host_pool_bytes, session.pool.allocations, len(session.pool._live)))
        assert sum(map(len, session.pool._kept.values())) <= stats.offloaded_tensors  # nothing piles up
    assert stats.offloaded_bytes > 0 and seen[-1][0] == session.pool.total_bytes == SMALLEST_SLAB
    assert len(set(seen)) == 1  # one slab from the first step on, every buffer back after each step
    assert session.pool.free_bytes == session.pool.total_bytes  # every range came back
    session.remove()
    assert session.pool.total_bytes == 0


# ---------------------------------------------------------------- exact-size pinned memory

class FakeCuda:
    def __init__(self, status: int = 0) -> None:
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []
        self.status = status

    def register(self, address: int, nbytes: int) -> int:
        if not self.status:
            self.registered[address] = nbytes
        return self.status

    def unregister(self, address: int) -> int:
        self.unregistered.append(address)
        return 0


def test_pinned_memory_is_page_aligned_exact_and_unregistered_with_its_last_view():
    cuda = FakeCuda()
    memory = pinned_host_memory(3 * PAGE + 1, cuda.register, cuda.unregister)
    address = memory.data_ptr()
    assert memory.dtype == torch.uint8 and memory.numel() == 4 * PAGE and address % PAGE == 0
    assert cuda.registered == {address: 4 * PAGE}  # exactly the pages, no power-of-two rounding
    view = memory[PAGE:PAGE + 10]
    view.fill_(3)
    del memory
    gc.collect()
    assert cuda.unregistered == []  # a view still uses the mapping
    assert torch.equal(view, torch.full((10,), 3, dtype=torch.uint8))
    del view
    gc.collect()
    assert cuda.unregistered == [address]


def test_pinned_memory_registration_failure_is_a_clear_error():
    cuda = FakeCuda(status=2)
    with pytest.raises(RuntimeError, match=r"cudaHostRegister of 4096 bytes .* failed \(CUDA error 2\).*ulimit -l"):
        pinned_host_memory(10, cuda.register, cuda.unregister)
    gc.collect()
    assert cuda.unregistered == []  # nothing was registered, so nothing is unregistered


def test_pinned_memory_is_registered_and_unregistered_on_the_engines_device(monkeypatch):
    """Note [Pinning on the engine's device]: with the current device 0, a slab for ``cuda:1`` is registered
    and unregistered while device 1 is current (on device 0 the runtime would start a context there), and
    the current device is 0 again after each call."""
    from types import SimpleNamespace

    from swapkit.engine.cuda import CudaCopyEngine

    current, calls = [0], []

    class FakeDevice:
        def __init__(self, index):
            self.index, self.previous = index, None

        def __enter__(self):
            self.previous, current[0] = current[0], (current[0] if self.index is None else self.index)

        def __exit__(self, *exc):
            current[0] = self.previous

    class FakeCudart:
        def cudaHostRegister(self, address, nbytes, flags):
            calls.append(("register", current[0], nbytes, flags))
            return 0

        def cudaHostUnregister(self, address):
            calls.append(("unregister", current[0]))
            return 0

    monkeypatch.setattr(torch.cuda, "device", FakeDevice)
    monkeypatch.setattr(torch.cuda, "cudart", FakeCudart)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # a CPU build has no CUDA
    memory = CudaCopyEngine.host_buffer(SimpleNamespace(device=torch.device("cuda", 1)), PAGE + 1)
    assert calls == [("register", 1, 2 * PAGE, 1)] and current == [0]  # portable, on device 1
    del memory
    gc.collect()
    assert calls[1:] == [("unregister", 1)] and current == [0]


def test_pool_of_registered_slabs_counts_the_registered_bytes():
    cuda = FakeCuda()
    pool = HostPool(lambda n: pinned_host_memory(n, cuda.register, cuda.unregister), granule=PAGE)
    buffers = [pool.acquire(n) for n in (100, 3 * MiB + 5)]
    assert pool.total_bytes == sum(cuda.registered.values()) == MiB + round_up(3 * MiB + 5, PAGE)
    for buffer in buffers:
        pool.release(buffer)
    pool.clear()
    del buffers, buffer
    gc.collect()
    assert sorted(cuda.unregistered) == sorted(cuda.registered) and pool.total_bytes == 0


@pytest.mark.cuda
def test_cuda_pinned_slab_is_pinned_exact_and_round_trips():
    memory = pinned_host_memory(5 * MiB + 3)
    assert memory.is_pinned() and memory.numel() == round_up(5 * MiB + 3, PAGE)
    src = torch.randint(0, 255, (5 * MiB + 3,), dtype=torch.uint8, device="cuda")
    host = memory[:src.numel()]
    host.copy_(src, non_blocking=True)
    back = host.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, src)


@pytest.mark.cuda
def test_cuda_session_pool_pins_exact_slabs_and_stays_flat():
    from swapkit.train.model import build_model, lm_loss
    from tests.toys import SMALL

    model = build_model(SMALL, seed=1, device="cuda")
    session = swapkit.apply(model, toy_config(4, **layer_swap(2)), layers="layers")
    tokens, targets = (t.cuda() for t in llama_batch())
    caching_host_bytes = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    seen = []
    for _ in range(10):
        model.zero_grad(set_to_none=True)
        with session:
            lm_loss(model(tokens), targets).backward()
        torch.cuda.synchronize()
        seen.append((session.stats.host_pool_bytes, session.pool.allocations))
    assert session.engine.name == "cuda" and session.stats.offloaded_bytes > 0
    assert len(set(seen)) == 1 and seen[0][0] % PAGE == 0
    # the slabs are registered, not taken from the power-of-two CachingHostAllocator
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == caching_host_bytes
    host = session.pool.acquire(4096)
    assert host.is_pinned()
    session.pool.release(host)
    session.remove()


# ---------------------------------------------------------------- the benchmark is shipped

def test_cuda_peers_leave_out_torchtune_with_a_note_when_it_is_not_importable(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchtune", None)  # any import of it fails
    variants = bench_module("variants")
    assert [peer.name for peer in variants.cuda_peers()] == ["peer: torch save_on_cpu(pin_memory=True)"]
    (note,) = variants.missing_peers()
    assert note.startswith("peer torchtune OffloadActivations skipped: torchtune is not importable")


def test_host_pool_benchmark_records_exact_bytes_and_no_growth(tmp_path):
    bench = bench_module("host_pool")
    assert bench.main(["--quick", "--steps", "3", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "host_pool.json").read_text())
    assert (tmp_path / "host_pool.md").stat().st_size > 0 and data["env"]["device"] == "cpu"
    rows = {row["mix"].split(",")[0]: row for row in data["rows"]}
    for row in rows.values():
        pool = row["slab_pool"]
        assert pool["new_slabs_after_first_step"] == 0 and pool["held_bytes_flat_after_first_step"]
        assert row["data_bytes"] <= pool["held_bytes"] < row["power_of_two"]["held_bytes"]
        assert row["power_of_two"]["measured"] is False  # modelled on CPU, and the report says so
    assert rows["Llama-3-8B layer"]["slab_pool_ratio"] == 1.0  # every activation has an exact slab


# ---------------------------------------------------------------- public API misuse

def _heap_pool(cap=None):
    return HostPool(lambda n: torch.empty(n, dtype=torch.uint8), cap)


@pytest.mark.parametrize("cap", [-1, "1GiB", 2.5, True])
def test_a_bad_cap_is_refused_when_the_pool_is_made(cap):
    with pytest.raises(ValueError, match=rf"max_bytes: got {cap!r}; expected None or a whole number"):
        _heap_pool(cap)


def test_a_part_of_a_buffer_is_not_taken_for_the_buffer():
    pool = _heap_pool()
    buffer = pool.acquire(1000)
    with pytest.raises(ValueError, match="a buffer of 500 bytes .* not handed out"):
        pool.release(buffer[:500])  # same address, fewer bytes: not what acquire handed out
    pool.release(buffer)
    assert pool.free_bytes == pool.total_bytes


@pytest.mark.parametrize("options", [{"latency_s": True}, {"bandwidth_gbps": True}])
def test_a_bool_is_no_link_setting(options):
    with pytest.raises(ValueError, match="got True; expected"):
        ThreadCopyEngine(**options)


# ---------------------------------------------------------------- copy failures

class _FailsEveryCopy(ThreadCopyEngine):
    def _copy_region(self, region, sources, where=""):
        raise MemoryError("host copy failed")


def test_failed_steps_give_their_host_regions_back():
    model = ToyNet(layers=4)
    session = swapkit.apply(model, toy_config(4, **layer_swap(1, offload_batch_bytes=0)), layers="layers")
    install_engine(session, _FailsEveryCopy())

    def failing_step() -> None:
        with pytest.raises(MemoryError, match="host copy failed"):
            with session:
                model(torch.randn(4, 16)).sum().backward()

    for _ in range(3):
        failing_step()
        gc.collect()
        assert session.pool.free_bytes == session.pool.total_bytes, "a failed copy's error kept its records alive"
    session.remove()


def test_a_copy_error_first_raised_when_the_block_ends_frees_its_step():
    """The block's exit raises a copy error no ``ready`` or ``wait`` reported yet (nothing came due in forward):
    ``synchronize`` raised the stored object itself, whose traceback then held the caller's frame, its loss
    and the graph, which holds that object (Note [A reported copy error holds no frames])."""
    model = ToyNet(layers=4)
    session = swapkit.apply(model, toy_config(4, **layer_swap(100)), layers="layers")  # nothing due in forward
    install_engine(session, _FailsEveryCopy())

    def failing_forward() -> None:
        with pytest.raises(MemoryError, match="host copy failed"):
            with session:
                loss = model(torch.randn(4, 16)).sum()
        assert loss.requires_grad  # the graph is alive in this frame when the error reaches it

    for _ in range(3):
        failing_forward()
        gc.collect()
        assert session.pool.free_bytes == session.pool.total_bytes > 0, "a copy error kept its step alive"
    session.remove()
