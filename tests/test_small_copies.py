"""The thread engine runs a small copy on the calling thread when its queue is idle, and hands everything else to
its worker in FIFO order (swapkit.engine.thread Note [Small copies run on the caller])."""
from __future__ import annotations

import threading

import pytest
import torch

import swapkit
from swapkit.engine import ThreadCopyEngine
from swapkit.engine.base import StorageChangedError
from tests.toys import (
    ReadyWhenDone, ToyNet, assert_grads_equal, grads, install_engine, layer_swap, require_native, toy_config,
)


def sources_of(*tensors: torch.Tensor, offsets: tuple[int, ...]) -> list:
    return [(t.untyped_storage(), offset, t.untyped_storage().nbytes(), t.untyped_storage().data_ptr())
            for t, offset in zip(tensors, offsets)]


def gate_the_worker(engine: ThreadCopyEngine) -> threading.Event:
    """Queue a job that holds the worker until the returned event is set (60 s at most)."""
    gate = threading.Event()
    engine._submit(lambda: gate.wait(60))
    return gate


def test_a_small_copy_with_an_idle_queue_is_done_when_returned_and_starts_no_worker():
    engine = ThreadCopyEngine("cpu")
    a, b = torch.arange(5, dtype=torch.float32), torch.arange(3, dtype=torch.int64) + 7
    region = torch.full((64,), 255, dtype=torch.uint8)
    copy = engine.offload_storages(region, sources_of(a, b, offsets=(0, 32)), None, "layer 0")
    assert copy.done and engine.ready(copy) and engine.fence() is None
    assert torch.equal(region[:20].view(torch.float32), a) and torch.equal(region[32:56].view(torch.int64), b)
    assert torch.equal(region[20:32], torch.full((12,), 255, dtype=torch.uint8))  # the padding untouched
    back, fetched = engine.prefetch(region)
    assert fetched.done and not fetched.synchronized and torch.equal(back, region)
    assert engine._worker is None  # nothing was handed over
    engine.close()


