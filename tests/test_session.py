"""The swap session end to end on CPU: numerics, mechanisms (through stats), lifecycle."""
from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

import swapkit
from tests.toys import (
    GatedEngine, ToyNet, assert_grads_equal, grads, install_engine, layer_swap, llama, llama_batch, llama_step,
    open_gate_when_blocked, synced_session, toy_config,
)

F32 = 4


def no_saved_tensor_hooks() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def reference(batch, seed: int = 1):
    model = llama(seed)
    loss = llama_step(model, batch)
    return loss, grads(model)


SWAP_CONFIGS = {
    "default_flash_attention": {"swap_config": {"swap": True, "default_prefetch": 2}},
    "layer_swap_k1": layer_swap(1),
    "layer_swap_k7": layer_swap(7),
    "layer_swap_k1000": layer_swap(1000),
    "op_swap": {"swap_config": {"swap": True, "op_swap": [
        {"op_name": "attention", "backward_prefetch": 3, "layers": [0, 1, 2]},
        {"op_name": "feed_forward", "backward_prefetch": 5, "layers": True},
        {"op_name": r"ffn_norm\.norm", "backward_prefetch": 1, "layers": [3]}]},
        "runtime": {"min_offload_bytes": 0}},
}


@pytest.mark.parametrize("name", SWAP_CONFIGS)
@pytest.mark.parametrize("options", [{}, {"latency_s": 0.0003, "bandwidth_gbps": 2.0}], ids=["fast", "slow_link"])
def test_swap_is_bit_identical_to_unwrapped(name, options):
    batch = llama_batch(0)
    ref_loss, ref_grads = reference(batch)
    config = dict(SWAP_CONFIGS[name])
    config["runtime"] = {**config.get("runtime", {}), "engine_options": options}
    model = llama()
    session = swapkit.apply(model, toy_config(4, **config), layers="layers")
    moved = []
    for _ in range(2):  # the second step skips offloading the forward's tail
        model.zero_grad()
        with session:
            loss = llama_step(model, batch)
        assert torch.equal(loss, ref_loss)
        assert_grads_equal(grads(model), ref_grads)
        stats = session.stats
        assert stats.released_bytes + stats.tail_bytes == stats.offloaded_bytes
        assert stats.prefetched_bytes == stats.released_bytes
        assert stats.resident_bytes == 0  # everything went away with the graph
        moved.append(stats.offloaded_bytes + stats.skipped.get("tail", 0))
    assert moved[0] > 0 and moved[0] == moved[1]
    session.remove()


@pytest.mark.parametrize("seed", range(6))
def test_random_seeds_with_injected_latency(seed):
    """Many graphs and copy timings: every race window the thread engine can open stays correct."""
    torch.manual_seed(seed)
    k = int(torch.randint(1, 12, ()).item())
    latency = float(torch.rand(()).item()) * 5e-4
    batch = llama_batch(seed)
    ref_loss, ref_grads = reference(batch, seed=seed)
    model = llama(seed)
    session = swapkit.apply(model, toy_config(4, **layer_swap(k, engine_options={"latency_s": latency})),
                            layers="layers")
    with session:
        loss = llama_step(model, batch)
    assert torch.equal(loss, ref_loss)
    assert_grads_equal(grads(model), ref_grads)


def test_exact_stats_on_toy_model():
    """3 blocks, 8x16 float32 activations (512 bytes each).

    Ticks: block 0 saves x, s0; block 1 saves W1.t(), s0, s1; block 2 saves W2.t(), s1, s2
    (x needs no grad, so block 0 saves no weight). Storages: x, s0, s1, s2; each of the first three
    moves once, and s2, alone in the batch still open when backward begins, is never copied.
    """
    model = ToyNet(layers=3)
    session = synced_session(model, toy_config(3, **layer_swap(1)))
    x = torch.randn(8, 16)
    with session:
        model(x).sum().backward()
    stats = session.stats
    act = 8 * 16 * F32
    assert stats.ticks == 8
    assert stats.saved_bytes == 4 * act  # s0 and s1 are saved twice (output, next input): one storage each
    assert stats.offloaded_tensors == 3 and stats.offloaded_bytes == 3 * act
    # s2's batch was open when backward began: discarded, not copied (swapkit.runtime.batch Note [Coalesced copies])
    assert stats.skipped == {"parameter": 2 * 16 * 16 * F32, "tail": act}
    assert stats.offload_copies == 3  # x comes due (tick 1) before s0 joins its batch: [x], [s0], [s1]
    assert stats.offloaded_by_scope == {"layer 0": 2 * act, "layer 1": act}
    # k=1: every storage is released one tick after it was saved, except s2, the last save of forward
    assert stats.released_bytes == 3 * act and stats.tail_bytes == 0
    assert stats.prefetched_bytes == 3 * act and stats.prefetched_tensors == 3
    # forward holds one activation at a time; backward holds the one in use and the next prefetch
    assert stats.peak_device_bytes == 2 * act
    assert stats.mean_prefetch_lead == 1.0  # each prefetch was issued k=1 tick ahead of use
    assert stats.late_fetches == 0  # ReadyWhenDone never reports an unfinished copy
    assert stats.resident_bytes == 0


