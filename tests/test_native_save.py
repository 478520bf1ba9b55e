"""``runtime.native_save``: the session's hooks in C++ (swapkit.runtime.native Note [The native save path]).

Every test compares a native session with a Python one on the same model and batch: bit-identical losses and
gradients, the same stats, and the C++ having served saves and unpacks (``native_counts``)."""
from __future__ import annotations

import gc
import logging
import sys
import threading
import weakref

import pytest
import torch
from torch import nn

import swapkit
from swapkit.runtime import native
from swapkit.runtime.records import KeptRecord, Saved, SwapRecord, storage_key
from tests.toys import (
    ToyNet, assert_grads_equal, bench_module, grads, layer_swap, llama, llama_batch, llama_step, require_native,
    synced_session, toy_config,
)


@pytest.fixture(scope="module", autouse=True)
def built():
    return require_native()


def native_config(config: dict, on: bool = True) -> dict:
    return {**config, "runtime": {**config.get("runtime", {}), "native_save": on}}


def one_layer_session(on: bool = True) -> swapkit.SwapSession:
    """A session on a one-layer ToyNet that keeps everything, with the C++ hooks (``on``) or the Python ones."""
    return synced_session(ToyNet(layers=1), native_config(toy_config(1), on))


def record_refs(step) -> list[weakref.ref]:
    """Weak references to every live record of ``step``: the step's own index's, and the C++'s (native_save.cpp
    Note [The records kept in C++])."""
    return [*step._index.values(), *map(weakref.ref, step.kept_natively.records())]


def run_both(make_model, config: dict, step, steps: int = 2):
    """(losses, grads, stats, native_counts) per step of a Python session, then of a native one."""
    out = []
    for on in (False, True):
        model = make_model()
        session = synced_session(model, native_config(config, on))
        runs = []
        for _ in range(steps):
            model.zero_grad()
            with session:
                loss = step(model)
            runs.append((loss, grads(model), session.stats))
        out.append((runs, session.native_counts))
        session.remove()
    return out


def assert_same_runs(python, native_run):
    for (loss_a, grads_a, stats_a), (loss_b, grads_b, stats_b) in zip(python[0], native_run[0], strict=True):
        assert torch.equal(loss_a, loss_b)
        assert_grads_equal(grads_a, grads_b)
        assert stats_a == stats_b


CONFIGS = {
    "keep_only": {},
    "layer_swap": layer_swap(1),
    "op_swap": {"swap_config": {"swap": True, "op_swap": [{"op_name": "attention", "backward_prefetch": 2,
                                                            "layers": [1, 2]}]},
                "runtime": {"min_offload_bytes": 0}},
    "recompute_and_swap": {"recompute_config": {"recompute": [0]},
                           **layer_swap(2, layers=[2, 3])},
    "select_recompute": {"recompute_config": {"select_recompute": {r"feed_forward\.w1": True}}},
    # the swaps the C++ serves (Note [Swaps served in C++]) through verify mode's checksums and a host cap that
    # keeps some batches on the device
    "layer_swap_verify": layer_swap(2, verify=True),
    "layer_swap_host_cap": layer_swap(2, max_host_bytes=64 * 1024),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_native_hooks_give_the_python_hooks_results_bit_for_bit(name):
    batch = llama_batch(0)
    python, native_run = run_both(llama, toy_config(4, **CONFIGS[name]), lambda m: llama_step(m, batch))
    assert python[1] is None
    packs, unpacks = native_run[1]
    assert packs > 0 and unpacks > 0  # the C++ served saves and unpacks, not only the Python behind it
    assert_same_runs(python, native_run)


def test_a_keep_only_step_is_served_almost_wholly_in_cpp():
    """A keep-only model of plain ops: every save but each layer's first (a new frame: the Python sees it) is
    served in C++, the weights' views included (their storages are the step's known parameters); every unpack
    but the backward's first (the step still watches unpacks until one prefetches nothing)."""
    model = ToyNet(layers=3)
    session = synced_session(model, native_config(toy_config(3)))
    x = torch.randn(8, 16)
    with session:
        model(x).sum().backward()
    stats = session.stats
    packs, unpacks = session.native_counts
    assert stats.ticks == 8  # the ToyNet saves of test_session.test_exact_stats_on_toy_model
    assert packs == 8 - 3  # one first save per layer frame goes to the Python
    assert unpacks == 8 - 1
    assert stats.skipped == {}  # nothing counted as a swap scope's: no scope swaps
    assert stats.saved_bytes == 4 * 8 * 16 * 4 and stats.resident_bytes == 0


def test_an_in_place_write_after_a_native_save_raises_the_sessions_error():
    model = ToyNet(layers=2)
    session = synced_session(model, native_config(toy_config(2)))
    x = torch.randn(8, 16)
    with session:
        y = model(x)
        h = y.exp()  # saves its output natively: the frame is the one of the previous save (outside the layers)
        z = (h * 2).sum()
        h.add_(1)
        with pytest.raises(RuntimeError, match="modified by an in-place operation after it was saved"):
            z.backward()
    assert session.native_counts[0] > 0


def test_views_and_shared_storages_share_one_kept_record():
    """Saves of one storage (a tensor and its views) find the record the first save made, in C++ or Python."""
    seen = []

    class Views(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Identity()])

        def forward(self, x):
            h = self.layers[0](x).sin()  # saves x
            a = h.exp()  # saves exp's output
            b = h[1:].cos() + h.t()[0].sin().sum()  # saves two views of h
            return a.sum() + b.sum() + h.sin().sum()  # h again

    for on in (False, True):
        torch.manual_seed(0)
        model = Views()
        session = synced_session(model, native_config(toy_config(1), on))
        x = torch.randn(6, 6, requires_grad=True)
        with session:
            model(x).backward()
        seen.append((x.grad.clone(), session.stats))
        session.remove()
    assert torch.equal(seen[0][0], seen[1][0])
    assert seen[0][1] == seen[1][1]
    assert seen[1][1].saved_bytes == 3 * 36 * 4  # x, h, exp(h): h's views add no bytes