def test_a_small_copy_behind_an_unfinished_one_waits_its_turn_on_the_worker():
    """FIFO: a prefetch of a host buffer whose offload is still queued must see the offloaded bytes."""
    engine = ThreadCopyEngine("cpu")
    gate = gate_the_worker(engine)
    src, host = torch.arange(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    region_copy = engine.offload_storages(host, sources_of(src, offsets=(0,)))
    back, fetched = engine.prefetch(host)
    assert not region_copy.done and not fetched.done and engine.fence() is not None
    gate.set()
    engine.wait(fetched)
    assert engine.ready(region_copy) and torch.equal(back, src) and engine.fence() is None
    back, fetched = engine.prefetch(host)  # the queue is idle again: on the caller
    assert fetched.done and torch.equal(back, src)
    engine.close()


@pytest.mark.parametrize("change", ["large", "inline_off", "link", "replaced_copy", "subclass"])
def test_copies_the_caller_must_not_run_go_to_the_worker(change):
    """Larger than ``inline_bytes``, ``inline_bytes=0``, an emulated link, a replaced copy (instance attribute or
    subclass): the worker runs them, and a replaced copy still sees each of its copies."""
    seen = []

    class CountsCopies(ThreadCopyEngine):
        def _copy(self, dst, src):
            seen.append(src.numel())
            super()._copy(dst, src)

    options = {"large": {"inline_bytes": 32}, "inline_off": {"inline_bytes": 0},
               "link": {"bandwidth_gbps": 1000.0}}.get(change, {})
    engine = (CountsCopies if change == "subclass" else ThreadCopyEngine)("cpu", **options)
    if change == "replaced_copy":
        copy = engine._copy
        engine._copy = lambda dst, src: seen.append(src.numel()) or copy(dst, src)
    src = torch.arange(64, dtype=torch.uint8)
    back, fetched = engine.prefetch(src)
    engine.wait(fetched)
    assert torch.equal(back, src) and engine._worker is not None
    assert seen == ([64] if change in ("replaced_copy", "subclass") else [])
    engine.close()


@pytest.mark.parametrize("native", [False, True])
def test_a_storage_changed_before_its_inline_copy_fails_that_copy_once(native):
    """The inline copy checks the storages as the worker does, in Python or with the C++ ``copy_region``; its
    failure is reported by ``ready`` (each time) and, once reported, not again by ``synchronize``; one nobody
    asked about is raised by ``synchronize`` once."""
    engine = ThreadCopyEngine("cpu")
    if native:
        engine.use_native_copies(require_native().copy_region)
    t = torch.arange(6, dtype=torch.float32)
    sources = sources_of(t, offsets=(0,))
    t.untyped_storage().resize_(0)
    copy = engine.offload_storages(torch.empty(32, dtype=torch.uint8), sources, None, "layer 2")
    for _ in range(2):
        with pytest.raises(StorageChangedError, match=r"saved in layer 2 was resized.*\(24 bytes when saved, 0 now\)"):
            engine.ready(copy)
    engine.synchronize()
    engine.offload_storages(torch.empty(32, dtype=torch.uint8), sources, None, "layer 3")
    with pytest.raises(StorageChangedError, match="saved in layer 3"):
        engine.synchronize()
    engine.synchronize()
    assert engine._worker is None
    engine.close()


def test_ctrl_c_during_an_inline_copy_reaches_the_caller_and_is_no_copy_failure():
    """A KeyboardInterrupt raised while a copy runs on the caller propagates (it is not swallowed as the copy's
    error) and leaves nothing for ``synchronize``; the engine goes on copying."""
    engine = ThreadCopyEngine("cpu")

    def interrupted(region, sources):
        raise KeyboardInterrupt

    engine.use_native_copies(interrupted)  # the batch copy's C++ step, replaced: still the engine's own copy
    t = torch.arange(4, dtype=torch.float32)
    with pytest.raises(KeyboardInterrupt):
        engine.offload_storages(torch.empty(16, dtype=torch.uint8), sources_of(t, offsets=(0,)))
    engine.synchronize()
    back, fetched = engine.prefetch(torch.arange(8, dtype=torch.uint8))
    assert fetched.done and torch.equal(back, torch.arange(8, dtype=torch.uint8)) and engine._worker is None
    engine.close()


def test_only_a_cpu_engine_copies_on_the_caller():
    """With ``runtime.engine: thread`` on a CUDA model a copy on the compute thread would wait for its stream."""
    assert ThreadCopyEngine("cpu")._runs_here(64, "_copy")
    assert not ThreadCopyEngine("cuda")._runs_here(64, "_copy")


@pytest.mark.parametrize("bad", [-1, True, 1.5, "64"])
def test_inline_bytes_must_be_a_whole_number_of_bytes(bad):
    with pytest.raises(ValueError, match=rf"thread engine inline_bytes: got {bad!r}; expected a whole number"):
        ThreadCopyEngine("cpu", inline_bytes=bad)


@pytest.mark.parametrize("inline_bytes", [64 * 1024, 0])
def test_a_session_gives_the_same_gradients_with_copies_inline_or_on_the_worker(inline_bytes):
    """Bit-identical gradients to the model without swapkit either way; the stats count the same copies, and only
    the engine that hands copies over starts a worker."""
    model, ref = ToyNet(layers=3), ToyNet(layers=3)
    ref.load_state_dict(model.state_dict())
    x = torch.randn(8, 16)
    ref(x).sum().backward()
    session = swapkit.apply(model, toy_config(3, **layer_swap(1)), layers="layers")
    engine = ReadyWhenDone("cpu", inline_bytes=inline_bytes)  # releases at their horizon either way
    install_engine(session, engine)
    with session:
        model(x).sum().backward()
    assert_grads_equal(grads(model), grads(ref))
    stats = session.stats
    assert stats.offload_copies > 0 and stats.prefetch_copies > 0 and stats.prefetched_bytes == stats.released_bytes > 0
    assert (engine._worker is None) == (inline_bytes > 0)
    session.remove()


def test_runtime_engine_options_inline_bytes_reaches_the_thread_engine_and_bad_values_name_the_key():
    from swapkit.config.types import EngineOptions
    from swapkit.engine import unused_engine_options

    session = swapkit.apply(ToyNet(layers=1), toy_config(1, **layer_swap(1, engine_options={"inline_bytes": 0})),
                            layers="layers")
    with session:
        pass
    assert session.engine.inline_bytes == 0
    session.remove()
    for bad, expected in ((-1, "got -1; expected an integer >= 0"),
                          ("64KiB", "got '64KiB'; expected a whole byte count >= 0. This key takes plain bytes, not a "
                                    "size with a unit: write 65536")):
        with pytest.raises(swapkit.ConfigError, match=rf"runtime.engine_options.inline_bytes: {expected}"):
            swapkit.apply(ToyNet(layers=1), toy_config(1, **layer_swap(1, engine_options={"inline_bytes": bad})),
                          layers="layers")
    assert unused_engine_options(EngineOptions(), "cuda") == []  # the default is no choice of the user's
    assert unused_engine_options(EngineOptions(inline_bytes=0), "cuda") == [
        "runtime.engine_options.inline_bytes: 0 has no effect with the CUDA engine (every copy is queued on its side "
        "stream); remove it"]
