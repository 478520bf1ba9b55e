"""The benchmark is shipped: its quick mode runs end to end and its checks hold."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.toys import bench_module, skip_without_cpp_toolchain

ROOT = Path(__file__).resolve().parent.parent


def test_quick_benchmark_writes_results_and_checks_hold(tmp_path):
    out = tmp_path / "bench"
    # one intra-op thread: tiny matrices run as fast, and the math has no split across threads that could
    # differ between the baseline's probe and a variant's. Two full-suite runs on the busy shared machine
    # saw a parity check below fail once each, cause not captured (its message now carries the re-probe);
    # eleven runs of this test alone, some beside busy processes, never did
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "swap_vs_recompute.py"), "--quick",
                             "--reps", "2", "--deterministic", "--threads", "1", "--out", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    for name in ("results.json", "results.md", "tradeoff.png", "prefetch_sweep.png"):
        assert (out / name).stat().st_size > 0, name
    data = json.loads((out / "results.json").read_text())
    assert {"torch", "cpu_count"} <= set(data["env"])
    # --deterministic (Note [Deterministic kernels for the checks]) is recorded, with the cuBLAS setting used
    assert data["env"]["deterministic"] is True
    assert data["env"]["cublas_workspace_config"] == os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    assert "deterministic kernels" in (out / "results.md").read_text()
    assert "**Run:** 1 warm-up step then 2 interleaved repetitions per variant" in (out / "results.md").read_text()
    variants = {v["name"]: v for v in data["variants"]}
    for key in ("time_ratio", "step_time_median_s", "peak_device_bytes", "memory_ratio", "moved_bytes",
                "late_fetches", "wait_seconds"):
        assert all(key in v for v in variants.values()), key
    swapkit_rows = [v for v in variants.values() if v["checks"]]
    assert len(swapkit_rows) >= 8
    for row in swapkit_rows:
        checks = row["checks"]
        # on a mismatch the message carries the baseline's re-probe (did it match itself?) and the warnings
        assert checks["loss_equal"] and checks["grads_equal"], (row["name"], checks, data["warnings"])
        assert checks["parameter_bytes_moved"] == 0 and checks["moved_twice"] == 0, row["name"]
        assert checks["offload_copies"] == checks["stats_offloaded_tensors"], row["name"]  # Note [Move check]
    layer, saved = variants["swap layer (every layer)"], variants["session, nothing configured"]["peak_device_bytes"]
    assert layer["moved_bytes"] > 0.5 * saved  # copied to host whatever the copy thread's speed
    assert layer["checks"]["offload_copies"] > 0  # the move check saw the batches' copies
    loaded = any("the machine was loaded" in w for w in data["warnings"])
    if not loaded:  # the thread engine releases a storage only once its copy finished: timing-dependent
        assert layer["memory_ratio"] < 0.5  # (swapkit.runtime.swap_schedule Note [Releases never stall compute])
    assert variants["recompute select silu+mul (MindFormers)"]["memory_ratio"] < 1.0
    assert data["sweep"] and data["microbench"]
    assert isinstance(data["warnings"], list) and data["env"]["wall_seconds"] > 0
    markdown = (out / "results.md").read_text()
    assert all(f"> **WARNING:** {w}" in markdown for w in data["warnings"])  # the report is marked


def test_microbench_takes_the_swap_way_apart_and_leaves_the_collector_on():
    """Ways (g) and (h) (Note [Taking the swap way apart] in benchmarks/microbench.py) run beside (d) in
    the same repetitions; (g) turns the collector off for its steps only, and (h)'s copies run without
    the copy thread, yet still move storages."""
    import gc

    microbench = bench_module("microbench")
    ways = tuple(w for w in microbench.WAYS if w not in microbench.NATIVE_WAYS)  # theirs need a compiler: below
    assert gc.isenabled()
    micro = microbench.run(torch.device("cpu"), length=60, reps=1, ways=ways)
    assert gc.isenabled()
    assert set(ways) - {"none"} == set(micro["cpu_us_per_saved_tensor"])
    assert micro["swap_inline_copy_jobs"] > 0 and micro["swap_copy_jobs"] > 0
    assert micro["collector_us_per_saved_tensor"]["swap_no_gc"] == 0  # no collection while it was off
    assert set(micro["full_collections"]) == set(ways)  # Note [The collector's clock]
    # (d)'s and (e)'s batches are small enough to run on the saving thread (swapkit.engine.thread Note [Small
    # copies run on the caller]) and none is ever queued behind another: no copy thread; (o) hands all over
    assert micro["swap_inline_copy_thread"] is False and micro["swap_copy_thread"] is False
    assert micro["swap_per_tensor_copy_thread"] is False
    if "swap_session_native_thread" in micro["cpu_us_per_saved_tensor"]:  # built: a C++ compiler is here
        assert micro["swap_session_native_thread_copy_thread"] is True
        # not equal counts: a batch of (o) whose copy was unfinished at its records' horizons is never prefetched
        assert micro["swap_session_native_thread_copy_jobs"] > 0 and micro["swap_session_native_copy_jobs"] > 0
    assert "(h) as (d), copies inline" in "\n".join(microbench.report_lines({"microbench": micro, "env": {
        "date": "-", "torch": "-", "cpu_count": 2, "torch_threads": 2, "device": "cpu"}}))


def test_microbench_isolated_runs_each_way_in_a_process_of_its_own(tmp_path):
    """--isolated N (Note [Each way alone]): every chosen way runs N times, each time in a new process with
    only (a) and (b) beside it, and the report puts its ratios next to the paired run's. One way: each
    process imports torch (3-5 s on a 2-core VM), and the rotation of several is run_isolated's loop."""
    out = tmp_path / "overhead"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "microbench.py"), "--length", "20", "--reps",
                             "1", "--ways", "keep", "--isolated", "2", "--out", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    isolated = json.loads((out / "overhead.json").read_text())["isolated"]
    assert set(isolated) == {"keep"}  # (a) and (b) run in every process, never alone
    for one in isolated.values():
        assert len(one["cpu_over_identity"]) == 2 and one["range"][0] <= one["median"] <= one["range"][1]
    report = (out / "overhead.md").read_text()
    assert "| (c) swapkit session, keep all | " in report.split("Each way alone")[-1]


