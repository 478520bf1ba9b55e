"""The CUDA engine: side stream, events, pinned pool. Skipped without a CUDA device."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import swapkit
from swapkit.train.model import build_model, lm_loss
from tests.toys import ReadyWhenDone, SMALL, ToyNet, grads, install_engine, layer_swap, llama_batch, toy_config

pytestmark = pytest.mark.cuda

CONFIGS = {
    "default": {"swap_config": {"swap": True, "default_prefetch": 2}},
    "layer_k1": layer_swap(1),
    "layer_k6": layer_swap(6),
    "op": {"swap_config": {"swap": True, "op_swap": [
        {"op_name": "attention", "backward_prefetch": 3, "layers": True},
        {"op_name": "feed_forward", "backward_prefetch": 5, "layers": [0, 2]}]}, "runtime": {"min_offload_bytes": 0}},
}


class Sleepy(nn.Module):
    """Keeps the compute stream busy so copies and kernels really overlap (widens race windows)."""

    def forward(self, x):
        torch.cuda._sleep(200_000)
        return x


def cuda_step(model, batch):
    tokens, targets = (t.cuda() for t in batch)
    loss = lm_loss(model(tokens), targets)
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("sleepy", [False, True])
def test_cuda_swap_is_bit_identical(name, sleepy):
    ref, model = build_model(SMALL, seed=1, device="cuda"), build_model(SMALL, seed=1, device="cuda")
    if sleepy:
        for layer in model.layers:
            layer.attention_norm = nn.Sequential(Sleepy(), layer.attention_norm)
        for layer in ref.layers:
            layer.attention_norm = nn.Sequential(Sleepy(), layer.attention_norm)
    batch = llama_batch()
    ref_loss = cuda_step(ref, batch)
    session = swapkit.apply(model, toy_config(4, **CONFIGS[name]), layers="layers")
    assert session.plan.runtime.engine == "auto"
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        with session:
            loss = cuda_step(model, batch)
        torch.cuda.synchronize()
        assert session.engine.name == "cuda"
        assert torch.equal(loss, ref_loss)
        for key, value in grads(ref).items():
            assert torch.equal(grads(model)[key], value), key
        assert session.stats.offloaded_bytes + session.stats.skipped.get("tail", 0) > 0
    assert session.pool.acquire(16) is not None and session.pool.acquire(16).is_pinned()
    session.remove()


def _small_llama_on_cuda(config):
    """The SMALL model with ``config`` applied, a batch on the GPU, and the bytes allocated before its forward."""
    model = build_model(SMALL, seed=1, device="cuda")
    session = swapkit.apply(model, toy_config(4, **config), layers="layers")
    tokens, targets = (t.cuda() for t in llama_batch(batch=8))
    torch.cuda.synchronize()
    return model, session, tokens, targets, torch.cuda.memory_allocated()


def test_swap_frees_device_memory_before_backward():
    def allocated_after_forward(config):
        model, session, tokens, targets, base = _small_llama_on_cuda(config)
        with session:
            loss = lm_loss(model(tokens), targets)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base
        loss.backward()
        return held, session.stats

    kept, _ = allocated_after_forward({"runtime": {"min_offload_bytes": 0}})
    swapped, stats = allocated_after_forward(layer_swap(2))
    assert stats.released_bytes > 0
    assert swapped <= kept - stats.released_bytes // 2  # released storages really went back to the allocator


def test_a_gpu_bound_backward_frees_used_prefetch_buffers_without_a_synchronize():
    """swapkit.engine.cuda Note [A joined prefetch target is stream-ordered]: with the GPU a long sleep
    behind the CPU, backward issues every prefetch before the GPU has run one; each buffer must still go
    back to the allocator once its records are used, or every layer's activations come back at once."""
    cfg = dataclasses.replace(SMALL, num_layers=8)

    def backward_growth(config):
        model = build_model(cfg, seed=1, device="cuda")
        session = swapkit.apply(model, toy_config(8, **config), layers="layers")
        tokens, targets = (t.cuda() for t in llama_batch(batch=8, cfg=cfg))
        with session:
            loss = lm_loss(model(tokens), targets)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            torch.cuda._sleep(1_000_000_000)  # about half a second: the whole backward is queued behind it
            loss.backward()
            behind = not torch.cuda.current_stream().query()  # the CPU finished backward before the GPU did
        torch.cuda.synchronize()
        session.remove()
        return torch.cuda.max_memory_allocated() - start, session.stats, behind, grads(model)

    keep = {"runtime": {"min_offload_bytes": 0}}
    backward_growth(keep)  # warm-up: the first backward also allocates cuBLAS's workspace (32 MiB)
    kept, _, _, kept_grads = backward_growth(keep)
    swapped, stats, behind, swapped_grads = backward_growth(layer_swap(1))
    assert behind, "the GPU caught up with the CPU during backward: the test proves nothing here"
    assert stats.prefetched_bytes > 0
    assert swapped < kept + stats.prefetched_bytes // 2, (swapped, kept, stats.prefetched_bytes)
    for name, grad in kept_grads.items():  # the early frees are safe: every gradient is the kept run's
        assert torch.equal(swapped_grads[name], grad), name


