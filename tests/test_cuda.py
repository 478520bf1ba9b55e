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
