"""Swaps that something else overrides at run time are reported (swapkit.runtime.overrides
Note [Swaps nobody reports]): a WARNING naming layer and op, and ``SwapStats.unused_swaps``."""
from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import swapkit
from swapkit.runtime.overrides import FROZEN, NO_GRAD, NOT_ENTERED, OTHER_HOOKS
from swapkit.runtime.reached import ScopesReached
from swapkit.runtime.scope import Frame
from torch import nn

from tests.toys import Block, ToyNet, assert_grads_equal, grads, synced_session, toy_config


class UserCheckpointed(ToyNet):
    """Layer 1 runs inside the user's own ``torch.utils.checkpoint``."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__(layers=3)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            x = checkpoint(layer, x, use_reentrant=self.reentrant) if index == 1 else layer(x)
        return x


def op_swap(op: str = "lin", **extra) -> dict:
    return toy_config(3, swap_config={"swap": True, "op_swap": [{"op_name": op, "backward_prefetch": 1,
                                                                  "layers": True}], **extra},
                      runtime={"min_offload_bytes": 0, "skip_tail_offload": False})


def run(model, session, steps: int = 2) -> None:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0), requires_grad=True)
    for _ in range(steps):
        with session if session is not None else contextlib.nullcontext():
            model(x).sum().backward()


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "saw no saved" in r.getMessage()]


@pytest.mark.parametrize("reentrant,cause", [(False, OTHER_HOOKS), (True, NO_GRAD)])
def test_op_swap_inside_a_users_checkpoint_is_reported(reentrant, cause, caplog):
    torch.manual_seed(0)
    model, reference = UserCheckpointed(reentrant), UserCheckpointed(reentrant)
    reference.load_state_dict(model.state_dict())
    session = synced_session(model, op_swap())
    caplog.set_level(logging.WARNING, logger="swapkit")
    run(model, session)
    run(reference, _Plain())
    stats = session.stats
    assert stats.unused_swaps == ["layer 1: lin"]
    assert set(stats.offloaded_by_scope) == {"layer 0: lin", "layer 2: lin"}  # layer 1's tensors never reached us
    assert warnings_of(caplog) == [f"swapkit: op swap at layer 1: lin saw no saved tensor in step 1: {cause}; the "
                                   "swap has no effect. Drop the swap from swap_config, or stop the other "
                                   "checkpointing for this layer (Note [Swaps nobody reports])"]  # once, not per step
    assert_grads_equal(grads(model), grads(reference))


class _Plain:
    """A stand-in for a session: no hooks."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def test_layer_swap_inside_a_users_checkpoint_is_reported(caplog):
    model = UserCheckpointed(reentrant=False)
    cfg = toy_config(3, swap_config={"swap": True, "layer_swap": [{"backward_prefetch": 1, "layers": True}]},
                     runtime={"min_offload_bytes": 0})
    session = synced_session(model, cfg)
    caplog.set_level(logging.WARNING, logger="swapkit")
    run(model, session)
    assert session.stats.unused_swaps == ["layer 1"]
    assert warnings_of(caplog)[0].startswith("swapkit: layer swap at layer 1 saw no saved tensor in step 1: it ran "
                                             "inside another saved_tensors_hooks context")


def test_swaps_that_see_tensors_are_not_reported(caplog):
    model = ToyNet(layers=3)
    session = synced_session(model, op_swap())
    caplog.set_level(logging.WARNING, logger="swapkit")
    run(model, session)
    assert session.stats.unused_swaps == [] and warnings_of(caplog) == []
    assert "layer 0: lin" in session.stats.offloaded_by_scope  # (layers 1-2 save what layer 0's act kept)