def test_packs_in_backward_and_double_backward_go_to_the_python_hooks():
    """Double backward: backward's own saves (graph task running) are not the C++'s; the results are exact."""
    results = []
    for on in (False, True):
        model = ToyNet(layers=2)
        torch.manual_seed(0)
        for p in model.parameters():
            nn.init.normal_(p)
        session = synced_session(model, native_config(toy_config(2), on))
        x = torch.randn(8, 16, requires_grad=True)
        with session:
            out = model(x).tanh().sum()
            (gx,) = torch.autograd.grad(out, x, create_graph=True)
            gx.pow(2).sum().backward()
        results.append((x.grad.clone(), grads(model)))
        session.remove()
    assert torch.equal(results[0][0], results[1][0])
    assert_grads_equal(results[0][1], results[1][1])


def test_many_native_steps_leave_no_record_or_handle_behind():
    """Records and handles the C++ makes are freed by their reference counts (Note [Objects the collector need
    not see]): after 50 steps every record a step's index named is dead, and no step outlives the session's
    current and last one (a handle or record left alive would hold its step)."""
    model = ToyNet(layers=3)
    session = synced_session(model, native_config(toy_config(3, **layer_swap(1, layers=[1]))))
    x = torch.randn(8, 16)
    records, steps = [], []
    for _ in range(50):
        with session:
            out = model(x).sum()
            records += record_refs(session._step)
            steps.append(weakref.ref(session._step))
            out.backward()
        del out
    gc.collect()
    assert len(records) > 50 and all(ref() is None for ref in records)
    assert sum(step() is not None for step in steps) <= 2
    assert session.stats.resident_bytes == 0 and session.stats.peak_device_bytes > 0
    packs, unpacks = session.native_counts
    assert packs > 50 and unpacks > 50
    session.remove()


def test_what_the_cpp_makes_is_untracked_and_freed_by_reference_counts():
    """Note [Objects the collector need not see]: the handle and the record of a native keep are untracked; the
    keeper is not. With the collector off, the record dies with its last handle, takes its bytes off the step's
    ledger and its entry out of the C++'s index (native_save.cpp Note [The records kept in C++]), which the
    step's own index never had."""
    model = ToyNet(layers=1)
    session = synced_session(model, native_config(toy_config(1)))
    enabled = gc.isenabled()
    gc.disable()
    try:
        with session:
            step, pack = session._step, session._native[0]
            handle = pack(torch.randn(4, 4))  # outside the layers, the frame (None) of a new step's first save
            assert type(handle) is Saved and type(handle.record) is native.NativeKeptRecord
            key = storage_key(handle.keeper)
            assert step.kept_natively.get(key) is handle.record and key not in step._index
            assert not gc.is_tracked(handle) and not gc.is_tracked(handle.record)
            assert gc.is_tracked(handle.keeper)
            ref, before = weakref.ref(handle.record), step.device_bytes
            del handle
            assert ref() is None and step.device_bytes == before - 64
            assert step.kept_natively.get(key) is None and step.kept_natively.records() == []
    finally:
        if enabled:
            gc.enable()
    assert session.native_counts[0] == 1
    session.remove()


