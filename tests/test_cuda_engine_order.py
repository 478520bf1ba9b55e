"""The CUDA engine's call order, on CPU: fake streams and events log what is queued on which stream, so the
rules of ``swapkit.engine.cuda`` that no CPU engine exercises run in CI without a GPU. The copies themselves are
CPU copies (finished when issued); what is checked is where and in which order each step is queued:
Notes [D2H waits for the producer], [Copy sources are released in stream order], [H2D target reuse],
[A prefetched buffer used on another stream], [A joined prefetch target is stream-ordered], [A copy is joined
once per stream], [Switching to the side stream], and a whole session on that engine with its events never
completing until synchronized (a GPU far behind the CPU)."""
from __future__ import annotations

import threading

import pytest
import torch

import swapkit
import swapkit.engine.cuda as cuda_engine
import swapkit.runtime.session as session_module
from tests.test_coalesce import MixedNet, run
from tests.toys import ToyNet, grads, layer_swap, toy_config

pytestmark = pytest.mark.usefixtures("remove_sessions")


class FakeStream:
    """A stream that logs the waits queued on it; ``synchronize`` completes the events recorded on it."""

    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def __repr__(self) -> str:
        return self.name

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(("wait_stream", self, other))

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait_event", self, event))

    def synchronize(self) -> None:
        for entry in self.log:
            if entry[0] == "record" and entry[2] is self:
                entry[1].done = True


class FakeEvent:
    """An event that completes only when its stream is synchronized (or at once, with ``done_at_record``)."""

    done_at_record = False

    def __init__(self, log: list, enable_timing: bool = False) -> None:
        self.log, self.done = log, False

    def record(self, stream: FakeStream) -> None:
        self.log.append(("record", self, stream))
        self.done = self.done_at_record

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True

    def elapsed_time(self, end: FakeEvent) -> float:
        return 0.0