class Shift(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1.0  # saves nothing for backward


class ShiftBlock(Block):
    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.shift = Shift()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shift(super().forward(x))


def test_a_scope_that_saves_nothing_is_reported_without_a_cause(caplog):
    model = ToyNet(layers=3, block=ShiftBlock)
    session = synced_session(model, op_swap("shift"))
    caplog.set_level(logging.WARNING, logger="swapkit")
    run(model, session)
    assert session.stats.unused_swaps == ["layer 0: shift", "layer 1: shift", "layer 2: shift"]
    (message,) = warnings_of(caplog)  # one for the three layers
    assert message.startswith("swapkit: op swap at layers 0-2: shift saw no saved tensor in step 1: nothing inside "
                              "it saved a tensor through swapkit")


class SkipsLastLayer(ToyNet):
    """Layer 2 does not run (as a layer of another pipeline chunk); layer 1 never calls its ``act``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers[0](x)
        return self.layers[1].lin(x)


def test_scopes_of_layers_that_did_not_run_are_not_reported(caplog):
    model = SkipsLastLayer(layers=3)
    session = synced_session(model, op_swap("act"))
    caplog.set_level(logging.WARNING, logger="swapkit")
    run(model, session, steps=1)
    assert session.stats.unused_swaps == []  # layer 1's act: layer 1's own hooks never ran either
    model.forward = lambda x: model.layers[1](model.layers[0](x))
    model.layers[1].forward = lambda x: model.layers[1].lin(x)  # layer 1 runs, its act does not
    run(model, session, steps=1)
    assert session.stats.unused_swaps == ["layer 1: act"]
    assert NOT_ENTERED in warnings_of(caplog)[0]


def test_the_rest_of_a_forward_after_autograd_grad_is_not_reported(caplog):
    """A gradient penalty: ``torch.autograd.grad`` inside the forward ends the step, and the rest of the
    forward (the penalty, outside the layers) is a new step that runs no layer. That is no evidence of
    hooks bypassed by a compiled graph: the block's first step ran the layers, so nothing is reported."""
    model, reference = ToyNet(layers=3), ToyNet(layers=3)
    reference.load_state_dict(model.state_dict())
    session = synced_session(model, op_swap())
    caplog.set_level(logging.WARNING, logger="swapkit")

    def penalized(net: nn.Module, x: torch.Tensor) -> None:
        out = net(x).sum()
        (g,) = torch.autograd.grad(out, x, create_graph=True)
        (out + g.square().sum()).backward()

    x = torch.randn(4, 16, requires_grad=True)
    with session:
        penalized(model, x)
    penalized(reference, x.detach().requires_grad_())
    assert_grads_equal(grads(model), grads(reference))
    assert session.stats.unused_swaps == [] and warnings_of(caplog) == []


def test_a_swap_on_a_frozen_layer_is_reported_as_frozen(caplog):
    """Fine-tuning with the first layer frozen: it saves nothing for backward, so its swap has no effect.
    The warning says why (frozen parameters) instead of guessing at other checkpointing."""
    model = ToyNet(layers=3)
    model.layers[0].requires_grad_(False)
    session = synced_session(model, op_swap())
    caplog.set_level(logging.WARNING, logger="swapkit")
    run(model, session, steps=1)  # the input requires grad, yet layer 0's lin saves only its frozen weight
    assert session.stats.unused_swaps == []  # a parameter save reached the session
    x = torch.randn(4, 16)  # no grad: layer 0 saves nothing at all
    with session:
        model(x).sum().backward()
    assert session.stats.unused_swaps == ["layer 0: lin"]
    (message,) = warnings_of(caplog)
    assert message.startswith("swapkit: op swap at layer 0: lin saw no saved tensor in step 2: " + FROZEN)
    assert message.endswith("the swap has no effect. Leave frozen layers out of swap_config "
                            "(Note [Swaps nobody reports])")


def idle_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "swap moved nothing" in r.getMessage()]


def layer_swap_of(k: int, **runtime) -> dict:
    return toy_config(3, swap_config={"swap": True, "layer_swap": [{"backward_prefetch": k, "layers": True}]},
                      runtime={"min_offload_bytes": 0, **runtime})


@pytest.mark.parametrize("config, first, reason", [
    (layer_swap_of(1000), 2, "saved in the forward's last backward_prefetch ticks, which stay on the device (the "
                             "step saved 9 tensors: backward_prefetch counts saved tensors, not layers); lower "
                             "backward_prefetch well below 9"),
    (layer_swap_of(1, min_offload_bytes=1 << 20), 1, "smaller than runtime.min_offload_bytes (1048576 bytes); lower it"),
    (layer_swap_of(1, max_host_bytes=1), 1, "refused by runtime.max_host_bytes (1 bytes); raise it"),
])
def test_a_swap_that_moves_nothing_is_warned_once_with_its_reason(config, first, reason, caplog):
    """Note [Swaps that move nothing]: before, such a config ran exactly as without swap, silently."""
    model = ToyNet(layers=3)
    session = synced_session(model, config)
    caplog.set_level(logging.WARNING, logger="swapkit")
    run(model, session, steps=3)
    assert session.stats.offloaded_bytes == 0
    (message,) = idle_warnings(caplog)
    assert message.startswith(f"swapkit: swap moved nothing off the device in step {first}: its swap candidates "
                              "were kept, ")
    assert reason in message