def test_a_storage_written_in_place_after_a_cpp_keep_gets_one_new_record_as_in_the_python():
    """native_save.cpp Note [The records kept in C++]: a storage kept in C++ and then written in place is a new
    storage to both paths. The Python makes its record in the step's index, later saves find that one (not
    the C++'s older one), and the bytes are counted as a Python session counts them."""
    results = []
    for on in (False, True):
        session = one_layer_session(on)
        with session:
            step, pack = session._step, session._hook_pair[0]
            t = torch.randn(4, 4)
            first = pack(t)
            t.add_(1)
            second, third = pack(t), pack(t)
            assert third.record is second.record is not first.record and second.version == first.version + 1
            if on:
                assert type(first.record) is native.NativeKeptRecord and type(second.record) is KeptRecord
                assert step.kept_natively.get(storage_key(t)) is None  # the Python's newer record took its place
                first = None
            results.append((step.stats.saved_bytes, session.native_counts))
            del first, second, third
        session.remove()
    assert results[0][0] == results[1][0] == 2 * 64
    assert results[1][1][0] == 2 and results[0][1] is None  # the third save found the Python's record, in C++


def test_a_storage_saved_through_two_version_counters_gets_the_records_of_the_python():
    """native_save.cpp Note [The records kept in C++]: ``a.data`` shares ``a``'s storage but not its version
    counter, so a save of ``a`` after one of ``a.data`` finds the C++'s record at ``a``'s version again. The
    Python session's index holds the newer record of ``a.data`` there, and makes a third; the native session
    must too (the Python's record takes the storage out of the KeptIndex), and count the same bytes."""
    results = []
    for on in (False, True):
        session = one_layer_session(on)
        with session:
            step, pack = session._step, session._hook_pair[0]
            a = torch.randn(4, 4)
            a.add_(1)
            first, second, third = pack(a), pack(a.data), pack(a)
            assert len({id(first.record), id(second.record), id(third.record)}) == 3
            if on:
                assert type(first.record) is native.NativeKeptRecord and step.kept_natively.records() == []
            results.append((step.stats.saved_bytes, session.native_counts))
            first = second = third = None
            assert step.device_bytes == 0
        session.remove()
    assert results[0][0] == results[1][0] == 3 * 64
    assert results[1][1][0] == 1


def test_a_cpp_record_leaves_its_index_when_it_dies_whatever_its_keeper_became():
    """native_save.cpp Note [The records kept in C++]: the KeptIndex holds its records borrowed, so a dead
    record's entry must go. A record whose keeper was ``set_()`` to another storage is found by a walk of the
    index (an entry left behind named freed memory: a later save of the storage crashed); one whose storage got
    a newer record in the step's own index (forget) looks for no entry."""
    session = one_layer_session()
    with session:
        step, pack = session._step, session._hook_pair[0]
        a, b = torch.randn(4, 4), torch.randn(4, 4)
        first, other = pack(a), pack(b)
        first.keeper.set_(torch.empty(0))
        first = None
        assert step.kept_natively.records() == [other.record]
        again = pack(a)
        assert type(again.record) is native.NativeKeptRecord and step.kept_natively.get(storage_key(a)) is again.record
        a.add_(1)
        newer = pack(a)
        assert type(newer.record) is KeptRecord and again.record[4] is None
        assert step.kept_natively.get(storage_key(a)) is None
        again = None
        assert step.kept_natively.records() == [other.record]
        other = newer = None
        assert step.kept_natively.records() == [] and step.device_bytes == 0
    session.remove()


def test_a_cpp_record_dying_while_an_error_is_raised_keeps_the_error():
    """native_save.cpp finalize_kept: a record's C finalizer runs where an error is being raised (a frame
    holding its last handle unwinds), takes the record's bytes off the ledger and its entry out of the
    KeptIndex, and leaves that error as it was."""
    session = one_layer_session()
    with session:
        step, pack = session._step, session._hook_pair[0]

        def raises():
            handle = pack(torch.randn(4, 4))
            assert type(handle.record) is native.NativeKeptRecord and step.device_bytes == 64
            raise KeyError("the caller's")

        with pytest.raises(KeyError, match="the caller's"):
            raises()
        assert step.device_bytes == 0 and step.kept_natively.records() == []
    session.remove()


def test_a_storage_kept_in_cpp_is_found_by_a_later_python_save():
    """A storage first saved outside every swap scope (kept, in C++) and then inside a swap scope is the kept
    record's, as in the Python: it does not move."""
    results = []
    for on in (False, True):
        torch.manual_seed(0)
        model = ToyNet(layers=2)
        session = synced_session(model, native_config(toy_config(2, **layer_swap(1, layers=[1])), on))
        x = torch.randn(8, 16, requires_grad=True)
        with session:
            h = x.sin()  # x saved outside the layers: kept
            model.layers[0](x)  # x's storage again, in layer 0 (kept, no swap there)
            out = model(h).sum() + x.cos().sum()
            out.backward()
        results.append((x.grad.clone(), session.stats, session.native_counts))
        session.remove()
    assert torch.equal(results[0][0], results[1][0])
    assert results[0][1] == results[1][1]
    assert results[1][2][0] > 0


def test_the_config_key_is_checked():
    with pytest.raises(swapkit.ConfigError, match="runtime.native_save"):
        swapkit.load_config(native_config(toy_config(1), "yes"))


