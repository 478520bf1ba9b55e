"""The budget planner per pipeline stage: each stage measured in this process, its peak replayed
in the schedule's order (swapkit.plan.stages Note [Stage peak model]), the emitted plan run
through the real pipeline (2 gloo ranks, torch.distributed.pipelining) on deterministic copies.
"""
from __future__ import annotations

import dataclasses
import re

import pytest
import yaml

import swapkit
from pipeline_utils import MICRO_BATCHES, MICRO_BATCH_SIZE, TINY, StageRun, spawn
from swapkit.cli import main
from swapkit.plan.simulate import Link, Links, simulate
from swapkit.plan.emit import planned_config
from swapkit.plan.hostpool import HostModel, stage_host_use
from swapkit.plan.planner import Choice, reachable_peak
from swapkit.plan.stages import (
    StageBudgetError, StagePlanner, StageSchedule, direct_micro_batches, schedule_actions, simulate_stage,
)
from swapkit.plan.trace import FlatSave, FlatStep
from swapkit.planner.command import BudgetPlan, write
from swapkit.planner.stages import measure_stages, plan_stages, schedule_of, stage_plan_parts
from toys import ReadyWhenDone

SCHEDULES = ["1f1b", "gpipe"]


def stage_config(schedule: str, stages: int = 2, micro_batches: int = MICRO_BATCHES) -> dict:
    """Two layers per stage."""
    return {"model": {"model_config": {**TINY, "num_layers": 2 * stages}},
            "parallel_config": {"pipeline_stage": stages, "micro_batch_num": micro_batches,
                                "pipeline_schedule": schedule},
            "train": {"batch_size": MICRO_BATCH_SIZE}, "runtime": {"min_offload_bytes": 0}}


@pytest.fixture(autouse=True, scope="module")
def _deterministic_copies(inline_copies, one_thread):
    """Measured on copies that finish when issued (conftest); the pipeline ranks use ReadyWhenDone."""


@pytest.fixture(scope="module", params=SCHEDULES)
def measured(request):
    config = swapkit.load_config(stage_config(request.param))
    return request.param, config, measure_stages(config, steps=2, warmup=1)


@pytest.fixture(scope="module")
def ran(measured, tmp_path_factory):
    """The plan at 0.55 of the smallest stage baseline, run on 2 ranks (one spawn per schedule)."""
    schedule, config, found = measured
    baselines = [p.planned.baseline.peak_device_bytes for p in plan_stages(config, "1TiB", measured=found)]
    budget = int(0.55 * min(baselines))
    stages = plan_stages(config, str(budget), measured=found)
    plan = BudgetPlan(*stage_plan_parts(config, stage_config(schedule), str(budget), measured=found))
    ranks = spawn(_run, 2, tmp_path_factory.mktemp(schedule), schedule, plan.config)
    return budget, baselines, stages, plan, ranks


class TrainBatches(StageRun):
    """Micro-batches as ``swapkit train`` cuts them: views of one contiguous step batch."""

    def _run(self, x, y, losses) -> None:
        super()._run(x.contiguous(), y.contiguous(), losses)


def _run(rank: int, world: int, schedule: str, planned: dict) -> dict:
    keep = TrainBatches(rank, world, schedule, stage_config(schedule))
    run = TrainBatches(rank, world, schedule, planned, engine=ReadyWhenDone())
    peaks = []
    for number in (1, 2, 3):
        keep.step(number)
        run.step(number)
        peaks.append(run.session.stats.peak_device_bytes)
    group = run.session._group
    forwards = [("F", m.micro_batch) for m in run.session.micro_step_stats]
    direct = {step.key[1] for step in group.steps if step.direct}
    return {"keep": keep.session.stats.peak_device_bytes, "peaks": peaks, "backward": list(group.backward_order),
            "forwards": forwards, "late": run.session.stats.late_fetches, "direct": direct}


