"""Recompute on the built-in model: what is re-run (op counting), numerics, swap interplay, lifecycle.

Mechanism: a ``TorchDispatchMode`` counts aten ops during ``loss.backward()`` only. Whatever a
wrapped model runs there beyond the unwrapped model is recomputation, and it must equal the
forward ops of exactly the planned regions (measured per module on the plain model). Op-count
runs disable torch's checkpoint early stop (``set_checkpoint_early_stop(False)`` around the
forward), so a recomputed region re-runs its whole forward; with the default early stop torch
stops once the last saved tensor is rebuilt (a region saving only its inputs re-runs nothing),
which the gradient tests exercise as the production path.

Numerics: recompute re-runs the very same kernels on the very same inputs (and, with
``preserve_rng_state``, the same dropout masks), so losses and gradients are compared with
``torch.equal``; no case here needed ``assert_close``.
"""
from __future__ import annotations

import copy
import gc
import logging
import weakref
from collections import Counter, defaultdict
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import set_checkpoint_early_stop

import swapkit
from swapkit import build_plan, load_config
from swapkit.config.types import ModelConfig
from swapkit.train.model import build_model, lm_loss
from swapkit.runtime.recompute import outermost

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
SIZES = dict(num_layers=4, hidden_size=32, num_heads=2, intermediate_size=64, vocab_size=64, seq_length=16)
CFG = ModelConfig(**SIZES)
DROPOUT = replace(CFG, hidden_dropout=0.1, attention_dropout=0.1)
BATCH = 2
H_BYTES = BATCH * CFG.seq_length * CFG.hidden_size * 4  # one fp32 hidden state [B, S, H]
# Not model math: checkpoint detaches what it saves; swap restores rebuild views (empty + set_).
BOOKKEEPING = {"aten.detach", "aten.empty", "aten.set_"}


# ---------------------------------------------------------------------------- helpers

class OpCounter(TorchDispatchMode):
    """Counts aten ops by overload packet, in total and for every module on ``stack``."""

    def __init__(self) -> None:
        super().__init__()
        self.total: Counter = Counter()
        self.by_module: dict[str, Counter] = defaultdict(Counter)
        self.stack: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name not in BOOKKEEPING:
            self.total[name] += 1
            for module in self.stack:
                self.by_module[module][name] += 1
        return func(*args, **(kwargs or {}))


@dataclass
class Run:
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    backward_ops: Counter
    model: nn.Module
    session: Any


def config(recompute: dict | None = None, swap: dict | None = None, model: dict | None = None, **sections) -> dict:
    raw: dict = {"model": {"model_config": {**SIZES, **(model or {})}}, **sections}
    if recompute is not None:
        raw["recompute_config"] = recompute
    if swap is not None:
        raw["swap_config"] = swap
    return raw


def batch(cfg: ModelConfig = CFG) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shape = (BATCH, cfg.seq_length)
    tokens = torch.randint(0, cfg.vocab_size, shape, generator=gen)
    return tokens, torch.randint(0, cfg.vocab_size, shape, generator=gen)


def step(model: nn.Module, cfg: ModelConfig = CFG, session: Any = None, *, early_stop: bool = True,
         rng_seed: int | None = None) -> Run:
    """One forward (inside the session, if any) and a backward whose aten ops are counted."""
    tokens, targets = batch(cfg)
    if rng_seed is not None:
        torch.manual_seed(rng_seed)
    with set_checkpoint_early_stop(early_stop), session if session is not None else nullcontext():
        loss = lm_loss(model(tokens), targets)
    with OpCounter() as ops:
        loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return Run(loss.detach(), grads, ops.total, model, session)


def run(raw: Any = None, cfg: ModelConfig = CFG, **kwargs) -> Run:
    """A fresh model (seed 1 weights), wrapped by ``raw`` unless it is None, trained one step."""
    model = build_model(cfg, seed=1)
    session = swapkit.apply(model, raw) if raw is not None else None
    return step(model, cfg, session, **kwargs)


def assert_same_training(a: Run, b: Run) -> None:
    assert torch.equal(a.loss, b.loss), f"loss {a.loss.item()} != {b.loss.item()}"
    assert a.grads.keys() == b.grads.keys()
    for name in a.grads:
        assert a.grads[name] is not None and b.grads[name] is not None, name
        assert torch.equal(a.grads[name], b.grads[name]), f"gradient of {name} differs"


def recomputed(wrapped: Run, plain: Run) -> Counter:
    """The ops backward ran on top of the plain model's backward (recomputation)."""
    assert not plain.backward_ops - wrapped.backward_ops, "a backward op of the plain model did not run"
    return wrapped.backward_ops - plain.backward_ops


def region_ops(cfg: ModelConfig = CFG) -> dict[str, Counter]:
    """Forward aten ops of one training step of the plain model, per module path (children included)."""
    model = build_model(cfg, seed=1)
    counter = OpCounter()
    handles = []

    def leave(_module, _args, _output) -> None:
        counter.stack.pop()

    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(lambda _m, _a, name=name: counter.stack.append(name)))
        handles.append(module.register_forward_hook(leave))
    with counter:
        model(batch(cfg)[0])
    for handle in handles:
        handle.remove()
    return dict(counter.by_module)


def expected(ops: dict[str, Counter], regions: dict[str, int]) -> Counter:
    """Sum of region forward ops; ``{"feed_forward": 4}``: four layers' feed_forward ("" = the layer)."""
    total: Counter = Counter()
    for path, times in regions.items():
        for _ in range(times):
            total.update(ops["layers.0" + (f".{path}" if path else "")])
    return total


@pytest.fixture(scope="module")
def ops() -> dict[str, Counter]:
    return region_ops(CFG)


@pytest.fixture(scope="module")
def plain() -> Run:
    return run(None)


# ---------------------------------------------------------------------------- the regions themselves