def test_microbench_isolated_rounds_rotate_the_ways_and_keep_each_ways_ratios(tmp_path, monkeypatch):
    """run_isolated's loop without the processes: each round starts one process per way, the order rotated
    by one way per round, and each way gets the ratios of its own processes."""
    microbench = bench_module("microbench")
    order = []

    def fake_run(command, **kwargs):
        way, out = command[command.index("--ways") + 1], Path(command[command.index("--out") + 1])
        order.append(way)
        out.mkdir(parents=True)
        ratio = {"keep": 3.0, "floor": 1.25}[way] + len(order) / 100
        (out / "overhead.json").write_text(json.dumps({"microbench": {"cpu_over_identity": {way: ratio}}}))

    monkeypatch.setattr(microbench.subprocess, "run", fake_run)
    isolated = microbench.run_isolated("cpu", 20, 1, 3, ("none", "identity", "keep", "floor"), tmp_path)
    assert order == ["keep", "floor", "floor", "keep", "keep", "floor"]
    assert isolated["keep"] == {"cpu_over_identity": [3.01, 3.04, 3.05], "median": 3.04, "range": [3.01, 3.05]}
    assert isolated["floor"]["cpu_over_identity"] == [1.27, 1.28, 1.31]


def assert_a_safe_keep(hooks) -> None:
    """Hooks that keep safely hand back the same values and still catch an in-place write to a saved
    tensor (which autograd stops checking once hooks are installed)."""
    x = torch.randn(8, requires_grad=True)
    with hooks():
        y = x.exp()  # saves its output
    y.sum().backward()
    assert torch.equal(x.grad, x.detach().exp())
    with hooks():
        y = x.exp()
    with torch.no_grad():
        y.add_(1)
    with pytest.raises(RuntimeError, match="modified in place"):
        y.sum().backward()


def test_microbench_floor_is_a_safe_keep():
    """Way (f) is the floor of any *safe* keep."""
    assert_a_safe_keep(bench_module("microbench")._floor_hooks)


def test_microbench_keep_calls_is_a_safe_keep_with_one_record_per_storage():
    """Way (i) stands for what a keep must do (Note [What a save path in C would still pay]): it catches an
    in-place write, and the saves of one storage (x and its view) share one record, as a session's do."""
    microbench = bench_module("microbench")
    x = torch.randn(8, requires_grad=True)
    with microbench._keep_calls_hooks():
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        h = x * 2
        packed = [hooks[0](h), hooks[0](h[2:]), hooks[0](torch.ones(3))]
        y = h.exp()
    assert packed[0][2] is packed[1][2] and packed[0][2] is not packed[2][2]
    assert packed[0][2][0] == 32 and packed[2][2][0] == 12  # the storage's bytes
    y.sum().backward()
    assert torch.equal(x.grad, 2 * (2 * x.detach()).exp())
    assert_a_safe_keep(microbench._keep_calls_hooks)


def _native_save():
    """The module of ways (k) and (l); a skip only where this machine has no C++ compiler (a failed build fails
    the test)."""
    skip_without_cpp_toolchain("ways (k) and (l)")
    return bench_module("microbench").native_save()


