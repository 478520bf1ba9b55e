"""swapkit under data parallelism: FSDP2 (``fully_shard``) and DDP on 2 gloo ranks (CPU), and FSDP2 on
one NCCL rank with the CUDA engine (``@pytest.mark.cuda``).

Each test starts one pair of processes (``tests.dist_utils.run_ranks``) and runs every case inside it:
FSDP2 with ``reshard_after_forward`` True and False, against FSDP2 alone, over 3 optimizer steps.
"""
from __future__ import annotations

import contextlib
import os

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

import swapkit
from swapkit.config.types import ModelConfig
from swapkit.engine import ThreadCopyEngine
from tests.dist_utils import run_ranks, run_script
from tests.toys import install_engine, llama_batch, llama_step, toy_config

TINY = ModelConfig(num_layers=4, hidden_size=32, num_heads=2, intermediate_size=64, vocab_size=64, seq_length=16)
STEPS = 3

# Every mechanism on one model: layer 0 fully recomputed, layer 1 select recompute (MindFormers output
# recompute) + an op swap, layer 2 a layer swap, layer 3 op swaps.
CONFIGS = {
    "swap_only": {"swap_config": {"swap": True, "layer_swap": [{"backward_prefetch": 1, "layers": [0, 2]}],
                                  "op_swap": [{"op_name": "attention", "backward_prefetch": 2, "layers": [1, 3]},
                                              {"op_name": "feed_forward", "backward_prefetch": 3, "layers": [3]}]},
                  "runtime": {"min_offload_bytes": 0}},
    "swap_and_recompute": {
        "recompute_config": {"recompute": [0], "select_recompute": {r"feed_forward\.mul": [1]},
                             "select_comm_recompute": {r"ffn_norm\.norm": [1]}},
        "swap_config": {"swap": True, "layer_swap": [{"backward_prefetch": 1, "layers": [2]}],
                        "op_swap": [{"op_name": "attention", "backward_prefetch": 2, "layers": [1, 3]},
                                    {"op_name": "feed_forward", "backward_prefetch": 1, "layers": [3]}]},
        "runtime": {"min_offload_bytes": 0}},
}


def build(seed: int = 1) -> torch.nn.Module:
    from swapkit.train.model import build_model

    return build_model(TINY, seed=seed)


def shard(model: torch.nn.Module, reshard: bool, **options) -> torch.nn.Module:
    # A CPU mesh: without one fully_shard meshes the accelerator when the machine has one and moves
    # the parameters there, while these tests feed CPU batches (seen on an H100 host).
    options.setdefault("mesh", init_device_mesh("cpu", (torch.distributed.get_world_size(),)))
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=reshard, **options)
    fully_shard(model, reshard_after_forward=reshard, **options)
    return model


class ParameterWatch(ThreadCopyEngine):
    """Counts the bytes of copies whose source is the storage of a parameter the model holds right now
    (during forward FSDP2 registers its unsharded parameters on the modules)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__("cpu")
        self.model, self.parameter_bytes = model, 0

    def offload(self, src, dst):
        pointers = {_local(p).untyped_storage().data_ptr() for p in self.model.parameters()}
        if src.untyped_storage().data_ptr() in pointers - {0}:
            self.parameter_bytes += src.numel()
        return super().offload(src, dst)


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param


def local_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's local gradient shard, copied to the CPU (what a rank hands back)."""
    return {name: p.grad.to_local().to("cpu", copy=True) for name, p in model.named_parameters()}


