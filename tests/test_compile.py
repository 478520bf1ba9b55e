"""swapkit with ``torch.compile``d layers (``eager`` and ``aot_eager`` backends, tiny model).

Scope hooks and recipe bookkeeping run outside compiled graphs (swapkit.runtime.scope
Note [Bookkeeping stays out of compiled graphs]): swap stays bit-identical to the same compiled
model without swapkit, and op swaps offload what their scopes save.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import logging

import pytest
import torch

import swapkit
from swapkit.runtime import dynamo as dynamo_module
from swapkit.runtime import session as session_module
from swapkit.runtime.overrides import NOT_ENTERED
from tests.toys import SMALL, ReadyWhenDone, grads, install_engine, llama, llama_batch, llama_step, require_native

CFG = dataclasses.replace(SMALL, num_layers=2)
VARIANTS = {
    "layer_swap": {"swap_config": {"swap": True, "layer_swap": [{"backward_prefetch": 1, "layers": True}]}},
    "op_swap": {"swap_config": {"swap": True, "op_swap": [{"op_name": "attention", "backward_prefetch": 1,
                                                            "layers": True}]}},
    "select_recompute": {"recompute_config": {"select_recompute": True}},
    "full_recompute": {"recompute_config": {"recompute": True}},
}
KEEP_ONLY = {"keep_only": {}}  # not in VARIANTS: the tests of those check what swaps and recomputes did


@pytest.fixture(autouse=True, scope="module")
def _one_thread_here(one_thread):
    """Tiny matrices in this file (conftest's ``one_thread``)."""


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Dynamo's cache is per code object, shared by every model instance: start each test clean."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled(model, backend: str):
    for layer in model.layers:
        layer.compile(backend=backend)
    return model


def run(model, session=None, steps: int = 2, step=llama_step) -> list[torch.Tensor]:
    batch = llama_batch(cfg=CFG)
    losses = []
    for _ in range(steps):
        torch.manual_seed(0)
        if session is None:
            losses.append(step(model, batch))
        else:
            with session:
                losses.append(step(model, batch))
    return losses


@functools.lru_cache(maxsize=None)
def reference_grads(backend: str) -> tuple[list[torch.Tensor], dict]:
    """The compiled model without swapkit (a seeded model and batch: the same bits whichever test runs it
    first), computed once per backend; the tests only read it."""
    model = compiled(llama(cfg=CFG), backend)
    losses = run(model)
    torch._dynamo.reset()
    return losses, grads(model)


def config(variant: str) -> dict:
    if variant in KEEP_ONLY:
        return {"model": {"model_config": {"num_layers": CFG.num_layers}}, "runtime": {}}
    return {"model": {"model_config": {"num_layers": CFG.num_layers}},
            "runtime": {"min_offload_bytes": 0, "skip_tail_offload": False}, **VARIANTS[variant]}


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_compiled_layers_match_the_compiled_model(backend, variant):
    ref_losses, ref_grads = reference_grads(backend)
    model = llama(cfg=CFG)
    session = swapkit.apply(model, config(variant), layers="layers")
    install_engine(session, ReadyWhenDone())
    losses = run(compiled(model, backend), session)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    got = grads(model)
    assert got.keys() == ref_grads.keys()
    if (variant, backend) == ("op_swap", "aot_eager"):
        # the graph break at the swapped scope splits AOTAutograd's graph, which changes the last bits
        # (test_swap_under_aot_eager_is_exact_given_the_same_graphs shows the swap itself is exact)
        torch.testing.assert_close(got, ref_grads)
    else:
        assert all(torch.equal(got[name], ref_grads[name]) for name in got), "gradients differ"
    stats = session.stats
    assert stats.unused_swaps == []
    if variant == "op_swap":
        assert set(stats.offloaded_by_scope) == {"layer 0: attention", "layer 1: attention"}
        assert stats.prefetched_bytes == stats.offloaded_bytes > 0
    if variant == "layer_swap":
        assert set(stats.offloaded_by_scope) == {"layer 0", "layer 1"}
    if variant == "select_recompute":
        assert stats.recomputed_output_bytes > 0 and stats.output_recomputes == 2 * CFG.num_layers


def test_swap_under_aot_eager_is_exact_given_the_same_graphs():
    results = []
    for min_bytes in (0, 1 << 40):  # swap everything / swap nothing, through the same hooks and graph breaks
        torch._dynamo.reset()
        model = llama(cfg=CFG)
        cfg = config("op_swap")
        cfg["runtime"]["min_offload_bytes"] = min_bytes
        session = swapkit.apply(model, cfg, layers="layers")
        install_engine(session, ReadyWhenDone())
        results.append((run(compiled(model, "aot_eager"), session), grads(model), session.stats.offloaded_bytes))
    (losses, got, moved), (ref_losses, ref, kept) = results
    assert moved > 0 and kept == 0
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert all(torch.equal(got[name], ref[name]) for name in got), "gradients differ"


def test_hooks_added_after_compilation_are_reported(caplog):
    model = compiled(llama(cfg=CFG), "eager")
    run(model, steps=1)  # traced without swapkit's hooks; Dynamo does not guard on module hooks
    session = swapkit.apply(model, config("op_swap"), layers="layers")
    caplog.set_level(logging.WARNING, logger="swapkit")
    run(model, session, steps=1)
    assert session.stats.offloaded_bytes == 0
    assert session.stats.unused_swaps == ["layer 0: attention", "layer 1: attention"]
    warnings = [m for m in caplog.messages if "saw no saved tensor" in m]
    assert len(warnings) == 1 and NOT_ENTERED in warnings[0]  # one warning for both layers
    assert warnings[0].startswith("swapkit: op swap at layers 0-1: attention saw no saved tensor")
    # the fix fits the cause: there is no other checkpointing to stop here (it used to say so)
    assert "stop the other checkpointing" not in warnings[0]
    assert warnings[0].endswith("the swap has no effect. Call torch._dynamo.reset() after swapkit.apply, or drop "
                                "the swap from swap_config if the module is never called "
                                "(Note [Swaps nobody reports])")


@pytest.mark.cuda
@pytest.mark.parametrize("variant", ["layer_swap", "op_swap"])
def test_inductor_on_cuda_swap_is_exact_given_the_same_graphs(variant):
    """Inductor-compiled layers on the GPU with the CUDA engine: swapping everything vs nothing, through
    the same hooks and graph breaks, gives the same bits, and every offloaded byte comes back."""
    results = []
    for min_bytes in (0, 1 << 40):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = llama(cfg=CFG).cuda()
        cfg = config(variant)
        cfg["runtime"]["min_offload_bytes"] = min_bytes
        session = swapkit.apply(model, cfg, layers="layers")
        batch = tuple(t.cuda() for t in llama_batch(cfg=CFG))
        compiled(model, "inductor")
        losses = []
        for _ in range(2):
            with session:
                losses.append(llama_step(model, batch))
        torch.cuda.synchronize()
        assert session.engine.name == "cuda"
        results.append((losses, grads(model), session.stats))
    (losses, got, stats), (ref_losses, ref, kept) = results
    assert stats.offloaded_bytes > 0 and kept.offloaded_bytes == 0
    assert stats.prefetched_bytes == stats.offloaded_bytes and stats.unused_swaps == []
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert all(torch.equal(got[name], ref[name]) for name in got), "gradients differ"


def whole_model_run(variant: str | None, backend: str, step_compiled: bool,
                    native: bool = False) -> tuple[list, dict, object]:
    """``torch.compile`` of the whole model (or of the whole training step, backward included); ``native``:
    ``runtime.native_save``."""
    torch._dynamo.reset()
    model = llama(cfg=CFG)
    settings = config(variant) if variant is not None else None
    if native:
        settings["runtime"] = {**settings["runtime"], "native_save": True}
    session = None if variant is None else swapkit.apply(model, settings, layers="layers")
    if session is not None:
        install_engine(session, ReadyWhenDone())
    step = torch.compile(llama_step, backend=backend) if step_compiled else llama_step
    target = model if step_compiled else torch.compile(model, backend=backend)
    return run(target, session, step=step), grads(model), session


@functools.lru_cache(maxsize=None)
def whole_model_reference(step_compiled: bool) -> tuple[list, dict]:
    """``whole_model_run`` without swapkit, computed once (as ``reference_grads``)."""
    losses, grads_, _ = whole_model_run(None, "aot_eager", step_compiled)
    return losses, grads_


@pytest.mark.parametrize("variant,step_compiled", [(v, False) for v in sorted(VARIANTS)] + [("layer_swap", True)])
def test_whole_model_compile_runs_the_session_hooks_eagerly(variant, step_compiled):
    """Note [Saved-tensor hooks stay out of Dynamo]: without it Dynamo traced the pack hook that an eager op
    of the compiled frame called, and the step failed with InternalTorchDynamoError (or moved nothing)."""
    ref_losses, ref_grads = whole_model_reference(step_compiled)
    losses, got, session = whole_model_run(variant, "aot_eager", step_compiled)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    if variant == "op_swap":  # the graph break at the swapped scope changes the last bits, as for compiled layers
        torch.testing.assert_close(got, ref_grads)
    else:
        assert all(torch.equal(got[name], ref_grads[name]) for name in got), "gradients differ"
    stats = session.stats
    assert stats.unused_swaps == []
    if variant in ("layer_swap", "op_swap"):
        assert stats.prefetched_bytes == stats.offloaded_bytes > 0
    if variant == "select_recompute":
        assert stats.recomputed_output_bytes > 0 and stats.output_recomputes == 2 * CFG.num_layers


@pytest.mark.parametrize("variant,step_compiled", [("keep_only", False), ("keep_only", True), ("layer_swap", True)])
def test_whole_model_compile_with_the_native_hooks(variant, step_compiled):
    """swapkit.runtime.native Note [The native save path]: the C++ hooks are builtins, which Dynamo never traces;
    the Python hooks behind them stay marked. The same bits as without swapkit, and the C++ served saves."""
    require_native()
    ref_losses, ref_grads = whole_model_reference(step_compiled)
    losses, got, session = whole_model_run(variant, "aot_eager", step_compiled, native=True)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert all(torch.equal(got[name], ref_grads[name]) for name in got), "gradients differ"
    packs, unpacks = session.native_counts
    assert packs > 0 and unpacks > 0
    if variant == "layer_swap":
        assert session.stats.prefetched_bytes == session.stats.offloaded_bytes > 0
        assert min(session.native_swap_counts) > 0  # swapped saves and unpacks served in C++ (native_save.cpp)
    with session:
        assert session_module.active_session() is session


def test_whole_model_compile_with_the_disable_wrappers_of_an_older_torch(monkeypatch):
    """Where torch has no code execution strategies, the hooks are torch.compiler.disable wrappers; a
    session is still found as the active one (Note [Saved-tensor hooks stay out of Dynamo])."""
    monkeypatch.setattr(dynamo_module, "_SKIP_ALL", None)
    ref_losses, ref_grads = whole_model_reference(False)
    losses, got, session = whole_model_run("layer_swap", "aot_eager", False)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert all(torch.equal(got[name], ref_grads[name]) for name in got), "gradients differ"
    assert session.stats.prefetched_bytes == session.stats.offloaded_bytes > 0
    with session:
        assert session_module.active_session() is session


HOOK_ONLY = ("swapkit/runtime/session.py", "swapkit/runtime/step.py", "swapkit/runtime/swap_schedule.py",
             "swapkit/runtime/reached.py", "swapkit/runtime/reports.py", "swapkit/runtime/records.py",
             "swapkit/runtime/recipes.py", "swapkit/runtime/batch.py", "swapkit/engine/")


@pytest.mark.parametrize("variant", ["layer_swap", "select_recompute"])
def test_finalizers_never_reach_dynamo_in_a_compiled_step(variant):
    """Note [Saved-tensor hooks stay out of Dynamo]: the finalizers of records, recipes and recomputable
    outputs run where their last reference dies (in the compiled step's backward), not inside a hook; they
    are marked too, so Dynamo's frame callback is never handed one, nor anything they call."""
    from torch._dynamo.convert_frame import input_codes

    _, _, session = whole_model_run(variant, "aot_eager", True)
    assert session.stats.offloaded_bytes > 0 or session.stats.output_recomputes > 0
    handed = [code() for code in input_codes.seen if code() is not None]
    assert [f"{c.co_name} ({c.co_filename})" for c in handed if any(part in c.co_filename for part in HOOK_ONLY)] == []


@pytest.mark.parametrize("variant", ["keep_only", "layer_swap"])
@pytest.mark.parametrize("older_torch", [False, True])
def test_the_native_hooks_hand_dynamo_no_frame_of_swapkit(older_torch, variant, monkeypatch):
    """swapkit.runtime.native Note [The native save path]: what the C++ hooks call in Python (the step's settle
    at tick 0, the Python hooks they fall back to, and for swaps the schedule's add and advance, the step's
    unpacked and the record's restore) stays out of Dynamo as the Python hooks do: marked, or on a torch without
    code execution strategies wrapped in torch.compiler.disable."""
    from torch._dynamo.convert_frame import input_codes

    require_native()
    if older_torch:
        monkeypatch.setattr(dynamo_module, "_SKIP_ALL", None)
    _, _, session = whole_model_run(variant, "aot_eager", True, native=True)
    assert session.native_counts[0] > 0
    if variant == "layer_swap":
        assert min(session.native_swap_counts) > 0
    handed = [code() for code in input_codes.seen if code() is not None]
    assert [f"{c.co_name} ({c.co_filename})" for c in handed if any(part in c.co_filename for part in HOOK_ONLY)] == []


@pytest.mark.parametrize("variant", ["layer_swap", "full_recompute"])
def test_fullgraph_names_swapkit_and_the_fix(variant):
    """fullgraph=True cannot work with swapkit (its hooks are graph breaks by design). Dynamo's error said
    only 'Skip calling torch.compiler.disable()d function ... (reason: None). Hint: Remove the
    torch.compiler.disable call'; every swapkit wrapper now gives Dynamo the reason and the fix."""
    model = llama(cfg=CFG)
    session = swapkit.apply(model, config(variant), layers="layers")
    compiled_model = torch.compile(model, backend="eager", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        with session:
            compiled_model(llama_batch(cfg=CFG)[0])
    message = str(info.value)
    assert "swapkit's hooks run eagerly by design" in message
    assert "compile without fullgraph=True" in message


def test_compiled_transformer_encoder_never_compiles_swapkits_hook_objects():
    """An op swap on nn.MultiheadAttention in a compiled nn.TransformerEncoder: Dynamo broke the graph at the
    scope hook and then compiled ``AttachedHook.__call__`` as a frame of its own, once per hook signature, until
    it hit ``recompile_limit`` with a warning (Note [Saved-tensor hooks stay out of Dynamo])."""
    from torch._dynamo.convert_frame import input_codes

    from swapkit.runtime.detach import AttachedHook

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    session = swapkit.apply(model, {"swap_config": {"swap": True, "op_swap": {
        "op_name": "self_attn", "backward_prefetch": 1, "layers": True}}, "runtime": {"min_offload_bytes": 0}})
    install_engine(session, ReadyWhenDone())  # releases at their horizon: none left in the tail by a slow copy
    compiled_model = torch.compile(model, backend="eager")
    x = torch.randn(2, 8, 32, requires_grad=True)  # every layer's input requires grad: one graph per frame
    for _ in range(2):  # config.patch, not monkeypatch: its undo deleted the option from Dynamo's config
        with session, torch._dynamo.config.patch(error_on_recompile=True):
            compiled_model(x).square().mean().backward()
    assert AttachedHook.__call__.__code__ not in [code() for code in input_codes.seen]
    stats = session.stats
    assert stats.prefetched_bytes == stats.offloaded_bytes > 0 and stats.unused_swaps == []
    assert set(stats.offloaded_by_scope) == {"layer 0: self_attn", "layer 1: self_attn"}
    session.remove()


class NoisyBlock(torch.nn.Module):
    """Multiplies by a mask drawn from a ``torch.Generator`` the module owns."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.generator = torch.Generator().manual_seed(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * torch.bernoulli(torch.full((16,), 0.7), generator=self.generator)


def test_a_region_holding_a_generator_runs_eagerly_under_compile():
    """swapkit.runtime.replay Note [Generators of the region's modules]: Dynamo broke the graph at
    ``Generator.get_state`` and compiled the rest of the wrapper as a frame guarded on each input tensor's
    identity, recompiling at every call until ``recompile_limit``, with a warning."""
    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        model = torch.nn.Module()
        model.layers = torch.nn.ModuleList(NoisyBlock() for _ in range(3))
        model.forward = lambda x: model.layers[2](model.layers[1](model.layers[0](x)))
        return model

    plain, model = build(), build()
    session = swapkit.apply(model, {"recompute_config": {"recompute": True}})
    compiled_model = torch.compile(model, backend="eager")
    for step in range(3):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step), requires_grad=True)
        with session, torch._dynamo.config.patch(error_on_recompile=True):
            compiled_model(x).square().sum().backward()
        plain(x.detach().requires_grad_()).square().sum().backward()
    assert session.stats.recomputed_by_scope == {"layer 0": 1, "layer 1": 1, "layer 2": 1}
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("variant", ["full_recompute", "select_recompute"])
def test_whole_model_compile_never_recompiles_a_checkpoint_region(variant):
    """swapkit.runtime.recompute Note [Checkpoint regions under torch.compile]: Dynamo compiled the
    wrapper's ``Recompute._checkpoint`` as a frame guarded on the identity of the region's input tensor,
    so every recomputed call (each layer, each step) recompiled it until ``recompile_limit`` (8), with a
    warning; the region itself ran eagerly all along (torch.utils.checkpoint disables Dynamo inside)."""
    from torch._dynamo.convert_frame import input_codes

    from swapkit.runtime.recompute import Recompute

    model = llama(cfg=CFG)
    session = swapkit.apply(model, config(variant), layers="layers")
    compiled_model = torch.compile(model, backend="eager")
    batch = llama_batch(cfg=CFG)
    with session:  # the first step compiles what it compiles
        llama_step(compiled_model, batch)
    for _ in range(2):  # config.patch, as above
        with session, torch._dynamo.config.patch(error_on_recompile=True):
            llama_step(compiled_model, batch)
    assert Recompute._checkpoint.__code__ not in [code() for code in input_codes.seen]
    regions = 1 if variant == "full_recompute" else 2  # the layer, or its silu and mul
    assert sum(session.stats.recomputed_by_scope.values()) == regions * CFG.num_layers
    session.remove()