def test_a_failed_build_is_an_error_at_apply_naming_the_key_and_the_fix(monkeypatch):
    monkeypatch.setattr(native, "_built", [])
    monkeypatch.setattr(native, "_build", lambda: native.NativeBuildError(
        "runtime.native_save: true, but swapkit's C++ save hooks (native_save.cpp) could not be built: "
        "c++: command not found. ..."))
    with pytest.raises(native.NativeBuildError, match="runtime.native_save: true.*c\\+\\+: command not found"):
        swapkit.apply(ToyNet(layers=1), native_config(toy_config(1)), layers="layers")


def test_the_build_error_says_what_to_install_and_how_to_turn_it_off(monkeypatch):
    import torch.utils.cpp_extension as cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension 'swapkit_native_save'\nc++: command not found")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    err = native._build()
    assert isinstance(err, native.NativeBuildError)
    assert "c++: command not found" in str(err)
    assert "ninja" in str(err) and "runtime.native_save: false" in str(err)


def test_a_keep_only_config_with_native_save_is_not_called_idle(caplog):
    with caplog.at_level(logging.WARNING):
        config = swapkit.load_config(native_config(toy_config(1)))
        swapkit.apply(ToyNet(layers=1), config, layers="layers").remove()
    assert "native_save" not in caplog.text


def test_the_session_is_found_behind_the_native_hooks():
    model = ToyNet(layers=1)
    session = synced_session(model, native_config(toy_config(1)))
    with session:
        assert swapkit.runtime.session.active_session() is session
    assert swapkit.runtime.session.active_session() is None
    session.remove()


def test_the_hooks_refuse_a_record_type_they_cannot_build_without_its_call(built):
    """``kept_record`` fills an empty ``KeptRecord`` instead of calling the type: a record type with its own
    ``__init__`` would be skipped, so make_hooks refuses it."""
    from swapkit.runtime.ledger import SETTLE_TICKS
    from swapkit.runtime.step import Step
    from swapkit.runtime.swap_schedule import SwapSchedule

    class Initialised(KeptRecord):
        __slots__ = ()

        def __init__(self, fields):
            super().__init__(fields)

    session = synced_session(ToyNet(layers=1), toy_config(1))
    with pytest.raises(TypeError, match="KeptRecord must not define __new__ or __init__"):
        built.make_hooks(session, session.tracker, session._pack, session._unpack, Step.settle, SwapSchedule.advance,
                         SwapSchedule.add, Step.unpacked, SwapRecord.restore, Saved, Initialised, SwapRecord, Step,
                         SETTLE_TICKS)