def test_each_stage_peak_in_the_real_pipeline_is_the_prediction_and_fits(ran):
    budget, baselines, stages, plan, ranks = ran
    assert all(p.planned.predicted.peak_device_bytes <= budget for p in stages)
    assert not all(c.keeps_all for c in plan.planned.choices)
    write(plan, None)  # loads unchanged
    for one, rank in zip(stages, ranks):
        assert rank["keep"] == baselines[one.stage]  # the keep-everything replay is the stage session's count
        predicted = one.planned.predicted.peak_device_bytes
        steady = rank["peaks"][1:]  # from the second optimizer step on (skip_tail_offload learnt)
        assert all(abs(peak - predicted) <= 0.05 * predicted for peak in steady), (one.stage, predicted, steady)
        assert max(steady) <= budget, (one.stage, budget, steady)
        assert rank["late"] == 0


def test_schedule_order_and_direct_micro_batches_are_what_torch_runs(measured, ran):
    schedule = measured[0]
    for stage, rank in enumerate(ran[-1]):
        actions = schedule_actions(schedule, 2, stage, MICRO_BATCHES)
        assert [a for a in actions if a[0] == "F"] == rank["forwards"]
        assert [("B", m) for _, m in rank["backward"]] == [a for a in actions if a[0] == "B"]
        assert direct_micro_batches(actions) == rank["direct"]  # the stage session's own
    # 1F1B: each backward's micro-batch is the oldest waiting one, whose tail every forward open kept
    assert direct_micro_batches(schedule_actions("1f1b", 2, 1, 4)) == {0, 1, 2, 3}
    assert direct_micro_batches(schedule_actions("1f1b", 2, 0, 4)) == {0, 1, 2, 3}
    # GPipe: F1..F3 release the tails of m1, m2; B0 the tail of m3, whose backward runs last
    assert direct_micro_batches(schedule_actions("gpipe", 2, 0, 4)) == {0}


def test_the_plan_is_one_config_with_global_indices_and_a_stage_column(ran):
    _, _, stages, plan, _ = ran
    assert [row["layer"] for row in plan.document["layers"]] == list(range(4))
    assert [row["stage"] for row in plan.document["layers"]] == [0, 0, 1, 1]
    assert [s["stage"] for s in plan.document["stages"]] == [0, 1]
    assert plan.document["stages"][1]["predicted"] == stages[1].planned.predicted.to_json()
    loaded = swapkit.build_plan(swapkit.load_config(plan.config))
    for one in stages:
        for local, layer in enumerate(one.layers):
            choice = one.planned.choices[local]
            assert loaded.layers[layer].stage == one.stage
            assert loaded.layers[layer].full == (choice.action == "recompute"), layer
            swapped = choice.prefetch if choice.action == "swap" and "" in choice.scopes else None
            assert loaded.layers[layer].layer_swap == swapped, layer
    assert "stage 1 predicted" in plan.report


def test_a_budget_above_every_baseline_keeps_everything(measured):
    _, config, found = measured
    stages = plan_stages(config, "1TiB", measured=found)
    assert all(c.keeps_all for one in stages for c in one.planned.choices)


def capped(config, cap: int | None):
    return dataclasses.replace(config, runtime=dataclasses.replace(config.runtime, max_host_bytes=cap))


def stage_planner(config, one, stage: int) -> StagePlanner:
    return StagePlanner(one.trace, one.links, one.scopes, config.runtime.min_offload_bytes,
                        dataclasses.replace(schedule_of(config), stage=stage), one.host(config.runtime))


SWAP_ALL = (Choice("swap", ("",), 1),) * 4
#: Op swaps with k=2 on 3 stages: feed_forward on the first layer of each, attention and feed_forward
#: (two swapped scopes, a batch each) on the second.
OP_SWAPS = (Choice("swap", ("feed_forward",), 2), Choice("swap", ("attention", "feed_forward"), 2)) * 3