class Gate(nn.Module):
    """A sigmoid of one column: it saves only its 16-byte output."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(h[:, :1])


class GatedBlock(nn.Module):
    """``wide`` saves its 256-byte input; ``gate`` saves 16 bytes."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.wide, self.gate = nn.Linear(dim, dim, bias=False), Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.wide(x)
        return h * self.gate(h)


def gated_swaps(min_offload_bytes: int) -> dict:
    entries = [{"op_name": op, "backward_prefetch": 1, "layers": True} for op in ("wide", "gate")]
    return toy_config(3, swap_config={"swap": True, "op_swap": entries},
                      runtime={"min_offload_bytes": min_offload_bytes, "skip_tail_offload": False})


def test_a_swap_whose_tensors_are_all_small_is_warned_while_others_move(caplog):
    """Note [Swaps whose tensors are all small]: the gate's swap kept every tensor (under min_offload_bytes)
    while the step offloaded the wide ops' inputs, so the step-wide warning stayed silent; now the gate's swap
    is named once, for all its layers, with the size to lower the threshold to; gradients are unchanged."""
    expected = ToyNet(layers=3, block=GatedBlock)
    model = ToyNet(layers=3, block=GatedBlock)
    model.load_state_dict(expected.state_dict())
    run(expected, None, steps=3)  # gradients accumulate over the steps, as in the session's run
    session = synced_session(model, gated_swaps(100))
    caplog.set_level(logging.WARNING, logger="swapkit")
    run(model, session, steps=3)
    assert session.stats.offloaded_by_scope == {f"layer {i}: wide": 256 for i in range(3)}
    assert session.stats.skipped["small"] == 3 * 16  # the gates' outputs (the weights: "parameter")
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert messages == [
        "swapkit: op swap at layers 0-2: gate moved nothing in step 1: every tensor it could have moved was "
        "smaller than runtime.min_offload_bytes (100 bytes; the largest was 16), so all stayed on the device and "
        "the swap has no effect. Lower runtime.min_offload_bytes to 16 or less, or drop the swap from swap_config "
        "(Note [Swaps whose tensors are all small])"]
    assert_grads_equal(grads(model), grads(expected))


class NormedBlock(nn.Module):
    """``wide`` saves its 256-byte input; ``norm``, a LayerNorm over 2 features, saves 32 bytes of input, its
    mean and rstd, and its weight and bias (parameters, never candidates)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.wide, self.norm = nn.Linear(dim, dim, bias=False), nn.LayerNorm(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.wide(x)
        return h * self.norm(h[:, :2].contiguous()).sum(-1, keepdim=True)


def test_a_small_swap_that_also_saves_parameters_is_warned(caplog):
    """Note [Swaps whose tensors are all small]: a norm's swap saves its weight and bias too; they are kept as
    parameters, which no threshold would move, so they do not silence the warning (they did)."""
    model = ToyNet(layers=3, block=NormedBlock)
    config = gated_swaps(100)
    config["swap_config"]["op_swap"][1]["op_name"] = "norm"
    session = synced_session(model, config)
    caplog.set_level(logging.WARNING, logger="swapkit")
    run(model, session, steps=2)
    assert session.stats.skipped["parameter"] > 0
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(messages) == 1 and messages[0].startswith("swapkit: op swap at layers 0-2: norm moved nothing")
    assert "the largest was 32" in messages[0]


class Sine(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x)  # saves x


class CosineAndGate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cos(x) + torch.sigmoid(x[:, :1])  # saves x again, and a 16-byte output


class ReSaving(nn.Module):
    """``a`` saves the block's input (256 bytes, swapped); ``b`` saves it again, and otherwise only 16 bytes."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.a, self.b = Sine(), CosineAndGate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x)