def test_microbench_keep_native_is_a_safe_keep_with_one_record_per_storage():
    """Way (k) stands for a keep written as a torch extension (Note [What a save path in C++ pays]): the saves of
    one storage (x and its views) share one record, whose bytes are held until its last handle ends; it catches
    an in-place write, and a record written in place is replaced, not reused."""
    native = _native_save()
    pack, unpack, counters = native.make_hooks()
    h = torch.randn(8) * 2
    handles = [pack(h), pack(h[2:]), pack(torch.ones(3)), pack(h.view(2, 4))]
    assert counters() == {"saves": 4, "bytes": 32 + 12, "peak": 44, "records": 2, "indexed": 2}
    assert torch.equal(unpack(handles[1]), h[2:]) and torch.equal(unpack(handles[3]), h.view(2, 4))
    del handles[2]  # the ones' last handle: its record ends
    assert counters()["bytes"] == 32 and counters()["indexed"] == 1
    h.add_(1)
    with pytest.raises(RuntimeError, match="modified in place"):
        unpack(handles[0])
    handles.append(pack(h))  # a new record for the written storage; the old one lives while its handles do
    assert counters() == {"saves": 5, "bytes": 64, "peak": 64, "records": 3, "indexed": 1}
    handles.clear()
    assert counters()["bytes"] == 0 and counters()["indexed"] == 0
    with pytest.raises(TypeError, match="not a handle"):
        unpack((h, 0))
    hooks = bench_module("microbench")._keep_native_hooks(native)
    assert_a_safe_keep(hooks)
    x = torch.randn(8, requires_grad=True)
    with hooks():
        y = (x * 2).sin().exp()
    y.sum().backward()
    assert torch.equal(x.grad, (2 * x.detach()).sin().exp() * (2 * x.detach()).cos() * 2)


def test_microbench_swap_native_moves_each_storage_once_and_restores_it_exactly():
    """Way (l) is way (j) in C++ (Note [What a save path in C++ pays]): the saves of one storage share a record;
    a full batch is copied to host at once and its keepers let go of the storages; unpack rebuilds each view
    (mixed dtypes, aligned slots, conj and neg bits) from the host copy, catches an in-place write, and
    backward's gradients are bit-identical to those of the model without hooks."""
    microbench, native = bench_module("microbench"), _native_save()
    pack, unpack, counters = native.make_swap_hooks()
    h = torch.randn(8) * 2
    kept = [torch.full((3,), float(i), dtype=torch.float16 if i == 0 else torch.float32)  # 6 bytes, then 12s
            for i in range(5)] + [torch._neg_view(torch.randn(3)), torch.randn(3, dtype=torch.complex64).conj()]
    uses = [_storage_uses(t) for t in [h, *kept]]  # before any save holds them
    whole, view = pack(h), pack(h[2:])
    assert counters() == {"saves": 2, "copies": 0, "records": 1, "indexed": 1, "open": 1}
    others = [pack(t) for t in kept[:-1]]
    assert _storage_uses(kept[0]) > uses[1]  # held by the open batch and its keeper
    others.append(pack(kept[-1]))
    assert counters() == {"saves": 9, "copies": 1, "records": 8, "indexed": 8, "open": 0}
    assert [_storage_uses(t) for t in [h, *kept]] == uses  # copied: the batch and the keepers let go
    again = pack(h)  # saved again after its batch was copied: an empty keeper at once
    assert counters()["records"] == 8 and _storage_uses(h) == uses[0]
    assert torch.equal(unpack(view), h[2:]) and torch.equal(unpack(again), h)
    assert all(torch.equal(unpack(handle), t) for handle, t in zip(others, kept))
    assert unpack(others[-1]).is_conj() and unpack(others[-2]).is_neg()
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(RuntimeError, match="modified in place"):
        unpack(whole)
    with pytest.raises(TypeError, match="not a handle"):
        unpack((h, 0))
    del whole, view, again, others
    assert counters()["indexed"] == 0

    def chain(leaf):
        y = leaf * 2
        for _ in range(24):
            y = torch.sin(y) * y[0]
        return y.exp().sum()

    x = torch.randn(8, requires_grad=True)
    expected = x.detach().clone().requires_grad_()
    chain(expected).backward()
    with microbench._swap_native_hooks(native)():
        loss = chain(x)
    loss.backward()
    assert torch.equal(x.grad, expected.grad)


def _written_after_its_copy(hooks) -> tuple[torch.Tensor, torch.Tensor]:
    """A storage saved, copied with its batch, written in place, then saved again: the second save must see
    the new values (swapkit's step takes it for a new storage), not restore the copy of the old ones."""
    leaf = torch.arange(1.0, 5.0, requires_grad=True)
    with hooks():
        saved = (leaf * 1).exp()  # saves its output
        fillers = [(leaf * (i + 2)).sin() for i in range(8)]  # fill the batch: it is copied
        with torch.no_grad():
            saved.detach().mul_(2)  # the same storage, written in place after its copy
        (saved.detach() * leaf).sum().backward()
    return leaf.grad, saved.detach()


@pytest.mark.parametrize("way", ["swap_calls", "swap_native"])
def test_microbench_swap_ways_take_a_storage_written_since_its_copy_for_a_new_one(way):
    microbench = bench_module("microbench")
    hooks = microbench._swap_calls_hooks if way == "swap_calls" else microbench._swap_native_hooks(_native_save())
    grad, values = _written_after_its_copy(hooks)
    assert torch.equal(grad, values)  # d(sum(values * leaf))/d leaf: the written values, not the copied ones


