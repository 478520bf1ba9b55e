"""``parallel_config.micro_batch_num``: exactly as strict as torch's schedules, no stricter.

swapkit.distributed.pipeline Note [Micro-batch counts per schedule]. The rule is compared with
torch's own schedule constructors (a fake process group builds every rank's stages in this process),
and the counts that ``swapkit train`` used to refuse (not a multiple of ``pipeline_stage``) train on
2 gloo ranks with gradients bit-identical to the same pipeline without swapkit and to one process
accumulating the same micro-batches, with one micro-step per micro-batch and chunk.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS, ScheduleZBVZeroBubble,
)

import swapkit
from pipeline_utils import StageRun, batch, pipeline_config, spawn
from swapkit.config.errors import ConfigError
from swapkit.distributed.launch import check
from swapkit.distributed.pipeline import micro_batch_problems, nearest_micro_batches, takes_micro_batches
from swapkit.planner.stages import schedule_of
from swapkit.train.model import build_model, lm_loss
from toys import ReadyWhenDone

TORCH_SCHEDULES = {"gpipe": (ScheduleGPipe, 1), "1f1b": (Schedule1F1B, 1), "interleaved_1f1b": (ScheduleInterleaved1F1B, 2)}
COUNTS = range(1, 21)


# ---------------------------------------------------------------------- the rule, per schedule


def accepted(schedule: str, stages: int) -> list[int]:
    return [n for n in COUNTS if takes_micro_batches(schedule, stages, n)]


def test_gpipe_takes_any_count():
    for stages in (2, 3, 4):
        assert accepted("gpipe", stages) == list(COUNTS)


def test_1f1b_takes_at_least_one_micro_batch_per_stage():
    for stages in (2, 3, 4):
        assert accepted("1f1b", stages) == list(range(stages, 21))


def test_interleaved_1f1b_takes_a_multiple_of_its_rounds():
    assert accepted("interleaved_1f1b", 2) == [1, 2, 3, 4, 6, 8, 10, 12, 14, 16, 18, 20]
    assert accepted("interleaved_1f1b", 3) == [1, 2, 3, 4, 5, 6, 8, 9, 12, 15, 18]
    assert accepted("interleaved_1f1b", 4) == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 15, 16, 20]


def test_an_unknown_schedule_is_an_error():
    with pytest.raises(ValueError, match="'zbv' is not one of"):
        takes_micro_batches("zbv", 2, 4)


def _torch_takes(cls: type, chunks: int, stages: int, count: int) -> bool:
    """Does every rank's torch schedule constructor take ``count``? (A fake process group: no peers.)"""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    for rank in range(stages):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=stages)
        try:
            built = [PipelineStage(nn.Linear(2, 2), v * stages + rank, stages * chunks, torch.device("cpu"))
                     for v in range(chunks)]
            cls(built[0] if chunks == 1 else built, count, loss_fn=lm_loss)
        except ValueError:
            return False
        finally:
            dist.destroy_process_group()
    return True


@pytest.mark.parametrize("schedule", sorted(TORCH_SCHEDULES))
def test_the_rule_is_what_torchs_schedule_constructors_take(schedule):
    for stages in (2, 3, 4):
        torch_takes = [n for n in COUNTS if _torch_takes(*TORCH_SCHEDULES[schedule], stages, n)]
        assert accepted(schedule, stages) == torch_takes, (schedule, stages)


OTHER_SCHEDULES = [  # what the README says torch's other schedules take (your own schedule with swapkit)
    (ScheduleLoopedBFS, lambda p, n: True), (ScheduleZBVZeroBubble, lambda p, n: True),
    (ScheduleInterleavedZeroBubble, lambda p, n: takes_micro_batches("interleaved_1f1b", p, n)),
    (ScheduleDualPipeV, lambda p, n: n >= 2 * p),
]


@pytest.mark.parametrize("cls, rule", OTHER_SCHEDULES, ids=[c.__name__ for c, _ in OTHER_SCHEDULES])
def test_torchs_other_schedules_take_what_the_readme_says(cls, rule):
    for stages in (2, 3):
        assert [n for n in COUNTS if _torch_takes(cls, 2, stages, n)] == [n for n in COUNTS if rule(stages, n)]


def test_nearest_valid_counts_on_either_side():
    assert nearest_micro_batches("interleaved_1f1b", 2, 5) == [4, 6]
    assert nearest_micro_batches("interleaved_1f1b", 4, 13) == [12, 15]
    assert nearest_micro_batches("1f1b", 3, 1) == [3]  # none below


# ---------------------------------------------------------------------- the check before the ranks start


def parallel(schedule: str | None, count: int, stages: int = 2) -> swapkit.Config:
    interleave = 2 if schedule == "interleaved_1f1b" else 1
    layers = 2 * stages * interleave
    return swapkit.load_config({"model": {"model_config": {"num_layers": layers, "pp_interleave_num": interleave}},
                                "parallel_config": {"pipeline_stage": stages, "micro_batch_num": count,
                                                    "pipeline_schedule": schedule}})


@pytest.mark.parametrize("schedule, count", [("gpipe", 1), ("gpipe", 3), ("1f1b", 3), ("1f1b", 5),
                                             ("interleaved_1f1b", 3), ("interleaved_1f1b", 1)])
def test_counts_torch_takes_pass_the_check_though_not_multiples_of_pipeline_stage(schedule, count):
    assert count % 2
    config = parallel(schedule, count)
    assert micro_batch_problems(config) == []
    check(config, torch.device("cpu"))  # no ConfigError


