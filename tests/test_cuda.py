"""The CUDA engine: side stream, events, pinned pool. Skipped without a CUDA device."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import swapkit
from swapkit.train.model import build_model, lm_loss
from tests.toys import SMALL, ToyNet, grads, layer_swap, llama_batch, toy_config

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


def test_swap_frees_device_memory_before_backward():
    def allocated_after_forward(config):
        model = build_model(SMALL, seed=1, device="cuda")
        session = swapkit.apply(model, toy_config(4, **config), layers="layers")
        tokens, targets = (t.cuda() for t in llama_batch(batch=8))
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
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


def test_cuda_verify_checks_every_restored_storage():
    """runtime.verify on the CUDA engine: checksums on the compute stream, gradients unchanged."""
    ref, model = build_model(SMALL, seed=1, device="cuda"), build_model(SMALL, seed=1, device="cuda")
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


def test_offload_many_is_one_event_and_keeps_sources_and_targets_until_it_completed():
    from swapkit.engine.cuda import CudaCopyEngine

    engine = CudaCopyEngine("cuda")
    sources = [torch.arange(n, device="cuda").to(torch.uint8) for n in (3, 17, 4096)]
    region = torch.zeros(3 + 17 + 4096 + 32, dtype=torch.uint8, pin_memory=True)
    slots = [region[0:3], region[16:33], region[48:48 + 4096]]
    torch.cuda._sleep(50_000_000)  # the compute stream is busy: the side stream must wait for it
    copy = engine.offload_many(list(zip(sources, slots)))
    assert len(engine._inflight) == 1  # one event for the whole batch
    held = engine._inflight[0][1]
    assert all(any(s is src for src, _ in held) for s in sources) and all(any(d is dst for _, dst in held)
                                                                          for d in slots)
    engine.wait(copy)
    torch.cuda.current_stream().synchronize()
    assert engine.ready(copy)
    assert all(torch.equal(slot, src.cpu()) for slot, src in zip(slots, sources))
    engine.synchronize()
    assert not engine._inflight


def test_prefetch_keeps_the_host_region_until_its_copy_completed_and_is_read_after_wait():
    from swapkit.engine.cuda import CudaCopyEngine

    engine = CudaCopyEngine("cuda")
    region = torch.arange(256, dtype=torch.uint8).pin_memory()
    device, copy = engine.prefetch(region)
    assert engine._inflight[-1][1][0] is region and engine._inflight[-1][1][1] is device
    engine.wait(copy)
    assert torch.equal(device.cpu(), region)


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
    assert stats.prefetched_tensors > 0
    if batch_bytes:
        assert stats.offload_copies < stats.offloaded_tensors
    else:
        assert stats.offload_copies == stats.offloaded_tensors
    session.remove()