def run_under_cap(raw: dict, config, found, choices: tuple[Choice, ...], tmp_path) -> tuple:
    """``choices`` under a cap at 0.75 of the smallest pool a stage needs, run on one rank per stage:
    the stages' pools refuse some batches, of some micro-batches (swapkit.plan.hostpool Note [The host
    pool in a pipeline stage]). What a stage needs: its pool under a cap just below the one shared
    slab it holds without a cap, where slabs of exactly each region replace it (swapkit.engine.slabs
    Note [Slab sizes]) and nothing is refused. Returns the cap and, per stage, the prediction without
    refusals, under the cap, and the run's steps."""
    local = [choices[2 * stage:2 * stage + 2] for stage in range(len(found))]
    shared = [stage_planner(config, one, stage).predict(local[stage]) for stage, one in enumerate(found)]
    free = [stage_planner(capped(config, p.host_pool_bytes - 1), one, stage).predict(local[stage])
            for stage, (p, one) in enumerate(zip(shared, found))]
    assert not any(p.host_cap_bytes for p in free)
    cap = int(0.75 * min(p.host_pool_bytes for p in free))
    predicted = [stage_planner(capped(config, cap), one, stage).predict(local[stage]) for stage, one in enumerate(found)]
    planned = planned_config({**raw, "runtime": {**raw["runtime"], "max_host_bytes": cap}}, choices)
    parallel = raw["parallel_config"]
    ranks = spawn(_run_capped, len(found), tmp_path, parallel["pipeline_schedule"], planned, parallel["micro_batch_num"])
    return cap, free, predicted, ranks


@pytest.fixture(scope="module")
def capped_runs(measured, tmp_path_factory):
    """Every layer swapped (k=1) under a cap, on 2 ranks (:func:`run_under_cap`)."""
    schedule, config, found = measured
    return run_under_cap(stage_config(schedule), config, found, SWAP_ALL, tmp_path_factory.mktemp(f"{schedule}-capped"))


@pytest.fixture(scope="module")
def capped_op_swaps(tmp_path_factory):
    """Op swaps under a cap on 3 ranks, 1F1B with 6 micro-batches (:func:`run_under_cap`). Stage 0
    runs F0 F1 F2 B0 F3 B1 F4 ...: F2 releases micro-batch 1's tail, B0 prefetches it ahead and gives its
    regions back before F3 asks (swapkit.plan.hostpool Note [The host pool in a pipeline stage]); a
    replay without that look-ahead predicts 8 KiB more refused on stage 0 than the run measures."""
    raw = stage_config("1f1b", stages=3, micro_batches=6)
    config = swapkit.load_config(raw)
    found = measure_stages(config, steps=2, warmup=1)
    return run_under_cap(raw, config, found, OP_SWAPS, tmp_path_factory.mktemp("op-swaps-capped"))


def _run_capped(rank: int, world: int, schedule: str, planned: dict, micro_batches: int) -> list[dict]:
    run = TrainBatches(rank, world, schedule, planned, engine=ReadyWhenDone(), micro_batches=micro_batches)
    steps = []
    for number in (1, 2, 3):
        run.step(number)
        stats = run.session.stats
        steps.append({"peak": stats.peak_device_bytes, "pool": stats.host_pool_bytes,
                      "refused": stats.skipped.get("host_cap", 0)})
    return steps


def test_a_stage_pool_under_a_cap_is_what_the_pipeline_run_measures(capped_runs):
    """Per stage, from the second optimizer step on: the pool's slab bytes and the bytes it refused are the
    prediction, exactly, and the peak within 5% (Note [Stage peak model]); the cap refused batches on
    every stage and raised its peak above the uncapped prediction."""
    check_capped_run(*capped_runs)


def test_op_swaps_under_a_cap_on_three_stages_are_what_the_pipeline_run_measures(capped_op_swaps):
    """As above, for op swaps (two swapped scopes in a layer) on 3 stages of 1F1B, where the micro-batch
    after the next one runs forward after a backward that looked ahead into the next."""
    check_capped_run(*capped_op_swaps)