def test_larger_prefetch_distance_prefetches_ahead_and_holds_memory_longer():
    def run(k):
        model = ToyNet(layers=6)
        session = synced_session(model, toy_config(6, **layer_swap(k)))
        with session:
            model(torch.randn(8, 16)).sum().backward()
        return session.stats

    near, far = run(1), run(4)
    assert near.mean_prefetch_lead == 1.0 and far.mean_prefetch_lead > 2.0
    assert far.peak_device_bytes > near.peak_device_bytes
    assert far.released_bytes > 0


def gated_toy():
    """A 4-layer toy with layer swap k=1 on a GatedEngine, and an unwrapped twin."""
    model, ref = ToyNet(layers=4), ToyNet(layers=4)
    ref.load_state_dict(model.state_dict())
    session = swapkit.apply(model, toy_config(4, **layer_swap(1)), layers="layers")
    engine = GatedEngine()
    install_engine(session, engine)
    return model, ref, session, engine


def test_release_never_waits_for_unfinished_copies():
    model, ref, session, engine = gated_toy()
    x = torch.randn(8, 16)
    with session:
        out = model(x).sum()  # returns although no copy can finish
        assert session._step.stats.released_bytes == 0
        engine.gate.set()
        out.backward()
    ref(x).sum().backward()
    assert_grads_equal(grads(model), grads(ref))
    stats = session.stats
    assert stats.released_bytes == 0 and stats.tail_bytes == stats.offloaded_bytes  # all used from the device
    assert stats.prefetched_bytes == 0


def test_late_fetch_waits_and_is_counted():
    model, ref, session, engine = gated_toy()
    x = torch.randn(8, 16)
    engine.gate.set()
    with session:
        out = model(x).sum()
    assert session._step.stats.released_bytes > 0  # the exit waited for the copies and released
    engine.gate.clear()  # every prefetch now blocks until the gate opens, 50 ms after backward first waits
    open_gate_when_blocked(engine, 0.05)
    out.backward()
    ref(x).sum().backward()
    assert_grads_equal(grads(model), grads(ref))
    stats = session.stats
    assert stats.late_fetches >= 1 and stats.wait_seconds >= 0.03


class PrefetchFails(GatedEngine):
    """Every host-to-device copy waits for the gate, then fails (a device allocation error, say)."""

    def prefetch(self, src):
        def job():
            self.gate.wait(timeout=30)
            raise MemoryError("device copy failed")

        return torch.empty(src.numel(), dtype=torch.uint8), self._submit(job)


def test_a_late_fetch_whose_copy_fails_counts_neither_its_lead_nor_a_late_fetch():
    """The first restore waits for its prefetch, which fails: backward raises the copy's error, and the
    stats count that restore nowhere (as before the restore path took the step's lock once)."""
    model = ToyNet(layers=4)
    session = swapkit.apply(model, toy_config(4, **layer_swap(1)), layers="layers")
    engine = PrefetchFails()
    install_engine(session, engine)
    engine.gate.set()
    with session:
        out = model(torch.randn(8, 16)).sum()
    engine.gate.clear()  # the first restore blocks on its prefetch; the gate opens and the copy fails
    open_gate_when_blocked(engine, 0.01)
    with pytest.raises(MemoryError, match="device copy failed") as failure:
        out.backward()
    failure.value.__traceback__ = None  # its frames hold the graph
    del failure, out
    stats = session.stats
    assert stats.prefetched_tensors > 0  # the prefetch was issued ahead of its first use: it had a lead
    assert stats.late_fetches == 0 and stats.wait_seconds == 0 and stats.prefetch_lead_ticks == 0
    session.remove()