def test_1f1b_with_fewer_micro_batches_than_stages_names_key_value_schedule_and_fix():
    with pytest.raises(ConfigError) as err:
        check(parallel(None, 2, stages=3), torch.device("cpu"))
    assert ("parallel_config.micro_batch_num: got 2; pipeline_schedule 1f1b (the default) needs at least "
            "pipeline_stage (3) micro-batches (torch's Schedule1F1B refuses fewer); set it to 3, or use "
            "pipeline_schedule gpipe") in str(err.value)


def test_interleaved_count_off_its_rounds_names_key_value_schedule_and_nearest_counts():
    with pytest.raises(ConfigError) as err:
        check(parallel("interleaved_1f1b", 9, stages=4), torch.device("cpu"))
    assert ("parallel_config.micro_batch_num: got 9; pipeline_schedule interleaved_1f1b runs max(1, 9 // "
            "pipeline_stage 4) = 2 rounds and needs a multiple of them (torch's ScheduleInterleaved1F1B); set it "
            "to 8 or 10") in str(err.value)


def test_the_budget_planner_refuses_a_count_torch_refuses():
    assert schedule_of(parallel("1f1b", 3)).micro_batches == 3
    with pytest.raises(ConfigError, match=r"micro_batch_num: got 1; pipeline_schedule 1f1b"):
        schedule_of(parallel("1f1b", 1))


# ---------------------------------------------------------------------- 2 gloo ranks

# one process group per layout: the first layout applied in a group is its reference (Note [Stage
# layouts agree across ranks] in swapkit.runtime.stage_binding)
GROUPS = {"one chunk": [("gpipe", 3), ("1f1b", 3), ("gpipe", 1)], "two chunks": [("interleaved_1f1b", 3)]}
CASES = [case for cases in GROUPS.values() for case in cases]


def swap_everything(schedule: str, count: int) -> dict:
    return pipeline_config(schedule, parallel_config={"pipeline_stage": 2, "micro_batch_num": count},
                           swap_config={"swap": True, "layer_swap": [{"backward_prefetch": 2, "layers": True}]},
                           runtime={"min_offload_bytes": 0})


def single_process_grads(schedule: str, count: int, names: set[str]) -> dict[str, torch.Tensor]:
    """One process, the whole model, the same micro-batches accumulated, scaled by ``1/count`` as the
    schedule scales them; the parameters ``names`` (one stage's)."""
    config = swapkit.load_config(pipeline_config(schedule)).model
    model = build_model(config, seed=1)
    x, y = batch(1, vars(config), count)
    for xm, ym in zip(x.tensor_split(count), y.tensor_split(count)):
        lm_loss(model(xm), ym).backward()
    return {n: p.grad / count for n, p in model.named_parameters() if n in names}


def _train_counts(rank: int, world: int, cases: list[tuple[str, int]]) -> dict:
    out = {}
    for schedule, count in cases:
        ref = StageRun(rank, world, schedule, None, micro_batches=count)
        ref.step(1)
        swap = StageRun(rank, world, schedule, swap_everything(schedule, count), engine=ReadyWhenDone(),
                        micro_batches=count)
        swap.step(1)
        grads = swap.grads()
        out[(schedule, count)] = {"ref": ref.grads(), "swap": grads, "stats": swap.session.stats,
                                  "single": single_process_grads(schedule, count, set(grads)),
                                  "per": swap.session.micro_step_stats}
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``{case: [rank 0's result, rank 1's]}``."""
    out = {}
    for name, cases in GROUPS.items():
        ranks = spawn(_train_counts, 2, tmp_path_factory.mktemp(name.replace(" ", "_")), cases)
        out.update({case: [ranks[0][case], ranks[1][case]] for case in cases})
    return out


@pytest.mark.parametrize("case", CASES, ids=[f"{s}-{n}" for s, n in CASES])
def test_counts_not_a_multiple_of_the_stages_train_bit_identically(trained, case):
    for result in trained[case]:
        assert result["ref"].keys() == result["swap"].keys() == result["single"].keys()
        for name, grad in result["ref"].items():
            assert torch.equal(grad, result["swap"][name]), name  # swapkit changes nothing
            assert torch.equal(grad, result["single"][name]), name  # the single-process accumulation


@pytest.mark.parametrize("case", CASES, ids=[f"{s}-{n}" for s, n in CASES])
def test_one_micro_step_per_micro_batch_and_chunk_and_every_byte_back(trained, case):
    schedule, count = case
    chunks = 2 if schedule == "interleaved_1f1b" else 1
    for result in trained[case]:
        stats, per = result["stats"], result["per"]
        assert stats.micro_steps == count * chunks
        assert sorted((m.chunk, m.micro_batch) for m in per) == [(c, b) for c in range(chunks) for b in range(count)]
        moved = {m.stats.offloaded_bytes for m in per}
        assert len(moved) == 1 and moved.pop() > 0  # every micro-batch's forward offloads the same bytes
        assert stats.offloaded_bytes == sum(m.stats.offloaded_bytes for m in per)
        for m in per:
            assert m.stats.prefetched_bytes + m.stats.tail_bytes == m.stats.offloaded_bytes
        assert stats.prefetched_bytes == sum(m.stats.prefetched_bytes for m in per)
        assert stats.late_fetches == 0 and stats.resident_bytes == 0
