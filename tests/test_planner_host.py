"""The budget planner under ``runtime.max_host_bytes`` (swapkit.plan.hostpool Note [The host pool in the
replay]): the replay batches swaps as the session does, places them as the pool does, and keeps on the
device what the pool refuses; the plans it chooses run at their predicted peak and host pool bytes."""
from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch
import yaml

from swapkit.cli import main
from swapkit.engine import HostPool
from swapkit.engine.slabs import EXACT_FROM, SlabLedger
from swapkit.load import load_config
from swapkit.plan.emit import planned_config
from swapkit.plan.hostpool import HostModel, PackedLedger
from swapkit.plan.planner import KEEP, RECOMPUTE, BudgetError, Choice, Planner, plan_budget
from swapkit.plan.simulate import simulate
from swapkit.planner import measure
from swapkit.train import train
from tests.test_planner import CONFIG, steady
from tests.test_planner_model import FAST, chain, planner_for, swap_all, synthetic_trace

KIB4 = 4096
pytestmark = pytest.mark.usefixtures("cli_loggers_restored")  # conftest


def predict(k: int, host: HostModel | None, n: int = 6):
    return simulate(chain(n), swap_all(k), FAST, host=host)


# ---------------------------------------------------------------------- the replay with a cap (pure)

def test_a_cap_that_holds_every_batch_changes_nothing():
    free, capped = predict(1, None), predict(1, HostModel(max_bytes=1 << 30))
    assert capped == free
    assert capped.host_cap_bytes == 0 and capped.moved_bytes_per_step == 2 * 6 * KIB4
    assert capped.host_pool_bytes == 6 * KIB4  # k=1: each storage is due before the next joins: 6 regions
    assert predict(1, HostModel(max_bytes=6 * KIB4)) == free  # exactly enough


def test_a_cap_below_one_batch_keeps_it_on_the_device():
    kept = simulate(chain(6), lambda layer, scope: None, FAST)
    capped = predict(1, HostModel(max_bytes=KIB4 - 1))
    assert capped.peak_device_bytes == kept.peak_device_bytes > predict(1, None).peak_device_bytes
    assert (capped.moved_bytes_per_step, capped.copies, capped.host_pool_bytes) == (0, 0, 0)
    assert capped.host_cap_bytes == 6 * KIB4


def test_the_pool_holds_the_first_batches_in_forward_order():
    capped = predict(1, HostModel(max_bytes=2 * KIB4))
    assert capped.host_cap_bytes == 4 * KIB4 and capped.host_pool_bytes == 2 * KIB4
    assert capped.moved_bytes_per_step == 2 * 2 * KIB4  # two storages out and back
    # the four kept storages add to the peak: it lies between swapping all and keeping all
    kept = simulate(chain(6), lambda layer, scope: None, FAST).peak_device_bytes
    assert predict(1, None).peak_device_bytes < capped.peak_device_bytes < kept


@pytest.mark.parametrize("batch_bytes, cap, refused", [
    (16 << 20, 3 * KIB4 - 1, 3 * KIB4),  # k=4: storages 0-2 are one batch (3 in the tail): refused whole
    (16 << 20, 3 * KIB4, 0),
    (2 * KIB4, 2 * KIB4, KIB4),  # runtime.offload_batch_bytes splits it: [0, 1] fits, [2] does not
    (0, KIB4, 2 * KIB4),  # one storage per batch: only the first fits
])
def test_batches_are_refused_whole_as_the_session_makes_them(batch_bytes, cap, refused):
    capped = predict(4, HostModel(max_bytes=cap, batch_bytes=batch_bytes))
    assert capped.host_cap_bytes == refused
    assert capped.moved_bytes_per_step == 2 * (3 * KIB4 - refused)


def test_a_save_in_another_swapped_scope_closes_the_batch():
    from swapkit.plan.trace import FlatSave, FlatStep

    scopes = ["attention", "feed_forward", "attention", "feed_forward"]
    forward = tuple(FlatSave((i,), KIB4, 0, scope, 1e-3) for i, scope in enumerate(scopes)) + (
        FlatSave(None, 0, None, None, 1e-3),) * 8
    backward = tuple(e for i in reversed(range(4)) for e in (("u", i, 1e-3), ("f", (i,), 0.0)))
    step = FlatStep(forward, backward, 0.0)
    k = lambda layer, scope: None if layer is None else 8  # noqa: E731 - every save swapped, all due at once
    frames = lambda layer, scope: scope  # noqa: E731 - each scope its own frame
    host = HostModel(max_bytes=KIB4)
    assert simulate(step, k, FAST, host=host, swap_scope=frames).host_cap_bytes == 3 * KIB4  # 4 batches, 1 fits
    assert simulate(step, k, FAST, host=host, swap_scope=lambda layer, scope: "").host_cap_bytes == 4 * KIB4  # 1


