"""Hugging Face's own gradient checkpointing together with swapkit's recompute on the same layers."""
from __future__ import annotations

import copy
import logging

import pytest
import torch

pytest.importorskip("transformers")

import swapkit  # noqa: E402
from tests.hf_zoo import FAMILIES  # noqa: E402
from tests.test_hf_models import config, train  # noqa: E402
from tests.toys import assert_grads_equal, grads  # noqa: E402

TWICE = "is also checkpointed by Hugging Face's gradient checkpointing"
MEGATRON_UNIFORM = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2}


@pytest.fixture(autouse=True, scope="module")
def _one_thread_here(one_thread):
    """Tiny matrices in this file (conftest's ``one_thread``)."""


def enable_hf_checkpointing(model: torch.nn.Module, **kwargs) -> None:
    """``gradient_checkpointing_enable()`` under its newer name (the old one warns that it is deprecated)."""
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)(kwargs or None)


class MatmulCounter(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.ops.aten.mm.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("recompute,region", [({"recompute": True}, "layer {}"),
                                              ({"select_recompute": ["attention"]}, "layer {}: self_attn"),
                                              (MEGATRON_UNIFORM, "layers 0-1")], ids=["full", "select", "uniform"])
def test_swapkit_recompute_inside_hf_gradient_checkpointing_is_reported(recompute, region, reentrant, caplog):
    """Both checkpoint the same layer: gradients stay exact, but swapkit's region frees nothing more and its
    forward may run again in backward (matrix products counted), which nothing said."""
    family = FAMILIES["llama"]
    model = family.build()
    reference = copy.deepcopy(model)
    enable_hf_checkpointing(reference, use_reentrant=reentrant)
    with MatmulCounter() as hf_alone:
        ref_losses, _ = train(reference, family, steps=1)
    session = swapkit.apply(model, config(family, recompute_config=recompute), layers=family.layers)
    caplog.set_level(logging.WARNING, logger="swapkit")
    train(model, family, session, steps=1)
    assert not [m for m in caplog.messages if TWICE in m]  # swapkit's recompute alone: nothing to say
    model.zero_grad()
    enable_hf_checkpointing(model, use_reentrant=reentrant)  # after apply, as the Trainer does in train()
    with MatmulCounter() as both:
        losses, _ = train(model, family, session, steps=1)
    assert torch.equal(losses[0], ref_losses[0])
    assert_grads_equal(grads(model), grads(reference))
    assert both.calls >= hf_alone.calls  # never less work than HF's checkpointing alone
    reported = [m for m in caplog.messages if TWICE in m]
    assert len(reported) == 1  # once per session
    # the first region run with grad enabled: in forward, or (inside a reentrant checkpoint, whose forward runs
    # without grad) in backward, which reaches the last layer first
    layer = 1 if reentrant and "select_recompute" in recompute else 0
    assert reported[0].startswith(f"swapkit: layer {layer} {TWICE}")
    assert f"swapkit's recompute of {region.format(layer)} " in reported[0]
    assert "gradient_checkpointing_disable()" in reported[0]
    train(model, family, session, steps=1)
    assert len([m for m in caplog.messages if TWICE in m]) == 1


@pytest.mark.parametrize("reentrant", [False, True])
def test_op_swaps_inside_hf_gradient_checkpointing_name_it_and_the_fix(reentrant, caplog):
    """The unused op swaps' warning named a generic cause (another saved_tensors_hooks context, or grad disabled
    "under torch.no_grad") where the layer's own HF gradient checkpointing was it, and no fix for that."""
    family = FAMILIES["llama"]
    model = family.build()
    enable_hf_checkpointing(model, use_reentrant=reentrant)
    cfg = config(family, swap_config={"swap": True, "op_swap": [{"op_name": "self_attn", "backward_prefetch": 1,
                                                                 "layers": True}]})
    session = swapkit.apply(model, cfg, layers=family.layers)
    caplog.set_level(logging.WARNING, logger="swapkit")
    train(model, family, session, steps=1)
    assert session.stats.unused_swaps == ["layer 0: self_attn", "layer 1: self_attn"]
    reported = [m for m in caplog.messages if "saw no saved tensor" in m]
    assert len(reported) == 1 and reported[0].startswith("swapkit: op swap at layers 0-1: self_attn saw")  # one for both
    for message in reported:
        assert "its layer is checkpointed by Hugging Face's gradient checkpointing" in message
        assert "model.gradient_checkpointing_disable()" in message and "recompute_config" in message
