"""Recomputation leaves batch-norm running statistics as one forward left them.

swapkit.runtime.replay Note [Norm statistics in recomputation]: plain ``torch.utils.checkpoint``
runs a batch norm's forward twice per step, so its running statistics moved twice and a model trained
with recompute evaluated differently from the same model trained without it.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import swapkit


class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.out = nn.Conv2d(channels, channels, 1)  # saves bn's output: the output recipe replays bn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(self.bn(self.conv(x)))


class ConvNet(nn.Module):
    def __init__(self, channels: int = 4, layers: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 1)
        self.blocks = nn.ModuleList(ConvBlock(channels) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return x


class Normed(ConvBlock):
    """A block whose own norm (instance norm, tracking statistics) is recomputed too."""

    def __init__(self, channels: int) -> None:
        super().__init__(channels)
        self.inorm = nn.InstanceNorm2d(channels, track_running_stats=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inorm(super().forward(x))


RECOMPUTE = {
    "full": {"recompute": True},
    "full_reentrant": {"recompute": True, "use_reentrant": True},
    "select_bn": {"select_recompute": {"bn": True}},
    "megatron_block": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2},
    "megatron_uniform": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 3},
    "megatron_selective": {"recompute_granularity": "selective", "recompute_modules": ["layernorm"],
                           "module_scopes": {"layernorm": "bn"}},
}


def train(model: nn.Module, session=None, steps: int = 2) -> None:
    for step in range(steps):
        x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(step), requires_grad=True)
        if session is None:
            model(x).square().mean().backward()
        else:
            with session:
                model(x).square().mean().backward()


def build(block: type = ConvBlock) -> nn.Module:
    torch.manual_seed(0)
    model = ConvNet()
    model.blocks = nn.ModuleList(block(4) for _ in range(3))
    return model


@pytest.mark.parametrize("name", sorted(RECOMPUTE))
def test_recompute_moves_running_statistics_once_per_forward(name):
    ref = build(Normed)
    model = copy.deepcopy(ref)
    session = swapkit.apply(model, {"recompute_config": RECOMPUTE[name]})
    train(ref)
    train(model, session)
    for (key, a), (_, b) in zip(ref.named_buffers(), model.named_buffers()):
        assert torch.equal(a, b), f"{key} differs from the model trained without recompute"
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ref.parameters(), model.parameters()))
    assert int(model.blocks[0].bn.num_batches_tracked) == 2


def test_the_output_recipe_replays_bn_without_moving_its_statistics():
    ref = build()
    model = copy.deepcopy(ref)
    session = swapkit.apply(model, {"recompute_config": RECOMPUTE["select_bn"]})
    train(ref)
    train(model, session)
    assert session.stats.output_recomputes == 3  # the consumer conv saved bn's output: it was rebuilt
    for (key, a), (_, b) in zip(ref.named_buffers(), model.named_buffers()):
        assert torch.equal(a, b), key


def test_norms_in_eval_mode_and_the_plain_forward_are_untouched():
    ref = build(Normed)
    model = copy.deepcopy(ref)
    session = swapkit.apply(model, {"recompute_config": RECOMPUTE["full"]})
    for m in (ref, model):
        m.blocks[1].bn.eval()  # frozen statistics inside a training model
    train(ref)
    train(model, session)
    assert all(torch.equal(a, b) for a, b in zip(ref.buffers(), model.buffers()))
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ref.parameters(), model.parameters()))


class Shared(nn.Module):
    """One cumulative-average batch norm (``momentum=None``) used twice in each recomputed block and once more
    outside them."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 1)
        self.norm = nn.BatchNorm2d(4, momentum=None)
        self.blocks = nn.ModuleList(nn.Conv2d(4, 4, 3, padding=1) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.stem(x))
        for block in self.blocks:
            x = x + block(x)
        return x


@pytest.mark.parametrize("reentrant,early_stop", [(False, True), (False, False), (True, True)])
def test_a_shared_cumulative_norm_used_twice_in_a_region_moves_once_per_use(reentrant, early_stop):
    torch.manual_seed(0)
    ref = Shared()
    for index, block in enumerate(ref.blocks):  # each block: conv -> shared norm -> shared norm again
        ref.blocks[index] = nn.Sequential(block, ref.norm, ref.norm)
    model = copy.deepcopy(ref)
    session = swapkit.apply(model, {"recompute_config": {"recompute": True, "use_reentrant": reentrant}},
                            layers="blocks")
    with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
        train(ref, steps=3)
        train(model, session, steps=3)
    assert session.recompute.wrapped == ["layer 0", "layer 1"]
    assert int(model.norm.num_batches_tracked) == 3 * 5  # the stem's use and two in each of two blocks
    for (key, a), (_, b) in zip(ref.named_buffers(), model.named_buffers()):
        assert torch.equal(a, b), f"{key} differs from the model trained without recompute"