def test_choice_swap_scope_names_the_frame_of_a_save():
    choice = Choice("swap", ("attention", "feed_forward.w2"), 2)
    assert choice.swap_scope("attention.wq") == "attention" and choice.swap_scope("feed_forward.w2") == "feed_forward.w2"
    assert choice.swap_scope("feed_forward.w1") is None and KEEP.swap_scope("attention") is None
    assert Choice("swap", ("",), 1).swap_scope("feed_forward.mul") == ""


@pytest.mark.parametrize("granule, cap", [(1, None), (1, 3 << 20), (4096, 5 << 20), (1, 700_000)])
def test_the_ledger_places_as_the_host_pool_does(granule, cap):
    """The replay's SlabLedger against the real HostPool: the same requests and releases get the same
    answers, slab bytes and free bytes (shared and exact slabs, same-size reuse, merges, the cap)."""
    rng = random.Random(granule * 7 + (cap or 0))
    pool = HostPool(lambda n: torch.empty(n, dtype=torch.uint8), cap, granule=granule)
    ledger = SlabLedger(cap, granule)
    live = []
    sizes = [1000, 4096, 30_000, 100_000, EXACT_FROM - 1, EXACT_FROM, 400_000, 1 << 20, 1_500_000]
    for _ in range(400):
        if live and rng.random() < 0.4:
            buffer, block = live.pop(rng.randrange(len(live)))
            pool.release(buffer)
            ledger.release(block)
        else:
            n = rng.choice(sizes)
            buffer, block = pool.acquire(n), ledger.acquire(n)
            assert (buffer is None) == (block is None), n
            if buffer is not None:
                live.append((buffer, block))
        assert (pool.total_bytes, pool.free_bytes) == (ledger.held_bytes, ledger.free_bytes)


def test_packed_ledger_counts_aligned_regions_under_the_cap():
    ledger = PackedLedger(max_bytes=1024)
    first = ledger.acquire(100)
    assert first == 512 and ledger.acquire(600) is None and ledger.acquire(512) == 512
    ledger.release(first)
    assert ledger.live == 512 and ledger.held_bytes == 1024


# ---------------------------------------------------------------------- the choice under a cap (pure)

def capped_planner(cap: int) -> Planner:
    free = planner_for(synthetic_trace())
    return Planner(free.trace, free.links, free.scopes, 1024, host=HostModel(max_bytes=cap))


def test_a_budget_only_swaps_reach_names_max_host_bytes_and_the_pool_it_needs():
    free = planner_for(synthetic_trace())
    budget = (free.predict((RECOMPUTE,) * 3).peak_device_bytes + free.predict(
        (Choice("swap", ("",), 1),) * 3).peak_device_bytes) // 2  # below recomputing all: swaps are needed
    unbounded = plan_budget(free, budget)
    assert unbounded.predicted.peak_device_bytes <= budget and unbounded.predicted.host_pool_bytes > 0
    with pytest.raises(BudgetError) as error:  # one of the 1 MiB storages: far from enough
        plan_budget(capped_planner(1 << 20), budget)
    message = str(error.value)
    assert "raise runtime.max_host_bytes (1048576 bytes)" in message and "skipped['host_cap']" in message
    needed = error.value.uncapped.host_pool_bytes
    assert f"without the cap the planner meets the budget with a host pool of {needed} bytes" in message
    fitting = plan_budget(capped_planner(needed), budget)  # the fix the message names works
    assert fitting.predicted.peak_device_bytes <= budget and fitting.predicted.host_cap_bytes == 0


def test_a_budget_error_without_a_cap_says_nothing_of_it():
    with pytest.raises(BudgetError) as error:
        plan_budget(planner_for(synthetic_trace()), 1024)
    assert "max_host_bytes" not in str(error.value) and error.value.uncapped is None


# ---------------------------------------------------------------------- predictions against real runs

@pytest.fixture(scope="module")
def measured(inline_copies, one_thread):
    """test_planner's model, copies finished when issued (conftest): predictions are exact there."""
    return measure(load_config(CONFIG), steps=2, warmup=1)


def capped_config(cap: int | None) -> dict:
    runtime = {**CONFIG["runtime"], **({"max_host_bytes": cap} if cap else {})}
    return {**CONFIG, "runtime": runtime}


def run_plan(choices, cap: int | None, tmp_path) -> list[dict]:
    path = tmp_path / "planned.yaml"
    path.write_text(yaml.safe_dump(planned_config(capped_config(cap), choices)), encoding="utf-8")
    return steady(train(load_config(path), progress=False))


