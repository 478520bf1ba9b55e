"""Swap under ``torch.autocast``: the low-precision copies of parameters that autocast caches for the whole
autocast block are kept, not swapped (swapkit.runtime.autocast Note [Autocast's cached casts])."""
from __future__ import annotations

import copy

import pytest
import torch

import swapkit
from tests.toys import ReadyWhenDone, ToyNet, assert_grads_equal, grads, install_engine, layer_swap, toy_config

DIM, ROWS, LAYERS = 32, 64, 3


@pytest.fixture(autouse=True, scope="module")
def _one_thread_here(one_thread):
    """Tiny matrices in this file (conftest's ``one_thread``)."""


def step(model, x, session=None, weight_grads: bool = True) -> torch.Tensor:
    for p in model.parameters():
        p.requires_grad_(weight_grads)
    with session if session is not None else torch.enable_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        loss = out.float().square().mean()
        loss.backward()
    return loss.detach()


def test_autocast_casts_of_parameters_are_kept_and_gradients_are_exact():
    """Each layer's matmul saves the bf16 copy of its weight that autocast made and caches until the
    autocast block ends, so swapping it freed nothing in forward: the stats counted it offloaded and
    released while the cache held it, and copied it both ways for nothing."""
    torch.manual_seed(0)
    model = ToyNet(LAYERS, DIM)
    reference = copy.deepcopy(model)
    x = torch.randn(ROWS, DIM)
    session = swapkit.apply(model, toy_config(LAYERS, **layer_swap(1, skip_tail_offload=False)), layers="layers")
    install_engine(session, ReadyWhenDone())
    assert torch.equal(step(model, x, session), step(reference, x))
    assert_grads_equal(grads(model), grads(reference))
    stats = session.stats
    weight, activation = DIM * DIM * 2, ROWS * DIM * 2  # bf16 bytes
    # layer 0's input needs no grad, so its matmul saves no weight (autograd saves what a gradient needs)
    assert stats.skipped["autocast_cache"] == (LAYERS - 1) * weight
    # the cast of x (needs no grad: not cached) and each layer's sigmoid output, the next layer's input
    assert stats.offloaded_bytes == (LAYERS + 1) * activation
    session.remove()


def test_casts_autocast_does_not_cache_are_swapped():
    """Frozen weights (no grad) are cast again at every use, not cached: their copies die with the saved
    tensor, so they are swapped as any activation."""
    torch.manual_seed(0)
    model = ToyNet(LAYERS, DIM)
    x = torch.randn(ROWS, DIM, requires_grad=True) * 1.0  # not a leaf: autocast caches casts of leaves only
    session = swapkit.apply(model, toy_config(LAYERS, **layer_swap(1, skip_tail_offload=False)), layers="layers")
    install_engine(session, ReadyWhenDone())
    step(model, x, session, weight_grads=False)
    stats = session.stats
    assert "autocast_cache" not in stats.skipped
    # each layer's weight copy (saved for the input's grad) and sigmoid output; the input is not saved
    assert stats.offloaded_bytes == LAYERS * (DIM * DIM * 2 + ROWS * DIM * 2)
    session.remove()