def test_a_native_save_that_raises_holds_on_to_nothing():
    """A C++ error inside a native save (here a dispatch mode refusing the keeper's ``detach``) raises as the
    Python hook's does and drops what the save held: the step, and the kept record a save of its storage found,
    which otherwise never dies (its bytes never leave the ledger)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class RefuseDetach(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.detach.default:
                raise RuntimeError("no detach here")
            return func(*args, **(kwargs or {}))

    model = ToyNet(layers=2)
    session = synced_session(model, native_config(toy_config(2)))
    x = torch.randn(8, 16)
    with session:
        a = model(x).exp()
        a.cos()  # a's storage kept in C++: a later save finds its record
        step, packs = session._step, session.native_counts[0]
        before = sys.getrefcount(step)
        for save in (a.sin, lambda: a.sum().exp()):  # a kept record's storage again; a new storage
            with pytest.raises(RuntimeError, match="no detach here"), RefuseDetach():
                save()
        assert sys.getrefcount(step) == before
        records = record_refs(step)
        del a
    gc.collect()
    assert session.native_counts[0] >= packs > 0
    assert records and all(ref() is None for ref in records)
    session.remove()


def test_a_failed_build_leaves_the_model_as_it_was(monkeypatch):
    """The build is checked before swapkit touches the model: a failed apply leaves no scope hook or recompute
    wrapper behind (no session was returned to remove them), and swapkit applies to the model again."""
    monkeypatch.setattr(native, "_built", [])
    monkeypatch.setattr(native, "_build", lambda: native.NativeBuildError("runtime.native_save: true, but ..."))
    model = ToyNet(layers=2)
    plain = {name: (dict(m._forward_pre_hooks), dict(m._forward_hooks), dict(vars(m)))
             for name, m in model.named_modules()}
    config = toy_config(2, recompute_config={"recompute": True})
    with pytest.raises(native.NativeBuildError):
        swapkit.apply(model, native_config(config), layers="layers")
    assert {name: (dict(m._forward_pre_hooks), dict(m._forward_hooks), dict(vars(m)))
            for name, m in model.named_modules()} == plain
    swapkit.apply(model, config, layers="layers").remove()


def test_a_pipeline_stage_is_told_that_native_save_does_nothing(caplog):
    """A stage keeps the Python hooks (its saves open micro-steps): said once at apply, and no C++ is installed."""
    config = native_config(toy_config(4, parallel_config={"pipeline_stage": 2}))
    with caplog.at_level(logging.WARNING, logger="swapkit"):
        session = swapkit.apply(ToyNet(layers=2), config, layers="layers", stage=0)
    assert sum("native_save: true has no effect on a pipeline stage" in m for m in caplog.messages) == 1
    assert session.native_counts is None
    session.remove()


def test_the_planner_measures_every_mode_with_the_hooks_the_config_runs():
    """The planner's keep, recompute and select runs took the default runtime (they swap nothing), native_save
    included: with ``native_save: true`` they timed the Python hooks, and the copy overhead compared the keep
    run's step with the probe's, which kept the C++ ones. Every measurement run now saves as the planned run
    does; the runtime keys that tune swapping still take their defaults where nothing swaps."""
    from swapkit.plan.trace import KEEP, RECOMPUTE, SELECT
    from swapkit.planner.measure import PROBE, mode_config

    config = swapkit.load_config(native_config(toy_config(2, runtime={"min_offload_bytes": 0})))
    for mode in (KEEP, RECOMPUTE, SELECT + "attention", PROBE):
        runtime = mode_config(config, mode).runtime
        assert runtime.native_save, mode
        assert mode == PROBE or runtime.min_offload_bytes == swapkit.config.types.RuntimeConfig().min_offload_bytes


def test_a_data_parallel_swapkit_train_is_told_that_its_ranks_are_stages(caplog):
    """``swapkit train`` runs every rank of a multi-process run as a pipeline stage, a data-parallel run's too
    (``swapkit.distributed.train``): with ``data_parallel: 2`` and no pipeline, native_save did nothing and the
    warning spoke only of a pipeline stage the config does not have."""
    config = native_config(toy_config(2, parallel_config={"data_parallel": 2}))
    with caplog.at_level(logging.WARNING, logger="swapkit"):
        session = swapkit.apply(ToyNet(layers=2), config, layers="layers", stage=0)
    (message,) = [m for m in caplog.messages if "native_save" in m]
    assert "data-parallel" in message and "swapkit train" in message
    assert session.native_counts is None
    session.remove()


@pytest.mark.parametrize("parallel", [{"data_parallel": 2}, {"pipeline_stage": 2}])
def test_the_planner_measures_a_multi_process_run_with_the_python_hooks_it_has(parallel):
    """Every rank of a multi-process run is a pipeline stage, which keeps the Python hooks: the planner, which
    measures one stage's layers (or a data-parallel run's model) in this process, times those, not the C++
    ones (the probe did, and with ``native_save`` kept in every mode so would the keep and recompute runs)."""
    from swapkit.plan.trace import KEEP, RECOMPUTE
    from swapkit.planner.measure import PROBE, mode_config
    from swapkit.planner.stages import measuring_config

    config = swapkit.load_config(native_config(toy_config(4, parallel_config=parallel)))
    if "pipeline_stage" in parallel:
        config = measuring_config(config, 2)
    for mode in (KEEP, RECOMPUTE, PROBE):
        assert not mode_config(config, mode).runtime.native_save, mode


def test_keeps_after_a_steps_first_swap_stay_in_cpp_and_run_the_releases_first():
    """Once a swap record is queued, a save ticks and then runs the releases due (``SwapSchedule.advance``), as
    ``Step.save`` does; the C++ keeps doing both for the keeps outside the swap scopes. Layer 0 swaps with
    k=1 and layers 1-2 keep: the layers that keep are served in C++ after layer 0 queued its swaps, and every
    release, prefetch and stat equals the Python hooks' run."""
    config = toy_config(3, **layer_swap(1, layers=[0]))
    python, native_run = run_both(lambda: (torch.manual_seed(1), ToyNet(layers=3))[1], config, _toy_step)
    assert_same_runs(python, native_run)
    stats = native_run[0][-1][2]
    assert stats.released_bytes > 0 and stats.prefetched_bytes == stats.released_bytes
    packs, _ = native_run[1]
    assert packs >= 2 * (8 - 2 - 3)  # per step: the saves of layers 1 and 2 but each layer's first


def _toy_step(model):
    torch.manual_seed(0)
    x = torch.randn(8, 16, requires_grad=True)
    loss = model(x).sum()
    loss.backward()
    return loss.detach()