FIXED = {
    "swap every layer k=1": lambda: (Choice("swap", ("",), 1),) * 3,
    "swap feed_forward k=2, recompute": lambda: (Choice("swap", ("feed_forward",), 2),) * 2 + (RECOMPUTE,),
    "swap attention.wo, feed_forward k=2": lambda: (Choice("swap", ("attention.wo", "feed_forward"), 2),) * 3,
}


@pytest.mark.parametrize("cap", [None, 150_000, 60_000, 20_000])
@pytest.mark.parametrize("name", FIXED)
def test_fixed_plans_under_a_cap_run_at_their_predicted_peak_and_pool(measured, tmp_path, name, cap):
    """The session's own count (``peak_device_bytes``, ``host_pool_bytes``) is the prediction, exactly."""
    choices = FIXED[name]()
    planner = Planner(measured.trace, measured.links, measured.scopes, 1024,
                      host=measured.host(load_config(capped_config(cap)).runtime))
    predicted = planner.predict(choices)
    for step in run_plan(choices, cap, tmp_path):
        assert (step["peak_device_bytes"], step["host_pool_bytes"]) == (
            predicted.peak_device_bytes, predicted.host_pool_bytes), predicted
        assert step["offloaded_bytes"] == predicted.moved_bytes_per_step // 2  # what went out came back


def test_without_the_model_a_cap_made_the_prediction_wrong(measured, tmp_path):
    """What the planner predicted before it modelled the pool (no cap) is below what the run measures
    under a cap that refuses some batches; with the cap modelled it is the measured peak."""
    choices = FIXED["swap every layer k=1"]()
    runtime = load_config(capped_config(20_000)).runtime
    blind = Planner(measured.trace, measured.links, measured.scopes, 1024).predict(choices)
    seen = Planner(measured.trace, measured.links, measured.scopes, 1024, host=measured.host(runtime)).predict(choices)
    measured_peak = run_plan(choices, 20_000, tmp_path)[-1]["peak_device_bytes"]
    assert blind.peak_device_bytes < measured_peak == seen.peak_device_bytes
    assert seen.host_cap_bytes > 0 and seen.host_pool_bytes <= 20_000


@pytest.mark.parametrize("cap", [150_000, 60_000])
def test_a_plan_under_a_cap_runs_within_its_budget(measured, tmp_path, cap):
    runtime = load_config(capped_config(cap)).runtime
    planner = Planner(measured.trace, measured.links, measured.scopes, 1024, host=measured.host(runtime))
    budget = planner.predict((KEEP,) * 3).peak_device_bytes // 2
    planned = plan_budget(planner, budget)
    assert planned.predicted.host_pool_bytes <= cap
    for step in run_plan(planned.choices, cap, tmp_path):
        assert step["peak_device_bytes"] <= budget, planned
        assert abs(step["peak_device_bytes"] - planned.predicted.peak_device_bytes) <= 0.05 * budget, planned
        assert step["host_pool_bytes"] == planned.predicted.host_pool_bytes


def test_cli_plan_with_a_cap_trains_within_budget_and_reports_the_pool(measured, tmp_path, capsys):
    """``swapkit plan --budget --set runtime.max_host_bytes=...``, then ``swapkit train --budget`` on it."""
    config = tmp_path / "model.yaml"
    config.write_text(yaml.safe_dump(CONFIG), encoding="utf-8")
    budget = Planner(measured.trace, measured.links, measured.scopes, 1024).predict((KEEP,) * 3).peak_device_bytes // 2
    out, cap = tmp_path / "planned.yaml", "runtime.max_host_bytes=60000"
    assert main(["plan", str(config), "--budget", str(budget), "--set", cap, "--json", "--out", str(out)]) == 0
    predicted = json.loads(capsys.readouterr().out)["predicted"]
    assert predicted["host_pool_bytes"] <= 60_000 and predicted["peak_device_bytes"] <= budget
    assert load_config(out).runtime.max_host_bytes == 60_000  # the planned config keeps the cap it was planned for
    metrics = tmp_path / "metrics.json"
    assert main(["train", str(config), "--budget", str(budget), "--set", cap, "--steps", "2", "--no-progress",
                 "--metrics-out", str(metrics)]) == 0
    printed = capsys.readouterr().out
    assert "--budget: host pool bytes measured / predicted" in printed and "within budget" in printed, printed
    steps = json.loads(metrics.read_text())["steps"]
    assert steps[-1]["peak_device_bytes"] <= budget and steps[-1]["host_pool_bytes"] <= 60_000