def test_cpu_tensors_in_a_cuda_forward_are_not_swapped():
    class SavesCpu(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(torch.ones(256))  # a host tensor saved during a CUDA forward
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            (host,) = ctx.saved_tensors
            assert host.device.type == "cpu"
            return grad * 2

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            return SavesCpu.apply(self.lin(x))

    model = ToyNet(layers=2, block=lambda d: Block()).cuda()
    session = swapkit.apply(model, toy_config(2, **layer_swap(1)), layers="layers")
    with session:
        model(torch.randn(8, 16, device="cuda")).sum().backward()
    assert session.stats.skipped["not_on_device"] == 2 * 256 * 4


@pytest.mark.parametrize("sleepy", [False, True])
def test_cuda_verify_checks_every_restored_storage(sleepy):
    """runtime.verify on the CUDA engine: each checksum is queued on the side stream after its copy (which
    waited for the producer), so a GPU far behind the CPU changes nothing; gradients unchanged."""
    ref, model = build_model(SMALL, seed=1, device="cuda"), build_model(SMALL, seed=1, device="cuda")
    if sleepy:  # the releases, and their checksums, are queued long before the data is produced
        for layer in model.layers:
            layer.register_forward_pre_hook(lambda *_: torch.cuda._sleep(20_000_000))
    batch = llama_batch()
    cuda_step(ref, batch)
    config = toy_config(4, **layer_swap(1, verify=True))
    session = swapkit.apply(model, config, layers="layers")
    tokens, targets = (t.cuda() for t in batch)
    with session:
        loss = lm_loss(model(tokens), targets)
    loss.backward()  # after the block: leaving it waited for the copies and released what was due
    assert session.stats.verified_tensors == session.stats.prefetched_tensors > 0
    for key, value in grads(ref).items():
        assert torch.equal(grads(model)[key], value), key


# ---------------------------------------------------------------- coalesced batches on the CUDA engine
# (swapkit.engine.cuda Note [One job per coalesced batch])


def test_offload_many_waits_for_the_producer_and_hands_its_sources_to_the_allocator():
    """swapkit.engine.cuda Notes [D2H waits for the producer], [Copy sources are released in stream order],
    [Host targets outlive their copies]."""
    from swapkit.engine.cuda import CudaCopyEngine

    engine = CudaCopyEngine("cuda")
    sizes = (3, 17, 4096)
    sources = [torch.zeros(n, dtype=torch.uint8, device="cuda") for n in sizes]
    region = torch.zeros(3 + 17 + 4096 + 32, dtype=torch.uint8, pin_memory=True)
    slots = [region[0:3], region[16:33], region[48:48 + 4096]]
    with torch.cuda.stream(engine.stream):
        torch.cuda._sleep(50_000_000)  # the side stream is busy: the batch's copies run long after it is queued
    torch.cuda._sleep(500_000_000)  # the compute stream is busy (~0.25 s): the side stream must wait for it
    for value, src in enumerate(sources, 1):
        src.fill_(value)  # the data is produced after the sleep, on the compute stream
    copy = engine.offload_many(list(zip(sources, slots)))
    assert len(engine.inflight) == 1  # one event for the whole batch
    assert all(held is slot for held, slot in zip(engine.inflight.held()[0], slots))  # the host side only
    addresses = {src.data_ptr() for src in sources}
    del src, sources  # the engine holds no source: the allocator must keep their blocks until the copy ran
    fresh = [torch.full((n,), 0xEE, dtype=torch.uint8, device="cuda") for n in sizes]
    assert not engine.ready(copy), "the GPU got through the sleep before the check: the test proves nothing here"
    assert not addresses & {t.data_ptr() for t in fresh}
    engine.wait(copy)
    torch.cuda.current_stream().synchronize()
    assert engine.ready(copy)
    assert all(torch.equal(slot, torch.full_like(slot, value)) for value, slot in enumerate(slots, 1))
    engine.synchronize()
    assert len(engine.inflight) == 0 and engine.fence() is None


def test_offload_storages_copies_whole_storages_into_their_slots_after_the_producer():
    """What a coalesced batch calls (swapkit.engine.base.region_pairs): flat views of whole storages of any
    dtype, built on this thread; the sources dropped once queued are kept by the allocator until copied."""
    from swapkit.engine.cuda import CudaCopyEngine

    engine = CudaCopyEngine("cuda")
    tensors = [torch.zeros(5, dtype=torch.float32, device="cuda"), torch.zeros(3, dtype=torch.int64, device="cuda")]
    region = torch.zeros(64, dtype=torch.uint8, pin_memory=True)
    # the compute stream is busy (about 0.25 s: a loaded host may be slow to reach the check below): the
    # copy must wait for the fills below
    torch.cuda._sleep(500_000_000)
    tensors[0].fill_(1.5)
    tensors[1].fill_(7)
    sources = [(t.untyped_storage(), offset, t.untyped_storage().nbytes(), t.data_ptr())
               for t, offset in zip(tensors, (0, 32))]
    expected = [torch.full((5,), 1.5), torch.full((3,), 7, dtype=torch.int64)]
    copy = engine.offload_storages(region, sources, engine.producer(), "layer 0")
    addresses = {t.data_ptr() for t in tensors}
    del tensors, sources
    fresh = [torch.full((64,), 0xEE, dtype=torch.uint8, device="cuda") for _ in range(2)]
    assert not engine.ready(copy), "the GPU got through the sleep before the check: the test proves nothing here"
    assert not addresses & {t.data_ptr() for t in fresh}
    engine.wait(copy)
    torch.cuda.current_stream().synchronize()
    assert torch.equal(region[0:20].view(torch.float32), expected[0])
    assert torch.equal(region[32:56].view(torch.int64), expected[1])
    engine.synchronize()


def test_prefetch_keeps_the_host_region_until_its_copy_completed_and_is_read_after_wait():
    from swapkit.engine.cuda import CudaCopyEngine

    engine = CudaCopyEngine("cuda")
    region = torch.arange(256, dtype=torch.uint8).pin_memory()
    torch.cuda._sleep(500_000_000)  # about 0.25 s: the copy is still queued at every check below
    device, copy = engine.prefetch(region)
    assert not engine.ready(copy), "the GPU got through the sleep before the check: the test proves nothing here"
    assert engine.inflight.held()[-1][0] is region and engine.inflight.held()[-1][1] is device
    with torch.cuda.stream(torch.cuda.Stream()):
        engine.wait(copy)  # another stream joined: the target's own stream has not, so it stays held
    assert engine.inflight.held()[-1][1] is device
    engine.wait(copy)
    assert not engine.ready(copy)
    held = engine.inflight.held()[-1]
    assert len(held) == 1 and held[0] is region  # Note [A joined prefetch target is stream-ordered]
    assert copy.held is None  # nor does the copy keep the host view
    assert torch.equal(device.cpu(), region)


def test_a_joined_prefetch_target_is_reused_only_after_its_copy_and_an_unjoined_one_not_at_all():
    """Note [A joined prefetch target is stream-ordered], end to end: once its own stream has joined, the
    target's block may go to the next allocation while the copy is still queued, and that allocation's
    kernels run after the copy (its bytes survive); a target nobody joined is not handed out at all."""
    from swapkit.engine.cuda import CudaCopyEngine

    engine = CudaCopyEngine("cuda")
    n = 1 << 20
    region = torch.arange(n, dtype=torch.int32).view(torch.uint8).pin_memory()
    torch.cuda._sleep(500_000_000)  # about 0.25 s: both copies are still queued at every check below
    joined, copy = engine.prefetch(region)
    engine.wait(copy)
    unjoined, other = engine.prefetch(region)
    joined_ptr, unjoined_ptr = joined.data_ptr(), unjoined.data_ptr()
    del joined, copy, unjoined, other
    fresh = [torch.full((4 * n,), 0xEE, dtype=torch.uint8, device="cuda") for _ in range(2)]
    assert len(engine.inflight) == 2, "the GPU got through the sleep before the check: the test proves nothing here"
    pointers = {t.data_ptr() for t in fresh}
    assert joined_ptr in pointers  # the joined target went back to the allocator before its copy ran
    assert unjoined_ptr not in pointers  # still held for its queued copy
    torch.cuda.synchronize()
    assert all(bool((t == 0xEE).all()) for t in fresh)  # no copy wrote into a block given out again


def test_copies_are_queued_on_the_side_stream_and_restore_the_callers_stream_even_when_one_fails():
    """Note [Switching to the side stream]: the copies run on the side stream, and the caller's own
    stream (here not the default one) is current again afterwards, also after a copy that raised."""
    from swapkit.engine.cuda import CudaCopyEngine

    engine = CudaCopyEngine("cuda")
    mine = torch.cuda.Stream()
    region = torch.zeros(64, dtype=torch.uint8, pin_memory=True)
    # made before the sleep: a kernel's first launch can block until the queued sleep has run (lazy loading)
    source, too_long = torch.ones(64, dtype=torch.uint8, device="cuda"), torch.ones(8, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(mine):
        with torch.cuda.stream(engine.stream):
            torch.cuda._sleep(500_000_000)  # about 0.25 s: the side stream is busy, the caller's is not
        copy = engine.offload_many([(source, region)])
        assert torch.cuda.current_stream() == mine
        back, fetched = engine.prefetch(region)
        assert torch.cuda.current_stream() == mine
        with engine.reading_sources():
            assert torch.cuda.current_stream() == engine.stream
        assert torch.cuda.current_stream() == mine
        mine.synchronize()
        assert not engine.ready(copy) and not engine.ready(fetched), \
            "the side stream got through the sleep before the check: the test proves nothing here"
        assert not region.any()  # the copy waits behind the sleep: it was queued on the side stream, not on mine
        with pytest.raises(RuntimeError):
            engine.offload_many([(too_long, region[:4])])
        assert torch.cuda.current_stream() == mine
        engine.wait(fetched)
        assert torch.equal(back.cpu(), torch.ones(64, dtype=torch.uint8))
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    engine.synchronize()


def test_current_stream_follows_the_current_stream_and_reuses_one_wrapper_per_stream():
    """Note [Compute stream is read at use]: read at every call, one ``Stream`` wrapper per stream."""
    from swapkit.engine.cuda import CurrentStream

    current = CurrentStream(torch.device("cuda"))
    default = current()
    assert default == torch.cuda.current_stream() and current() is default
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert current() == side and current() is current()
    assert current() is default
    current.MAX_STREAMS = 2
    streams = [torch.cuda.Stream() for _ in range(3)]
    for one in streams:
        with torch.cuda.stream(one):
            assert current() == one
    assert len(current._streams) <= 2  # started over instead of growing


def test_a_prefetch_is_joined_once_per_stream_and_read_correctly_on_each():
    """Note [A copy is joined once per stream]: the second wait from a stream queues nothing; another
    stream waits (and records the buffer) on its own, and both read the copied bytes."""
    from swapkit.engine.cuda import CudaCopyEngine

    engine = CudaCopyEngine("cuda")
    region = torch.arange(1 << 20, dtype=torch.int32).view(torch.uint8).pin_memory()
    torch.cuda._sleep(2_000_000)  # the copy queues behind this: a missing wait would read garbage
    device, copy = engine.prefetch(region)
    engine.wait(copy)
    assert copy.joined == (torch.cuda.current_stream(),)
    engine.wait(copy)
    assert len(copy.joined) == 1
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):
        engine.wait(copy)
        on_other = device.view(torch.int32).sum(dtype=torch.int64)
    assert copy.joined == (torch.cuda.current_stream(), other)
    engine.wait(copy, timed=True).seconds()  # a timed wait always measures its own wait
    assert copy.joined == (torch.cuda.current_stream(), other)
    expected = (1 << 20) * ((1 << 20) - 1) // 2
    assert device.view(torch.int32).sum(dtype=torch.int64).item() == expected
    torch.cuda.synchronize()
    assert on_other.item() == expected
    engine.close()


@pytest.mark.parametrize("batch_bytes", [0, 1 << 20])
@pytest.mark.parametrize("sleepy", [False, True])
def test_cuda_coalesced_views_and_mixed_dtypes_are_bit_identical(batch_bytes, sleepy):
    from tests.test_coalesce import MixedNet, run

    reference = MixedNet().cuda()
    x = torch.linspace(-1, 1, 15, device="cuda").reshape(3, 5)
    expected = run(reference, x=x.clone().requires_grad_())
    model = MixedNet().cuda()
    model.load_state_dict(reference.state_dict())
    if sleepy:
        for layer in model.layers:
            layer.register_forward_pre_hook(lambda *_: torch.cuda._sleep(5_000_000))
    session = swapkit.apply(model, toy_config(3, **layer_swap(2, offload_batch_bytes=batch_bytes)),
                            layers="layers")
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        got = run(model, session, x=x.clone().requires_grad_())
        for key, value in expected.items():
            assert torch.equal(got[key], value), key
    stats = session.stats
    # A record is released at its horizon as soon as its batch's copy is queued (swapkit.runtime.swap_schedule
    # Note [Stream-ordered release]), whatever the GPU has run: with the sleeps no copy has finished at any save,
    # yet the releases are those of copies that finish at once, and every released storage is prefetched.
    cpu = MixedNet()
    cpu_session = swapkit.apply(cpu, toy_config(3, **layer_swap(2, offload_batch_bytes=batch_bytes)), layers="layers")
    install_engine(cpu_session, ReadyWhenDone())
    for _ in range(2):
        run(cpu, cpu_session)
    assert stats.released_bytes == cpu_session.stats.released_bytes > 0
    assert stats.prefetched_bytes == stats.released_bytes
    assert stats.offloaded_bytes == stats.released_bytes + stats.tail_bytes
    cpu_session.remove()
    if batch_bytes:
        assert stats.offload_copies < stats.offloaded_tensors
    else:
        assert stats.offload_copies == stats.offloaded_tensors
    session.remove()


# ---------------------------------------------------------------- streams and a GPU far behind the CPU


class Branch(nn.Module):
    """A layer that runs on a stream of its own, after a sleep there: what it saves is produced late."""

    def __init__(self, dim: int, sleep_cycles: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.sleep_cycles = sleep_cycles
        self.streams: list[torch.cuda.Stream] = []  # set by the test (a list: not a module attribute)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stream = self.streams[0]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            if self.sleep_cycles:
                torch.cuda._sleep(self.sleep_cycles)
            return torch.sigmoid(self.lin(x))


class TwoBranches(nn.Module):
    """Two independent layers on two streams: layer 1 never waits for layer 0's stream in forward, and
    layer 0's stream sleeps long (about 0.1 s) before it writes its sigmoid output."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Branch(64, 200_000_000), Branch(64, 0)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [layer(x) for layer in self.layers]
        for layer in self.layers:
            torch.cuda.current_stream().wait_stream(layer.streams[0])
        return sum(out.sum() for out in outs)


def test_saves_on_a_second_stream_are_copied_after_that_stream():
    """swapkit.runtime.batch Note [A batch has one producer]: layer 0's batch is flushed during layer 1's
    first save, on layer 1's stream, which never waited for layer 0's; its copy must wait for layer 0's
    stream, or it reads the sigmoid output before it is written and backward restores garbage."""
    torch.manual_seed(0)
    reference = TwoBranches().cuda()
    model = TwoBranches().cuda()
    model.load_state_dict(reference.state_dict())
    for net in (reference, model):
        for layer in net.layers:
            layer.streams.append(torch.cuda.Stream())
    x = torch.randn(32, 64, device="cuda")
    reference(x).backward()
    session = swapkit.apply(model, toy_config(2, **layer_swap(1)), layers="layers")
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with session:
            model(x).backward()
        torch.cuda.synchronize()
        assert session.stats.released_bytes > 0  # layer 0's sigmoid output came back from the host
        for key, value in grads(reference).items():
            assert torch.equal(grads(model)[key], value), key
    session.remove()


def test_a_gpu_bound_forward_frees_swapped_memory_before_backward_without_a_synchronize():
    """swapkit.runtime.swap_schedule Note [Stream-ordered release]: with the GPU a long sleep behind the CPU, no copy
    has run when backward begins, yet the due storages went back to the allocator."""
    def held_before_backward(config):
        model, session, tokens, targets, base = _small_llama_on_cuda(config)
        with session:
            torch.cuda._sleep(1_000_000_000)  # about half a second: the whole forward is queued behind it
            loss = lm_loss(model(tokens), targets)
            held = torch.cuda.memory_allocated() - base  # no synchronize
            released = session._step.stats.released_bytes
            loss.backward()
        session.remove()
        return held, released

    kept, _ = held_before_backward({"runtime": {"min_offload_bytes": 0}})
    swapped, released = held_before_backward(layer_swap(1))
    assert released > 0
    assert swapped <= kept - released // 2  # the released storages really went back to the allocator