def test_storage_saved_three_times_moves_once_and_views_keep_strides():
    class ThreeViews(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x[:, :4], x.t(), x.view(-1)[3:20])
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            a, b, c = ctx.saved_tensors
            assert a.shape == (8, 4) and a.stride() == (16, 1) and a.storage_offset() == 0
            assert b.shape == (16, 8) and b.stride() == (1, 16)
            assert c.shape == (17,) and c.storage_offset() == 3
            assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() == c.untyped_storage().data_ptr()
            return grad * 2 + a.sum() + b.sum() + c.sum()

    class ViewBlock(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.lin = nn.Linear(dim, dim, bias=False)

        def forward(self, x):
            return ThreeViews.apply(self.lin(x))

    def run(model):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
        model(x).sum().backward()
        return grads(model)

    model = ToyNet(layers=2, block=ViewBlock)
    ref = ToyNet(layers=2, block=ViewBlock)
    ref.load_state_dict(model.state_dict())
    session = synced_session(model, toy_config(2, **layer_swap(1)))
    with session:
        got = run(model)
    assert_grads_equal(got, run(ref))
    stats = session.stats
    act = 8 * 16 * F32
    # per layer: the lin input and the lin output h, saved three times as views: 2 storages a layer
    assert stats.offloaded_tensors == 4 and stats.offloaded_bytes == 4 * act
    assert stats.offloaded_by_scope == {"layer 0": 2 * act, "layer 1": 2 * act}


def test_no_parameter_bytes_move_on_builtin_model():
    model = llama()
    session = swapkit.apply(model, toy_config(4, **layer_swap(3)), layers="layers")
    with session:
        llama_step(model, llama_batch())
    stats = session.stats
    layer_params = sum(p.numel() * p.element_size() for layer in model.layers for p in layer.parameters())
    rope_tables = sum(b.numel() * b.element_size() for b in model.buffers())  # mul saves cos/sin
    assert stats.skipped["parameter"] == layer_params + rope_tables
    assert 0 < stats.offloaded_bytes <= stats.saved_bytes  # saved_bytes never counts parameters


def test_min_offload_bytes_and_host_cap():
    model = ToyNet(layers=3)
    session = swapkit.apply(model, toy_config(3, **layer_swap(1, min_offload_bytes=1024)), layers="layers")
    with session:
        model(torch.randn(8, 16)).sum().backward()
    assert session.stats.offloaded_bytes == 0
    assert session.stats.skipped["small"] == 4 * 512

    capped = synced_session(ToyNet(layers=3), toy_config(3, **layer_swap(1, max_host_bytes=1100)))
    with capped:
        capped.model(torch.randn(8, 16)).sum().backward()
    stats = capped.stats  # layer 1's region crossed the cap; layer 2's was never asked for (discarded as tail)
    assert stats.offloaded_bytes == 2 * 512 and stats.skipped["host_cap"] == 512 and stats.skipped["tail"] == 512
    assert stats.host_pool_bytes == 1024


@pytest.mark.parametrize("swapped", [True, False], ids=["swapped", "kept"])
def test_inplace_write_to_saved_tensor_raises_naming_the_layer(swapped):
    class Mutating(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.lin = nn.Linear(dim, dim, bias=False)

        def forward(self, x):
            y = torch.sigmoid(self.lin(x))  # sigmoid saves y
            y.mul_(1.0)  # bumps y's version
            return y * 3

    model = ToyNet(layers=2, block=Mutating)
    layers = [0, 1] if swapped else [0]
    session = synced_session(model, toy_config(2, **layer_swap(1, layers=layers)))
    with session:
        loss = model(torch.randn(8, 16)).sum()
        with pytest.raises(RuntimeError, match=r"layer 1 was modified by an in-place operation"):
            loss.backward()
    assert no_saved_tensor_hooks()


def test_inplace_write_after_release_still_raises():
    model = ToyNet(layers=3)
    session = synced_session(model, toy_config(3, **layer_swap(1)))
    with session:
        out0 = model.layers[0](torch.randn(8, 16))
        out = model.layers[2](model.layers[1](out0))
        assert session._step.stats.released_bytes > 0
        with torch.no_grad():
            out0.add_(1)  # s0 was released long ago; its keeper still sees the version bump
        with pytest.raises(RuntimeError, match=r"layer [01] was modified"):  # s0 is saved by both
            out.sum().backward()


def _assert_clean(session):
    assert no_saved_tensor_hooks()
    assert not session.active
    assert session.tracker.stack == []
    gc.collect()
    step = session._step
    assert step.device_bytes == 0
    assert session.pool.free_bytes == session.pool.total_bytes  # every host buffer came back


def test_exception_mid_forward_leaves_clean_state():
    class Exploding(nn.Module):
        fire = False

        def forward(self, x):
            if Exploding.fire:
                raise ValueError("boom")
            return x

    model = ToyNet(layers=3)
    model.layers[2].act = nn.Sequential(nn.Sigmoid(), Exploding())
    ref = ToyNet(layers=3)
    ref.load_state_dict(model.state_dict())
    session = swapkit.apply(model, toy_config(3, **layer_swap(1)), layers="layers")
    x = torch.randn(8, 16)
    Exploding.fire = True
    with pytest.raises(ValueError, match="boom"):
        with session:
            model(x).sum().backward()
    assert session.stats.aborted
    _assert_clean(session)
    Exploding.fire = False
    with session:
        model(x).sum().backward()
    ref(x).sum().backward()
    assert_grads_equal(grads(model), grads(ref))
    assert not session.stats.aborted


def test_exception_mid_backward_leaves_clean_state():
    model = ToyNet(layers=3)
    ref = ToyNet(layers=3)
    ref.load_state_dict(model.state_dict())
    session = swapkit.apply(model, toy_config(3, **layer_swap(1)), layers="layers")
    x = torch.randn(8, 16)

    def explode(grad):
        raise RuntimeError("backward boom")

    with pytest.raises(RuntimeError, match="backward boom"):
        with session:
            out = model.layers[0](x)
            out.register_hook(explode)
            model.layers[2](model.layers[1](out)).sum().backward()
    del out
    _assert_clean(session)
    model.zero_grad(set_to_none=True)  # the failed backward accumulated partial gradients
    with session:
        model(x).sum().backward()
    ref(x).sum().backward()
    assert_grads_equal(grads(model), grads(ref))


def test_fifty_steps_keep_memory_flat_and_reuse_host_buffers():
    model = llama()
    session = synced_session(model, toy_config(4, **layer_swap(5)))
    batch = llama_batch()
    seen = []
    for step in range(50):
        model.zero_grad(set_to_none=True)
        with session:
            llama_step(model, batch)
        stats = session.stats
        seen.append((stats.peak_device_bytes, stats.offloaded_bytes, stats.host_pool_bytes))
        assert stats.resident_bytes == 0
        if step > 0:
            assert stats.host_allocations == 0, f"step {step} allocated host memory"
    assert len(set(seen[1:])) == 1  # identical accounting every step after the first
    assert session.stats.step == 50


def test_skip_tail_offload_after_first_step():
    model = ToyNet(layers=4)  # one copy per storage: the first step copies its tail, then uses it in place
    session = synced_session(model, toy_config(4, **layer_swap(2, offload_batch_bytes=0)))
    x = torch.randn(8, 16)
    with session:
        model(x).sum().backward()
    first = session.stats
    assert first.tail_bytes > 0 and "tail" not in first.skipped
    with session:
        model(x).sum().backward()
    second = session.stats
    assert second.tail_bytes == 0 and second.skipped["tail"] == first.tail_bytes
    assert second.offloaded_bytes == first.offloaded_bytes - first.tail_bytes


def test_a_coalesced_tail_is_not_copied_even_in_the_first_step():
    """s3, the last save, is alone in the batch still open when backward begins: it is discarded in the
    first step (swapkit.runtime.batch Note [Coalesced copies]) and never offloaded in the next."""
    model = ToyNet(layers=4)
    session = synced_session(model, toy_config(4, **layer_swap(2)))
    x = torch.randn(8, 16)
    seen = []
    for _ in range(2):
        with session:
            model(x).sum().backward()
        stats = session.stats
        seen.append((stats.offloaded_bytes, stats.offload_copies, stats.released_bytes, stats.skipped))
        assert stats.tail_bytes == 0 and stats.skipped["tail"] == 8 * 16 * F32
        assert stats.offloaded_bytes == stats.released_bytes == stats.prefetched_bytes == 4 * 8 * 16 * F32
    assert seen[0] == seen[1] and seen[0][1] == 3  # layers 0, 1 and 2 each copied their batch


def test_gradient_accumulation_several_forwards_then_backward():
    model, ref = llama(), llama()
    session = swapkit.apply(model, toy_config(4, **layer_swap(4)), layers="layers")
    batches = [llama_batch(seed) for seed in range(3)]
    from swapkit.train.model import lm_loss

    with session:
        total = sum(lm_loss(model(t), y) for t, y in batches)
        total.backward()
    sum(lm_loss(ref(t), y) for t, y in batches).backward()
    assert_grads_equal(grads(model), grads(ref))
    assert session.stats.ticks > 0 and session.stats.step == 1  # one step: one clock across the forwards


def test_micro_batches_inside_one_block_open_a_step_each():
    model, ref = llama(), llama()
    session = swapkit.apply(model, toy_config(4, **layer_swap(4)), layers="layers")
    batches = [llama_batch(seed) for seed in range(3)]
    with session:
        for batch in batches:
            llama_step(model, batch)
    for batch in batches:
        llama_step(ref, batch)
    assert_grads_equal(grads(model), grads(ref))
    assert session.stats.step == 3


def test_backward_after_the_with_block():
    model, ref = llama(), llama()
    session = synced_session(model, toy_config(4, **layer_swap(2)))
    tokens, targets = llama_batch()
    from swapkit.train.model import lm_loss

    with session:
        loss = lm_loss(model(tokens), targets)
    assert no_saved_tensor_hooks()
    assert session._step.stats.released_bytes > 0  # the exit released what was due
    loss.backward()
    lm_loss(ref(tokens), targets).backward()
    assert_grads_equal(grads(model), grads(ref))
    assert session.stats.prefetched_bytes > 0


def test_retain_graph_backward_twice():
    model, ref = llama(), llama()
    session = swapkit.apply(model, toy_config(4, **layer_swap(2)), layers="layers")
    tokens, targets = llama_batch()
    from swapkit.train.model import lm_loss

    with session:
        loss = lm_loss(model(tokens), targets)
        loss.backward(retain_graph=True)
        loss.backward()
    ref_loss = lm_loss(ref(tokens), targets)
    ref_loss.backward(retain_graph=True)
    ref_loss.backward()
    assert_grads_equal(grads(model), grads(ref))


def test_branch_whose_backward_never_runs_is_freed():
    model = ToyNet(layers=3)
    session = synced_session(model, toy_config(3, **layer_swap(1)))
    x = torch.randn(8, 16)
    with session:
        used = model(x).sum()
        unused = model(x * 2).sum()  # a second graph, never backpropagated
        used.backward()
    assert session.stats.resident_bytes > 0 or session.pool.free_bytes < session.pool.total_bytes
    del unused
    gc.collect()
    assert session._step.device_bytes == 0
    assert session.pool.free_bytes == session.pool.total_bytes


def test_sessions_do_not_nest_and_remove_restores():
    model = ToyNet(layers=2)
    hooks_before = [dict(m._forward_hooks) for m in model.modules()]
    session = swapkit.apply(model, toy_config(2, **layer_swap(1)), layers="layers")
    with session:
        with pytest.raises(RuntimeError, match="already active"):
            session.__enter__()
        with pytest.raises(RuntimeError, match="inside its `with` block"):
            session.remove()
    session.remove()
    assert [dict(m._forward_hooks) for m in model.modules()] == hooks_before
    assert all(not m._forward_pre_hooks for m in model.modules())
    with pytest.raises(RuntimeError, match="removed"):
        with session:
            pass


def test_eval_forward_without_grad_saves_nothing():
    model = llama()
    session = swapkit.apply(model, toy_config(4, **layer_swap(2)), layers="layers")
    with session, torch.no_grad():
        model(llama_batch()[0])
    assert session._step.clock == 0 and session._step.stats.saved_bytes == 0



def test_inference_mode_forwards_save_nothing_and_leave_no_step_open():
    model = llama()
    session = swapkit.apply(model, toy_config(4, **layer_swap(2)), layers="layers")
    with session:
        for _ in range(3):
            with torch.inference_mode():
                model(llama_batch()[0])
    assert session.stats.saved_bytes == 0 and session.stats.ticks == 0 and no_saved_tensor_hooks()


@pytest.mark.parametrize("recompute", [None, {"recompute": [1]}, {"select_recompute": {"feed_forward": [0, 2]}}])
def test_autocast_bfloat16_swap_is_bit_identical(recompute):
    """Under CPU autocast the saved activations are bfloat16; they move and come back bit for bit, with
    recompute replaying autocast (autocast's cached bf16 weight copies are kept: test_autocast.py)."""
    batch = llama_batch()

    def step(model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(batch[0])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[1].flatten())
        loss.backward()
        return loss.detach()

    plain = llama()
    expected = step(plain)
    model = llama()
    config = toy_config(4, **layer_swap(2, layers=[0, 1, 2]))
    if recompute is not None:
        config["recompute_config"] = recompute
    session = swapkit.apply(model, config, layers="layers")
    with session:
        loss = step(model)
    assert torch.equal(loss, expected)
    assert_grads_equal(grads(model), grads(plain))
    assert session.stats.offloaded_bytes > 0

def test_tensors_off_the_compute_device_are_skipped():
    class SavesMeta(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(torch.empty(300, device="meta"))  # 1200 bytes, not on the CPU
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            assert ctx.saved_tensors[0].device.type == "meta"
            return grad * 2

    class MetaBlock(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.lin = nn.Linear(dim, dim, bias=False)

        def forward(self, x):
            return SavesMeta.apply(self.lin(x))

    model = ToyNet(layers=2, block=MetaBlock)
    session = swapkit.apply(model, toy_config(2, **layer_swap(1)), layers="layers")
    with session:
        model(torch.randn(8, 16)).sum().backward()
    assert session.stats.skipped["not_on_device"] == 2 * 1200


@pytest.mark.parametrize("reentrant", [False, True])
def test_recompute_in_backward_does_not_move_the_clock(reentrant):
    model, ref = llama(), llama()
    config = toy_config(4, **layer_swap(3), recompute_config={
        "recompute": [1], "select_recompute": {"feed_forward": [2]}, "use_reentrant": reentrant})
    session = swapkit.apply(model, config, layers="layers")
    batch = llama_batch()
    from swapkit.train.model import lm_loss

    ticks = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with session:
            loss = lm_loss(model(batch[0]), batch[1])
            forward_ticks = session._step.clock
            loss.backward()  # recomputes layer 1 and layer 2's feed_forward; their hooks fire again
            assert session._step.clock == forward_ticks
            assert session._step.number == len(ticks) + 1  # backward-time packs opened no step
        ticks.append(forward_ticks)
    assert ticks[0] == ticks[1]
    ref_loss = llama_step(ref, batch)
    assert torch.equal(loss.detach(), ref_loss)
    for name, grad in grads(ref).items():
        torch.testing.assert_close(grads(model)[name], grad, rtol=0, atol=0)


class CollectsHandles:
    """A session observer that keeps every handle the pack hook returned."""

    def __init__(self) -> None:
        self.handles: list = []

    def saved(self, saved) -> None:
        self.handles.append(saved)

    def unpacked(self, saved) -> None:
        pass


def test_saved_handles_compare_by_identity():
    """A handle is a tuple (swapkit.runtime.records.Saved), but equal only to itself: comparing two must not
    compare their tensors."""
    model = ToyNet(layers=2)
    session = swapkit.apply(model, toy_config(2, **layer_swap(1)), layers="layers")
    session.observer = observer = CollectsHandles()
    with session:
        loss = model(torch.randn(8, 16)).sum()
    first, rest = observer.handles[0], observer.handles[1:]
    assert first == first and first not in rest and len({*observer.handles}) == len(observer.handles)
    loss.backward()


def test_emptying_keepers_sets_their_versions_back_even_when_a_set_fails():
    """A release empties a record's keepers (swapkit.runtime.records.empty_keepers); if one ``set_`` is refused
    (a user's dispatch mode, say), the keepers already emptied must not look modified in place."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from swapkit.runtime.records import empty_keepers

    class RefusesSecondSet(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.set_.default:
                RefusesSecondSet.calls += 1
                if RefusesSecondSet.calls == 2:
                    raise RuntimeError("set_ refused")
            return func(*args, **(kwargs or {}))

    a, b = torch.ones(4).detach(), torch.ones(4).detach()
    versions = (a._version, b._version)
    with pytest.raises(RuntimeError, match="set_ refused"), RefusesSecondSet():
        empty_keepers((a, b))
    assert a.untyped_storage().nbytes() == 0  # the first one was emptied
    assert (a._version, b._version) == versions


def test_a_backward_after_the_next_with_block_is_exact_and_warned_once(caplog):
    """Note [A backward after the next forward]: two `with` blocks, then one backward of both losses.
    The first step's schedule was dropped when the second began, so it warns (once per session) and
    says to use one block; inside one block both forwards share a step and its prefetches."""
    torch.manual_seed(0)
    model = ToyNet(3, dim=64)
    reference = copy.deepcopy(model)
    session = swapkit.apply(model, toy_config(3, **layer_swap(1)))
    x1, x2 = torch.randn(4, 64), torch.randn(4, 64)
    for _ in range(2):
        model.zero_grad()
        reference.zero_grad()
        with session:
            a = model(x1).sum()
        with session:
            b = model(x2).sum()
        (a + b).backward()
        (reference(x1).sum() + reference(x2).sum()).backward()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
    late = [r for r in caplog.records if "began after the next `with session:` block" in r.getMessage()]
    assert len(late) == 1 and "backward of step 1 " in late[0].getMessage()
    caplog.clear()
    with session:
        a, b = model(x1).sum(), model(x2).sum()
    (a + b).backward()
    stats = session.stats
    # what was offloaded came back ahead of use, or is the forward's tail, used in place (this step is twice
    # as long as the last one, so its real tail is offloaded as in a first step)
    assert stats.offloaded_tensors > 0 and stats.prefetched_bytes + stats.tail_bytes == stats.offloaded_bytes
    assert stats.mean_prefetch_lead > 0  # issued ahead of use, not on demand
    assert not [r for r in caplog.records if "began after the next" in r.getMessage()]


def test_a_step_longer_than_the_last_offloads_past_the_learnt_tail():
    """The tail learnt from the last step is its last k ticks, not everything after them: a step whose
    forward runs more layers than the previous one (LayerDrop, two forwards then one backward) offloads
    the extra layers (swapkit.runtime.swap_schedule Note [The last k ticks stay on the device])."""
    model = ToyNet(layers=4)
    session = synced_session(model, toy_config(4, **layer_swap(1, offload_batch_bytes=0)))
    ref = copy.deepcopy(model)  # a plain copy (swapkit.runtime.detach Note [Copies and pickles of a model ...])
    x = torch.randn(8, 16)
    with session:  # a short step: layers 0 and 1 (ticks 0-3), so the learnt tail is tick 3
        model.layers[1](model.layers[0](x)).sum().backward()
    model.zero_grad()
    with session:  # all four layers, ticks 0-7; storages x (tick 0), s0 (1, 2), s1 (3, 4), s2 (5, 6), s3 (7)
        model(x).sum().backward()
    stats, per_storage = session.stats, 8 * 16 * F32
    assert stats.skipped["tail"] == per_storage  # s1, saved at the learnt tail
    assert stats.offloaded_bytes == 4 * per_storage and stats.tail_bytes == per_storage  # s3: the real tail
    ref(x).sum().backward()
    assert_grads_equal(grads(model), grads(ref))


def test_a_training_forward_outside_the_with_block_is_warned_once(caplog):
    """A swap only acts inside `with session:`; a training forward through a swapped scope outside it
    swapped nothing, silently. It is warned about once per session; no_grad forwards are not."""
    model = llama()
    session = swapkit.apply(model, toy_config(4, **layer_swap(2)), layers="layers")
    with caplog.at_level("WARNING", logger="swapkit"):
        with torch.no_grad():
            model(llama_batch()[0])
        assert not [m for m in caplog.messages if "outside" in m]
        for _ in range(2):
            llama_step(model, llama_batch())
    outside = [m for m in caplog.messages if "outside `with session:`" in m]
    assert len(outside) == 1, caplog.messages
    assert "layer 0" in outside[0] and "swapped nothing" in outside[0] and "torch.no_grad()" in outside[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="swapkit"):
        with session:
            llama_step(model, llama_batch())
    assert session.stats.offloaded_bytes > 0 and not [m for m in caplog.messages if "outside" in m]
    session.remove()