def _storage_uses(tensor: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def test_microbench_leaves_out_the_native_ways_saying_why_when_they_cannot_build(monkeypatch, capsys):
    microbench = bench_module("microbench")

    def no_compiler():
        raise RuntimeError("Error building extension 'swapkit_bench_native_save'\nc++: command not found")

    monkeypatch.setattr(microbench, "native_save", no_compiler)
    result = microbench.run(torch.device("cpu"), 20, 1, ways=("keep", "keep_native", "swap_native"))
    assert set(result["cpu_over_identity"]) == {"identity", "keep"}
    assert ("microbench: ways keep_native, swap_native left out: their C++ build failed: c++: command not found"
            in capsys.readouterr().err)


def test_microbench_swap_calls_moves_each_storage_once_and_restores_it_exactly():
    """Way (j) stands for what a coalesced swap must do (Note [What a swap in C would still pay]): the saves of
    one storage share a record; a full batch is copied to host in one job and its keepers let go of the
    storages; unpack rebuilds each view from the host copy, catches an in-place write, and backward's
    gradients are bit-identical to those of the model without hooks."""
    microbench = bench_module("microbench")
    x = torch.randn(8, requires_grad=True)
    with microbench._swap_calls_hooks():
        pack, unpack = torch._C._autograd._top_saved_tensors_default_hooks(False)
        h = x * 2
        whole, view = pack(h), pack(h[2:])
        assert whole[2] is view[2] and whole[2][0][3] is None  # one record; its batch is still open
        kept = [torch.full((3,), float(i), dtype=torch.float16 if i == 0 else torch.float32)  # 6 bytes, then 12s
                for i in range(microbench.SWAP_CALLS_BATCH - 1)]
        others = [pack(t) for t in kept]
        assert whole[2][0][3] is not None and whole[2][0][3].numel() == 32 + 16 * len(others)  # copied, one region
        assert all(handle[0].untyped_storage().nbytes() == 0 for handle in [whole, view, *others])  # let go
        assert torch.equal(unpack(view), h[2:])
        assert all(torch.equal(unpack(handle), t) for handle, t in zip(others, kept))  # slots aligned, mixed dtypes
        with torch.no_grad():
            h.add_(1)
        with pytest.raises(RuntimeError, match="modified in place"):
            unpack(whole)

    def chain(leaf):
        y = leaf * 2
        for _ in range(3 * microbench.SWAP_CALLS_BATCH):
            y = torch.sin(y) * y[0]
        return y.exp().sum()

    expected = x.detach().clone().requires_grad_()
    chain(expected).backward()
    with microbench._swap_calls_hooks():
        loss = chain(x)
    loss.backward()
    assert torch.equal(x.grad, expected.grad)


def test_default_output_is_not_the_committed_results():
    args = bench_module("swap_vs_recompute").parse_args([])
    assert args.out == Path("bench-out")  # git-ignored; benchmarks/results/ only with an explicit --out
    assert "bench-out/" in (ROOT / ".gitignore").read_text().splitlines()
    # pipeline.py --quick used to overwrite the committed benchmarks/results/pipeline.{json,md}
    assert bench_module("pipeline").parse_args([]).out == Path("bench-out/pipeline")


BAD_ARGUMENTS = [  # each was a traceback after minutes of work (ZeroDivisionError, StatisticsError, ...) or ran anyway
    ("swap_vs_recompute", "parse_args", ["--link-fraction", "0"], "--link-fraction: got '0'; expected a number > 0"),
    ("swap_vs_recompute", "parse_args", ["--reps", "-1"], "--reps: got '-1'; expected a whole number >= 1"),
    ("swap_vs_recompute", "parse_args", ["--prefetch", "0"], "--prefetch: got '0'; expected a whole number >= 1"),
    ("swap_vs_recompute", "parse_args", ["--threads", "0"], "--threads: got '0'; expected a whole number >= 1"),
    ("host_pool", "main", ["--steps", "0"], "--steps: got '0'"),
    ("microbench", "main", ["--reps", "0"], "--reps: got '0'"),
    ("pipeline", "parse_args", ["--reps", "0"], "--reps: got '0'"),
    ("planner_frontier", "main", ["--threads", "0"], "--threads: got '0'"),
    ("memory_cap", "parse_args", ["--prefetch", "0"], "--prefetch: got '0'"),
    ("memory_cap", "parse_args", ["--warmup", "-1"], "--warmup: got -1; expected an integer >= 0"),  # 0 is allowed
    ("memory_cap", "parse_args", ["--steps", "0"], "--steps: got 0; expected a positive integer"),
    ("swap_vs_recompute", "main", ["--config", "missing.yaml"], "--config: invalid swapkit config"),
    ("host_pool", "main", ["--config", "missing.yaml"], "config file not found: missing.yaml"),
]


@pytest.fixture(autouse=True)
def swapkit_log_level():
    """A benchmark's main() quiets the swapkit logger for its run; later tests need it back. Used by every test
    here: one that called microbench.main without it left the logger at ERROR, and a later file's caplog of
    swapkit's warnings (tests/test_checkpoint_safety.py) saw none."""
    logger = logging.getLogger("swapkit")
    level = logger.level
    yield
    logger.setLevel(level)


@pytest.mark.parametrize("script, entry, argv, message", BAD_ARGUMENTS)
def test_bad_benchmark_arguments_are_usage_errors(capsys, swapkit_log_level, script, entry, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        getattr(bench_module(script), entry)(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
@pytest.mark.parametrize("script", ["microbench", "host_pool", "swap_vs_recompute"])
def test_device_cuda_without_cuda_is_a_usage_error(tmp_path, capsys, swapkit_log_level, script):
    assert bench_module(script).main(["--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "--device cuda: CUDA is not available" in capsys.readouterr().err


@pytest.mark.parametrize("script, entry", [("swap_vs_recompute", "parse_args"), ("planner_stages", "main"),
                                           ("microbench", "main")])
def test_an_output_folder_under_a_file_is_a_usage_error(tmp_path, capsys, script, entry):
    blocker = tmp_path / "results.md"
    blocker.write_text("a file")
    with pytest.raises(SystemExit) as exit_info:
        getattr(bench_module(script), entry)(["--out", str(blocker / "out")])
    assert exit_info.value.code == 2 and f"{blocker} is a file, not a folder" in capsys.readouterr().err


def test_loaded_machine_and_impossible_speedups_mark_the_report():
    report = bench_module("report")
    env = {"cpu_count": 2, "load_average_at_start": (3.5, 2.0, 1.0), "load_average_at_end": (1.0, 1.0, 1.0)}
    rows = [{"name": "baseline (no swapkit)", "time_ratio": 1.0}, {"name": "session, nothing configured",
                                                                   "time_ratio": 0.97},
            {"name": "recompute full", "time_ratio": 0.98}, {"name": "swap layer (every layer)", "time_ratio": 1.2}]
    warnings = report.hygiene_warnings(env, rows)
    assert warnings == [
        "the machine was loaded (load average up to 3.50 on 2 cores): other processes shared the cores, so step "
        "times are noisy; rerun on an idle machine",
        "recompute full measured faster than the baseline (time ratio 0.980) although it adds work (copies or "
        "recompute): noise dominates; more --reps or an idle machine"]
    quiet = {**env, "load_average_at_start": (1.0, 1.0, 1.0)}
    assert report.hygiene_warnings(quiet, rows[:2] + rows[3:]) == []


def test_a_one_thread_baseline_kept_off_its_core_marks_the_report_loaded():
    """Note [Contention the load average misses] in benchmarks/report.py"""
    report = bench_module("report")
    env = {"cpu_count": 2, "torch_threads": 1, "device": "cpu", "load_average_at_start": (1.0, 1.0, 1.0),
           "load_average_at_end": (1.2, 1.0, 1.0)}
    base = {"name": "baseline (no swapkit)", "time_ratio": 1.0, "step_time_median_s": 0.0169,
            "main_thread_cpu_median_s": 0.0101}
    warnings = report.hygiene_warnings(env, [base])
    assert len(warnings) == 1 and warnings[0].startswith("the machine was loaded: the baseline's one-thread steps "
                                                         "ran on a core only 60% of their wall time")
    assert report.hygiene_warnings(env, [{**base, "main_thread_cpu_median_s": 0.0165}]) == []
    assert report.hygiene_warnings({**env, "torch_threads": 2}, [base]) == []  # its pool threads share the work


def test_a_sweep_link_sized_from_a_forward_longer_than_the_step_marks_the_report():
    """Note [A link calibrated under contention] in benchmarks/report.py"""
    report = bench_module("report")
    env = {"cpu_count": 2, "torch_threads": 2, "load_average_at_start": (1.5, 1.0, 1.0),
           "load_average_at_end": (1.9, 1.0, 1.0)}
    base = {"name": "baseline (no swapkit)", "time_ratio": 1.0, "step_time_median_s": 0.0196}
    warnings = report.hygiene_warnings(env, [base], {"model_forward_s": 0.1137, "layer_forward_s": 0.0569})
    assert warnings == ["the prefetch sweep's link was sized from a forward of 113.7 ms, longer than the baseline's "
                        "whole training step (19.6 ms): the machine was contended while it was measured, so the "
                        "sweep's link is too slow and its rows are not comparable; rerun on an idle machine"]
    assert report.hygiene_warnings(env, [base], {"model_forward_s": 0.0077}) == []
    assert report.hygiene_warnings(env, [base], {"runtime": {}}) == []  # CUDA: the real link, nothing timed


def test_quick_pipeline_benchmark_has_a_row_per_schedule_variant_and_stage(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pipeline.py"), "--quick", "--reps", "1",
                             "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads((tmp_path / "pipeline.json").read_text())
    assert (tmp_path / "pipeline.md").stat().st_size > 0
    rows = {(r["schedule"], r["variant"], r["stage"]): r for r in data["rows"]}
    assert set(rows) == {(s, v, st) for s in ("gpipe", "1f1b") for v in ("keep", "swap", "recompute") for st in (0, 1)}
    for (schedule, variant, stage), row in rows.items():
        assert row["micro_steps"] == 4
        if variant == "keep":
            assert row["memory_ratio"] == 1.0 and row["moved_bytes"] == 0
        if variant == "swap":
            assert row["grads_equal"] and row["moved_bytes"] > 0
        if variant == "recompute":
            assert row["grads_close"] and row["memory_ratio"] < 0.5


def test_planner_frontier_quick_run_writes_results(tmp_path):
    out = tmp_path / "planner"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "planner_frontier.py"), "--quick", "--reps",
                             "1", "--links", "free", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "has no effect" not in result.stderr, result.stderr[-2000:]  # about its own variants, not the user's
    assert "1 interleaved timed step after 1 warm-up step per variant" in (out / "results.md").read_text()
    for name in ("results.json", "results.md", "planner_tradeoff.png"):
        assert (out / name).stat().st_size > 0, name
    data = json.loads((out / "results.json").read_text())
    assert [link["link"] for link in data["links"]] == ["free"]
    for link in data["links"]:
        for plan in link["plans"].values():
            assert "error" in plan or plan["measured"]["peak_device_bytes"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown when CUDA is missing")
def test_memory_cap_without_cuda_exits_2_with_a_clear_message(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "memory_cap.py"), "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "needs a CUDA device" in result.stderr and "Traceback" not in result.stderr


def test_memory_cap_report_names_what_ran_out_of_memory_and_where():
    memory_cap = bench_module("memory_cap")
    fit = {"times": [0.2, 0.22, 0.21], "oom_at_step": None, "alloc_retries": 3,
           "peak_reserved_bytes": 3 << 30, "peak_allocated_bytes": 2 << 30}
    oom = {"times": [], "oom_at_step": 2, "alloc_retries": 1, "peak_reserved_bytes": 4 << 30,
           "peak_allocated_bytes": 4 << 30}
    rows = [memory_cap.summarize("swap", [fit, fit], 0.2), memory_cap.summarize("plain", [oom, fit], 0.2)]
    assert rows[0]["fits"] and rows[0]["time_ratio"] == pytest.approx(1.05)
    assert rows[0]["alloc_retries_per_round"] == [3, 3]
    assert not rows[1]["fits"] and rows[1]["oom_at_steps"] == [2] and rows[1]["time_ratio"] is None
    env = {"cpu": "cpu", "cpu_count": 2, "torch_threads": 2, "ram_bytes": 1 << 30, "torch": "2", "python": "3",
           "swapkit": "0", "device": "cuda", "engine": "cuda", "date": "today",
           "pytorch_cuda_alloc_conf": "expandable_segments:True"}
    results = {"env": env, "variants": rows, "run": {"rounds": 2, "warmup": 1, "steps": 3, "prefetch": 8},
               "cap": {"fraction": 0.6, "need_bytes": 6 << 30, "cap_bytes": 4 << 30, "process_fraction": 0.05,
                       "baseline_uncapped_s": 0.2}}
    text = "\n".join(memory_cap.report_lines(results))
    assert "| swap | yes | 210.0 | 1.050 | 3072 | 2048 | [3, 3] |" in text
    assert "| plain | no: out of memory at step 2 | — | — | 4096 | 4096 | [1, 3] |" in text
    assert "expandable_segments:True" in text
    assert "Nothing fit" not in text  # one variant fit


def test_memory_cap_defaults_to_the_gpu_config_and_says_when_nothing_fit():
    """Note [A model whose activations are a small part of its memory]: on the CPU benchmarks' default
    model every row of an H100 run read "out of memory at step 0", and the run exited 0."""
    memory_cap = bench_module("memory_cap")
    assert Path(memory_cap.parse_args([]).config) == ROOT / "benchmarks" / "configs" / "gpu.yaml"
    oom = {"times": [], "oom_at_step": 0, "alloc_retries": 1, "peak_reserved_bytes": 108 << 20,
           "peak_allocated_bytes": 71 << 20}
    rows = [memory_cap.summarize(name, [oom], 0.012) for name in ("plain", "swap", "recompute")]
    env = {"cpu": "cpu", "cpu_count": 16, "torch_threads": 16, "ram_bytes": 1 << 30, "torch": "2", "python": "3",
           "swapkit": "0", "device": "cuda", "engine": "cuda", "date": "today"}
    results = {"env": env, "variants": rows, "run": {"rounds": 1, "warmup": 1, "steps": 3, "prefetch": 8},
               "cap": {"fraction": 0.6, "need_bytes": 182 << 20, "cap_bytes": 109 << 20, "process_fraction": 0.0013,
                       "baseline_uncapped_s": 0.012}}
    text = "\n".join(memory_cap.report_lines(results))
    assert "Nothing fit under the cap** (109 MiB, 0.6 of 182 MiB)" in text
    assert "Raise --cap" in text and "benchmarks/configs/gpu.yaml" in text


@pytest.mark.cuda
def test_memory_cap_runs_on_a_gpu(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "memory_cap.py"), "--config",
                             str(ROOT / "configs" / "tiny.yaml"), "--cap", "1", "--warmup", "1", "--steps", "1",
                             "--rounds", "1", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads((tmp_path / "memory_cap.json").read_text())
    assert len(data["variants"]) == 5 and data["cap"]["need_bytes"] > 0
    assert (tmp_path / "memory_cap.md").stat().st_size > 0


def test_host_pool_records_the_load_average_before_and_after_measuring(tmp_path, monkeypatch, swapkit_log_level):
    """It read the load average once, after measuring, and reported it as 'at start' ('at end: —')."""
    host_pool = bench_module("host_pool")
    clock = iter(range(1, 100))
    monkeypatch.setattr(os, "getloadavg", lambda: (float(next(clock)),) * 3)
    measured_at = []
    compare = host_pool.compare
    monkeypatch.setattr(host_pool, "compare", lambda *a: measured_at.append(os.getloadavg()[0]) or compare(*a))
    assert host_pool.main(["--quick", "--steps", "1", "--out", str(tmp_path)]) == 0
    env = json.loads((tmp_path / "host_pool.json").read_text())["env"]
    assert env["load_average_at_start"][0] < min(measured_at) <= max(measured_at) < env["load_average_at_end"][0]
    assert "at end —" not in (tmp_path / "host_pool.md").read_text()


def test_planner_frontier_reports_the_load_average_as_the_other_benchmarks_do():
    """It printed the raw tuples: 'load average at start (2.25634765625, 1.884765625, 1.4521484375)'."""
    env = {"cpu": "cpu", "cpu_count": 2, "torch_threads": 1, "torch": "2.x", "model": {}, "batch": 2, "reps": 1,
           "warmup": 1, "load_start": (0.25634765625, 1.884765625, 1.4521484375), "load_end": (0.5, 0.5, 0.5)}
    text = bench_module("planner_frontier").markdown({"env": env, "links": []})
    assert "load average (1/5/15 min) at start 0.26/1.88/1.45, at end 0.50/0.50/0.50;" in text


@pytest.mark.parametrize("fraction, verdict", [(0.5, "this is a favourable but not free link"),
                                               (1.0, "this link is about as slow as that"),
                                               (4.0, "this link is slower than that")])
def test_the_sweep_describes_the_link_the_fraction_gives(fraction, verdict):
    """--link-fraction 1 or 4 was still called 'a favourable but not free link' (the default 0.5's words)."""
    assert bench_module("sweep").link_verdict(fraction) == verdict


def test_planner_stages_quick_run_writes_a_row_per_stage_without_warnings_about_its_own_configs(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "planner_stages.py"), "--quick", "--out",
                             str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "has no effect" not in result.stderr and "moved nothing" not in result.stderr, result.stderr[-2000:]
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["env"]["quick"] is True
    assert [(row["schedule"], row["stage"]) for row in data["rows"]] == [("1f1b", 0), ("1f1b", 1)]
    for row in data["rows"]:
        assert 0 < row["measured_bytes"] and 0 < row["predicted_bytes"] <= row["baseline_bytes"]
    assert (tmp_path / "results.md").read_text().count("| 1f1b |") == 2


def test_planner_stages_trains_a_recompute_only_plan_without_its_idle_runtime_settings():
    """Its ranks warned 'runtime.min_offload_bytes: 0 has no effect' about the benchmark's own setting."""
    from swapkit.load import load_config
    from swapkit.plan.emit import planned_config
    from swapkit.plan.plan import build_plan
    from swapkit.plan.planner import KEEP, RECOMPUTE, Choice

    stages = bench_module("planner_stages")
    raw = stages.stage_config("1f1b", stages.QUICK)
    recompute_only = planned_config(raw, (RECOMPUTE, KEEP, RECOMPUTE, KEEP))
    assert build_plan(load_config(recompute_only)).warnings  # as planned: swap: true with empty lists
    assert build_plan(load_config(stages.trained_config(recompute_only))).warnings == ()
    swapping = planned_config(raw, (Choice("swap", ("",), 1), KEEP, KEEP, KEEP))
    assert stages.trained_config(swapping)["runtime"] == {"min_offload_bytes": 0}


def test_load_warning_names_the_highest_load_read_above_the_core_count():
    """Note [Loaded machines] in benchmarks/common.py"""
    common = bench_module("common")
    assert common.load_warning(2, (1.0, 2.0, 1.5), None) == []  # at the core count is not loaded
    assert common.load_warning(2, (1.0, 1.0, 1.0), (0.5, 4.48, 3.0)) == [
        "the machine was loaded (load average up to 4.48 on 2 cores): other processes shared the cores, so step "
        "times are noisy; rerun on an idle machine"]
    assert common.warning_lines([]) == [] and common.warning_lines(["x"]) == ["> **WARNING:** x", ""]


def test_host_pool_marks_a_run_on_a_loaded_machine(tmp_path, monkeypatch, capsys, swapkit_log_level):
    """Its committed result was measured at load 4.48 on 2 cores with no mark; its µs column is a timing."""
    host_pool = bench_module("host_pool")
    monkeypatch.setattr(os, "getloadavg", lambda: (float(os.cpu_count() + 1),) * 3)
    assert host_pool.main(["--quick", "--steps", "1", "--out", str(tmp_path)]) == 0
    warnings = json.loads((tmp_path / "host_pool.json").read_text())["warnings"]
    assert len(warnings) == 1 and warnings[0].startswith("the machine was loaded")
    assert (tmp_path / "host_pool.md").read_text().count(f"> **WARNING:** {warnings[0]}") == 1
    assert f"WARNING: {warnings[0]}" in capsys.readouterr().err


def test_pipeline_report_records_the_load_and_marks_a_loaded_machine():
    """It recorded no load average at all, though it reports step times and time ratios."""
    pipeline = bench_module("pipeline")
    env = {"world_size": 2, "torch": "t", "platform": "p", "cpu_count": 2, "load_average_at_start": (3.0, 1.0, 1.0),
           "load_average_at_end": (1.0, 1.0, 1.0)}
    assert pipeline.markdown([], env).startswith("> **WARNING:** the machine was loaded (load average up to 3.00")
    quiet = {**env, "load_average_at_start": (1.0, 1.0, 1.0)}
    assert "WARNING" not in pipeline.markdown([], quiet)


def test_microbench_marks_a_run_on_a_loaded_machine(tmp_path, monkeypatch, capsys):
    """It recorded the load average but never warned."""
    microbench = bench_module("microbench")
    monkeypatch.setattr(os, "getloadavg", lambda: (float(os.cpu_count() + 1),) * 3)
    assert microbench.main(["--length", "20", "--reps", "1", "--ways", "keep", "--out", str(tmp_path)]) == 0
    warnings = json.loads((tmp_path / "overhead.json").read_text())["warnings"]
    assert len(warnings) == 1 and warnings[0].startswith("the machine was loaded")
    assert (tmp_path / "overhead.md").read_text().startswith(f"> **WARNING:** {warnings[0]}")
    assert f"WARNING: {warnings[0]}" in capsys.readouterr().err


def test_the_time_ratio_is_the_median_of_same_repetition_ratios_not_a_ratio_of_medians():
    """Note [Pairwise ratios] in benchmarks/measure.py, on numbers where the two differ."""
    from types import SimpleNamespace as NS
    measure = bench_module("measure")
    baseline = NS(samples=[NS(seconds=s) for s in (1.0, 2.0, 4.0)])
    variant = NS(samples=[NS(seconds=s) for s in (2.0, 2.2, 8.0)])  # per repetition 2.0, 1.1, 2.0
    assert measure.pairwise_ratio(variant, baseline) == pytest.approx(2.0)  # the ratio of medians: 2.2 / 2.0


def test_pipeline_time_ratio_pairs_each_repetition_with_keeps():
    """It divided the two medians; the other benchmarks take the median of same-repetition ratios."""
    from types import SimpleNamespace as NS
    pipeline = bench_module("pipeline")
    stats = NS(peak_device_bytes=1, offloaded_bytes=0, prefetched_bytes=0, late_fetches=0, micro_steps=4)
    keep = NS(session=NS(stats=stats), grads=lambda: [], name="keep", times=[1.0, 2.0, 4.0])
    swap = NS(session=NS(stats=stats), grads=lambda: [], name="swap", times=[2.0, 2.2, 8.0])  # 2.0, 1.1, 2.0
    assert pipeline.row(0, "1f1b", swap, keep)["time_ratio"] == pytest.approx(2.0)  # medians: 2.2 / 2.0


def test_planned_vs_fastest_pairs_the_interleaved_steps():
    """It divided the two medians although both ran in the same interleaved rounds."""
    frontier = bench_module("planner_frontier")
    planned = {"step_seconds": 2.2, "step_times_s": [2.0, 2.2, 8.0], "peak_device_bytes": 1}
    fixed = {"step_seconds": 2.0, "step_times_s": [1.0, 2.0, 4.0], "peak_device_bytes": 1}  # same-round 2.0, 1.1, 2.0
    plan = {"label": "planned 0.5", "budget": 10, "predicted": {"peak_device_bytes": 1, "step_seconds": 1.0}}
    row = frontier._compare(plan, {"planned 0.5": planned, "swap layer": fixed})
    assert row["fastest_fixed"] == "swap layer" and row["planned_vs_fastest"] == pytest.approx(2.0)
    assert frontier.paired_ratio({"step_seconds": 2.2}, fixed) == pytest.approx(1.1)  # older rows: medians