def test_the_probe_measures_the_link_without_the_cap(measured):
    """Under a cap the probe's refused batches were never seen finished: a release lag of seconds."""
    from swapkit.planner.measure import PROBE, mode_config

    config = load_config(capped_config(20_000))
    assert mode_config(config, PROBE).runtime == dataclasses.replace(config.runtime, max_host_bytes=None)


def test_cli_plan_of_tiny_yaml_under_a_cap_runs_within_its_budget(inline_copies, one_thread, tmp_path, capsys):
    """``swapkit plan configs/tiny.yaml --budget 6MiB --set runtime.max_host_bytes=300000``: the planned
    config (whatever mix of swap and recompute it chose) runs under the budget and the cap."""
    from tests.test_cli_plan import CONFIGS

    out, metrics = tmp_path / "planned.yaml", tmp_path / "metrics.json"
    assert main(["plan", str(CONFIGS / "tiny.yaml"), "--budget", "6MiB", "--set", "runtime.max_host_bytes=300000",
                 "--json", "--out", str(out)]) == 0
    predicted = json.loads(capsys.readouterr().out)["predicted"]
    assert main(["train", str(out), "--steps", "2", "--no-progress", "--metrics-out", str(metrics)]) == 0
    last = json.loads(metrics.read_text())["steps"][-1]
    assert last["peak_device_bytes"] <= 6 << 20 and last["host_pool_bytes"] <= 300_000
    assert last["host_pool_bytes"] == predicted["host_pool_bytes"]


def test_the_first_step_offloads_its_tail_and_the_pool_keeps_those_bytes():
    """k=4 on 6 storages: the steady step swaps storages 0-2 (one region); the first step, which does
    not know the forward's length yet, also offloads 3-5 ([0-3] due at tick 4, [4, 5] flushed when the
    forward leaves the layer), and the pool keeps what it grew to."""
    steady = predict(4, HostModel())
    assert steady.moved_bytes_per_step == 2 * 3 * KIB4 and steady.host_pool_bytes == 6 * KIB4
    assert predict(4, HostModel(skip_tail=False)).host_pool_bytes == 6 * KIB4
    # a cap below the first step's region [0-3] refuses it there, and the steady step's [0-2] still fits
    capped = predict(4, HostModel(max_bytes=3 * KIB4))
    assert capped.host_cap_bytes == 0 and capped.host_pool_bytes == 3 * KIB4


def test_the_replays_alignments_are_the_runtimes():
    """swapkit.plan is pure (no torch): it states the batch slot and pool range alignments itself."""
    from swapkit.engine.slabs import ALIGNMENT
    from swapkit.plan.hostpool import RANGE_ALIGN, SLOT_ALIGN
    from swapkit.runtime.batch import ALIGN

    assert (SLOT_ALIGN, RANGE_ALIGN) == (ALIGN, ALIGNMENT)


def test_regions_go_back_in_backwards_order_so_the_pool_refuses_what_the_run_refuses(inline_copies, one_thread):
    """Batches of one size each (``offload_batch_bytes: 0``) near the cap: which block the pool reuses, and so
    which batches it refuses, follows the order backward gives the regions back (Note [The host pool in the
    replay]). A replay giving them back in forward order predicted 10893316 bytes where the run measured
    10991620 (review of the merge)."""
    from tests.test_cli_plan import CONFIGS

    base = yaml.safe_load((CONFIGS / "tiny.yaml").read_text())
    measured_tiny = measure(load_config(base))
    swap = lambda scopes, k: Choice("swap", scopes, k)  # noqa: E731
    cases = [((swap(("attention.wo", "attention.wq", "feed_forward"), 4), swap(("ffn_norm",), 4),
               swap(("attention", "feed_forward.w1"), 4), swap(("feed_forward.w2", "ffn_norm"), 4)), 1711713),
             ((swap(("feed_forward",), 8), Choice(), swap(("attention.wo", "feed_forward"), 2), swap(("",), 2)),
              2460188)]
    for choices, cap in cases:
        raw = {**base, "runtime": {**base["runtime"], "max_host_bytes": cap, "offload_batch_bytes": 0},
               "train": {**base["train"], "steps": 4}}
        config = load_config(planned_config(raw, choices))
        predicted = Planner(measured_tiny.trace, measured_tiny.links, measured_tiny.scopes, 1024,
                            host=measured_tiny.host(config.runtime)).predict(choices)
        assert predicted.host_cap_bytes > 0  # the cap refuses some batches
        for step in train(config, progress=False).steps[1:]:
            assert (step["peak_device_bytes"], step["host_pool_bytes"]) == (
                predicted.peak_device_bytes, predicted.host_pool_bytes), (cap, predicted)