def _new_parameter_storages(model):
    """An update that gives every parameter a new storage (``p.data = ...``): the next step knows none of them
    from the previous one."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data * 0.5


def test_parameters_given_new_storages_between_steps_are_kept_as_the_python_keeps_them():
    """A parameter's storage the step does not know yet goes to the Python (Note [The native save path]); with
    every parameter on a new storage each step, the native run still equals the Python one."""
    batch = llama_batch(0)

    def step(model):
        loss = llama_step(model, batch)
        _new_parameter_storages(model)
        return loss

    python, native_run = run_both(llama, toy_config(4, **CONFIGS["recompute_and_swap"]), step, steps=3)
    assert_same_runs(python, native_run)
    assert native_run[1][0] > 0


def test_sessions_on_concurrent_threads_each_give_the_python_results():
    """One session per thread (Note [One session per thread, one thread per session]): three native sessions
    running at once on three threads each equal a Python session run alone."""
    config = toy_config(4, **layer_swap(1, layers=[1, 3]))

    def run(on: bool, seed: int, out: dict) -> None:
        out[seed] = _one_run(on, seed, config)

    python, native_runs = {}, {}
    for seed in (1, 2, 3):
        run(False, seed, python)
    threads = [threading.Thread(target=run, args=(True, seed, native_runs)) for seed in (1, 2, 3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for seed in (1, 2, 3):
        assert_same_runs(python[seed], native_runs[seed])
        assert native_runs[seed][1][0] > 0


def _one_run(on: bool, seed: int, config: dict, steps: int = 3):
    """(per-step (loss, grads, stats), native_counts) of one session on ``llama(seed)``."""
    model = llama(seed)
    session = synced_session(model, native_config(config, on))
    runs = []
    for step in range(steps):
        model.zero_grad()
        with session:
            loss = llama_step(model, llama_batch(10 * seed + step))
        runs.append((loss, grads(model), session.stats))
    session.remove()
    return runs, session.native_counts


#: ``length`` ``sin`` ops, each saving its input, a new plain storage: the microbenchmark's layer
SinChain = bench_module("microbench").TinyChain


class SinNet(nn.Module):
    def __init__(self, layers: int = 3, length: int = 6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, 16))
        self.layers = nn.ModuleList([SinChain(length) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.weight
        for layer in self.layers:
            x = layer(x)
        return x.sum()


class WritingChain(SinChain):
    """A SinChain that writes its first output in place after the next ``sin`` saved it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.sin(x)
        y = torch.sin(x)
        x.mul_(1)
        return super().forward(y)


def _sin_step(model):
    loss = model(torch.linspace(-1.0, 1.0, 16, dtype=model.weight.dtype))
    loss.backward()
    return loss.detach()


def test_new_swapped_storages_and_swapped_unpacks_are_served_in_cpp():
    """Note [Swaps served in C++] in native_save.cpp: in a layer swap of plain ops, every new storage but each
    layer's first save (a new frame: the Python sees it) gets its swap record through the C++, which calls
    ``SwapSchedule.add``; every unpack of a swapped save is served in C++, whichever path made its handle. The
    batches, releases, prefetches and stats equal the Python hooks' run, bit for bit."""
    config = toy_config(3, **layer_swap(2))
    python, native_run = run_both(lambda: SinNet(), config, _sin_step, steps=1)
    assert_same_runs(python, native_run)
    stats = native_run[0][0][2]
    assert stats.offloaded_tensors > 0 and stats.prefetched_bytes == stats.released_bytes > 0
    model = SinNet()
    session = synced_session(model, native_config(config))
    _sin_step_in(session, model)
    assert session.native_swap_counts == (3 * (6 - 1), 3 * 6)


def _sin_step_in(session, model):
    with session:
        return _sin_step(model)


class _CountingObserver:
    """Sees every save and unpack, as the planner's measurement does (``SwapSession.observer``)."""

    def __init__(self) -> None:
        self.saved_count = self.unpacked_count = 0

    def saved(self, saved) -> None:
        self.saved_count += 1

    def unpacked(self, saved) -> None:
        self.unpacked_count += 1


@pytest.mark.parametrize("change", ["version", "observer", "dtype", "small"])
def test_swaps_the_cpp_does_not_serve_go_to_the_python_hooks(change):
    """A swapped save the C++ cannot serve as the Python would is the Python's: a half-precision tensor (autocast
    may cache it), one under ``min_offload_bytes`` (kept and counted as small), or any save or unpack of a
    session with an observer; at unpack, a keeper written in place gets the session's error."""
    runtime = {"min_offload_bytes": 10**6} if change == "small" else {}
    model = SinNet().to(torch.float16) if change == "dtype" else SinNet()
    session = synced_session(model, native_config(toy_config(3, **layer_swap(2, **runtime))))
    if change == "version":  # layer 1 writes in place a storage its second sin saved in C++
        model.layers[1] = WritingChain(6)
        with session, pytest.raises(RuntimeError, match="modified by an in-place operation after it was saved"):
            _sin_step(model)
        assert session.native_swap_counts[0] > 0
        return
    if change == "observer":
        session.observer = _CountingObserver()
    _sin_step_in(session, model)
    packs, unpacks = session.native_swap_counts
    stats = session.stats
    if change == "observer":
        assert packs == unpacks == 0 and session.observer.unpacked_count == stats.ticks == 1 + 3 * 6
    elif change == "dtype":
        assert packs == 0 and stats.offloaded_tensors > 0  # swapped by the Python
    else:
        assert packs == 0 and stats.skipped["small"] == 3 * 6 * 16 * 4 and stats.offloaded_tensors == 0


