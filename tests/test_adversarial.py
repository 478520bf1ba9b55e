"""Cases found by an adversarial review of the Python API: a user's own model and loop doing what
plain autograd allows (or refuses), compared with the unwrapped model."""
from __future__ import annotations

import gc
import logging

import pytest
import torch
from torch import nn

import swapkit

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


class SelectedActWrittenInBackward(nn.Module):
    """Layer 0 of a select-recompute model: the output of ``act`` (a selected scope, rebuilt in backward for
    its consumers) is saved by ``a * w`` and by :class:`ScalesSavedInBackward`, whose backward writes it."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.act = nn.SiLU()
        self.w = nn.Parameter(torch.randn(dim))

    def forward(self, x):
        a = self.act(self.lin(x))
        scaled = a * self.w
        return scaled + ScalesSavedInBackward.apply(a)


def test_a_recomputed_output_written_in_place_during_backward_raises_as_autograd_does():
    """A select-recomputed output rebuilt in backward is handed to each consumer as a fresh view: a write
    by the first consumer's backward must make the second one raise, not read the overwritten values."""
    def model():
        torch.manual_seed(0)
        net = ToyNet(layers=2, dim=16, block=Sigmoid)
        net.layers[0] = SelectedActWrittenInBackward(16)
        return net

    x = torch.randn(64, 16)  # outputs of at least runtime.min_offload_bytes are rebuilt
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        backward_once(model(), x)
    net = model()
    session = swapkit.apply(net, toy_config(2, recompute_config={"select_recompute": {"act": [1]}}), layers="layers")
    with pytest.raises(RuntimeError, match=r"in layer 0: act was modified by an in-place operation"):
        with session:
            backward_once(net, x)
    assert session.stats.output_recomputes == 1  # the output really was rebuilt, not kept
    session.remove()


@pytest.mark.cuda
def test_a_restored_tensor_written_in_place_during_backward_raises_on_cuda():
    """The same on the CUDA engine, whose releases come when a copy is queued (stream-ordered)."""
    x = torch.randn(64, 16, device="cuda")
    model = net(shared=False).cuda()
    session = swapkit.apply(model, toy_config(3, **layer_swap(1)), layers="layers")
    with pytest.raises(RuntimeError, match=r"in layer 0 was modified by an in-place operation"):
        with session:
            backward_twice(model, x)
    assert session.stats.prefetched_bytes > 0
    session.remove()


def live_tensors() -> int:
    gc.collect()
    return sum(type(obj) is torch.Tensor for obj in gc.get_objects())


def test_many_backward_passes_over_one_graph_are_exact_and_hold_no_more_tensors():
    """A Jacobian taken row by row (``retain_graph=True``) unpacks every restored storage once per row: the
    rows are bit-identical to the plain model's, and what swapkit keeps to check in-place writes does not
    grow with the number of passes (Note [Writes to restored tensors])."""
    torch.manual_seed(0)
    model, plain = ToyNet(layers=3, dim=16, block=Sigmoid), ToyNet(layers=3, dim=16, block=Sigmoid)
    plain.load_state_dict(model.state_dict())
    x = torch.randn(24, 16, requires_grad=True)
    reference = plain(x)
    session = synced_session(model, toy_config(3, **layer_swap(1)))
    with session:
        out = model(x)
        rows = [torch.autograd.grad(out[i].sum(), x, retain_graph=True)[0] for i in range(4)]
        held = live_tensors()
        rows += [torch.autograd.grad(out[i].sum(), x, retain_graph=True)[0] for i in range(4, 24)]
        assert live_tensors() == held + 20  # the 20 new rows, nothing else
    for i, row in enumerate(rows):
        assert torch.equal(row, torch.autograd.grad(reference[i].sum(), x, retain_graph=True)[0])
    assert session.stats.prefetched_bytes > 0
    session.remove()


def bypass_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "saw no saved" in r.getMessage()]


def test_another_hooks_context_around_the_whole_forward_is_reported(caplog):
    """``save_on_cpu`` (or ``allow_mutation_on_saved_tensors``, or a user's ``saved_tensors_hooks``) around the
    whole forward inside ``with session:`` keeps every tensor from swapkit: no save reaches the session and no
    backward it could see begins. The configured swaps moved nothing, and the stats and the log say so (overrides
    Note [Swaps nobody reports]); an evaluation under ``no_grad``, which saves nothing either, is not reported."""
    caplog.set_level(logging.WARNING, logger="swapkit")
    torch.manual_seed(0)
    model = ToyNet(layers=2, dim=16, block=Sigmoid)
    session = synced_session(model, toy_config(2, **layer_swap(1)))
    x = torch.randn(64, 16, requires_grad=True)
    with session:
        model(x).sum().backward()
    assert session.stats.step == 1 and session.stats.offloaded_bytes > 0
    with session, torch.no_grad():
        model(x)
    assert session.stats.step == 1 and not bypass_warnings(caplog)  # the last training step's stats
    with session:
        with torch.autograd.graph.save_on_cpu():
            model(x).sum().backward()
    stats = session.stats
    assert (stats.step, stats.ticks, stats.offloaded_bytes) == (3, 0, 0)
    assert stats.unused_swaps == ["layer 0", "layer 1"]
    assert [m.split(":")[1] for m in bypass_warnings(caplog)] == [
        " layer swap at layers 0-1 saw no saved tensor in step 3"]  # one warning names both layers
    assert all("another saved_tensors_hooks context" in m for m in bypass_warnings(caplog))
    session.remove()


class WritesSavedOutsideLayers(nn.Module):
    """A sigmoid between the two bound layers, outside both, whose saved output is then doubled in place."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

    def forward(self, x):
        y = torch.sigmoid(self.layers[0](x))
        y.mul_(2)
        return self.layers[1](y)


def test_a_tensor_saved_outside_the_layers_and_written_in_place_is_named_as_such():
    """The error reads 'saved for backward outside the bound layers', not '... in outside the bound layers'."""
    model = WritesSavedOutsideLayers()
    session = swapkit.apply(model, toy_config(2, **layer_swap(1)), layers="layers")
    with pytest.raises(RuntimeError, match=r"saved for backward outside the bound layers was modified by an in-place"):
        with session:
            model(torch.randn(4, 16, requires_grad=True)).sum().backward()
    session.remove()
