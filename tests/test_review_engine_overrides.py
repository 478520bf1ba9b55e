"""Review demonstration: an engine that hooks ``offload_many`` must still see every coalesced batch copy.

Before 33b4c1e ``Batch.flush`` called ``engine.offload_many``; it now calls ``engine.offload_storages``, and
``ThreadCopyEngine._copies_unchanged`` only looks at ``offload`` and ``_copy``. A subclass that overrides
``offload_many`` (what tests/test_stream_order.NamedStreams did before the change) is bypassed silently.
"""
from __future__ import annotations

import torch

from tests.toys import ReadyWhenDone, ToyNet, install_engine, layer_swap, toy_config


class CountsBatches(ReadyWhenDone):
    def __init__(self) -> None:
        super().__init__("cpu")
        self.batches = 0

    def offload_many(self, pairs, producer=None):
        self.batches += 1
        return super().offload_many(pairs, producer)


def test_an_offload_many_override_sees_every_batch_copy():
    import swapkit

    model = ToyNet(layers=3)
    session = swapkit.apply(model, toy_config(3, **layer_swap(1)), layers="layers")
    engine = CountsBatches()
    install_engine(session, engine)
    with session:
        model(torch.randn(8, 16)).sum().backward()
    assert session.stats.offload_copies > 0
    assert engine.batches == session.stats.offload_copies  # fails on main: 0 batches seen


class Collects:
    def __init__(self) -> None:
        self.handles = []

    def saved(self, saved) -> None:
        self.handles.append(saved)

    def unpacked(self, saved) -> None:
        pass


def test_saved_handles_compare_by_identity():
    """``Saved`` became a tuple subclass (52213c7): ``==`` / ``in`` now compare the keeper tensors elementwise."""
    import swapkit

    model = ToyNet(layers=2)
    session = swapkit.apply(model, toy_config(2, **layer_swap(1)), layers="layers")
    install_engine(session, ReadyWhenDone("cpu"))
    session.observer = observer = Collects()
    with session:
        loss = model(torch.randn(8, 16)).sum()
        first, rest = observer.handles[0], observer.handles[1:]
        assert first not in rest  # main: RuntimeError: Boolean value of Tensor ... is ambiguous
        loss.backward()