def test_the_cpp_region_copy_moves_each_storage_into_its_slot_and_names_a_changed_one(built):
    """``copy_region`` (swapkit.engine.thread Note [Region copies without the interpreter lock]): each source's
    bytes at its offset, the padding between slots untouched; a storage resized since its save is named by its
    index, before anything is copied; sources that are not (storage, offset, nbytes, address) are refused."""
    a, b = torch.arange(5, dtype=torch.float32), torch.arange(3, dtype=torch.int64) + 7
    sources = [(t.untyped_storage(), offset, t.untyped_storage().nbytes(), t.untyped_storage().data_ptr())
               for t, offset in ((a, 0), (b, 32))]
    region = torch.full((64,), 255, dtype=torch.uint8)
    assert built.copy_region(region, sources) == -1
    assert torch.equal(region[:20].view(torch.float32), a) and torch.equal(region[32:56].view(torch.int64), b)
    assert torch.equal(region[20:32], torch.full((12,), 255, dtype=torch.uint8))  # the padding
    b.untyped_storage().resize_(8)
    region.fill_(0)
    assert built.copy_region(region, sources) == 1
    assert not region.any()  # checked before any copy
    with pytest.raises(ValueError, match="does not fit its slot"):
        built.copy_region(torch.empty(16, dtype=torch.uint8), sources[:1])
    storage, _, _, address = sources[0]
    with pytest.raises(ValueError, match="does not fit its slot"):  # an end past int64's range is no wrap-around
        built.copy_region(region, [(storage, 2**62, 2**62, address)])
    with pytest.raises(TypeError, match=r"\(storage, offset, nbytes, address\)"):
        built.copy_region(region, [(a, 0, 20, 0)])


def test_a_native_session_gives_its_cpu_thread_engine_the_cpp_region_copy():
    """A session with ``native_save`` hands its thread engine the C++ copy on entering (the engine may be new);
    one without it leaves the engine's Python copies. The copies are exact: the parity tests above run them."""
    on, off = one_layer_session(), one_layer_session(on=False)
    for session in (on, off):
        with session:
            pass
    assert on.engine._native_region is native.native_module().copy_region
    assert off.engine._native_region is None


class _WritesItsSwappedInput(nn.Module):
    """Saves ``a`` in a swap scope, then writes it in place (a new version of a swapped storage)."""

    def forward(self, x):
        a = torch.sin(x)
        b = torch.sin(a)  # saves a: swapped
        with torch.no_grad():
            a.mul_(1)
        return a, b


class _SavesAWrittenSwappedStorageAgain(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, 16))
        self.layers = nn.ModuleList([_WritesItsSwappedInput(), SinChain(1)])

    def forward(self, x):
        a, b = self.layers[0](x * self.weight)
        c = torch.sin(b)  # outside the layers: a new frame, the Python
        d = torch.sin(a)  # the same frame: the C++ keeps a at its new version, past a stale swap record
        return self.layers[1](a).sum() + c.sum() + d.sum()  # layer 1's first save of a: the Python again


@pytest.mark.parametrize("make", [_SavesAWrittenSwappedStorageAgain, "recycled"])
def test_a_storage_the_cpp_keeps_past_a_stale_swap_record_is_counted_once(make):
    """A swap record found by a storage's key is stale when its storage was written since or died (its
    StorageImpl's address then another storage's); the C++ keeps the storage then, in its KeptIndex, and takes
    the stale record out of the step's index as the Python's first save replaces it: a later Python save
    finds the kept record, not the stale one, and the bytes are counted once (a review found them counted
    twice). ``recycled``: layer 0 swaps a chain, whose released storages' addresses the kept chain after it
    takes; kept layers then save those storages again."""
    def recycled():
        model = SinNet(layers=9, length=1)
        model.layers[0] = SinChain(8)

        def forward(x):
            kept = [torch.sin(model.layers[0](x * model.weight))]
            for _ in range(8):
                kept.append(torch.sin(kept[-1]))
            return sum(layer(t).sum() for layer, t in zip(model.layers[1:], kept))
        model.forward = forward
        return model

    layers = 9 if make == "recycled" else 2
    config = toy_config(layers, **layer_swap(1, layers=[0]))
    results = []
    for on in (False, True):
        model = recycled() if make == "recycled" else make()
        session = synced_session(model, native_config(config, on))
        with session:
            loss = model(torch.linspace(-1.0, 1.0, 16))
            forward = (session._step.stats.saved_bytes, session._step.device_bytes)
            if make == "recycled":  # the written storage's backward would raise: it was saved before the write
                loss.backward()
            del loss
        results.append((forward, session.stats, grads(model) if make == "recycled" else {}))
    (forward_a, stats_a, grads_a), (forward_b, stats_b, grads_b) = results
    assert forward_a == forward_b and stats_a == stats_b
    assert_grads_equal(grads_a, grads_b)