def check_capped_run(cap: int, free: list, predicted: list, ranks: list) -> None:
    """:func:`run_under_cap`'s prediction per stage against each steady step of its rank."""
    for stage, (one, uncapped, steps) in enumerate(zip(predicted, free, ranks)):
        assert one.host_cap_bytes > 0 and one.host_pool_bytes <= cap < uncapped.host_pool_bytes, (stage, one)
        assert one.peak_device_bytes > uncapped.peak_device_bytes
        for step in steps[1:]:
            assert (step["pool"], step["refused"]) == (one.host_pool_bytes, one.host_cap_bytes), (stage, one, step)
            assert abs(step["peak"] - one.peak_device_bytes) <= 0.05 * one.peak_device_bytes, (stage, one, step)


def test_a_host_cap_on_a_pipeline_is_planned_for(measured):
    """A budget planned under a cap fits it with the swaps the pool can hold: each stage's predicted pool
    is within the cap, and the plan differs from the uncapped one where the cap refused its swaps."""
    _, config, found = measured
    uncapped = plan_stages(config, "1TiB", measured=found)
    budget = int(0.55 * min(one.planned.baseline.peak_device_bytes for one in uncapped))
    free = plan_stages(config, str(budget), measured=found)
    cap = max(min(one.planned.predicted.host_pool_bytes for one in free) // 2, 1)
    for one in plan_stages(capped(config, cap), str(budget), measured=found):
        predicted = one.planned.predicted
        assert predicted.host_pool_bytes <= cap and predicted.peak_device_bytes <= budget, (one.stage, predicted)
        assert predicted.to_json()["host_cap_bytes"] == predicted.host_cap_bytes


def test_a_stage_budget_only_swaps_reach_names_the_cap(measured):
    """Under a cap that holds no batch, a stage's budget between its lowest peak with swaps and without
    them is refused with the cap as the cause (BudgetError's host-cap message, for that stage)."""
    _, config, found = measured
    free = reachable_peak(stage_planner(config, found[1], 1))
    held = reachable_peak(stage_planner(capped(config, 4096), found[1], 1))
    assert free < held
    with pytest.raises(StageBudgetError) as error:
        plan_stages(capped(config, 4096), f"1TiB,{(free + held) // 2}B", measured=found)
    assert error.value.stage == 1 and error.value.host_cap == 4096, str(error.value)
    assert str(error.value).startswith("pipeline stage 1: ") and "raise runtime.max_host_bytes (4096 bytes)" in str(
        error.value)


def test_below_a_stage_minimum_the_error_names_the_stage_and_its_minimum(measured):
    _, config, found = measured
    with pytest.raises(StageBudgetError, match=r"pipeline stage 0: .*smallest reachable peak_device_bytes is \d+"
                       ) as err:
        plan_stages(config, "1KiB,1TiB", measured=found)
    assert err.value.stage == 0 and err.value.reachable > 1024
    at_minimum = plan_stages(config, f"{err.value.reachable}B,1TiB", measured=found)[0]  # the minimum can be planned
    assert at_minimum.planned.predicted.peak_device_bytes <= err.value.reachable
    with pytest.raises(StageBudgetError, match=r"pipeline stage 1: "):
        plan_stages(config, "1TiB,1KiB", measured=found)


def test_cli_exit_2_below_the_minimum_and_bad_budget_lists(tmp_path, capsys):
    path = tmp_path / "pp.yaml"
    path.write_text(yaml.safe_dump(stage_config("1f1b")), encoding="utf-8")
    assert main(["plan", str(path), "--budget", "1KiB"]) == 2
    assert re.search(r"pipeline stage 0: --budget 1024 bytes cannot be met: the smallest reachable "
                     r"peak_device_bytes is [1-9]\d* bytes", capsys.readouterr().err)
    assert main(["plan", str(path), "--budget", "1MiB,2MiB,3MiB"]) == 2
    assert "one size for every stage or one per stage" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["1MiB,", "1MiB,,2MiB", ",1MiB"])
