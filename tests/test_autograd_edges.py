"""Autograd edge cases with swap on: a backward that leaves a forward to continue it (a gradient
penalty), the stats and the learnt forward length that follow."""
from __future__ import annotations

import torch

from tests.toys import ToyNet, assert_grads_equal, grads, layer_swap, synced_session, toy_config


def penalized(net: torch.nn.Module, x: torch.Tensor) -> None:
    """A gradient penalty: ``autograd.grad(create_graph=True)`` ends the step's backward, then ``g.square()``
    saves ``g`` outside the layers (a pack after backward began: a new step that runs no layer)."""
    out = net(x).sum()
    (g,) = torch.autograd.grad(out, x, create_graph=True)
    (out + g.square().sum()).backward()


def test_a_gradient_penalty_keeps_the_step_that_ran_the_layers_in_stats():
    """Note [The rest of a forward]: the penalty's step ran no bound layer; the session's stats and the
    forward length the next step's tail skip learns are those of the step that ran the layers, as without
    the penalty (before, ``stats`` said 0 bytes offloaded, 1 tick, and the tail was offloaded every step)."""
    model, reference, plain = ToyNet(layers=4), ToyNet(layers=4), ToyNet(layers=4)
    reference.load_state_dict(model.state_dict())
    plain.load_state_dict(model.state_dict())
    session, plain_session = synced_session(model, toy_config(4, **layer_swap(1))), \
        synced_session(plain, toy_config(4, **layer_swap(1)))
    x = torch.randn(4, 16, requires_grad=True)
    for _ in range(2):
        with session:
            penalized(model, x)
        with plain_session:
            (plain(x).sum()).backward()
    for _ in range(2):
        penalized(reference, x.detach().requires_grad_())
    assert_grads_equal(grads(model), grads(reference))
    stats, expected = session.stats, plain_session.stats
    assert stats.ticks == expected.ticks and stats.offloaded_bytes == expected.offloaded_bytes > 0
    assert stats.skipped.get("tail") == expected.skipped.get("tail") > 0  # the learnt length is the forward's
    assert stats.released_bytes == stats.prefetched_bytes == expected.released_bytes


def test_the_backward_of_one_forward_leaves_a_later_forwards_swaps_on_the_host():
    """swap_schedule Note [A backward prefetches its own forward's records]: two forwards in one block, then one
    backward each. The first backward brings back the first forward's swaps only; the second forward's stay on
    the host until its own backward, which prefetches them in time (before, the first backward's first unpack
    brought every record of the second forward back to the device at once)."""
    model, reference = ToyNet(layers=4), ToyNet(layers=4)
    reference.load_state_dict(model.state_dict())
    session = synced_session(model, toy_config(4, **layer_swap(1)))
    x1, x2 = torch.randn(4, 16), torch.randn(4, 16)
    with session:
        a, b = model(x1).sum(), model(x2).sum()
        a.backward()
        step = session._step
        after_a = step.stats.prefetched_bytes, step.device_bytes
        b.backward()
    reference(x1).sum().backward()
    reference(x2).sum().backward()
    assert_grads_equal(grads(model), grads(reference))
    stats = session.stats
    rows = 4 * 16 * 4  # bytes of one [4, 16] float32 activation
    assert after_a[0] == 5 * rows  # forward a's input and its 4 layer outputs, not forward b's
    assert stats.released_bytes == 9 * rows  # b's last output, in the step's tail, never left the device
    assert after_a[1] == rows  # b's tail; b's 4 released records are still on the host
    assert stats.prefetched_bytes == stats.released_bytes and stats.late_fetches == 0