def test_region_op_counts_are_what_the_cases_rely_on(ops):
    layer = ops["layers.0"]
    assert layer["aten.mm"] == 7  # wq, wk, wv, wo, w1, w3, w2
    sdpa = ops["layers.0.attention.flash_attention"]
    assert len(sdpa) == 1 and "scaled_dot_product" in next(iter(sdpa))
    assert ops["layers.0.feed_forward.w1.activation.silu"] == Counter({"aten.silu": 1})
    assert ops["layers.0.feed_forward.mul"] == Counter({"aten.mul": 1})
    assert ops["layers.0.feed_forward"]["aten.mm"] == 3
    assert ops["layers.0.attention_norm.norm"]["aten.rsqrt"] == 1
    assert all(ops[f"layers.{i}"] == layer for i in range(CFG.num_layers))


# ---------------------------------------------------------------------------- mechanism + numerics

def labels(template: str, layers=range(4)) -> list[str]:
    return [line.format(i=i) for i in layers for line in template.split("|")]


SILU, MUL = "feed_forward.w1.activation.silu", "feed_forward.mul"
MEGATRON_FULL = {"recompute_granularity": "full"}
# A MindFormers select/comm scope whose output a consumer saves runs twice in backward: once as a
# recipe rebuilding that output for the consumer (swapkit.runtime.recipes Note [Output recompute]), once as
# its own checkpoint region. silu, mul and the norms are such scopes; feed_forward is not (the
# residual add saves nothing), and Megatron scopes never record recipes.
CASES = {
    # name: (raw config, wrapped labels in apply order, recomputed regions {path in layer: count})
    "full_first_two": (config({"recompute": [2]}), ["layer 0", "layer 1"], {"": 2}),
    "full_all": (config({"recompute": True}), labels("layer {i}"), {"": 4}),
    "uniform_2": (config({**MEGATRON_FULL, "recompute_method": "uniform", "recompute_num_layers": 2}),
                  ["layers 0-1", "layers 0-1 (pass-through 1)", "layers 2-3", "layers 2-3 (pass-through 3)"],
                  {"": 4}),
    "uniform_3_ragged": (config({**MEGATRON_FULL, "recompute_method": "uniform", "recompute_num_layers": 3}),
                         ["layers 0-2", "layers 0-2 (pass-through 1)", "layers 0-2 (pass-through 2)", "layer 3"],
                         {"": 4}),
    "block_1_per_stage": (config({**MEGATRON_FULL, "recompute_method": "block", "recompute_num_layers": 1},
                                 parallel_config={"pipeline_stage": 2}), ["layer 0", "layer 2"], {"": 2}),
    "select_defaults": (config({"select_recompute": True}), labels(f"layer {{i}}: {MUL}|layer {{i}}: {SILU}"),
                        {SILU: 8, MUL: 8}),
    "core_attn": (config({"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}),
                  labels("layer {i}: attention.flash_attention"), {"attention.flash_attention": 4}),
    "mlp": (config({"recompute_granularity": "selective", "recompute_modules": ["mlp"]}),
            labels("layer {i}: feed_forward"), {"feed_forward": 4}),
    "comm_norm": (config({"select_comm_recompute": [r".*\.norm"]}),
                  labels("layer {i}: attention_norm.norm|layer {i}: ffn_norm.norm"),
                  {"attention_norm.norm": 8, "ffn_norm.norm": 8}),
    "exclude_mul": (config({"select_recompute": True, "select_recompute_exclude": [r"feed_forward\.mul"]}),
                    labels(f"layer {{i}}: {SILU}"), {SILU: 8}),
    "full_beats_select": (config({"recompute": [1], "select_recompute": True, "select_comm_recompute": True}),
                          ["layer 0"] + labels(f"layer {{i}}: {MUL}|layer {{i}}: {SILU}|"
                                               "layer {i}: attention_norm.norm|layer {i}: ffn_norm.norm", range(1, 4)),
                          {"": 1, SILU: 6, MUL: 6, "attention_norm.norm": 6, "ffn_norm.norm": 6}),
    "outermost_scope_wins": (config({"select_recompute": ["feed_forward", r"feed_forward\.mul",
                                                          r"feed_forward\.w1\.activation\.silu"]}),
                             labels("layer {i}: feed_forward"), {"feed_forward": 4}),
}


@pytest.mark.parametrize("name", CASES)
def test_backward_reruns_exactly_the_planned_regions(name, ops):
    raw, wrapped_labels, regions = CASES[name]
    base = run(None, early_stop=False)
    wrapped = run(raw, early_stop=False)
    assert wrapped.session.recompute.wrapped == wrapped_labels
    assert recomputed(wrapped, base) == expected(ops, regions)
    assert_same_training(wrapped, base)


@pytest.mark.parametrize("name", CASES)
def test_gradients_bit_identical_with_default_early_stop(name, ops, plain):
    raw, _, regions = CASES[name]
    wrapped = run(raw)
    assert_same_training(wrapped, plain)
    assert recomputed(wrapped, plain) <= expected(ops, regions)  # early stop may end a region sooner


def test_full_layer_recompute_with_early_stop_still_reruns_the_layer(ops, plain):
    extra = recomputed(run(config({"recompute": [2]})), plain)
    # w2's matmul is the only one whose result nobody saved for backward: early stop skips it
    assert extra["aten.mm"] == 2 * 6
    assert extra[next(iter(ops["layers.0.attention.flash_attention"]))] == 2


def test_a_full_layer_never_gets_op_wrappers_even_if_its_plan_lists_ops(ops):
    plan = build_plan(load_config(config({"select_recompute": True})))
    layers = list(plan.layers)
    layers[0] = replace(layers[0], full=True, unit=(0, 0))  # select patterns kept on purpose
    plan = replace(plan, layers=tuple(layers))
    base = run(None, early_stop=False)
    wrapped = run(plan, early_stop=False)
    assert wrapped.session.recompute.wrapped == ["layer 0"] + labels(f"layer {{i}}: {MUL}|layer {{i}}: {SILU}",
                                                                     range(1, 4))
    # a nested silu checkpoint inside layer 0 would re-run silu once more; layers 1-3 run silu and
    # mul twice each (checkpoint region + output recipe, see CASES)
    assert recomputed(wrapped, base) == expected(ops, {"": 1, SILU: 6, MUL: 6})
    assert_same_training(wrapped, base)


def saved_bytes(raw: dict) -> int:
    return run(raw).session.stats.saved_bytes


def test_uniform_units_save_only_each_units_input():
    uniform = {n: saved_bytes(config({**MEGATRON_FULL, "recompute_method": "uniform", "recompute_num_layers": n}))
               for n in (1, 2, 4)}
    # N=1 saves the input of all four layers, N=2 of layers 0 and 2, N=4 of layer 0 only
    assert uniform[1] - uniform[2] == 2 * H_BYTES
    assert uniform[2] - uniform[4] == H_BYTES
    assert uniform[1] == saved_bytes(config({"recompute": True}))
    assert saved_bytes(config()) - uniform[4] > 10 * H_BYTES  # the layers' own activations are gone


def test_selective_mlp_saves_less_than_keeping_everything():
    assert saved_bytes(config({"recompute_granularity": "selective", "recompute_modules": ["mlp"]})) \
        < saved_bytes(config())


def test_select_recompute_of_silu_and_mul_drops_their_outputs():
    """swapkit.runtime.recipes Note [Output recompute]: silu's and mul's outputs ([B, S, intermediate]) are
    not held for w2 / mul; recipes rebuild them in backward."""
    wrapped = run(config({"select_recompute": True}))
    stats = wrapped.session.stats
    per_layer = 2 * BATCH * CFG.seq_length * CFG.intermediate_size * 4  # two [B, S, intermediate] fp32
    assert stats.recomputed_output_bytes == CFG.num_layers * per_layer
    assert stats.saved_bytes == saved_bytes(config()) - CFG.num_layers * per_layer
    assert stats.output_recomputes == 2 * CFG.num_layers and stats.resident_bytes == 0


def test_outermost_drops_nested_and_repeated_paths():
    paths = ["feed_forward.mul", "attention_norm", "feed_forward", "attention.wq.matmul", "attention",
             "feed_forward", "attention_norm.norm", "ffn_norm.norm"]
    assert outermost(paths) == ["attention_norm", "feed_forward", "attention", "ffn_norm.norm"]
    assert outermost(["attention", "attention_norm"]) == ["attention", "attention_norm"]  # not a prefix path
    assert outermost(["a.b", "a.b"]) == ["a.b"]
    assert outermost([]) == []


# ---------------------------------------------------------------------------- recompute + swap

def swap_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and r.name.startswith("swapkit") and "no effect" in r.getMessage()]


def test_select_recomputed_op_overrides_its_op_swap(caplog, ops, plain):
    caplog.set_level(logging.INFO, logger="swapkit")
    raw = config({"recompute": False, "select_recompute": {"feed_forward": [0, 3]}}, {"swap": True, "op_swap": [
        {"op_name": "attention", "backward_prefetch": 20, "layers": [0, 1, 2]},
        {"op_name": "attention", "backward_prefetch": 10, "layers": [3]},
        {"op_name": "feed_forward", "backward_prefetch": 15, "layers": [0, 1, 2]}]})
    wrapped = run(raw, early_stop=False)
    plan = wrapped.session.plan
    assert [layer.overridden for layer in plan.layers] == [("feed_forward",), (), (), ()]
    assert plan.to_json()["layers"][0]["overridden"] == ["feed_forward"]
    assert swap_warnings(caplog) == ["op swap feed_forward at layer 0 has no effect: feed_forward is recomputed "
                                     "(recompute wins over swap)"]
    assert wrapped.session.recompute.wrapped == ["layer 0: feed_forward", "layer 3: feed_forward"]
    assert_same_training(wrapped, run(None, early_stop=False))
    assert recomputed(wrapped, run(None, early_stop=False)) == expected(ops, {"feed_forward": 2})
    moved = wrapped.session.stats.offloaded_by_scope
    assert set(moved) == {f"layer {i}: attention" for i in range(4)} | {"layer 1: feed_forward",
                                                                         "layer 2: feed_forward"}
    assert all(nbytes > 0 for nbytes in moved.values())
    assert sum(moved.values()) == wrapped.session.stats.offloaded_bytes


def test_full_recompute_overrides_the_layers_layer_and_op_swaps(caplog, ops):
    caplog.set_level(logging.INFO, logger="swapkit")
    raw = config({"recompute": [1]}, {"swap": True,
                                      "layer_swap": [{"backward_prefetch": 3, "layers": [1, 2]}],
                                      "op_swap": [{"op_name": "attention", "backward_prefetch": 2, "layers": [1]}]})
    base = run(None, early_stop=False)
    wrapped = run(raw, early_stop=False)
    assert [layer.overridden for layer in wrapped.session.plan.layers] == [(), ("layer", "attention"), (), ()]
    warnings = swap_warnings(caplog)
    assert len(warnings) == 2
    assert "layer swap at layer 1" in warnings[0] and "fully recomputed" in warnings[0]
    assert "op swap attention at layer 1" in warnings[1] and "fully recomputed" in warnings[1]
    assert wrapped.session.recompute.wrapped == ["layer 1"]
    assert recomputed(wrapped, base) == expected(ops, {"": 1})
    assert_same_training(wrapped, base)
    stats = wrapped.session.stats
    assert set(stats.offloaded_by_scope) == {"layer 2"}  # layer 1 moved nothing
    assert stats.offloaded_by_scope["layer 2"] == stats.offloaded_bytes > 0


def test_enclosing_layer_swap_still_offloads_the_inputs_of_recomputed_regions(plain):
    raw = config({"select_recompute": {"attention": [3], "feed_forward": [3]},
                  "select_comm_recompute": {".*_norm": [3]}},
                 {"swap": True, "layer_swap": [{"backward_prefetch": 1, "layers": [3]}]})
    wrapped = run(raw)
    assert wrapped.session.plan.layers[3].overridden == ()
    assert wrapped.session.recompute.wrapped == labels(
        "layer {i}: attention|layer {i}: feed_forward|layer {i}: attention_norm|layer {i}: ffn_norm", [3])
    stats = wrapped.session.stats
    # everything in layer 3 is recomputed: what is saved there are the four regions' inputs (layer
    # input, attention_norm output, mid residual, ffn_norm output); the norms' outputs are rebuilt
    # by recipes (swapkit.runtime.recipes Note [Output recompute]), so only the two residuals move
    assert stats.offloaded_by_scope == {"layer 3": 2 * H_BYTES}
    assert stats.offloaded_tensors == 2 and stats.recomputed_output_bytes == 2 * H_BYTES
    assert stats.skipped.get("parameter", 0) > 0
    assert_same_training(wrapped, plain)


# ---------------------------------------------------------------------------- state_dict and remove()

STATE_CONFIGS = {
    "full": CASES["full_all"][0],
    "uniform": CASES["uniform_2"][0],
    "select_and_comm": config({"recompute": [1], "select_recompute": True, "select_comm_recompute": True}),
    "swap_and_recompute": config({"recompute": [0], "select_recompute": {"feed_forward": [2]}}, {
        "swap": True, "layer_swap": [{"backward_prefetch": 2, "layers": [0, 1]}],
        "op_swap": [{"op_name": "attention", "backward_prefetch": 1, "layers": True}]}),
}


@pytest.mark.parametrize("name", STATE_CONFIGS)
def test_wrapping_never_changes_the_state_dict(name):
    reference = build_model(CFG, seed=1).state_dict()
    model = build_model(CFG, seed=1)
    session = swapkit.apply(model, STATE_CONFIGS[name])
    state = model.state_dict()
    assert list(state) == list(reference)
    assert all(torch.equal(state[key], reference[key]) for key in state)
    session.remove()


def sgd_step(run_: Run) -> None:
    with torch.no_grad():
        for param in run_.model.parameters():
            param -= 0.5 * param.grad
            param.grad = None


def test_checkpoint_saved_while_applied_loads_into_the_plain_model_and_back(tmp_path):
    raw = STATE_CONFIGS["swap_and_recompute"]
    trained = run(raw)
    sgd_step(trained)
    torch.save(trained.model.state_dict(), tmp_path / "wrapped.pt")
    plain = build_model(CFG, seed=2)
    plain.load_state_dict(torch.load(tmp_path / "wrapped.pt"))  # strict: same keys
    for (name, a), b in zip(trained.model.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name
    torch.save(plain.state_dict(), tmp_path / "plain.pt")
    again = build_model(CFG, seed=3)
    session = swapkit.apply(again, raw)
    again.load_state_dict(torch.load(tmp_path / "plain.pt"))
    assert_same_training(step(again, session=session), step(plain))


def hooks_left(model: nn.Module) -> list[str]:
    found = []
    for name, module in model.named_modules():
        for kind in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            if getattr(module, kind):
                found.append(f"{name}.{kind}")
        if "forward" in module.__dict__:
            found.append(f"{name}.forward")
    return found


@pytest.mark.parametrize("name", STATE_CONFIGS)
def test_remove_restores_the_model_exactly(name, plain):
    model = build_model(CFG, seed=1)
    session = swapkit.apply(model, STATE_CONFIGS[name])
    assert hooks_left(model)  # something was installed
    step(model, session=session)
    model.zero_grad(set_to_none=True)
    session.remove()
    assert hooks_left(model) == []
    assert session.recompute.wrapped == []
    again = step(model)
    assert again.backward_ops == plain.backward_ops  # nothing is recomputed any more
    assert_same_training(again, plain)
    session.remove()  # idempotent


# ---------------------------------------------------------------------------- dropout

DROPOUT_CASES = {
    "full": config({"recompute": [2]}, model={"hidden_dropout": 0.1, "attention_dropout": 0.1}),
    "uniform": config({**MEGATRON_FULL, "recompute_method": "uniform", "recompute_num_layers": 2},
                      model={"hidden_dropout": 0.1, "attention_dropout": 0.1}),
    "core_attn": config({"recompute_granularity": "selective", "recompute_modules": ["core_attn"]},
                        model={"hidden_dropout": 0.1, "attention_dropout": 0.1}),
    "select_defaults": config({"select_recompute": True}, model={"hidden_dropout": 0.1, "attention_dropout": 0.1}),
    "mlp": config({"recompute_granularity": "selective", "recompute_modules": ["mlp"]},
                  model={"hidden_dropout": 0.1, "attention_dropout": 0.1}),
    "full_reentrant": config({"recompute": True, "use_reentrant": True},
                             model={"hidden_dropout": 0.1, "attention_dropout": 0.1}),
}


def test_dropout_is_active_in_the_dropout_model():
    assert not torch.equal(run(None, DROPOUT, rng_seed=7).loss, run(None, DROPOUT, rng_seed=8).loss)


@pytest.mark.parametrize("name", DROPOUT_CASES)
def test_dropout_recomputes_with_the_same_masks(name):
    base = run(None, DROPOUT, rng_seed=7, early_stop=False)
    wrapped = run(DROPOUT_CASES[name], DROPOUT, rng_seed=7, early_stop=False)
    assert recomputed(wrapped, base)  # something was re-run (dropout included where it lies in a region)
    assert_same_training(wrapped, base)


def test_dropout_ops_are_rerun_by_a_full_layer_recompute():
    ops = region_ops(DROPOUT)
    assert ops["layers.0.hidden_dropout"]  # hidden dropout draws random numbers in training
    base = run(None, DROPOUT, rng_seed=7, early_stop=False)
    wrapped = run(DROPOUT_CASES["full"], DROPOUT, rng_seed=7, early_stop=False)
    assert recomputed(wrapped, base) == expected(ops, {"": 2})


# ---------------------------------------------------------------------------- eval / no_grad

@pytest.mark.parametrize("name", ["full_all", "uniform_2", "select_defaults", "core_attn", "mlp"])
def test_eval_and_no_grad_call_straight_through(name):
    tokens, targets = batch()
    models = [build_model(CFG, seed=1), build_model(CFG, seed=1)]
    swapkit.apply(models[1], CASES[name][0])
    counts = []
    for model in models:
        with torch.no_grad(), OpCounter() as train_no_grad:
            train_out = model(tokens)
        model.eval()
        with OpCounter() as eval_forward:
            loss = lm_loss(model(tokens), targets)
        with OpCounter() as eval_backward:
            loss.backward()
        counts.append((train_out, loss, train_no_grad.total, eval_forward.total, eval_backward.total))
    (out_a, loss_a, *ops_a), (out_b, loss_b, *ops_b) = counts
    assert torch.equal(out_a, out_b) and torch.equal(loss_a, loss_b)
    assert ops_a == ops_b  # same forward ops, and no recompute in the eval backward
    for (name_a, p_a), (_, p_b) in zip(*(m.named_parameters() for m in models)):
        assert torch.equal(p_a.grad, p_b.grad), name_a


# ---------------------------------------------------------------------------- use_reentrant

@pytest.mark.parametrize("name", ["full_first_two", "uniform_2", "block_1_per_stage"])
def test_reentrant_full_layer_recompute(name, ops):
    raw, _, regions = CASES[name]
    raw = {**raw, "recompute_config": {**raw["recompute_config"], "use_reentrant": True}}
    base = run(None)
    wrapped = run(raw)
    assert wrapped.session.plan.use_reentrant
    assert recomputed(wrapped, base) == expected(ops, regions)  # reentrant re-runs whole regions
    assert_same_training(wrapped, base)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return torch.tanh(self.lin(h)) * scale


class KeywordNet(nn.Module):
    """Calls its layers with a keyword argument."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.layers = nn.ModuleList(Layer() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h, scale=2.0)
        return h


class RawInputNet(nn.Module):
    """Feeds the raw input (no grad) straight into the first layer."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def toy_run(net: type, recompute: dict | None) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = net()
    if recompute is not None:
        swapkit.apply(model, {"model": {"model_config": {"num_layers": 2}}, "recompute_config": recompute})
    model(torch.randn(4, 8)).square().sum().backward()
    return {name: p.grad for name, p in model.named_parameters()}


def assert_toy_grads_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("net, message", [
    (KeywordNet, r"recompute of layer 0 with use_reentrant=True cannot pass keyword arguments \(scale\)"),
    (RawInputNet, r"recompute of layer 0 with use_reentrant=True needs a tensor input that requires grad"),
])
def test_reentrant_limits_raise_a_clear_error(net, message):
    with pytest.raises(ValueError, match=message) as err:
        toy_run(net, {"recompute": True, "use_reentrant": True})
    assert "use_reentrant: false" in str(err.value)
    # the same model is fine with non-reentrant checkpointing
    assert_toy_grads_equal(toy_run(net, {"recompute": True}), toy_run(net, None))


def test_reentrant_checks_only_apply_when_recomputing():
    torch.manual_seed(0)
    model = KeywordNet()
    swapkit.apply(model, {"model": {"model_config": {"num_layers": 2}},
                          "recompute_config": {"recompute": True, "use_reentrant": True}})
    with torch.no_grad():
        model(torch.randn(4, 8))  # no recompute, no error
    model.eval()
    model(torch.randn(4, 8))


def frozen_bottom(model: nn.Module) -> nn.Module:
    """A fine-tune's frozen embedding and first two layers: they have nothing to differentiate."""
    for p in [*model.tok_embeddings.parameters(), *model.layers[:2].parameters()]:
        p.requires_grad_(False)
    return model


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_frozen_layer_is_not_recomputed_and_trainable_ones_are(use_reentrant):
    """region_inputs Note [Regions with nothing to differentiate]: reentrant checkpointing refused the
    frozen layer, non-reentrant counted it as recomputed although backward never re-runs it."""
    tokens = torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_length + 1), generator=torch.Generator().manual_seed(0))
    plain, model = frozen_bottom(build_model(CFG, seed=0)), frozen_bottom(build_model(CFG, seed=0))
    session = swapkit.apply(model, {"model": {"model_config": {"num_layers": 4}}, "swap_config": {
        "swap": True, "layer_swap": [{"backward_prefetch": 1, "layers": [1]}]}, "recompute_config": {
        "recompute": [0, 3], "select_recompute": {"attention": [1, 2]}, "use_reentrant": use_reentrant}})
    lm_loss(plain(tokens[:, :-1]), tokens[:, 1:]).backward()
    with session:
        lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    assert session.stats.recomputed_by_scope == {"layer 2: attention": 1, "layer 3": 1}
    assert session.stats.unused_swaps == ["layer 1"]  # no output recipe kept layer 1's attention input
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad), name


