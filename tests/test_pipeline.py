"""Pipeline stages: stage binding with global layer ids, micro-steps, and torch's pipeline schedules.

The multi-process tests run GPipe, 1F1B and Interleaved1F1B with 4 micro-batches on 2 gloo ranks
(tests/pipeline_utils.py); one spawn per schedule measures everything its tests assert.
"""
from __future__ import annotations

import logging
import threading

import pytest
import torch

import swapkit
from pipeline_utils import StageRun, pipeline_config, spawn, use_tick_link
from swapkit.distributed.pipeline import build_stage_chunks
from toys import ReadyWhenDone, install_engine

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b"]


def layer_swap_config(schedule: str, k: int) -> dict:
    return pipeline_config(schedule, swap_config={"swap": True, "layer_swap": [{"backward_prefetch": k, "layers": True}]},
                           runtime={"min_offload_bytes": 0})


def _measure(rank: int, world: int, schedule: str) -> dict:
    ref = StageRun(rank, world, schedule, None)
    ref.step(1)
    keep = StageRun(rank, world, schedule, pipeline_config(schedule))
    keep.step(1)
    swap = StageRun(rank, world, schedule, layer_swap_config(schedule, 2), engine=ReadyWhenDone())
    swap.step(1)
    link = StageRun(rank, world, schedule, layer_swap_config(schedule, 8))
    use_tick_link(link.session, delay=2)
    link_late = []
    for number in (1, 2, 3):
        link.step(number)
        link_late.append(link.session.stats.late_fetches)
    single = swapkit.build_plan(swapkit.load_config(layer_swap_config(schedule, 2)))
    return {
        "grads_ref": ref.grads(), "grads_swap": swap.grads(), "grads_keep": keep.grads(),
        "keep": keep.session.stats, "swap": swap.session.stats, "per_micro_step": swap.session.micro_step_stats,
        "bound": [(b.index, b.plan == single.layers[b.index]) for b in swap.session.binding.layers],
        "stage_layers": single.stage_layers(rank), "link_late": link_late,
    }


@pytest.fixture(scope="module", params=SCHEDULES)
def measured(request, tmp_path_factory):
    return request.param, spawn(_measure, 2, tmp_path_factory.mktemp(request.param), request.param)


def test_swap_grads_bit_identical_to_the_same_pipeline_without_swapkit(measured):
    _, ranks = measured
    for result in ranks:
        assert result["grads_ref"].keys() == result["grads_swap"].keys() == result["grads_keep"].keys()
        for name, grad in result["grads_ref"].items():
            assert torch.equal(grad, result["grads_swap"][name]), name
            assert torch.equal(grad, result["grads_keep"][name]), name


def test_decisions_are_the_single_process_plans_per_global_layer(measured):
    _, ranks = measured
    for rank, result in enumerate(ranks):
        ids = [layer for chunk in result["stage_layers"] for layer in chunk]
        assert [index for index, _ in result["bound"]] == ids
        assert all(same for _, same in result["bound"])
        labels = set(result["swap"].offloaded_by_scope)
        assert labels == {f"layer {i}" for i in ids}  # global ids in every label


def test_every_micro_batch_forward_is_a_micro_step(measured):
    schedule, ranks = measured
    chunks = 2 if schedule == "interleaved_1f1b" else 1
    for result in ranks:
        assert result["swap"].micro_steps == 4 * chunks  # metadata inference is not one
        per = result["per_micro_step"]
        assert sorted((m.chunk, m.micro_batch) for m in per) == [(c, b) for c in range(chunks) for b in range(4)]
        assert result["swap"].offloaded_bytes == sum(m.stats.offloaded_bytes for m in per) > 0
        assert all(m.stats.prefetched_bytes + m.stats.tail_bytes == m.stats.offloaded_bytes for m in per)


def test_layer_swap_peak_per_stage_is_at_most_035_of_keep(measured):
    _, ranks = measured
    for result in ranks:
        keep, swap = result["keep"], result["swap"]
        assert keep.offloaded_bytes == 0 and keep.peak_device_bytes > 0
        assert swap.peak_device_bytes <= 0.35 * keep.peak_device_bytes, (swap.peak_device_bytes, keep.peak_device_bytes)
        assert swap.late_fetches == 0