def test_an_empty_size_in_a_budget_list_names_the_whole_list(tmp_path, capsys, text):
    """'--budget 1MiB,' said only "--budget: got ''; expected a size such as 64MiB"."""
    path = tmp_path / "pp.yaml"
    path.write_text(yaml.safe_dump(stage_config("1f1b")), encoding="utf-8")
    assert main(["plan", str(path), "--budget", text]) == 2
    assert (f"--budget: got {text!r}, with an empty size between its commas; give one size for every stage (200MiB) "
            "or one per stage (200MiB,150MiB)") in capsys.readouterr().err


# ---------------------------------------------------------------------- the replay alone (pure)

def _step(saves: int = 4, nbytes: int = 4096):
    """One layer saving ``saves`` storages; backward unpacks them last first, each dies after its unpack."""
    forward = tuple(FlatSave((i,), nbytes, 0, "", 0.001) for i in range(saves))
    backward = tuple(event for i in reversed(range(saves)) for event in (("u", i, 0.001), ("f", (i,), 0.0)))
    return FlatStep(forward, backward, 0.0)


FAST = Links(Link(0.0, 1e15), Link(0.0, 1e15))
N = 4096


def swap_k1(layer, scope):
    return 1


@pytest.mark.parametrize("schedule,stage,in_flight", [("gpipe", 0, 4), ("gpipe", 1, 4), ("1f1b", 0, 2),
                                                      ("1f1b", 1, 1)])
def test_keeping_everything_holds_each_micro_batch_in_flight(schedule, stage, in_flight):
    predicted = simulate_stage(_step(), lambda layer, scope: None, FAST, StageSchedule(schedule, 2, stage, 4))
    assert predicted.peak_device_bytes == in_flight * 4 * N
    assert predicted.moved_bytes_per_step == 0


def test_on_the_last_1f1b_stage_each_micro_batch_is_a_single_step():
    """Every backward directly follows its forward: the stage is the single-step replay, four times."""
    single = simulate(_step(), swap_k1, FAST)
    stage = simulate_stage(_step(), swap_k1, FAST, StageSchedule("1f1b", 2, 1, 4))
    assert stage.peak_device_bytes == single.peak_device_bytes == 2 * N
    assert stage.moved_bytes_per_step == 4 * single.moved_bytes_per_step


def test_waiting_micro_batches_release_their_tails_except_the_next_one():
    """GPipe, k=1, 4 saves: each forward ends holding its last storage (its tail). A new forward, and
    a backward's begin, release the tails of the waiting micro-steps but the oldest (it runs backward
    next), so B0 holds m0's tail and the storage it fetches, not m3's (its backward runs last). The
    peak, 3 storages, is F3's: m0's tail and m3's two newest saves (4 forwards' tails would be 5).
    m0 (its tail never left the device) offloads 3 storages and fetches 3; m1..m3 offload and fetch
    4 each: 30 copies. In the first step m0 offloads its tail too: 31."""
    predicted = simulate_stage(_step(), swap_k1, FAST, StageSchedule("gpipe", 2, 0, 4))
    assert predicted.peak_device_bytes == 3 * N
    assert predicted.copies == 30 and predicted.moved_bytes_per_step == 30 * N
    first_step = simulate_stage(_step(), swap_k1, FAST, StageSchedule("gpipe", 2, 0, 4, skip_tail_offload=False))
    assert first_step.copies == 31 and first_step.peak_device_bytes == 3 * N


