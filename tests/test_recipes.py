"""Output recompute for MindFormers select scopes (swapkit.runtime.recipes Note [Output recompute])."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import swapkit
from tests.toys import ToyNet, assert_grads_equal, grads, layer_swap, llama, llama_batch, llama_step, toy_config


class Scaled(nn.Module):
    """The selected op. Its output ``y`` is saved by its consumer, ``y * sigmoid(y)``."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return self.drop(x * 3)


class Block(nn.Module):
    def __init__(self, dim, dropout: float = 0.0, mutate: str = ""):
        super().__init__()
        self.lin = nn.Linear(dim, dim, bias=False)
        self.scaled = Scaled(dropout)
        self.mutate = mutate

    def forward(self, x):
        y = self.scaled(self.lin(x))
        if self.mutate == "before_save":
            y.add_(1)  # changed before its consumer saves it: the consumer must save the real value
        out = y * torch.sigmoid(y)  # mul saves y (and the sigmoid output)
        if self.mutate == "after_save":
            with torch.no_grad():
                y.add_(1)
        return out


def net(**kwargs):
    return ToyNet(layers=2, block=lambda d: Block(d, **kwargs))


SELECT = {"recompute_config": {"select_recompute": ["scaled"]}}


def run(model, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    model(x).sum().backward()
    return grads(model)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_selected_output_is_not_held_and_is_rebuilt_exactly(dropout):
    model, ref = net(dropout=dropout), net(dropout=dropout)
    ref.load_state_dict(model.state_dict())
    session = swapkit.apply(model, toy_config(2, **SELECT), layers="layers")
    with session:
        got = run(model)
    assert_grads_equal(got, run(ref))  # the recipe replays the dropout mask
    stats = session.stats
    assert stats.recomputed_output_bytes == 2 * 8 * 16 * 4  # y of each layer
    assert stats.output_recomputes == 2 and stats.resident_bytes == 0


def test_output_changed_in_place_before_the_consumer_saves_it_is_saved_for_real():
    model, ref = net(mutate="before_save"), net(mutate="before_save")
    ref.load_state_dict(model.state_dict())
    session = swapkit.apply(model, toy_config(2, **SELECT), layers="layers")
    with session:
        got = run(model)
    assert_grads_equal(got, run(ref))
    assert session.stats.recomputed_output_bytes == 0  # the recipe would have rebuilt the old value


def test_output_changed_in_place_after_the_consumer_saved_it_raises():
    model = net(mutate="after_save")
    session = swapkit.apply(model, toy_config(2, **SELECT), layers="layers")
    with session, pytest.raises(RuntimeError, match="modified by an in-place operation"):
        run(model)


def test_recipes_with_swap_stay_bit_identical():
    model, ref = llama(), llama()
    config = toy_config(4, **layer_swap(4), recompute_config={
        "select_recompute": True, "select_comm_recompute": [0, 2]})
    session = swapkit.apply(model, config, layers="layers")
    batch = llama_batch()
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with session:
            loss = llama_step(model, batch)
    assert torch.equal(loss, llama_step(ref, batch))
    assert_grads_equal(grads(model), grads(ref))
    stats = session.stats
    assert stats.recomputed_output_bytes > 0 and stats.offloaded_bytes + stats.skipped.get("tail", 0) > 0
    assert stats.resident_bytes == 0


def test_megatron_scopes_keep_checkpoint_semantics():
    model = llama()
    session = swapkit.apply(model, toy_config(4, recompute_config={
        "recompute_granularity": "selective", "recompute_modules": ["layernorm"]}), layers="layers")
    with session:
        llama_step(model, llama_batch())
    assert session.stats.recomputed_output_bytes == 0 and session.stats.output_recomputes == 0


def test_no_recipes_outside_the_session():
    model, ref = net(), net()
    ref.load_state_dict(model.state_dict())
    session = swapkit.apply(model, toy_config(2, **SELECT), layers="layers")
    assert_grads_equal(run(model), run(ref))  # plain checkpoint regions, no session hooks
    assert session.stats.output_recomputes == 0