def test_a_swap_that_saves_again_a_storage_another_swap_moves_is_not_called_small(caplog):
    """``b``'s only new candidate is small, but it also saves the input ``a`` swaps: it holds moved bytes, and
    "every tensor it could have moved was smaller" would be false (Note [Swaps whose tensors are all small])."""
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0), requires_grad=True)
    plain = ToyNet(layers=3, block=ReSaving)(x).sum()
    expected = torch.autograd.grad(plain, x)[0]
    model = ToyNet(layers=3, block=ReSaving)
    entries = [{"op_name": op, "backward_prefetch": 1, "layers": True} for op in ("a", "b")]
    session = synced_session(model, toy_config(3, swap_config={"swap": True, "op_swap": entries},
                                               runtime={"min_offload_bytes": 100, "skip_tail_offload": False}))
    caplog.set_level(logging.WARNING, logger="swapkit")
    for _ in range(2):
        with session:
            got = torch.autograd.grad(model(x).sum(), x)[0]
    assert torch.equal(got, expected)
    assert session.stats.skipped["small"] == 3 * 16 and "layer 0: a" in session.stats.offloaded_by_scope
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == []


def test_a_swap_with_tensors_above_the_threshold_is_not_called_small(caplog):
    model = ToyNet(layers=3, block=GatedBlock)
    session = synced_session(model, gated_swaps(0))
    caplog.set_level(logging.WARNING, logger="swapkit")
    run(model, session, steps=2)
    assert session.stats.offloaded_by_scope["layer 0: gate"] == 16
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == []


def test_a_swap_that_frees_memory_is_not_warned(caplog):
    model = ToyNet(layers=3)
    session = synced_session(model, layer_swap_of(1))
    caplog.set_level(logging.WARNING, logger="swapkit")
    run(model, session, steps=3)
    assert session.stats.released_bytes > 0 and idle_warnings(caplog) == []


def test_a_too_long_default_prefetch_is_named_as_written(caplog):
    """Under the default strategy the distance is swap_config.default_prefetch: the warning said to lower
    backward_prefetch, a key the config does not have."""
    from tests.toys import llama, llama_batch, llama_step

    model = llama()
    config = {"model": {"model_config": {"num_layers": len(model.layers)}},
              "swap_config": {"swap": True, "default_prefetch": 10_000}, "runtime": {"min_offload_bytes": 0}}
    session = swapkit.apply(model, config)
    caplog.set_level(logging.WARNING, logger="swapkit")
    for _ in range(2):
        with session:
            llama_step(model, llama_batch())
    session.remove()
    (message,) = idle_warnings(caplog)
    assert "saved in the forward's last swap_config.default_prefetch ticks" in message
    assert "swap_config.default_prefetch counts saved tensors, not layers); lower swap_config.default_prefetch " \
           "well below" in message and "backward_prefetch" not in message.replace("default_prefetch", "")


def test_a_scope_unused_in_many_layers_is_one_warning_naming_them(caplog):
    """32 layers' op swaps under another hooks context: one WARNING per scope and cause with the layers
    as ranges, not one per layer; the stats still list every layer's scope."""
    from swapkit.runtime.overrides import OTHER_HOOKS, unused_message

    assert unused_message([0, 1, 2, 5], "lin", OTHER_HOOKS, 1).startswith(
        "swapkit: op swap at layers 0-2, 5: lin saw no saved tensor in step 1: " + OTHER_HOOKS)
    assert "for these layers" in unused_message([0, 1], "lin", None, 1)
    assert "for this layer" in unused_message([3], "lin", None, 1)
    model = ToyNet(layers=32)
    config = {**op_swap(), "model": {"model_config": {"num_layers": 32}}}
    session = synced_session(model, config)
    caplog.set_level(logging.WARNING, logger="swapkit")
    with session:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            model(torch.randn(8, 16, requires_grad=True)).sum().backward()
    assert session.stats.unused_swaps == [f"layer {i}: lin" for i in range(32)]
    (message,) = [m for m in warnings_of(caplog) if "saw no saved tensor" in m]
    assert message.startswith("swapkit: op swap at layers 0-31: lin saw no saved tensor in step 1")


def test_a_hooked_op_inside_a_swap_counts_for_the_swap_it_takes_its_distance_from():
    """Note [Swaps whose tensors are all small]: an op hooked for recompute inside a swapped layer saves under the
    layer's distance, so its tensors count for the layer swap, not for an op swap nobody configured."""
    owner = ScopesReached(((0, ""), (0, "attn"), (1, "mlp"))).swap_owner
    assert owner(0, "attn") == (0, "attn") and owner(0, "attn.q") == (0, "attn")
    assert owner(0, "mlp") == (0, "") and owner(0, "attnx") == (0, "")  # a prefix of the name is no parent
    assert owner(1, "mlp.w1") == (1, "mlp") and owner(1, "norm") is None


