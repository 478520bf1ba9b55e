"""Cases found by an adversarial review of the Python API: a user's own model and loop doing what
plain autograd allows (or refuses), compared with the unwrapped model."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.toys import ToyNet, layer_swap, synced_session, toy_config


class ScalesSavedInBackward(torch.autograd.Function):
    """``x * x`` whose backward reuses its saved ``x`` as the gradient buffer (an in-place write to a saved
    tensor during backward, a memory-saving trick of some fused kernels)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return x.mul_(2).mul_(grad)


class WritesSavedInBackward(nn.Module):
    """Layer 0 of :func:`net`: ``h * w`` and :class:`ScalesSavedInBackward` both save ``h``; the latter's
    backward, which autograd runs first (it was created last), writes ``h`` in place. ``shared=False``:
    only the function saves ``h`` (legal for one backward, not for a second one over the same graph)."""

    def __init__(self, dim: int, shared: bool = True) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.w = nn.Parameter(torch.randn(dim))
        self.shared = shared

    def forward(self, x):
        h = self.lin(x)
        scaled = h * self.w if self.shared else 0
        return scaled + ScalesSavedInBackward.apply(h)


class Sigmoid(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        return torch.sigmoid(self.lin(x))


def net(shared: bool) -> ToyNet:
    torch.manual_seed(0)
    model = ToyNet(layers=3, dim=16, block=Sigmoid)
    model.layers[0] = WritesSavedInBackward(16, shared)
    return model


def backward_twice(model, x):
    loss = model(x).sum()
    loss.backward(retain_graph=True)
    loss.backward()


def backward_once(model, x):
    model(x).sum().backward()


@pytest.mark.parametrize("shared, run", [(True, backward_once), (False, backward_twice)],
                         ids=["second_consumer", "retain_graph"])
def test_a_restored_tensor_written_in_place_during_backward_raises_as_autograd_does(shared, run):
    """Plain autograd raises when a saved tensor that backward wrote in place is unpacked again; a swapped
    tensor restored from the host must not hand the overwritten values on instead (silently wrong grads)."""
    x = torch.randn(64, 16)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(net(shared), x)
    model = net(shared)
    session = synced_session(model, toy_config(3, **layer_swap(1)))
    with pytest.raises(RuntimeError, match=r"in layer 0 was modified by an in-place operation"):
        with session:
            run(model, x)
    assert session.stats.prefetched_bytes > 0  # layer 0's tensors really came back from the host
    session.remove()
