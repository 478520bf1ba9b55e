"""What a user reads: SwapStats as a MiB table, SwapSession's repr."""
from __future__ import annotations

import torch
from torch import nn

import swapkit
from swapkit.runtime.stats import SwapStats
from tests.user_models import TinyGPT

CONFIG = {"model": {"model_config": {"preset": "gpt2"}}, "runtime": {"min_offload_bytes": 0},
          "swap_config": {"swap": True, "layer_swap": [{"backward_prefetch": 2, "layers": [0, 1]}]}}


def test_stats_print_as_a_mib_table():
    stats = SwapStats(step=3, ticks=40, saved_bytes=8 << 20, offloaded_tensors=5, offloaded_bytes=3 << 20,
                      released_bytes=2 << 20, prefetched_tensors=4, prefetched_bytes=2 << 20, tail_bytes=1 << 20,
                      prefetch_lead_ticks=10, late_fetches=1, wait_seconds=0.0025, peak_device_bytes=5 << 20,
                      host_pool_bytes=4 << 20, host_allocations=2, skipped={"parameter": 1 << 19})
    assert str(stats).splitlines() == [
        "swapkit step 3: session accounting, not RSS or the allocator's totals",
        "  saved (device-resident, peak)  5.00 MiB of 8.00 MiB saved",
        "  offloaded                      3.00 MiB in 5 tensors",
        "  released after copy            2.00 MiB",
        "  prefetched                     2.00 MiB in 4 tensors",
        "  tail (used in place)           1.00 MiB",
        "  late fetches                   1 (waited 2.50 ms)",
        "  mean prefetch lead             2.5 ticks of 40",
        "  recomputed outputs             0.00 MiB (0 recipes)",
        "  host pool                      4.00 MiB (2 new buffers)",
        "  kept: parameter                0.50 MiB",
    ]


def test_stats_table_shows_what_reveals_a_no_op_and_the_rest_when_set():
    stats = SwapStats(step=2, offloaded_by_scope={f"layer {i}: attn": (i + 1) << 20 for i in range(5)},
                      unused_swaps=["layer 0: self_attn"], resident_bytes=1 << 20, verified_tensors=7, micro_steps=4)
    assert str(stats).splitlines()[-5:] == [
        "  offloaded by scope             layer 4: attn 5.00 MiB, layer 3: attn 4.00 MiB, layer 2: attn 3.00 MiB "
        "(+2 more)",
        "  UNUSED swaps (no effect)       layer 0: self_attn (see the warning)",
        "  still held                     1.00 MiB",
        "  verified (checksums)           7 tensors",
        "  micro-steps                    4",
    ]


def test_session_repr_says_what_it_is():
    model = TinyGPT()
    session = swapkit.apply(model, CONFIG)
    assert repr(session) == ("SwapSession(TinyGPT.blocks: 3 layers, preset=gpt2, swap on 2, recompute on 0, "
                             "engine=not started, steps=0, ready)")
    with session:
        model(torch.randint(0, 64, (2, 8))).sum().backward()
        assert repr(session).endswith("engine=ThreadCopyEngine, steps=1, active)")
    session.remove()
    assert repr(session).endswith("removed)")


def test_session_repr_does_not_count_swaps_that_recompute_overrides():
    """Before: 'swap on 3' for 3 layers configured to swap, one of them fully recomputed (its swap moves nothing)."""
    config = {**CONFIG, "swap_config": {"swap": True, "layer_swap": [{"backward_prefetch": 2, "layers": True}]},
              "recompute_config": {"recompute": [1]}}
    session = swapkit.apply(TinyGPT(), config)
    assert "3 layers, preset=gpt2, swap on 2 (+1 overridden by recompute), recompute on 1," in repr(session)
    session.remove()


class Mlp(nn.Module):
    """The README's MLP: select-recomputing the GELU (``mlp\\.1``) drops its output, the widest activation."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        return x + self.mlp(x)


def test_a_peak_above_the_saved_bytes_says_it_holds_outputs_recomputed_in_backward():
    torch.manual_seed(0)
    model = nn.Sequential(*(Mlp() for _ in range(3)))
    session = swapkit.apply(model, {"recompute_config": {"select_recompute": [r"mlp\.1"]}})
    with session:
        model(torch.randn(16, 32, requires_grad=True)).square().mean().backward()
    stats = session.stats
    # the GELU outputs rebuilt in backward are resident at the peak, never counted as saved in forward
    assert stats.saved_bytes < stats.peak_device_bytes <= stats.saved_bytes + stats.recomputed_output_bytes
    assert stats.memory_saved_bytes == 0
    row = str(stats).splitlines()[1]
    assert row == (f"  saved (device-resident, peak)  {stats.peak_device_bytes / 2**20:.2f} MiB: "
                   f"{stats.saved_bytes / 2**20:.2f} MiB saved in forward plus outputs recomputed in backward")
    session.remove()