@pytest.mark.parametrize("make", [
    lambda: torch.arange(12, dtype=torch.float32).reshape(3, 4),
    lambda: torch.arange(24, dtype=torch.float64).reshape(4, 6)[1:, ::2],  # offset and strides
    lambda: torch.arange(6, dtype=torch.int16).reshape(2, 3).t(),
    lambda: torch.randn(3, 2, dtype=torch.complex64).conj(),  # the lazy conjugate bit
    lambda: torch._neg_view(torch.randn(5, dtype=torch.complex128)),  # the lazy negative bit
    lambda: torch._neg_view(torch.randn(3, dtype=torch.complex64)).conj(),  # both bits
    lambda: torch.randn(4, dtype=torch.complex64).conj().imag,  # a real dtype with the negative bit
    lambda: torch.zeros(0, 3, dtype=torch.bfloat16),
], ids=["f32", "f64_view", "i16_t", "conj", "neg", "neg_conj", "real_neg", "empty"])
def test_the_cpp_view_on_rebuilds_what_the_python_rebuilds(built, make):
    """``view_on`` of ``record_ops.cpp`` (swapkit.runtime.records Note [A record's torch calls in C++]): the same
    dtype, sizes, strides, storage offset, lazy bits and values as the Python's, on the same storage."""
    from swapkit.runtime.records import view_meta, view_on

    tensor = make()
    region = torch.zeros(256, dtype=torch.uint8)
    flat = tensor.untyped_storage()
    region[64:64 + flat.nbytes()] = torch.empty(0, dtype=torch.uint8).set_(flat)
    meta = view_meta(tensor)
    ours, theirs = built.view_on(region.untyped_storage(), 64, meta, None), view_on(region.untyped_storage(), 64,
                                                                                   meta, {})
    for view in (ours, theirs):
        assert (view.dtype, view.shape, view.stride(), view.is_conj(), view.is_neg()) == (
            tensor.dtype, tensor.shape, tensor.stride(), tensor.is_conj(), tensor.is_neg())
        assert view.storage_offset() == tensor.storage_offset() + 64 // tensor.element_size()
        assert view.untyped_storage().data_ptr() == region.untyped_storage().data_ptr()
        assert torch.equal(view.resolve_conj().resolve_neg(), tensor.resolve_conj().resolve_neg())
    with pytest.raises(TypeError, match=r"\(dtype, size, stride, offset, conj, neg\)"):
        built.view_on(region.untyped_storage(), 0, meta[:5], None)


def test_the_cpp_empty_keeper_frees_the_storage_and_keeps_counting_writes(built):
    """``empty_keeper`` of ``record_ops.cpp``: the keeper holds no bytes, its version is what it was, and an
    in-place write through another alias of its version counter still shows on it (Note [Version keepers])."""
    from swapkit.runtime.records import empty_keeper

    for empty in (built.empty_keeper, empty_keeper):
        tensor = torch.randn(8)
        tensor.add_(1)
        keeper = tensor.detach()
        version = keeper._version
        empty(keeper)
        assert keeper.untyped_storage().nbytes() == 0 and keeper._version == version
        tensor.mul_(2)  # shares the counter: the restore's version check must see this
        assert keeper._version == version + 1 and tensor.untyped_storage().nbytes() == 32


def test_the_cpp_empty_keeper_puts_the_version_back_when_set_is_refused(built):
    """As the Python's (tests/test_session.py): a dispatch mode refusing ``set_`` gets its error, and the keeper
    does not look modified in place."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class RefusesSet(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.set_.default:
                raise ValueError("set_ refused")
            return func(*args, **(kwargs or {}))

    keeper = torch.ones(4).detach()
    version = keeper._version
    with pytest.raises(ValueError, match="set_ refused"), RefusesSet():
        built.empty_keeper(keeper)
    assert keeper._version == version and keeper.untyped_storage().nbytes() == 16


def test_a_native_step_rebuilds_views_and_empties_keepers_in_cpp():
    """A session with ``native_save`` gives its steps the C++ record ops; one without keeps the Python's."""
    from swapkit.runtime import records

    on, off = one_layer_session(), one_layer_session(on=False)
    for session in (on, off):
        with session:
            pass
    module = native.native_module()
    assert (on._step.view_on, on._step.empty_keeper) == (module.view_on, module.empty_keeper)
    assert (off._step.view_on, off._step.empty_keeper) == (records.view_on, records.empty_keeper)