def train(model: torch.nn.Module, rank: int, session=None, device: str = "cpu") -> list[dict]:
    """3 SGD steps on rank-specific batches; the local gradient shards and stats of each step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(STEPS):
        batch = tuple(t.to(device) for t in llama_batch(seed=10 * step + rank, cfg=TINY))
        opt.zero_grad()
        if session is None:
            loss = llama_step(model, batch)
        else:
            with session:
                loss = llama_step(model, batch)
        out.append({"loss": loss.cpu(), "grads": local_grads(model), "stats": session.stats if session else None})
        opt.step()
    return out


def single_process_stats(config: dict) -> object:
    """The same config on an unsharded model: what swapkit moves without FSDP2."""
    model = build()
    session = swapkit.apply(model, toy_config(4, **config), layers="layers")
    with session:
        llama_step(model, llama_batch(seed=0, cfg=TINY))
    session.remove()
    return session.stats


def fsdp_cases(rank: int, world_size: int) -> dict:
    results = {}
    for reshard in (True, False):
        reference = train(shard(build(), reshard), rank)
        for name, config in CONFIGS.items():
            model = build()
            session = swapkit.apply(model, toy_config(4, **config), layers="layers")
            shard(model, reshard)
            install_engine(session, watch := ParameterWatch(model))
            results[(reshard, name)] = (reference, train(model, rank, session))
            results[(reshard, name, "parameter bytes moved")] = watch.parameter_bytes
            session.remove()
        model = shard(build(), reshard)  # the other order: swapkit applied to an already sharded model
        session = swapkit.apply(model, toy_config(4, **CONFIGS["swap_and_recompute"]), layers="layers")
        results[(reshard, "swap_and_recompute")] += (train(model, rank, session),)
        session.remove()
    results["single"] = {name: single_process_stats(config) for name, config in CONFIGS.items()}
    return results


def test_fsdp2_swap_and_recompute_bit_identical():
    for rank_results in run_ranks(fsdp_cases, 2):
        single = rank_results.pop("single")
        moved = {key: rank_results.pop(key) for key in list(rank_results) if len(key) == 3}
        assert len(moved) == 4 and set(moved.values()) == {0}, moved
        assert single["swap_and_recompute"].recomputed_output_bytes > 0  # the select recompute really ran
        for (reshard, name), (reference, *runs) in rank_results.items():
            for step, (ref, got) in enumerate((r, g) for swapped in runs for r, g in zip(reference, swapped)):
                where = f"reshard_after_forward={reshard}, {name}, step {step}"
                assert torch.equal(ref["loss"], got["loss"]), where
                for param, grad in ref["grads"].items():
                    assert torch.equal(grad, got["grads"][param]), f"{where}: grad of {param}"
                stats = got["stats"]
                assert stats.offloaded_bytes == single[name].offloaded_bytes > 0, where
                assert stats.saved_bytes == single[name].saved_bytes, where  # no gathered weight counted
                assert stats.recomputed_output_bytes == single[name].recomputed_output_bytes, where
                assert stats.skipped.get("parameter", 0) == single[name].skipped.get("parameter", 0) > 0, where


def mixed_precision(rank: int, world_size: int) -> dict:
    """bf16 parameters gathered for compute (``MixedPrecisionPolicy``): swapped vs FSDP2 alone."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    reference = train(shard(build(), True, mp_policy=policy), rank)
    model = build()
    session = swapkit.apply(model, toy_config(4, **CONFIGS["swap_and_recompute"]), layers="layers")
    shard(model, True, mp_policy=policy)
    install_engine(session, watch := ParameterWatch(model))
    return {"runs": (reference, train(model, rank, session)), "parameter bytes": watch.parameter_bytes}


def test_fsdp2_mixed_precision_bit_identical():
    for result in run_ranks(mixed_precision, 2):
        assert result["parameter bytes"] == 0
        for step, (ref, got) in enumerate(zip(*result["runs"])):
            assert got["stats"].offloaded_bytes > 0 and got["stats"].skipped["parameter"] > 0
            for param, grad in ref["grads"].items():
                assert torch.equal(grad, got["grads"][param]), f"step {step}: grad of {param}"


RUNS = 20
RACE = {"swap_config": {"swap": True, "layer_swap": [{"backward_prefetch": 1, "layers": True}],
                        "op_swap": [{"op_name": "attention", "backward_prefetch": 1, "layers": True}]},
        "runtime": {"min_offload_bytes": 0, "engine_options": {"latency_s": 0.0005}}}


def repeated_runs(rank: int, world_size: int) -> dict:
    """The case that crashed: resharded parameters swapped behind a slow copy queue, 20 times."""
    batch = llama_batch(seed=rank, cfg=TINY)
    reference = shard(build(), True)
    llama_step(reference, batch)
    expected = local_grads(reference)
    model = build()
    session = swapkit.apply(model, toy_config(4, **RACE), layers="layers")
    shard(model, True)
    identical, moved = 0, []
    for _ in range(RUNS):
        model.zero_grad()
        with session:
            llama_step(model, batch)
        got = local_grads(model)
        identical += all(torch.equal(got[name], grad) for name, grad in expected.items())
        moved.append((session.stats.offloaded_bytes, session.stats.skipped.get("parameter", 0)))
    session.remove()
    return {"identical": identical, "moved": moved}


def test_fsdp2_resharded_parameters_never_swapped_over_20_runs():
    for result in run_ranks(repeated_runs, 2):
        assert result["identical"] == RUNS
        offloaded, parameter_bytes = result["moved"][0]
        assert offloaded > 0 and parameter_bytes > 0
        # every step moves the same bytes (step 1 on: minus the forward's tail, Note [The last k ticks ...])
        assert len(set(result["moved"][1:])) == 1