class InplaceActLayer(nn.Module):
    """``act`` is ``ReLU(inplace=True)`` (torchvision's blocks): it overwrites its input, ``lin``'s output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.act, self.out = nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.lin(x)))


class InplaceActNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(InplaceActLayer() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("recompute", [
    {"select_recompute": ["act"]}, {"select_recompute": ["act"], "use_reentrant": True},
    {"recompute_granularity": "selective", "recompute_modules": ["mlp"], "module_scopes": {"mlp": "act"}}])
def test_a_region_that_overwrites_its_input_is_refused_in_forward(recompute):
    """Note [Regions that write their inputs]: before, backward raised swapkit's in-place error, which
    said autograd would fail without swapkit too, although the model trains without swapkit."""
    with pytest.raises(RuntimeError, match=r"swapkit: the recomputed region layer 0: act \(ReLU\) changed its "
                                           r"input in place.*inplace=False.*recompute_config"):
        toy_run(InplaceActNet, recompute)
    toy_run(InplaceActNet, None)  # trains without swapkit



class SpectralLayer(nn.Module):
    """``spectral_norm`` (a GAN's discriminator): each training forward runs a power-iteration step that
    writes the buffers ``_u`` and ``_v`` in place, and the weight is computed from them."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.utils.parametrizations.spectral_norm(nn.Linear(8, 8))
        self.register_buffer("scale", torch.full((8,), 0.5))  # only read: never refused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * self.scale


class CountingLayer(nn.Module):
    """A buffer of the model's own changed in forward (a step counter); the output does not read it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.lin(x))


def net_of(layer: type) -> type:
    class Net(InplaceActNet):
        def __init__(self) -> None:
            nn.Module.__init__(self)
            self.layers = nn.ModuleList(layer() for _ in range(2))

    return Net


def test_plain_checkpoint_of_a_region_writing_a_buffer_changes_the_gradients():
    """What the refusal below prevents: torch.utils.checkpoint re-runs spectral_norm's power iteration
    in backward from the buffers the forward changed, so the recomputed weight is another one."""
    torch.manual_seed(0)
    layer = SpectralLayer()
    ref = copy.deepcopy(layer)
    x = torch.randn(4, 8)
    ref(x).square().sum().backward()
    torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False).square().sum().backward()
    assert not torch.equal(layer.lin.parametrizations.weight.original.grad,
                           ref.lin.parametrizations.weight.original.grad)


@pytest.mark.parametrize("layer, buffer, region", [
    (SpectralLayer, r"lin\.parametrizations\.weight\.0\._u", r"layer 0 \(SpectralLayer\)"),
    (CountingLayer, "calls", r"layer 0 \(CountingLayer\)")])
def test_a_region_that_writes_a_buffer_is_refused_in_forward(layer, buffer, region):
    """Note [Regions that write module state]: before, the gradients (spectral norm) or the buffer
    (a counter, moved twice per step) differed silently from the model without recompute."""
    with pytest.raises(RuntimeError, match=rf"swapkit: the recomputed region {region} changed its buffer "
                                           rf"{buffer} in place in forward.*out of recompute_config"):
        toy_run(net_of(layer), {"recompute": True})


@pytest.mark.parametrize("recompute, region", [
    ({"select_recompute": ["lin"]}, r"layer 0: lin \(ParametrizedLinear\) changed its buffer "
                                    r"parametrizations\.weight\.0\._u"),
    ({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2},
     r"layers 0-1 \(SpectralLayer\) changed its buffer layer 0: lin\.parametrizations\.weight\.0\._u")])
def test_op_regions_and_units_that_write_a_buffer_are_refused_naming_it(recompute, region):
    with pytest.raises(RuntimeError, match=rf"swapkit: the recomputed region {region} in place"):
        toy_run(net_of(SpectralLayer), recompute)


def test_a_region_that_only_reads_a_buffer_is_recomputed_exactly():
    """``scale`` is read by every layer; with the spectral norms in eval mode nothing is written."""
    def run(recompute: dict | None) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = net_of(SpectralLayer)()
        for layer in model.layers:
            layer.lin.eval()  # spectral_norm power-iterates only in training mode
        if recompute is not None:
            swapkit.apply(model, {"model": {"model_config": {"num_layers": 2}}, "recompute_config": recompute})
        model(torch.randn(4, 8)).square().sum().backward()
        return {name: p.grad for name, p in model.named_parameters()}

    assert_toy_grads_equal(run({"recompute": True}), run(None))


class ClipsEarlierLayer(InplaceActNet):
    """After layer 1 ran, clips layer 0's weight in place (a max-norm constraint applied mid-forward)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers[1](self.layers[0](x))
        with torch.no_grad():
            self.layers[0].lin.bias.clamp_(-0.1, 0.1)
        return x


@pytest.mark.parametrize("recompute", [
    {"recompute": True}, {"select_recompute": ["lin"]},
    {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2}])
def test_a_parameter_changed_between_forward_and_re_run_raises_in_backward(recompute):
    """Note [Module state changed before the re-run]: plain autograd needs no bias to compute gradients
    (nothing saved it), so the model trains; before, the re-run read the clipped bias and every gradient
    behind it was that of another forward, silently."""
    plain = toy_run(ClipsEarlierLayer, None)
    assert plain["layers.0.lin.weight"] is not None
    with pytest.raises(RuntimeError, match=r"swapkit: (layer 0: )?(lin\.)?bias of the recomputed region layers? 0.* "
                                           r"was changed in place between the region's forward and its "
                                           r"recomputation in backward .*out of recompute_config"):
        toy_run(ClipsEarlierLayer, recompute)



class Shift(nn.Module):
    """``x + bias``: saves nothing, so its checkpoint never re-runs; only an output recipe re-runs it."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bias


class ShiftLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shift, self.out = Shift(), nn.Linear(8, 8)  # out saves shift's output: the recipe rebuilds it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.shift(x))


class ClipsShift(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ShiftLayer() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers[1](self.layers[0](x))
        with torch.no_grad():
            self.layers[0].shift.bias.clamp_(-0.1, 0.1)
        return x


def test_an_output_recipe_re_run_after_a_parameter_changed_raises():
    """Note [Module state changed before the re-run], for MindFormers op semantics: the recipe rebuilding
    shift's output read the clipped bias, so ``out``'s weight gradient was another forward's, silently."""
    torch.manual_seed(0)
    model = ClipsShift()
    session = swapkit.apply(model, {"model": {"model_config": {"num_layers": 2}},
                                    "recompute_config": {"select_recompute": ["shift"]}})
    with pytest.raises(RuntimeError, match=r"swapkit: bias of the recomputed region layer 0: shift was changed"):
        with session:
            model(torch.randn(4, 8)).square().sum().backward()
    assert session.stats.output_recomputes == 1  # layer 1's recipe ran; layer 0's raised

def test_an_optimizer_step_between_forward_and_backward_raises_with_recompute():
    torch.manual_seed(0)
    model = InplaceActNet()
    swapkit.apply(model, {"model": {"model_config": {"num_layers": 2}}, "recompute_config": {"recompute": True}})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.randn(4, 8)).square().sum()
    model(torch.randn(4, 8)).square().sum().backward()  # another micro-batch's backward, then a step
    optimizer.step()
    with pytest.raises(RuntimeError, match=r"swapkit: lin\.weight of the recomputed region layer 1 was changed"):
        loss.backward()