def test_no_late_fetch_at_a_generous_distance_on_an_emulated_link(measured):
    schedule, ranks = measured
    for result in ranks:
        late = result["link_late"]
        # the first optimizer step guesses the backward order (oldest first), which Interleaved1F1B breaks;
        # from the second step on the order learnt from the previous step is used
        assert late[1:] == [0, 0], late
        if schedule != "interleaved_1f1b":
            assert late[0] == 0


# ---------------------------------------------------------------------- in one process


def tiny_stage(schedule: str = "1f1b", stage: int = 1, **sections):
    config = pipeline_config(schedule, **sections)
    plan = swapkit.build_plan(swapkit.load_config(config))
    return config, build_stage_chunks(swapkit.load_config(config).model, plan, stage, seed=1)


def swapped_stage(prefetch: int):
    """Stage 1's chunk with every layer swapped at distance ``prefetch`` (no size threshold), its session on an
    engine whose ``ready`` waits for the copy (releases exactly at their horizon): ``(session, chunk)``."""
    config, (chunk,) = tiny_stage(stage=1, swap_config={"swap": True, "layer_swap": [{"backward_prefetch": prefetch,
                                                                                       "layers": True}]},
                                  runtime={"min_offload_bytes": 0})
    session = swapkit.apply(chunk, config, layers="layers", stage=1)
    install_engine(session, ReadyWhenDone())
    return session, chunk


def test_stage_layers_follow_the_mindformers_layout():
    plan = swapkit.build_plan(swapkit.load_config({
        "model": {"model_config": {"num_layers": 10, "pp_interleave_num": 2, "offset": [[0, 1], [1, 0]]}},
        "parallel_config": {"pipeline_stage": 2}}))
    assert plan.stage_layers(0) == [[0, 1], [5, 6, 7]]
    assert plan.stage_layers(1) == [[2, 3, 4], [8, 9]]
    with pytest.raises(ValueError, match=r"stage=2 .* 0\.\.1"):
        plan.stage_layers(2)


def test_wrong_container_names_the_expected_global_layers():
    config, chunks = tiny_stage(stage=1)
    del chunks[0].layers[0]
    with pytest.raises(swapkit.BindError, match=r"global layers \[4, 5, 6, 7\]"):
        swapkit.apply(chunks, config, layers="layers", stage=1)


def test_wrong_chunk_count_and_missing_stage_are_bind_errors():
    config, chunks = tiny_stage("interleaved_1f1b", stage=0)
    with pytest.raises(swapkit.BindError, match=r"pp_interleave_num: 2.*\[\[0, 1\], \[4, 5\]\]"):
        swapkit.apply(chunks[:1], config, layers="layers", stage=0)
    with pytest.raises(swapkit.BindError, match="stage="):
        swapkit.apply(chunks, config, layers="layers")


def test_log_lines_use_global_layer_ids(caplog):
    config, chunks = tiny_stage(stage=1, swap_config={"swap": True, "layer_swap": [{"backward_prefetch": 3,
                                                                                     "layers": [1, 5]}]})
    with caplog.at_level(logging.INFO, logger="swapkit"):
        session = swapkit.apply(chunks, config, layers="layers", stage=1)
    assert "Set layer swap at layer 5 and value is: 3" in caplog.messages
    assert not any("at layer 1 " in m for m in caplog.messages)  # layer 1 lives on stage 0
    session.remove()
    assert not chunks[0].__dict__.get("_swapkit_applied")


def _forward(chunk, x):
    return chunk(x).sum()