SCOPES = ((0, ""), (0, "attn"), (1, ""), (1, "attn"))  # a layer swap and an op swap on each of two layers


def test_unused_swaps_are_the_scopes_of_the_layers_that_ran_that_no_save_reached():
    """Note [Swaps nobody reports], on ScopesReached alone: a scope of a layer that ran and saw no tensor is
    unused, with the cause it was entered under (none known: ``None``); a layer that did not run is not
    reported (another pipeline chunk's); with no layer seen or entered at all, every scope is, as never entered."""
    reached = ScopesReached(SCOPES)
    reached.seen.add((0, ""))
    reached.entered(Frame(0, "attn", 2), None)
    assert reached.unused_swaps(saved_any=True) == [(0, "attn", None)]  # layer 1 never ran
    reached.entered(Frame(0, "attn", 2), OTHER_HOOKS)  # a later entry knows the cause
    reached.entered(Frame(0, "attn", 2), NO_GRAD)  # the first known cause stays
    assert reached.unused_swaps(saved_any=True) == [(0, "attn", OTHER_HOOKS)]
    assert reached.reached_swap_scopes() == {(0, "")}
    nothing = ScopesReached(SCOPES)
    assert nothing.unused_swaps(saved_any=True) == [(layer, path, NOT_ENTERED) for layer, path in SCOPES]


def test_a_step_that_saved_nothing_reports_only_the_scopes_entered_under_other_hooks():
    """Note [Swaps nobody reports]: a forward none of whose saves reached the session (another hooks context around
    it, or ``no_grad``) names only the scopes entered under another saved-tensor hooks context."""
    reached = ScopesReached(SCOPES)
    reached.entered(Frame(0, "", 2), OTHER_HOOKS)
    reached.entered(Frame(1, "", 2), NO_GRAD)
    assert reached.unused_swaps(saved_any=False) == [(0, "", OTHER_HOOKS)]


def test_the_rest_of_a_forward_reports_nothing_and_counts_as_having_run_layers():
    """swapkit.runtime.session Note [The rest of a forward]: a step that runs no bound layer after an earlier step
    of its block did is no bypass; once it runs one, it is judged as any step."""
    rest = ScopesReached(SCOPES)
    rest.layers_ran_before = True
    assert rest.rest_of_forward() and rest.layers_ran() and rest.unused_swaps(saved_any=True) == []
    rest.seen.add((1, "attn"))
    assert not rest.rest_of_forward() and rest.unused_swaps(saved_any=True) == [(1, "", NOT_ENTERED)]
    first = ScopesReached(SCOPES)
    assert not first.rest_of_forward() and not first.layers_ran()


def test_small_swaps_are_the_scopes_that_kept_only_small_candidates_and_moved_nothing():
    """Note [Swaps whose tensors are all small], on ScopesReached alone: the largest small candidate per
    configured scope (an op hooked inside a layer swap counts for it), never a scope that offloaded bytes, kept a
    candidate for another reason, or saved again a storage another scope moves."""
    reached = ScopesReached(SCOPES)
    layer0, attn0, norm0 = Frame(0, "", 2), Frame(0, "attn", 2), Frame(0, "norm", 2)
    layer1, attn1 = Frame(1, "", 2), Frame(1, "attn", 2)
    reached.seen.update({(0, ""), (0, "attn"), (0, "norm"), (1, ""), (1, "attn")})
    reached.kept_in(layer0, "small", 100)
    reached.kept_in(norm0, "small", 300)  # hooked inside layer 0's swap: counts for it
    reached.kept_in(attn0, "small", 50)
    reached.kept_in(attn0, "tail", 4096)  # also kept for the tail: lowering the threshold would not do
    reached.kept_in(layer1, "small", 10)
    reached.kept_in(attn1, "small", 20)
    reached.kept_in(attn1, "moved", 4096)  # saved again a storage another scope moves
    assert reached.small_swaps({}) == [(0, "", 300), (1, "", 10)]
    assert reached.small_swaps({"layer 0": 1 << 20}) == [(1, "", 10)]  # layer 0 offloaded bytes