@pytest.mark.parametrize("schedule,stage,regions", [("gpipe", 0, 16), ("1f1b", 0, 8), ("1f1b", 1, 4)])
def test_a_stage_pool_holds_the_regions_of_the_micro_batches_in_flight(schedule, stage, regions):
    """k=1, 4 saves: each save is its own batch and region. GPipe holds all four micro-batches' regions
    at once, 1F1B on stage 0 two, on the last stage one. The pool keeps what the first optimizer step
    grew it to, when every micro-step offloaded its tail (4 regions each)."""
    predicted = simulate_stage(_step(), swap_k1, FAST, StageSchedule(schedule, 2, stage, 4))
    assert (predicted.host_pool_bytes, predicted.host_cap_bytes) == (regions * N, 0)
    assert "host_pool_bytes" in predicted.to_json()


def refused(schedule: str, stages: int, stage: int, micro_batches: int, cap: int) -> dict:
    actions = schedule_actions(schedule, stages, stage, micro_batches)
    use = stage_host_use(_step(), swap_k1, None, 0, HostModel(max_bytes=cap), actions, direct_micro_batches(actions))
    return {m: sorted(storage[0] for storage in found) for m, found in use.refused.items() if found}, use


def test_a_capped_stage_pool_refuses_whichever_micro_batch_asks_when_it_is_full():
    """swapkit.plan.hostpool Note [The host pool in a pipeline stage]. GPipe under a cap of 10 regions:
    m0 (its tail stays, it runs backward first) offloads 3, m1 4, m2 its first 3 and m3 none of its four
    (B0 releases m3's tail: its backward runs last). 1F1B under 5: each micro-batch's tail stays (each runs
    backward next), so each offloads 3; m1's last does not fit beside m0's three, m2's three fit once B0
    gave m0's back, and m3's last does not fit beside m2's."""
    found, use = refused("gpipe", 2, 0, 4, 10 * N)
    assert found == {2: [3], 3: [0, 1, 2, 3]}
    assert (use.refused_bytes, use.pool_bytes) == (5 * N, 10 * N)
    found, use = refused("1f1b", 2, 0, 4, 5 * N)
    assert found == {1: [2], 3: [2]}
    assert (use.refused_bytes, use.pool_bytes) == (2 * N, 5 * N)
    predicted = simulate_stage(_step(), swap_k1, FAST, StageSchedule("1f1b", 2, 0, 4), host=HostModel(max_bytes=5 * N))
    assert (predicted.host_cap_bytes, predicted.host_pool_bytes) == (2 * N, 5 * N)
    # a refused storage is neither offloaded nor fetched: of the 24 copies (3 out and 3 back per micro-batch,
    # the tails never leave the device), m1 and m3 copy 2 fewer each
    assert predicted.copies == 24 - 2 - 2


def test_one_budget_per_stage(measured):
    _, config, found = measured
    baselines = [p.planned.baseline.peak_device_bytes for p in plan_stages(config, "1TiB", measured=found)]
    budgets = [int(0.5 * baselines[0]), int(0.9 * baselines[1])]
    stages = plan_stages(config, f"{budgets[0]}B, {budgets[1]}B", measured=found)
    assert [one.budget for one in stages] == budgets
    for one in stages:
        assert one.planned.predicted.peak_device_bytes <= one.budget < one.planned.baseline.peak_device_bytes


def test_train_with_a_budget_runs_a_pipeline_config_on_one_process_per_stage(tmp_path, capsys):
    path = tmp_path / "pp.yaml"
    path.write_text(yaml.safe_dump(stage_config("1f1b")), encoding="utf-8")
    assert main(["train", str(path), "--budget", "1TiB", "--steps", "1", "--no-progress"]) == 0
    out = capsys.readouterr()
    assert "stage 1 predicted" in out.err  # the plan's report
    assert "stage 0: peak" in out.out and "stage 1: peak" in out.out  # one row per stage: it ran as a pipeline
    for stage in (0, 1):  # each stage's pool, measured against the stage replay's prediction
        assert re.search(rf"--budget stage {stage}: host pool bytes measured / predicted +0 B / 0 B", out.out), out.out