class OwnGeneratorLayer(nn.Module):
    """Dropout drawn from a ``torch.Generator`` the module owns (reproducible per-module noise)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.generator = torch.Generator().manual_seed(7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.bernoulli(torch.full((x.shape[0], 8), 0.7), generator=self.generator)
        return torch.tanh(self.lin(x)) * keep


@pytest.mark.parametrize("recompute", [
    {"recompute": True}, {"recompute": True, "use_reentrant": True},
    {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2}])
def test_a_generator_owned_by_the_region_replays_its_numbers(recompute):
    """Note [Generators of the region's modules]: checkpointing replays only the default generators, so the
    re-run drew another mask from the module's own generator and the gradients differed silently."""
    def run(config: dict | None) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
        torch.manual_seed(0)
        model = net_of(OwnGeneratorLayer)()
        if config is not None:
            swapkit.apply(model, {"model": {"model_config": {"num_layers": 2}}, "recompute_config": config})
        for _ in range(2):
            model(torch.randn(4, 8, requires_grad=True)).square().sum().backward()
        return {n: p.grad for n, p in model.named_parameters()}, [l.generator.get_state() for l in model.layers]

    (got, got_states), (expected, expected_states) = run(recompute), run(None)
    assert_toy_grads_equal(got, expected)
    assert all(torch.equal(a, b) for a, b in zip(got_states, expected_states))  # the re-run drew nothing

# ---------------------------------------------------------------------------- wrapper contracts

class OptionsLayer(nn.Module):
    """Keyword names that torch.utils.checkpoint also takes (Note [Keyword arguments ...])."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor, debug: bool = False, early_stop: float = 1.0) -> torch.Tensor:
        return self.lin(h) * (3.0 if debug else 1.0) * early_stop


class OptionsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(OptionsLayer() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, debug=True, early_stop=2.0)
        return x


def test_module_keywords_named_like_checkpoint_options_reach_the_module():
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(0)
    reference = OptionsNet()
    expected_out = reference(x)
    torch.manual_seed(0)
    model = OptionsNet()
    swapkit.apply(model, {"model": {"model_config": {"num_layers": 2}}, "recompute_config": {"recompute": True}})
    out = model(x)
    assert torch.equal(out, expected_out)
    out.sum().backward()
    expected_out.sum().backward()
    assert_toy_grads_equal({n: p.grad for n, p in model.named_parameters()},
                           {n: p.grad for n, p in reference.named_parameters()})


def test_remove_puts_back_a_forward_the_user_had_patched_on_the_instance():
    torch.manual_seed(0)
    model = RawInputNet()
    patched = model.layers[0].forward = lambda h, scale=1.0: Layer.forward(model.layers[0], h, scale) * 0.5
    x = torch.randn(4, 8, requires_grad=True)
    expected_out = model(x)
    session = swapkit.apply(model, {"model": {"model_config": {"num_layers": 2}},
                                    "recompute_config": {"recompute": True}})
    assert model.layers[0].__dict__["forward"] is not patched
    assert torch.equal(model(x), expected_out)  # the wrapper recomputes the patched forward
    session.remove()
    assert model.layers[0].__dict__["forward"] is patched
    assert "forward" not in model.layers[1].__dict__


class LoopNet(nn.Module):
    """A decoder loop that breaks uniform units in one of two ways (or not at all)."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.layers = nn.ModuleList(Layer() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.requires_grad_()
        for i, layer in enumerate(self.layers):
            if self.mode == "between":
                h = layer(h) + 0.0
            elif self.mode == "per_layer_args":
                h = layer(h, 1.0 + i)
            elif self.mode.startswith("skip"):  # LayerDrop, an early exit: layer int(mode[4:]) is skipped
                h = h if i == int(self.mode[4:]) else layer(h, 0.5)
            else:
                h = layer(h, 0.5)
        return h


UNIFORM_2 = {"model": {"model_config": {"num_layers": 4}},
             "recompute_config": {**MEGATRON_FULL, "recompute_method": "uniform", "recompute_num_layers": 2}}


@pytest.mark.parametrize("mode, message", [
    ("between", r"layer 1 was called with a tensor other than the previous layer's output"),
    ("per_layer_args", r"layer 1 was called with other extra arguments than the first layer of the unit"),
])
def test_uniform_unit_refuses_a_loop_it_would_compute_wrongly(mode, message):
    model = LoopNet(mode)
    swapkit.apply(model, UNIFORM_2)
    with pytest.raises(RuntimeError, match=message):
        model(torch.randn(4, 8))


@pytest.mark.parametrize("skipped, message", [
    (1, "uniform recompute unit layers 0-1: layer 1 was not called after layer 0 in that forward"),
    (3, "uniform recompute unit layers 2-3: layer 3 was not called after layer 2 in that forward")])
def test_uniform_unit_whose_later_layer_is_skipped_raises_in_backward(skipped, message):
    """Note [Uniform units]: the unit had already run the skipped layer; before, the loss and gradients were
    those of a model that ran it, silently (layer 3: the model's output itself was the unit's)."""
    torch.manual_seed(0)
    model = LoopNet(f"skip{skipped}")
    swapkit.apply(model, UNIFORM_2)
    loss = model(torch.randn(4, 8)).square().sum()
    with pytest.raises(RuntimeError, match=message + r".*recompute_method: block"):
        loss.backward()
    model.mode = "skip0"  # a skipped head is no unit: layer 1 computes itself (no stale unit output left)
    model(torch.randn(4, 8)).square().sum().backward()

def test_uniform_unit_with_same_extra_arguments_matches_the_plain_loop():
    torch.manual_seed(0)
    plain_model = LoopNet("same")
    model = LoopNet("same")
    model.load_state_dict(plain_model.state_dict())
    swapkit.apply(model, UNIFORM_2)
    x = torch.randn(4, 8)
    for m in (plain_model, model):
        m(x.clone()).square().sum().backward()
    assert_toy_grads_equal({n: p.grad for n, p in model.named_parameters()},
                           {n: p.grad for n, p in plain_model.named_parameters()})


def test_uniform_unit_lets_go_of_its_output_after_the_forward():
    model = build_model(CFG, seed=1)
    swapkit.apply(model, CASES["uniform_2"][0])
    outputs: list[weakref.ref] = []
    handle = model.layers[3].register_forward_hook(lambda _m, _a, out: outputs.append(weakref.ref(out)))
    tokens, targets = batch()
    lm_loss(model(tokens), targets).backward()
    handle.remove()
    gc.collect()
    assert outputs and outputs[0]() is None  # nothing in the wrappers keeps the last unit's output alive
    # and a pass-through called on its own (no unit running) computes its layer
    h = torch.randn(BATCH, CFG.seq_length, CFG.hidden_size, requires_grad=True)
    cos, sin = model.rope_cos, model.rope_sin
    assert not torch.equal(model.layers[1](h, cos, sin), h)


# ---------------------------------------------------------------------------- shipped configs

SEED_CONFIGS = {
    # file: (wrapped labels of full layers or None, recomputed regions {path: count})
    "seed001_recompute_pp.yaml": (
        ["layer 0", "layer 1", "layer 4", "layer 24"],
        # 4 full layers; silu, mul and both norms on the other 44; w1's matmul on layers 25 and 29;
        # w3's matmul only picks full layers (0, 24 and 4)
        {"": 4, SILU: 44, MUL: 44, "attention_norm.norm": 44, "ffn_norm.norm": 44, "feed_forward.w1.matmul": 2}),
    # feed_forward's output feeds the residual add, which saves nothing: no output recipe runs
    "seed001_swap_recompute.yaml": ([], {"feed_forward": 2}),
    "megatron_selective_core_attn.yaml": ([], {"attention.flash_attention": 4}),
    "megatron_selective_core_attn_layernorm.yaml": ([], {"attention.flash_attention": 4, "attention_norm": 4,
                                                         "ffn_norm": 4}),
    "megatron_selective_mlp.yaml": ([], {"feed_forward": 4}),
    "megatron_full_uniform.yaml": (labels("layer {i}"), {"": 4}),
    "megatron_full_block.yaml": (["layer 0", "layer 1", "layer 2", "layer 4", "layer 5", "layer 6"], {"": 6}),
}


# MindFormers scopes whose outputs a consumer saves also run once as an output recipe (see CASES)
RECIPE_SCOPES = {SILU, MUL, "attention_norm.norm", "ffn_norm.norm", "feed_forward.w1.matmul"}
RECIPE_RERUNS = {"seed001_recompute_pp.yaml": 2}


@pytest.mark.parametrize("name", SEED_CONFIGS)
def test_shipped_config_trains_like_the_unwrapped_model(name):
    full_layers, regions = SEED_CONFIGS[name]
    cfg = load_config(CONFIGS / name).model
    base = run(None, cfg, early_stop=False)
    wrapped = run(CONFIGS / name, cfg, early_stop=False)
    wrapped_labels = wrapped.session.recompute.wrapped
    assert [label for label in wrapped_labels if ":" not in label] == full_layers
    assert len(wrapped_labels) == sum(regions.values())
    reruns = {path: count * RECIPE_RERUNS.get(name, 1) if path in RECIPE_SCOPES else count
              for path, count in regions.items()}
    assert recomputed(wrapped, base) == expected(region_ops(cfg), reruns)
    assert_same_training(wrapped, base)
    assert_same_training(run(CONFIGS / name, cfg), run(None, cfg))  # default early stop


def test_seed001_recompute_pp_hand_counts():
    cfg = load_config(CONFIGS / "seed001_recompute_pp.yaml").model
    extra = recomputed(run(CONFIGS / "seed001_recompute_pp.yaml", cfg, early_stop=False),
                       run(None, cfg, early_stop=False))
    # four full layers, plus w1's matmul on layers 25 and 29 (region + output recipe each)
    assert extra["aten.mm"] == 4 * 7 + 2 * 2
    assert extra["aten.silu"] == 4 + 44 * 2  # once in each full layer, twice in the 44 select layers
    assert extra["aten.rsqrt"] == 4 * 2 + 44 * 2 * 2  # both norms: once in full layers, twice elsewhere


def test_seed001_swap_recompute_swaps_the_other_ops():
    cfg = load_config(CONFIGS / "seed001_swap_recompute.yaml").model
    wrapped = run(CONFIGS / "seed001_swap_recompute.yaml", cfg)
    assert wrapped.session.recompute.wrapped == ["layer 0: feed_forward", "layer 3: feed_forward"]
    assert all(layer.overridden == () for layer in wrapped.session.plan.layers)
    assert set(wrapped.session.stats.offloaded_by_scope) == {f"layer {i}: attention" for i in range(4)} | {
        "layer 1: feed_forward", "layer 2: feed_forward"}


@pytest.mark.parametrize("recompute", [{"recompute": True}, {"select_recompute": {"lin": [3]}}],
                         ids=["full", "select"])
def test_a_gradient_forward_in_eval_mode_is_warned_once(recompute, caplog):
    """swapkit recomputes only in training mode (as HF's gradient checkpointing): a forward with grad in eval
    mode (training with dropout turned off through model.eval()) recomputed nothing, silently. It now warns
    once per session; a forward in training mode, or in eval mode under no_grad, does not."""
    from tests.toys import ToyNet, toy_config

    torch.manual_seed(0)
    model = ToyNet(3, dim=16)
    session = swapkit.apply(model, toy_config(3, recompute_config=recompute))
    caplog.set_level(logging.WARNING, logger="swapkit")
    x = torch.randn(4, 16)
    with session:
        model(x).sum().backward()
    model.eval()
    with session, torch.no_grad():
        model(x)
    assert not [m for m in caplog.messages if "eval mode" in m]
    for _ in range(2):
        with session:
            model(x).sum().backward()
    warnings = [m for m in caplog.messages if "eval mode" in m]
    assert len(warnings) == 1
    assert warnings[0].startswith("swapkit: layer 0") and "is not recomputed" in warnings[0]
    assert "model.train()" in warnings[0]


@pytest.mark.parametrize("recompute, expected", [
    ({"recompute": [2]}, {"layer 0": 1, "layer 1": 1}),
    ({"select_recompute": {"lin": [3]}}, {"layer 0: lin": 1, "layer 1: lin": 1, "layer 2: lin": 1}),
    ({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 3}, {"layers 0-2": 1}),
], ids=["full", "select", "uniform"])
def test_stats_say_which_regions_were_recomputed(recompute, expected):
    """A user checking that recompute happens (HF's gradient checkpointing beside it, eval mode, a compiled
    model) had no stat for it: only select recompute's rebuilt outputs were counted."""
    from tests.toys import ToyNet, toy_config

    torch.manual_seed(0)
    model = ToyNet(3, dim=16)
    session = swapkit.apply(model, toy_config(3, recompute_config=recompute))
    x = torch.randn(4, 16)
    for _ in range(2):
        with session:
            model(x).sum().backward()
        assert session.stats.recomputed_by_scope == expected  # per step, not accumulated
    model.eval()
    with session:
        model(x).sum().backward()
    assert session.stats.recomputed_by_scope == {}  # eval mode: nothing is recomputed (Note [Recompute in eval mode])
    assert "recomputed regions" not in str(session.stats)
    model.train()
    with session:
        model(x).sum().backward()
    assert "recomputed regions" in str(session.stats)