def fsdp_on_cuda(rank: int, world_size: int) -> dict:
    """FSDP2 on the GPU (its all-gathers and reduce-scatters on its own streams) with the CUDA engine."""
    torch.use_deterministic_algorithms(True)  # CUBLAS_WORKSPACE_CONFIG is set by the caller, before CUDA starts
    mesh = init_device_mesh("cuda", (world_size,))
    results = {}
    for reshard in (True, False):
        reference = train(shard(build().cuda(), reshard, mesh=mesh), rank, device="cuda")
        model = build().cuda()
        session = swapkit.apply(model, toy_config(4, **CONFIGS["swap_and_recompute"]), layers="layers")
        shard(model, reshard, mesh=mesh)
        results[reshard] = (reference, train(model, rank, session, device="cuda"), session.engine.name)
        session.remove()
    return results


@pytest.mark.cuda
def test_fsdp2_on_cuda_swap_and_recompute_bit_identical(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # inherited by the spawned rank
    result, = run_ranks(fsdp_on_cuda, 1, backend="nccl")
    moved = {}
    for reshard, (reference, swapped, engine) in result.items():
        assert engine == "cuda"
        for step, (ref, got) in enumerate(zip(reference, swapped)):
            where = f"reshard_after_forward={reshard}, step {step}"
            assert torch.equal(ref["loss"], got["loss"]), where
            for param, grad in ref["grads"].items():
                assert torch.equal(grad, got["grads"][param]), f"{where}: grad of {param}"
            stats = got["stats"]
            assert stats.offloaded_bytes > 0 and stats.recomputed_output_bytes > 0, where
            assert stats.skipped.get("parameter", 0) > 0, where  # gathered weights seen, and kept
        moved[reshard] = [got["stats"].offloaded_bytes for got in swapped]
    assert moved[True] == moved[False], moved  # resharding or not, the same activations move


def ddp_cases(rank: int, world_size: int) -> dict:
    """DDP with 2 micro-batches per step, the first under ``no_sync``: swapped vs plain."""
    results = {}
    for name, config in CONFIGS.items():
        runs = []
        for use_swap in (False, True):
            model = build()
            session = swapkit.apply(model, toy_config(4, **config), layers="layers") if use_swap else None
            ddp = DistributedDataParallel(model)
            runs.append(ddp_steps(ddp, rank, session))
        results[name] = runs
    return results


def ddp_steps(ddp: DistributedDataParallel, rank: int, session) -> list:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    out = []
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(2):
            batch = llama_batch(seed=100 * step + 10 * micro + rank, cfg=TINY)
            context = ddp.no_sync() if micro == 0 else contextlib.nullcontext()
            with context, (session if session is not None else contextlib.nullcontext()):
                llama_step(ddp, batch)
        grads = {n: p.grad.clone() for n, p in ddp.module.named_parameters()}
        out.append((grads, session.stats.offloaded_bytes if session is not None else 0))
        opt.step()
    return out


def test_ddp_no_sync_micro_batches_bit_identical():
    for rank_results in run_ranks(ddp_cases, 2):
        for name, (plain, swapped) in rank_results.items():
            for step, ((ref, _), (got, offloaded)) in enumerate(zip(plain, swapped)):
                assert offloaded > 0, (name, step)
                for param, grad in ref.items():
                    assert torch.equal(grad, got[param]), f"{name}, step {step}: grad of {param}"


def fsdp_accumulation_cases(rank: int, world_size: int) -> dict:
    """FSDP2 with 2 micro-batches per step, the first with ``set_requires_gradient_sync(False)`` (torchtitan's
    gradient accumulation): swapped vs plain, ``reshard_after_forward`` True and False."""
    results = {}
    for reshard in (True, False):
        for name, config in CONFIGS.items():
            runs = []
            for use_swap in (False, True):
                model = build()
                session = swapkit.apply(model, toy_config(4, **config), layers="layers") if use_swap else None
                runs.append(fsdp_accumulation_steps(shard(model, reshard), rank, session))
            results[(reshard, name)] = runs
    return results


def fsdp_accumulation_steps(model: torch.nn.Module, rank: int, session) -> list:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(2):
            model.set_requires_gradient_sync(micro == 1)
            with session if session is not None else contextlib.nullcontext():
                llama_step(model, llama_batch(seed=100 * step + 10 * micro + rank, cfg=TINY))
        out.append((local_grads(model), session.stats.offloaded_bytes if session is not None else 0))
        opt.step()
    return out


def test_fsdp2_gradient_accumulation_without_sync_bit_identical():
    for rank_results in run_ranks(fsdp_accumulation_cases, 2):
        for (reshard, name), (plain, swapped) in rank_results.items():
            for step, ((ref, _), (got, offloaded)) in enumerate(zip(plain, swapped)):
                assert offloaded > 0, (reshard, name, step)
                for param, grad in ref.items():
                    assert torch.equal(grad, got[param]), f"{name}, reshard {reshard}, step {step}: grad of {param}"


UNIFORM = {"recompute_config": {"recompute_granularity": "full", "recompute_method": "uniform",
                                "recompute_num_layers": 2}}


def uniform_unit_cases(rank: int, world_size: int) -> dict:
    """A Megatron uniform unit (layers 0-1, 2-3) under FSDP2 sharded per layer and per unit
    (swapkit.runtime.recompute Note [Uniform units under FSDP2])."""
    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for grouping in ("per_layer", "per_unit"):
        model = build()
        session = swapkit.apply(model, toy_config(4, **UNIFORM), layers="layers")
        groups = [[layer] for layer in model.layers] if grouping == "per_layer" else \
            [[model.layers[0], model.layers[1]], [model.layers[2], model.layers[3]]]
        for group in groups:
            fully_shard(group, mesh=mesh)
        fully_shard(model, mesh=mesh)
        try:
            with session:
                llama_step(model, llama_batch(seed=rank, cfg=TINY))
            out[grouping] = sorted(name for name, p in model.named_parameters() if p.grad is not None)
        except RuntimeError as err:
            out[grouping] = str(err)
    return out


def test_a_uniform_unit_sharded_per_layer_names_the_fsdp2_grouping_to_use():
    (result,) = run_ranks(uniform_unit_cases, 1)
    assert result["per_layer"].startswith("swapkit: uniform recompute unit layers 0-1: layer 1 is sharded by a "
                                          "fully_shard call of its own"), result["per_layer"]
    assert "fully_shard([layers[0], layers[1]])" in result["per_layer"]
    assert isinstance(result["per_unit"], list) and any(".layers.1." in n or n.startswith("layers.1.")
                                                        for n in result["per_unit"]), result["per_unit"]


def fail_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank one failed on purpose")
    return rank


def test_run_ranks_reports_the_failing_rank_with_its_traceback():
    with pytest.raises(RuntimeError, match=r"(?s)rank 1:.*ValueError: rank one failed on purpose"):
        run_ranks(fail_on_rank_one, 2, timeout_s=60)


def _environment_and_stderr(rank: int, world_size: int, name: str) -> str | None:
    os.write(2, f"rank {rank} wrote this\n".encode())
    return os.environ.get(name)


def test_ranks_take_the_environment_and_stderr_the_parent_has_at_each_start(tmp_path, monkeypatch):
    """swapkit.distributed.rank_start Note [Ranks forked from a preloaded server]: the fork server outlives a
    start, and ranks forked later still see the parent's environment and standard error of that start."""
    assert run_ranks(_environment_and_stderr, 2, "SWAPKIT_TEST_MARK") == [None, None]  # the server runs now
    monkeypatch.setenv("SWAPKIT_TEST_MARK", "set after the server started")
    saved = os.dup(2)
    with open(tmp_path / "stderr", "wb") as target:
        os.dup2(target.fileno(), 2)
        try:
            marks = run_ranks(_environment_and_stderr, 2, "SWAPKIT_TEST_MARK")
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    assert marks == ["set after the server started"] * 2
    lines = (tmp_path / "stderr").read_text().splitlines()
    assert sorted(line for line in lines if line.startswith("rank ")) == ["rank 0 wrote this", "rank 1 wrote this"]


def test_a_stream_closed_when_the_parent_started_is_devnull_in_its_ranks(tmp_path):
    """swapkit.distributed.rank_start Note [Ranks forked from a preloaded server]: with stderr closed (`2>&-`)
    descriptor 2 may name any file the parent opened since; the rank gets os.devnull, not that file."""
    out = tmp_path / "fds.txt"
    done = run_script(tmp_path / "closed_stderr.py",
                      "import multiprocessing, os, sys\n"
                      "from swapkit.distributed.rank_start import RankStart, start_method\n"
                      "def rank(start, out):\n"
                      "    start.take()\n"
                      "    open(out, 'w').write(os.readlink('/proc/self/fd/2') + '\\n' + os.readlink('/proc/self/fd/1'))\n"
                      "if __name__ == '__main__':\n"
                      "    assert sys.stderr is None\n"
                      "    reused = os.open(__file__, os.O_RDONLY)  # takes the free number 2\n"
                      "    ctx = multiprocessing.get_context(start_method('cpu', preload=()))\n"
                      "    process = ctx.Process(target=rank, args=(RankStart(), sys.argv[1]))\n"
                      "    process.start()\n"
                      "    process.join()\n"
                      "    sys.exit(process.exitcode)\n", str(out), close_stderr=True)
    assert done.returncode == 0
    stderr, stdout = out.read_text().splitlines()
    assert stderr == os.devnull and stdout.startswith("pipe:")