def test_a_later_forward_leaves_earlier_micro_steps_alone():
    """F0 F1 B0 B1 by hand: each forward is a micro-step; the no-grad pass opens none; bytes add up."""
    session, chunk = swapped_stage(2)
    xs = [torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    with session:
        with torch.no_grad():
            chunk(xs[0])  # like PipelineStage's shape inference under no_grad
        losses = [_forward(chunk, x) for x in xs]
        for loss in losses:
            loss.backward()
    stats, per = session.stats, session.micro_step_stats
    assert stats.micro_steps == 2 and [(m.chunk, m.micro_batch) for m in per] == [(0, 0), (0, 1)]
    assert per[0].stats.offloaded_bytes == per[1].stats.offloaded_bytes > 0
    assert stats.offloaded_bytes == 2 * per[0].stats.offloaded_bytes
    assert per[0].stats.prefetched_bytes == per[0].stats.offloaded_bytes  # its tail was released, then fetched
    assert stats.late_fetches == 0 and stats.resident_bytes == 0
    assert stats.peak_device_bytes < per[0].stats.saved_bytes
    assert stats.host_pool_bytes > 0
    session.remove()  # empties the host pool; the last optimizer step's numbers stay as they were
    assert session.stats == stats and session.micro_step_stats == per


def test_gpipe_order_releases_the_last_forwards_tail_when_another_backward_begins():
    """Note [Micro-step tails], GPipe's order by hand (F0 F1 F2 B0 B1 B2, torch's ScheduleGPipe runs its
    backwards in forward order) at a distance longer than a micro-step's saves: every save is tail. Micro-step
    2 was the last forward, but B0 and B1 run between its forward and its backward, so its tail must not stay
    on the device through them (it stayed: only a new forward released tails), and the next step must still
    offload it (it skipped: micro-step 2 counted as "backward directly after forward")."""
    session, chunk = swapped_stage(1000)
    for step in (1, 2):
        _micro_batches_by_hand(session, chunk, 3, steps=1)
        per = session.micro_step_stats
        last = per[2].stats
        assert last.skipped.get("tail", 0) == 0 and last.offloaded_bytes == per[1].stats.offloaded_bytes > 0, step
        assert last.tail_bytes == 0 and last.prefetched_bytes == last.offloaded_bytes, step
        assert per[0].stats.tail_bytes + per[0].stats.skipped.get("tail", 0) == per[1].stats.offloaded_bytes, step
        assert session.stats.late_fetches == 0 and session.stats.resident_bytes == 0
    session.remove()


def test_a_tail_release_waits_for_the_micro_steps_lock_and_spares_one_whose_backward_began():
    """Note [Micro-step tails] and swapkit.runtime.records Note [Unpacks from several threads]: a backward's
    begin releases other micro-steps' tails on its autograd thread. One of them may be beginning its own
    backward on another thread (one backward over several micro-batches, CPU and CUDA nodes): that begin holds
    its step's lock. The release waits for the lock and then leaves the step alone; it ran at once, beside the
    begin that drops the same records' host copies."""
    session, chunk = swapped_stage(1000)
    xs = [torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    with session:
        losses = [_forward(chunk, x) for x in xs]
        last = session._group.steps[1]  # F1 kept m0's tail (it runs backward next) and m1's is its own
        assert not last.tail_released and last.stats.offloaded_bytes > 0
        other_thread = threading.Thread(target=last.release_tail)
        with last.lock:  # as its own backward's begin on another autograd thread holds it
            other_thread.start()
            other_thread.join(timeout=0.2)
            assert other_thread.is_alive() and last.stats.released_bytes == 0  # it waits
            last._begin_backward()
        other_thread.join()
        assert not last.tail_released and last.stats.released_bytes == 0
        for loss in reversed(losses):
            loss.backward()
    stats = session.micro_step_stats[1].stats
    assert stats.tail_bytes == stats.offloaded_bytes and stats.prefetched_bytes == 0
    assert session.stats.late_fetches == 0 and session.stats.resident_bytes == 0
    session.remove()


def _bypassed(module: torch.nn.Module, calls: list[int]) -> None:
    """``module``'s forward under identity saved-tensor hooks for the call numbers in ``calls`` (counted from 0):
    its saves then bypass the session (overrides Note [Swaps nobody reports]); the math is unchanged."""
    forward, count = module.forward, iter(range(1 << 30))

    def wrapped(*args, **kwargs):
        if next(count) not in calls:
            return forward(*args, **kwargs)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            return forward(*args, **kwargs)

    module.forward = wrapped


def test_a_stage_lists_each_unused_swap_once_and_only_if_no_micro_step_used_it(caplog):
    """SwapStats.unused_swaps of an optimizer step: layer 4's attention bypasses the session in every micro-step,
    layer 5's only in the first. The step lists layer 4's once (it listed it once per micro-step), and not
    layer 5's, whose swap moved bytes in the other micro-steps (it was listed, and warned about: "no effect")."""
    config, (chunk,) = tiny_stage(stage=1, swap_config={
        "swap": True, "op_swap": [{"op_name": "attention", "backward_prefetch": 1, "layers": [4, 5]}]},
                                  runtime={"min_offload_bytes": 0})
    _bypassed(chunk.layers[0].attention, list(range(6)))
    _bypassed(chunk.layers[1].attention, [0, 3])  # the first micro-batch of each of the 2 steps
    session = swapkit.apply(chunk, config, layers="layers", stage=1)
    install_engine(session, ReadyWhenDone())
    with caplog.at_level(logging.WARNING, logger="swapkit"):
        _micro_batches_by_hand(session, chunk, 3)
    unused = [m for m in caplog.messages if "saw no saved tensor" in m]
    assert len(unused) == 1 and "layer 4: attention" in unused[0] and "layer 5" not in unused[0], unused
    per = session.micro_step_stats
    assert [m.stats.unused_swaps for m in per] == [["layer 4: attention", "layer 5: attention"],
                                                   ["layer 4: attention"], ["layer 4: attention"]]
    assert session.stats.offloaded_by_scope.keys() == {"layer 5: attention"}
    assert session.stats.unused_swaps == ["layer 4: attention"]
    session.remove()


def test_a_stage_whose_swap_moves_nothing_warns_once(caplog):
    """overrides Note [Swaps that move nothing], in a pipeline stage's session: every candidate is under
    min_offload_bytes, so the micro-steps offload nothing; the stage warns once (not once per step)."""
    config, (chunk,) = tiny_stage(stage=1, swap_config={"swap": True, "layer_swap": [{"backward_prefetch": 2,
                                                                                       "layers": True}]},
                                  runtime={"min_offload_bytes": 1 << 30})
    session = swapkit.apply(chunk, config, layers="layers", stage=1)
    xs = [torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    for _ in range(2):
        with session:
            for loss in [_forward(chunk, x) for x in xs]:
                loss.backward()
    assert session.stats.offloaded_bytes == 0 and session.stats.skipped["small"] > 0
    idle = [m for m in caplog.messages if "swap moved nothing off the device" in m]
    assert len(idle) == 1 and "runtime.min_offload_bytes" in idle[0]


def test_a_chunk_whose_swaps_keep_only_small_tensors_is_named_while_the_other_chunk_moves(caplog):
    """overrides Note [Swaps whose tensors are all small] in a stage of two chunks: chunk 0's layer swaps
    offload, chunk 1's op swap of the norm keeps every tensor (under min_offload_bytes). No micro-step of chunk
    1 offloaded anything and the stage-wide idle warning stays silent (chunk 0 moved bytes): the norm's swap
    is named once (it was silent: each micro-step looked only at its own offloads)."""
    swap = {"swap": True, "layer_swap": [{"backward_prefetch": 2, "layers": [2, 3]}],
            "op_swap": [{"op_name": "attention_norm", "backward_prefetch": 2, "layers": [6, 7]}]}
    config, chunks = tiny_stage("interleaved_1f1b", stage=1, swap_config=swap, runtime={"min_offload_bytes": 8192})
    session = swapkit.apply(chunks, config, layers="layers", stage=1)
    install_engine(session, ReadyWhenDone())
    xs = [torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    caplog.set_level(logging.WARNING, logger="swapkit")
    with session:
        hidden = [chunks[0](x) for x in xs]
        for loss in [chunks[1](h).sum() for h in hidden]:
            loss.backward()
    assert [(m.chunk, m.stats.offloaded_bytes > 0) for m in session.micro_step_stats] == \
        [(0, True), (0, True), (1, False), (1, False)]
    small = [m for m in caplog.messages if "smaller than runtime.min_offload_bytes" in m]
    assert len(small) == 1 and small[0].startswith("swapkit: op swap at layers 6-7: attention_norm moved nothing "
                                                   "in step 1:")  # the optimizer step, not micro-step 3
    session.remove()


@pytest.mark.cuda
def test_micro_steps_with_the_cuda_engine_keep_gradients_bit_identical():
    """F0 F1 B0 B1 by hand on a GPU: the CUDA engine's streams under micro-steps."""
    swap = {"swap_config": {"swap": True, "layer_swap": [{"backward_prefetch": 2, "layers": True}]},
            "runtime": {"min_offload_bytes": 0}}
    config = pipeline_config("1f1b", **swap)
    plan = swapkit.build_plan(swapkit.load_config(config))
    model = swapkit.load_config(config).model
    ref, = build_stage_chunks(model, plan, 1, seed=1, device="cuda")
    chunk, = build_stage_chunks(model, plan, 1, seed=1, device="cuda")
    session = swapkit.apply(chunk, config, layers="layers", stage=1)
    xs = [torch.randn(2, 16, 32, device="cuda", generator=torch.Generator("cuda").manual_seed(i)) for i in range(2)]
    for loss in [_forward(ref, x) for x in xs]:
        loss.backward()
    with session:
        for loss in [_forward(chunk, x) for x in xs]:
            loss.backward()
    assert session.stats.micro_steps == 2 and session.stats.offloaded_bytes > 0
    for (name, a), (_, b) in zip(ref.named_parameters(), chunk.named_parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_a_stage_session_names_its_container_and_its_own_layers():
    """The repr and the binding of a stage name the chunk's layer container as written (not its
    characters joined, 'ModuleList.l, a, y, e, r, s') and count the stage's layers, not the model's."""
    config, chunks = tiny_stage("interleaved_1f1b", stage=1, swap_config={
        "swap": True, "layer_swap": [{"backward_prefetch": 1, "layers": [0, 2, 3]}]})
    session = swapkit.apply(chunks, config, layers="layers", stage=1)
    assert session.binding.layers_path == "layers"
    text = repr(session)
    assert text.startswith("StageSession(stage 1 of 2: layers [[2, 3], [6, 7]] in 2 x PipelineChunk.layers: 4 layers")
    assert "swap on 2, recompute on 0" in text  # layers 2 and 3; layer 0 lives on stage 0
    session.remove()


def test_a_bad_op_pattern_on_a_stage_names_the_chunk_container():
    config, chunks = tiny_stage(stage=1, swap_config={
        "swap": True, "op_swap": [{"op_name": "attentoin", "backward_prefetch": 1, "layers": True}]})
    with pytest.raises(swapkit.BindError, match=r"any layer of PipelineChunk\.layers; did you mean 'attention'"):
        swapkit.apply(chunks, config, layers="layers", stage=1)


def test_a_list_of_containers_with_stage_is_a_bind_error_naming_the_fix():
    config, chunks = tiny_stage(stage=1)
    with pytest.raises(swapkit.BindError, match=r"layers=\['layers', 'extra'\].*stage=1.*one dotted path"):
        swapkit.apply(chunks, config, layers=["layers", "extra"], stage=1)
    session = swapkit.apply(chunks, config, layers=["layers"], stage=1)  # one path in a list is that path
    assert session.binding.layers_path == "layers"
    session.remove()


def _apply_with_offsets(rank: int, world: int, cases: list) -> list[str]:
    """Each case: every rank applies swapkit to its stage with its own config's offset and layer swaps,
    rank 1 after rank 0; one process group for all cases (the first layout applied is the reference)."""
    import torch.distributed as dist

    outcomes = []
    for offsets, swapped in cases:
        config = pipeline_config("1f1b", swap_config={"swap": True, "layer_swap": [{"backward_prefetch": 1,
                                                                                    "layers": swapped[rank]}]})
        config["model"]["model_config"]["offset"] = offsets[rank]
        plan = swapkit.build_plan(swapkit.load_config(config))
        chunks = build_stage_chunks(swapkit.load_config(config).model, plan, rank, seed=1)
        if rank == 1:
            dist.barrier()
        try:
            swapkit.apply(chunks, config, layers="layers", stage=rank).remove()
            outcomes.append("applied")
        except swapkit.ConfigError as err:
            outcomes.append(str(err))
        if rank == 0:
            dist.barrier()
    return outcomes


def test_ranks_whose_configs_lay_out_the_model_differently_are_a_config_error(tmp_path):
    """The same layout with other swaps per rank applies (a stage applies only its own layers' decisions).
    Then rank 1's config puts layers 4-7 on stage 1 where rank 0's put 5-7 (0-4 on stage 0): layer 4 on
    both stages, no partition of the model. The rank that applies second names both layouts and the key."""
    same = ([[1, -1], [1, -1]], [[0, 1], [6]])
    other = ([[1, -1], 0], [True, True])
    (rank0_same, rank0_other), (rank1_same, rank1_other) = spawn(_apply_with_offsets, 2, tmp_path, [same, other])
    assert [rank0_same, rank0_other, rank1_same] == ["applied", "applied", "applied"]
    assert "model.model_config.offset" in rank1_other
    assert "num_layers per stage [[4, 4]] (stage 1 of 2)" in rank1_other
    assert "rank 0 applied swapkit with [[5, 3]]" in rank1_other
    assert "same model.model_config" in rank1_other


def _fsdp_stage(rank: int, world: int) -> dict:
    """FSDP2 inside each stage (a 1-rank mesh per stage), 1F1B, every layer swapped, reshard_after_forward
    True and False, against the same sharded pipeline without swapkit; 2 optimizer steps each."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from pipeline_utils import batch
    from swapkit.distributed.pipeline import make_schedule, pipeline_stages
    from swapkit.train.model import lm_loss

    groups = [dist.new_group([r]) for r in range(world)]
    mesh = DeviceMesh.from_group(groups[rank], "cpu")
    config = layer_swap_config("1f1b", 1)
    plan = swapkit.build_plan(swapkit.load_config(config))
    model = swapkit.load_config(config).model
    out = {}
    for reshard in (True, False):
        for swapped in (False, True):
            chunks = build_stage_chunks(model, plan, rank, seed=1)
            session = swapkit.apply(chunks, config, layers="layers", stage=rank) if swapped else None
            for chunk in chunks:
                for layer in chunk.layers:
                    fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
                fully_shard(chunk, mesh=mesh, reshard_after_forward=reshard)
            schedule = make_schedule("1f1b", pipeline_stages(chunks, rank, world, torch.device("cpu")), 4, lm_loss)
            grads = []
            for number in (1, 2):
                x, y = batch(number, vars(model))
                with session if session is not None else torch.enable_grad():
                    schedule.step(x) if rank == 0 else schedule.step(target=y, losses=[])
                grads.append({n: p.grad.to_local().clone() for n, p in chunks[0].named_parameters()})
                chunks[0].zero_grad(set_to_none=True)
            out[(reshard, swapped)] = (grads, session.stats if session is not None else None)
    return out


def test_fsdp2_inside_pipeline_stages_keeps_gradients_bit_identical(tmp_path):
    for result in spawn(_fsdp_stage, 2, tmp_path):
        for reshard in (True, False):
            (ref, _), (got, stats) = result[(reshard, False)], result[(reshard, True)]
            for before, after in zip(ref, got):
                assert before.keys() == after.keys()
                assert all(torch.equal(before[n], after[n]) for n in before), reshard
            assert stats.micro_steps == 4 and stats.offloaded_bytes > 0
            assert stats.skipped["parameter"] > 0  # FSDP2's unsharded weights are recognised, never copied


def _torch_schedule(run: StageRun, name: str, micro_batches: int) -> StageRun:
    """``run`` driven by torch's schedule class ``name`` (one swapkit train does not offer) over its chunks."""
    from torch.distributed import pipelining
    from swapkit.distributed.pipeline import pipeline_stages
    from swapkit.train.model import lm_loss

    stages = pipeline_stages(run.chunks, run.rank, run.world, torch.device("cpu"))
    run.schedule, run.micro_batches = getattr(pipelining, name)(stages, micro_batches, loss_fn=lm_loss), micro_batches
    return run


def _zero_bubble_and_looped_bfs(rank: int, world: int) -> dict:
    out = {}
    for name in ("ScheduleInterleavedZeroBubble", "ScheduleLoopedBFS"):
        ref = _torch_schedule(StageRun(rank, world, "interleaved_1f1b", None), name, 3)
        swap = _torch_schedule(StageRun(rank, world, "interleaved_1f1b", layer_swap_config("interleaved_1f1b", 2),
                                        engine=ReadyWhenDone()), name, 3)
        for number in (1, 2):
            ref.step(number)
            swap.step(number)
            out[(name, number)] = (ref.grads(), swap.grads(), swap.session.stats, swap.session.micro_step_stats)
    return out


def test_zero_bubble_and_looped_bfs_keep_gradients_bit_identical(tmp_path):
    """The README's other schedules, 3 micro-batches on 2 stages x 2 chunks: ZeroBubble splits each backward
    into an input pass and a later weight pass (the saved tensors are unpacked twice), LoopedBFS runs backwards
    newest first. Gradients equal the same pipeline without swapkit; every micro-step brings back what it
    offloaded or used its tail in place. (LoopedBFS accumulates the micro-batches' gradients in reverse order,
    so it is not bit-identical to one process accumulating them in order; that is torch's order, not swapkit.)"""
    for result in spawn(_zero_bubble_and_looped_bfs, 2, tmp_path):
        for (name, number), (ref, got, stats, per) in result.items():
            assert ref.keys() == got.keys() and ref, name
            assert all(torch.equal(ref[n], got[n]) for n in ref), (name, number)
            assert stats.micro_steps == 6 and stats.offloaded_bytes > 0 and stats.resident_bytes == 0, name
            assert all(m.stats.prefetched_bytes + m.stats.tail_bytes == m.stats.offloaded_bytes for m in per), name
            assert stats.late_fetches == 0, name


def _micro_batches_by_hand(session, chunk, count: int, steps: int = 2) -> None:
    xs = [torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(i)) for i in range(count)]
    for _ in range(steps):
        with session:
            for loss in [_forward(chunk, x) for x in xs]:
                loss.backward()


def test_micro_batch_num_other_than_what_the_schedule_ran_warns_once(caplog):
    """parallel_config.micro_batch_num is swapkit train's; a stage session whose schedule runs another
    count says so once (the key did nothing), naming the key, both counts and the fix."""
    config, (chunk,) = tiny_stage(stage=1, parallel_config={"pipeline_stage": 2, "micro_batch_num": 4})
    session = swapkit.apply(chunk, config, layers="layers", stage=1)
    with caplog.at_level(logging.WARNING, logger="swapkit"):
        _micro_batches_by_hand(session, chunk, 2)
    assert session.stats.micro_steps == 2
    found = [m for m in caplog.messages if "micro_batch_num" in m]
    assert len(found) == 1, caplog.messages
    assert "parallel_config.micro_batch_num: 4" in found[0] and "ran 2 micro-batches" in found[0]
    assert "n_microbatches" in found[0]
    session.remove()


def test_micro_batch_num_equal_to_what_the_schedule_ran_says_nothing(caplog):
    config, (chunk,) = tiny_stage(stage=1, parallel_config={"pipeline_stage": 2, "micro_batch_num": 2})
    session = swapkit.apply(chunk, config, layers="layers", stage=1)
    with caplog.at_level(logging.WARNING, logger="swapkit"):
        _micro_batches_by_hand(session, chunk, 2)
    assert not [m for m in caplog.messages if "micro_batch_num" in m]
    session.remove()


def test_a_stage_forward_outside_the_with_block_is_warned_once(caplog):
    """schedule.step(...) outside `with session:` swaps nothing; the stage session says so once."""
    config, (chunk,) = tiny_stage(stage=1, swap_config={"swap": True, "layer_swap": [{"backward_prefetch": 1,
                                                                                       "layers": [5]}]})
    session = swapkit.apply(chunk, config, layers="layers", stage=1)
    with caplog.at_level(logging.WARNING, logger="swapkit"):
        for i in range(2):
            _forward(chunk, torch.randn(2, 16, 32)).backward()
    outside = [m for m in caplog.messages if "outside `with session:`" in m]
    assert len(outside) == 1 and "layer 5" in outside[0] and "schedule.step" in outside[0]
    session.remove()


def test_a_chunk_that_is_its_own_layer_container_is_named_plainly():
    """torch's pipelining examples split an nn.Sequential of blocks: the chunk is the container (path
    ''), named 'Sequential', not 'Sequential.'."""
    config, (chunk,) = tiny_stage(stage=1, swap_config={
        "swap": True, "op_swap": [{"op_name": "attentoin", "backward_prefetch": 1, "layers": True}]})
    blocks = torch.nn.Sequential(*chunk.layers)
    with pytest.raises(swapkit.BindError, match=r"any layer of Sequential; did you mean"):
        swapkit.apply(blocks, config, stage=1)
    config["swap_config"]["op_swap"][0]["op_name"] = "attention"
    session = swapkit.apply(blocks, config, stage=1)
    assert "in 1 x Sequential: 4 layers" in repr(session)
    session.remove()