class FakeCuda:
    """The CUDA calls ``swapkit.engine.cuda`` makes, on one device with a per-thread current stream."""

    def __init__(self, monkeypatch) -> None:
        self.log: list = []
        self.capturing = False  # what torch.cuda.is_current_stream_capturing answers
        self._current = threading.local()
        self._streams: dict[int, FakeStream] = {}
        self.default = self.stream()
        self.default.name = "default"
        patch = monkeypatch.setattr
        patch(torch.cuda, "Stream", self._stream_factory)
        patch(torch.cuda, "Event", lambda enable_timing=False: FakeEvent(self.log, enable_timing))
        patch(torch.cuda, "_lazy_init", lambda: None)
        patch(torch.cuda, "is_current_stream_capturing", lambda: self.capturing)
        patch(torch.cuda, "current_device", lambda: None)  # as the engine's device index below: set_stream is used
        patch(torch.cuda._utils, "_get_device_index", lambda device, optional=False: 0)
        patch(torch._C, "_cuda_getCurrentStream", lambda index: (id(self.current), 0, 1), raising=False)
        patch(torch.cuda, "set_stream", self.set_current)
        patch(torch.Tensor, "record_stream", lambda t, s: self.log.append(("record_stream", t.data_ptr(), s)),
              raising=False)
        patch(cuda_engine, "device_pinned_memory", lambda n, device: torch.empty(-(-n // 4096) * 4096,
                                                                                  dtype=torch.uint8))
        copy, empty = torch.Tensor.copy_, torch.empty

        def logged_copy(dst, src, non_blocking=False):
            self.log.append(("copy", dst.data_ptr(), src.data_ptr(), self.current, non_blocking))
            return copy(dst, src, non_blocking)

        def logged_empty(*args, **kwargs):
            out = empty(*args, **kwargs)
            if out.numel():
                self.log.append(("empty", out.data_ptr(), self.current))
            return out

        patch(torch.Tensor, "copy_", logged_copy)
        patch(torch, "empty", logged_empty)

    @property
    def current(self) -> FakeStream:
        return getattr(self._current, "stream", self.default)

    def set_current(self, stream: FakeStream) -> None:
        self._current.stream = stream

    def stream(self) -> FakeStream:
        made = FakeStream(self.log, f"s{len(self._streams)}")
        self._streams[id(made)] = made
        return made

    def _stream_factory(self, device=None, priority=0, stream_id=None, device_index=None, device_type=None):
        return self._streams[stream_id] if stream_id is not None else self.stream()

    def engine(self) -> cuda_engine.CudaCopyEngine:
        engine = cuda_engine.CudaCopyEngine(torch.device("cuda", 0))
        engine.device = torch.device("cpu")  # the tensors stay on the CPU; streams and events are the fakes
        return engine

    def kinds(self) -> list[str]:
        return [entry[0] for entry in self.log]


@pytest.fixture()
def fake(monkeypatch) -> FakeCuda:
    return FakeCuda(monkeypatch)


def test_an_offload_waits_for_its_producer_then_records_and_copies_on_the_side_stream(fake):
    engine, mine = fake.engine(), fake.stream()
    fake.set_current(mine)
    src, region = torch.arange(8, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)
    copy = engine.offload_storages(region, [(src.untyped_storage(), 0, 8, src.data_ptr())], producer=fake.default)
    assert fake.kinds() == ["wait_stream", "record_stream", "copy", "record"]
    wait, record_stream, copied, recorded = fake.log
    assert wait[1:] == (engine.stream, fake.default)  # the batch's producer, not the stream current at the flush
    assert record_stream[2] is engine.stream and copied[3] is engine.stream and recorded[2] is engine.stream
    assert copied[4]  # non_blocking: the host side is pinned
    assert fake.current is mine  # the caller's stream again
    assert torch.equal(region[:8], src)
    fake.log.clear()
    engine.wait(copy)
    assert fake.log == [("wait_event", mine, copy.event)]


def test_a_prefetch_target_is_made_on_the_compute_stream_and_each_reader_joins_once(fake):
    engine = fake.engine()
    region = torch.arange(32, dtype=torch.uint8)
    target, copy = engine.prefetch(region)
    assert fake.kinds() == ["empty", "wait_stream", "copy", "record"]
    made, wait, copied, _ = fake.log
    assert made[2] is fake.default and wait[1:] == (engine.stream, fake.default) and copied[3] is engine.stream
    other = fake.stream()
    fake.log.clear()
    fake.set_current(other)
    engine.wait(copy)  # another stream reads it: the buffer is recorded there, and its own stream has not joined
    assert fake.log == [("record_stream", target.data_ptr(), other), ("wait_event", other, copy.event)]
    assert engine.inflight.held()[-1][1] is target
    fake.set_current(fake.default)
    fake.log.clear()
    engine.wait(copy)
    assert fake.log == [("wait_event", fake.default, copy.event)]
    assert engine.inflight.held()[-1] == [region]  # its own stream joined: the target is stream-ordered now
    fake.log.clear()
    engine.wait(copy)
    assert fake.log == []
    assert torch.equal(target, region)


@pytest.mark.parametrize("done_at_record", [False, True], ids=["gpu_behind", "copies_done"])
@pytest.mark.parametrize("verify", [False, True], ids=["", "verify"])
@pytest.mark.parametrize("batch_bytes", [0, 1 << 20], ids=["per_storage", "coalesced"])
def test_a_session_on_the_cuda_engine_is_bit_identical_and_leaves_nothing_in_flight(
        fake, monkeypatch, done_at_record, verify, batch_bytes):
    monkeypatch.setattr(FakeEvent, "done_at_record", done_at_record)
    engine = fake.engine()
    monkeypatch.setattr(session_module, "make_engine", lambda runtime, device: engine)
    reference = MixedNet()
    expected = run(reference)
    model = MixedNet()
    model.load_state_dict(reference.state_dict())
    session = swapkit.apply(model, toy_config(3, **layer_swap(2, offload_batch_bytes=batch_bytes, verify=verify)),
                            layers="layers")
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        got = run(model, session)
        for key, value in expected.items():
            assert torch.equal(got[key], value), key
        stats = session.stats
        assert stats.prefetched_bytes == stats.released_bytes > 0  # released when queued, all came back
        assert stats.verified_tensors == (stats.prefetched_tensors if verify else 0)
        assert engine.inflight.last is None and len(engine.inflight) == 0  # the block's exit synchronized
    assert {"wait_stream", "record_stream", "copy", "record", "wait_event"} <= set(fake.kinds())


def test_each_batch_waits_for_the_stream_its_storages_were_saved_on(fake, monkeypatch):
    engine = fake.engine()
    monkeypatch.setattr(session_module, "make_engine", lambda runtime, device: engine)
    a, b = fake.stream(), fake.stream()
    torch.manual_seed(0)
    model, reference = ToyNet(layers=3), ToyNet(layers=3)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(8, 16)
    reference(x).sum().backward()
    for layer, stream in zip(model.layers, (a, b, a)):
        layer.register_forward_pre_hook(lambda module, args, stream=stream: fake.set_current(stream))
    model.layers[2].register_forward_hook(lambda module, args, out: fake.set_current(fake.default))
    session = swapkit.apply(model, toy_config(3, **layer_swap(1, offload_batch_bytes=1 << 20)), layers="layers")
    with session:
        model(x).sum().backward()
    offloads = [entry[2] for entry, after in zip(fake.log, fake.log[1:])
                if entry[0] == "wait_stream" and after[0] == "record_stream"]
    # layer 0's batches wait for a; layer 1's is flushed at layer 2's first save, with a current again, and still
    # waits for b (layer 2's storages are the tail: never copied)
    assert set(offloads) == {a, b} and offloads[-1] is b and fake.default not in offloads, offloads
    for key, value in grads(reference).items():
        assert torch.equal(grads(model)[key], value), key


def test_swap_copies_inside_cuda_graph_capture_are_refused_naming_the_scope_and_the_fix(fake, monkeypatch):
    """swapkit.engine.cuda Note [No copies inside CUDA graph capture]: once the current stream captures, no slab is
    pinned and no copy is queued; the error names the layer and what to do, and after capture the session swaps
    again, exactly. A fresh engine's first refusal is the slab, before any copy."""
    engine = fake.engine()
    monkeypatch.setattr(session_module, "make_engine", lambda runtime, device: engine)
    torch.manual_seed(0)
    model, reference = ToyNet(layers=3), ToyNet(layers=3)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(8, 16)
    reference(x).sum().backward()
    session = swapkit.apply(model, toy_config(3, **layer_swap(1)), layers="layers")
    with session:  # a warm-up step outside capture, as reduce-overhead's: the pool has its slab
        model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    fake.log.clear()
    fake.capturing = True
    with pytest.raises(cuda_engine.CaptureError, match=r"device-to-host copy for layer 0 .*capturing a CUDA graph"
                       r".*max-autotune-no-cudagraphs.*swap_config"):
        with session:
            model(x).sum().backward()
    assert "copy" not in fake.kinds() and "wait_stream" not in fake.kinds()
    fake.capturing = False
    with session:
        model(x).sum().backward()
    assert session.stats.prefetched_bytes == session.stats.released_bytes > 0
    for key, value in grads(reference).items():
        assert torch.equal(grads(model)[key], value), key
    fake.capturing = True
    with pytest.raises(cuda_engine.CaptureError, match="a pinned host slab was asked for"):
        fake.engine().host_buffer(4096)
