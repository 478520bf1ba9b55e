"""The budget planner end to end on the built-in model: measure, plan, emit YAML, train it, compare."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import yaml

from swapkit.cli import main
from swapkit.load import load_config
from swapkit.plan.emit import planned_config
from swapkit.plan.planner import KEEP, RECOMPUTE, BudgetError, Planner, plan_budget, reachable_peak
from swapkit.planner import measure
from swapkit.train import train

CONFIG = {
    "model": {"model_config": {"num_layers": 3, "hidden_size": 32, "num_heads": 2, "intermediate_size": 88,
                               "vocab_size": 64, "seq_length": 32}},
    "runtime": {"engine": "thread", "min_offload_bytes": 1024},
    "train": {"steps": 3, "batch_size": 2, "lr": 1e-3},
}


pytestmark = pytest.mark.usefixtures("cli_loggers_restored")  # conftest


@pytest.fixture(autouse=True, scope="module")
def _deterministic_copies(inline_copies, one_thread):
    """Predicted and measured peaks are compared on copies that finish when issued (conftest), with
    one intra-op thread (a copy then costs microseconds on a busy machine, not an OpenMP wake-up)."""


@pytest.fixture(scope="module")
def measured():
    return measure(load_config(CONFIG), steps=2, warmup=1)


@pytest.fixture(scope="module")
def planner(measured):
    return Planner(measured.trace, measured.links, measured.scopes, 1024)


@pytest.fixture()
def config_file(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(CONFIG), encoding="utf-8")
    return path


def steady(result) -> list[dict]:
    return result.steps[1:]  # from step 2 on the session skips the forward's tail (as the planner assumes)


def test_measured_bytes_are_the_sessions_own(planner):
    baseline = planner.predict((KEEP,) * 3)
    result = train(CONFIG, steps=2, progress=False)
    assert result.steps[-1]["peak_device_bytes"] == baseline.peak_device_bytes
    assert baseline.moved_bytes_per_step == 0


def test_every_layer_is_measured_with_its_scopes(measured):
    assert measured.scopes[0][0] == ""  # the whole layer first
    assert {"attention", "feed_forward"} <= set(measured.scopes[0])
    keep, recompute = measured.trace.modes["keep"], measured.trace.modes["recompute"]
    assert all(len(recompute[i].forward) < len(keep[i].forward) for i in range(3))  # only checkpoint inputs
    assert measured.trace.scope_seconds[(0, "")] > 0
    assert measured.links.d2h.bytes_per_s > 0 and measured.links.h2d.bytes_per_s > 0


@pytest.mark.parametrize("fraction", [0.8, 0.5, 0.25])
def test_planned_yaml_runs_within_5_percent_of_its_predicted_peak_and_under_budget(planner, tmp_path, fraction):
    baseline = planner.predict((KEEP,) * 3).peak_device_bytes
    budget = int(baseline * fraction)
    planned = plan_budget(planner, budget)
    path = tmp_path / "planned.yaml"
    path.write_text(yaml.safe_dump(planned_config(CONFIG, planned.choices)), encoding="utf-8")
    result = train(load_config(path), progress=False)  # the emitted file loads unchanged
    predicted = planned.predicted.peak_device_bytes
    why = f"{planned.choices} predicted {planned.predicted} links {planner.links}"
    for step in steady(result):
        assert step["peak_device_bytes"] <= budget, why
        assert abs(step["peak_device_bytes"] - predicted) <= 0.05 * predicted, why
    moved = sum(step["offloaded_bytes"] for step in steady(result)) / len(steady(result))
    assert any(not c.keeps_all for c in planned.choices)
    assert (moved > 0) == (planned.predicted.moved_bytes_per_step > 0)


def test_budget_above_the_baseline_keeps_everything(config_file, capsys):
    assert main(["plan", str(config_file), "--budget", "1GiB", "--json"]) == 0
    captured = capsys.readouterr()
    document = json.loads(captured.out)
    # the measurement runs that swap nothing take the default runtime: the config's runtime.engine is
    # not reported as doing nothing (swapkit.runtime.session.inactive_runtime)
    assert "has no effect" not in captured.err
    assert {row["decision"] for row in document["layers"]} == {"keep"}
    assert document["plan"]["swap_config"] == {"swap": False}
    assert document["predicted"] == document["baseline"]
    assert set(document["predicted"]) == {"peak_device_bytes", "step_seconds", "moved_bytes_per_step",
                                          "host_pool_bytes", "host_cap_bytes"}
    assert document["predicted"]["host_pool_bytes"] == 0  # nothing swapped: the pool holds nothing


def test_budget_below_the_minimum_exits_2_with_the_reachable_minimum(config_file, planner, capsys):
    assert main(["plan", str(config_file), "--budget", "1KiB"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    reachable = int(err.split("smallest reachable peak_device_bytes is ")[1].split()[0])
    assert 0 < reachable < planner.predict((KEEP,) * 3).peak_device_bytes
    assert f"raise --budget to at least {reachable}" in err
    # The number is the search's real minimum (on one measurement: the CLI measured on its own,
    # and with swaps the minimum depends on the copy lag it saw).
    with pytest.raises(BudgetError) as below:
        plan_budget(planner, 1024)
    lowest = below.value.reachable
    assert lowest <= min(reachable_peak(planner), planner.predict((RECOMPUTE,) * 3).peak_device_bytes)
    assert plan_budget(planner, lowest).predicted.peak_device_bytes <= lowest


def test_plan_budget_without_out_prints_one_yaml_document(config_file, capsys, monkeypatch):
    """Without --out the report table and then the YAML went to stdout: `swapkit plan CONFIG --budget SIZE >
    planned.yaml` wrote a file that failed to load ("YAML syntax error at line 4"). The report lines are
    now YAML comments above the planned config."""
    from swapkit.planner import command

    raw = yaml.safe_load(config_file.read_text())
    report = "layer  decision  saved MiB\n0      recompute     0.075\npredicted: peak_device_bytes 71044 (keep all: 1)"
    monkeypatch.setattr(command, "budget_plan", lambda *args, **kwargs: command.BudgetPlan(raw, None, report, {}))
    assert main(["plan", str(config_file), "--budget", "1MiB"]) == 0
    out = capsys.readouterr().out
    assert "# predicted: peak_device_bytes 71044 (keep all: 1)\n" in out, out
    written = config_file.with_name("redirected.yaml")
    written.write_text(out, encoding="utf-8")
    assert yaml.safe_load(out) == raw and load_config(written).model.num_layers == 3


def test_plan_writes_yaml_that_loads_and_train_budget_trains_it(config_file, planner, tmp_path, capsys):
    budget = planner.predict((KEEP,) * 3).peak_device_bytes // 2
    out = tmp_path / "planned.yaml"
    assert main(["plan", str(config_file), "--budget", str(budget), "--out", str(out)]) == 0
    assert "predicted: peak_device_bytes" in capsys.readouterr().out
    planned = load_config(out)
    assert planned.swap.swap is True and planned.model.num_layers == 3
    metrics = tmp_path / "metrics.json"
    assert main(["train", str(config_file), "--budget", str(budget), "--steps", "2", "--no-progress",
                 "--metrics-out", str(metrics)]) == 0
    steps = json.loads(metrics.read_text())["steps"]
    assert steps[-1]["peak_device_bytes"] <= budget  # half the keep-everything peak: something was planned


def test_gradient_accumulation_is_planned_per_micro_batch(planner, tmp_path):
    """Each micro-batch is its own swap step: the peak is one micro-batch's, the copies happen twice."""
    config = {**CONFIG, "train": {**CONFIG["train"], "gradient_accumulation_steps": 2}}
    measured = measure(load_config(config), steps=2, warmup=1, select=False)
    assert measured.trace.micro_batches == 2
    accumulating = Planner(measured.trace, measured.links, measured.scopes, 1024)
    budget = accumulating.predict((KEEP,) * 3).peak_device_bytes // 2
    planned = plan_budget(accumulating, budget)
    single = Planner(dataclasses.replace(measured.trace, micro_batches=1), measured.links, measured.scopes, 1024)
    assert planned.predicted.moved_bytes_per_step == 2 * single.predict(planned.choices).moved_bytes_per_step
    path = tmp_path / "planned.yaml"
    path.write_text(yaml.safe_dump(planned_config(config, planned.choices)), encoding="utf-8")
    assert load_config(path).train.gradient_accumulation_steps == 2
    for step in steady(train(load_config(path), progress=False)):
        assert step["peak_device_bytes"] <= budget
        assert abs(step["peak_device_bytes"] - planned.predicted.peak_device_bytes) <= 0.05 * budget


def test_an_interleaved_pipeline_config_is_a_clean_error(tmp_path, capsys):
    """Pipeline configs are planned per stage (tests/test_planner_stages.py), but not interleaved ones."""
    config = {**CONFIG, "model": {"model_config": {**CONFIG["model"]["model_config"], "num_layers": 4,
                                                   "pp_interleave_num": 2}},
              "parallel_config": {"pipeline_stage": 2}}
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    assert main(["plan", str(path), "--budget", "1MiB"]) == 2
    err = capsys.readouterr().err
    assert "parallel_config.pipeline_schedule" in err and "'interleaved_1f1b'" in err and "Traceback" not in err


def test_sizes_per_stage_without_a_pipeline_say_so(config_file, capsys):
    assert main(["plan", str(config_file), "--budget", "1MiB,2MiB"]) == 2
    assert "--budget: got '1MiB,2MiB'; sizes per stage apply only to a pipeline config" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the engine/device mismatch needs a CPU-only machine")
@pytest.mark.parametrize("command", ["plan", "train"])
def test_cuda_engine_on_cpu_is_a_config_error_as_in_train(config_file, capsys, command):
    argv = [command, str(config_file), "--budget", "1MiB", "--set", "runtime.engine=cuda"]
    assert main(argv) == 2
    assert ("invalid swapkit command line (1 problem):\n  - runtime.engine (from --set runtime.engine=cuda): got "
            "'cuda' but the model trains on cpu; set runtime.engine: auto") in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--budget", "lots"], ["--budget", "0"], ["--out", "x.yaml"]])
def test_bad_budget_arguments_are_clean_errors(config_file, capsys, argv):
    assert main(["plan", str(config_file), *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and ("--budget" in err or "--out" in err)


def test_train_budget_logs_the_trained_config_not_the_measurement_runs(config_file, planner, tmp_path, capfd):
    """The measurement runs recompute every layer; their 'Set full recompute' lines are not the run's."""
    budget = planner.predict((KEEP,) * 3).peak_device_bytes  # keeps everything: nothing is Set
    assert main(["train", str(config_file), "--budget", str(budget), "--steps", "1", "--no-progress"]) == 0
    err = capfd.readouterr().err
    assert "Set full recompute" not in err and "Set layer swap" not in err and "measured on" not in err
    assert "Formative layer_recompute" in err and "predicted: peak_device_bytes" in err  # the run's own lines


def test_train_budget_warns_about_the_input_config_once(planner, tmp_path, capfd):
    """The planned config is the input with two sections replaced: its warnings are the input's."""
    path = tmp_path / "mindformers.yaml"
    path.write_text(yaml.safe_dump({**CONFIG, "context": {"memory_optimize_level": "O1"}}), encoding="utf-8")
    budget = planner.predict((KEEP,) * 3).peak_device_bytes
    assert main(["train", str(path), "--budget", str(budget), "--steps", "1", "--no-progress"]) == 0
    assert capfd.readouterr().err.count("context.memory_optimize_level has no effect") == 1


def test_train_budget_checks_steps_before_measuring(config_file, capsys, monkeypatch):
    def no_measuring(*args, **kwargs):
        raise AssertionError("measured before checking --steps")

    monkeypatch.setattr("swapkit.planner.command.measure", no_measuring)
    assert main(["train", str(config_file), "--budget", "1MiB", "--steps", "0"]) == 2
    assert "--steps: got 0; expected an integer >= 1" in capsys.readouterr().err


def test_train_budget_refuses_a_used_save_dir_before_measuring(config_file, tmp_path, capsys, monkeypatch):
    """A fresh run over an earlier run's checkpoints is refused (checkpoint Note [A fresh run in a used
    save_dir]); with --budget only after the measurement runs."""
    def no_measuring(*args, **kwargs):
        raise AssertionError("measured before checking train.save_dir")

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "step_0000003.pt").write_bytes(b"an earlier run")
    monkeypatch.setattr("swapkit.planner.command.measure", no_measuring)
    assert main(["train", str(config_file), "--budget", "1MiB", "--set", f"train.save_dir={tmp_path / 'ckpt'}"]) == 2
    assert "train.save_dir (from --set train.save_dir=" in capsys.readouterr().err


def test_train_budget_refuses_a_checkpoint_of_another_model_before_measuring(config_file, tmp_path, capsys,
                                                                           monkeypatch):
    """A resume from a checkpoint of another model size was refused only after the measurement runs."""
    def no_measuring(*args, **kwargs):
        raise AssertionError("measured before checking the checkpoint")

    save = ["--set", f"train.save_dir={tmp_path / 'ckpt'}"]
    assert main(["train", str(config_file), "--steps", "1", "--no-progress", *save]) == 0
    capsys.readouterr()
    monkeypatch.setattr("swapkit.planner.command.measure", no_measuring)
    assert main(["train", str(config_file), "--budget", "1MiB", *save, "--set", "train.resume=true",
                 "--set", "model.model_config.hidden_size=64"]) == 2
    err = capsys.readouterr().err
    assert "model.model_config.hidden_size (from --set model.model_config.hidden_size=64): 32 -> 64 (changed since " \
           "step_0000001.pt was saved)" in err, err


@pytest.mark.parametrize("argv, message", [
    (["plan", "--budget", "1MiB", "--layers", "model.layers"],
     "--layers: got 'model.layers'; the built-in model keeps its layers in 'layers': drop --layers, or add --model"),
    (["plan", "--budget", "1MiB", "--file-layers"],
     "model.model_config.layers_path: got 'blocks'; the built-in model keeps its layers in 'layers'"),
    (["train", "--budget", "1MiB", "--file-layers"], "model.model_config.layers_path: got 'blocks'"),
    (["train", "--steps", "1", "--file-layers"], "model.model_config.layers_path: got 'blocks'"),
])
def test_a_layer_path_the_built_in_model_lacks_is_refused_before_measuring(tmp_path, capsys, monkeypatch, argv,
                                                                           message):
    """The built-in model's runs bound 'layers' whatever --layers or layers_path said: a misspelt path
    trained silently (Note [Layer paths of the built-in model])."""
    def no_measuring(*args, **kwargs):
        raise AssertionError("measured before checking the layer path")

    monkeypatch.setattr("swapkit.planner.command.measure", no_measuring)
    layers_path = {"layers_path": "blocks"} if "--file-layers" in argv else {}
    config = {**CONFIG, "model": {"model_config": {**CONFIG["model"]["model_config"], **layers_path}}}
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    command, *rest = [arg for arg in argv if arg != "--file-layers"]
    assert main([command, str(path), *rest]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("command, flag", [("plan", "--out"), ("train", "--metrics-out")])
def test_unwritable_output_is_refused_before_measuring(config_file, tmp_path, capsys, monkeypatch, command, flag):
    def no_measuring(*args, **kwargs):
        raise AssertionError("measured before checking the output path")

    monkeypatch.setattr("swapkit.planner.command.measure", no_measuring)
    out = tmp_path / "missing" / "out.yaml"
    assert main([command, str(config_file), "--budget", "1MiB", flag, str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{flag}: got {out}; its folder {out.parent} does not exist" in err and "Traceback" not in err


@pytest.mark.parametrize("command, flag, example", [("plan", "--out", "planned.yaml"),
                                                    ("train", "--metrics-out", "metrics.json")])
def test_an_output_that_is_a_folder_suggests_a_file_of_its_kind(config_file, tmp_path, capsys, command, flag, example):
    """plan --budget --out DIR suggested DIR/metrics.json for the planned YAML."""
    assert main([command, str(config_file), "--budget", "1MiB", flag, str(tmp_path)]) == 2
    assert f"{flag}: got {tmp_path}, which is a directory; expected a file path such as {tmp_path / example}" in \
        capsys.readouterr().err


@pytest.mark.parametrize("command, flag", [("plan", "--out"), ("train", "--metrics-out")])
def test_an_output_onto_the_planned_config_is_refused_and_leaves_it_intact(config_file, capsys, monkeypatch,
                                                                           command, flag):
    def no_measuring(*args, **kwargs):
        raise AssertionError("measured before checking the output path")

    monkeypatch.setattr("swapkit.planner.command.measure", no_measuring)
    before = config_file.read_text()
    assert main([command, str(config_file), "--budget", "1MiB", flag, str(config_file)]) == 2
    err = capsys.readouterr().err
    assert f"{flag}: got {config_file}, the config file of this run; writing there would replace it" in err
    assert f"{config_file.stem}.out{config_file.suffix}" in err and "Traceback" not in err
    assert config_file.read_text() == before


def test_the_link_is_measured_with_an_engine_whose_slabs_are_whole_pages():
    """The CUDA engine's ``host_buffer`` rounds a slab up to a page; ``measure_link`` copied its ``nbytes``
    source into the whole slab, which fails for a largest storage (above 64 KiB) that is no whole number of
    pages (a GPT-2 vocabulary's fp32 logits at sequence length 1000)."""
    from swapkit.engine import ThreadCopyEngine
    from swapkit.engine.slabs import round_up
    from swapkit.planner.link import measure_link

    class PagedSlabs(ThreadCopyEngine):
        host_granule = 4096

        def host_buffer(self, nbytes: int) -> torch.Tensor:
            return torch.empty(round_up(nbytes, self.host_granule), dtype=torch.uint8)

    engine = PagedSlabs("cpu")
    try:
        links = measure_link(engine, 100_000, repeats=1)
    finally:
        engine.close()
    assert links.d2h.bytes_per_s > 0 and links.h2d.bytes_per_s > 0


@pytest.mark.cuda
def test_cuda_link_is_measured_per_direction():
    import torch

    from swapkit.engine.cuda import CudaCopyEngine
    from swapkit.planner.link import measure_link

    engine = CudaCopyEngine(torch.device("cuda"))
    try:
        links = measure_link(engine, 64 << 20)
    finally:
        engine.close()
    for link in (links.d2h, links.h2d):  # pinned copies over PCIe or NVLink: GB/s, microseconds
        assert link.bytes_per_s > 1e9 and link.latency_s < 1e-3


@pytest.mark.cuda
def test_cuda_plan_runs_within_5_percent_of_its_predicted_peak(tmp_path):
    config = {**CONFIG, "runtime": {"engine": "cuda"}, "train": {**CONFIG["train"], "device": "cuda"}}
    measured_cuda = measure(load_config(config), steps=2, warmup=1)
    cuda_planner = Planner(measured_cuda.trace, measured_cuda.links, measured_cuda.scopes, 1024)
    budget = cuda_planner.predict((KEEP,) * 3).peak_device_bytes // 2
    planned = plan_budget(cuda_planner, budget)
    path = tmp_path / "planned.yaml"
    path.write_text(yaml.safe_dump(planned_config(config, planned.choices)), encoding="utf-8")
    for step in steady(train(load_config(path), progress=False)):
        assert step["peak_device_bytes"] <= budget
        assert abs(step["peak_device_bytes"] - planned.predicted.peak_device_bytes) <= 0.05 * budget


def test_release_lag_is_the_largest_delay_past_the_links_prediction():
    from swapkit.plan.simulate import Link, Links
    from swapkit.planner.measure import release_lag

    links = Links(Link(0.001, 1e9), Link(0.001, 1e9))  # 1 ms per copy (size negligible)
    # (issued, last seen unfinished, bytes): the 2nd queues behind the 1st, due at 2 ms, unfinished at 5 ms
    copies = [(0.0, None, 1), (0.0, 0.005, 1), (0.010, 0.0105, 1)]
    assert release_lag(copies, links) == pytest.approx(0.003)
    assert release_lag([(0.0, None, 1)], links) == 0.0  # finished when first looked at: no lag


FIXED_PLANS = {
    "swap every layer k=1": lambda c: (c("swap", ("",), 1),) * 3,
    "swap every layer k=4": lambda c: (c("swap", ("",), 4),) * 3,
    "swap, swap, recompute": lambda c: (c("swap", ("",), 1), c("swap", ("",), 2), c("recompute")),
    "recompute, swap, swap": lambda c: (c("recompute"), c("swap", ("",), 1), c("swap", ("",), 1)),
    "swap feed_forward k=2": lambda c: (c("swap", ("feed_forward",), 2),) * 3,
    "select attention": lambda c: (c(select="attention"),) * 3,
    "select attention + swap feed_forward": lambda c: (c("swap", ("feed_forward",), 2, "attention"),) * 3,
    "select feed_forward, recompute, keep": lambda c: (c(select="feed_forward"), c("recompute"), c()),
}


@pytest.mark.parametrize("name", FIXED_PLANS)
def test_fixed_plans_run_at_their_predicted_peak(planner, tmp_path, name):
    """Every kind of decision and their mixes: the composed, replayed step is the session's own count
    (copies inline: a release comes exactly at its horizon, and the measured lag is zero)."""
    from swapkit.plan.planner import Choice

    assert planner.links.release_lag_s == 0.0
    choices = FIXED_PLANS[name](Choice)
    predicted = planner.predict(choices).peak_device_bytes
    path = tmp_path / "fixed.yaml"
    path.write_text(yaml.safe_dump(planned_config(CONFIG, choices)), encoding="utf-8")
    for step in steady(train(load_config(path), progress=False)):
        assert step["peak_device_bytes"] == predicted


def test_traced_times_are_scaled_to_the_untraced_step():
    from swapkit.planner.segments import tracing_factor

    assert tracing_factor([2.0, 2.0, 2.2], [1.0, 1.1, 1.0]) == pytest.approx(0.5)
    assert tracing_factor([1.0], [1.5]) == 1.0  # noise never inflates the trace


def test_modes_measured_one_after_another_give_what_side_by_side_gives():
    """The CUDA path (one mode after another) on CPU: the same modes and the later modes picked from
    the keep run's warm-up step."""
    import torch

    from swapkit.planner.measure import mode_config
    from swapkit.planner.sampling import _one_after_another, measure_modes

    config = load_config(CONFIG)
    first = {mode: mode_config(config, mode) for mode in ("keep", "recompute")}
    seen = []

    def later(tracer, scopes):
        seen.append((len(tracer.saves), scopes[0][0]))
        return {"select:feed_forward": mode_config(config, "select:feed_forward")}

    results = [f(first, later, torch.device("cpu"), [()] * 3, 1, 1, None) for f in (_one_after_another, measure_modes)]
    for result in results:
        assert set(result) == {"keep", "recompute", "select:feed_forward"}
    assert seen[0] == seen[1] and seen[0][0] > 0 and seen[0][1] == ""
    keep_bytes = [sum(s.nbytes for seg in r["keep"][0][0][0].values() for s in seg.forward) for r in results]
    assert keep_bytes[0] == keep_bytes[1]


def test_event_medians_add_up_to_the_median_step():
    """Note [Medians of events and of steps]: each step lost time in another event; the per-event
    medians alone would drop all of it."""
    from swapkit.plan.trace import Save, Segment
    from swapkit.planner.segments import median_segments

    def step(a, b):
        return {0: Segment((Save(None, 0, None, a), Save(None, 0, None, b)), (), 0.0)}

    merged = median_segments([step(1.0, 1.0), step(3.0, 1.0), step(1.0, 3.0)])  # steps of 2, 4 and 4 s
    assert [save.seconds for save in merged[0].forward] == pytest.approx([2.0, 2.0])


def test_select_recompute_of_an_op_scope_is_measured_and_predicted(measured, planner, tmp_path):
    from swapkit.plan.planner import Choice

    assert set(planner.selects) == {"attention", "feed_forward"}  # the two children owning the most bytes
    choices = (Choice(select="feed_forward"),) * 3
    predicted = planner.predict(choices).peak_device_bytes
    assert predicted < planner.predict((KEEP,) * 3).peak_device_bytes
    path = tmp_path / "select.yaml"
    path.write_text(yaml.safe_dump(planned_config(CONFIG, choices)), encoding="utf-8")
    config = load_config(path)
    assert config.recompute.select_recompute == {"feed_forward": [0, 1, 2]}
    result = train(config, progress=False)
    assert result.summary is not None
    for step in steady(result):
        assert abs(step["peak_device_bytes"] - predicted) <= 0.05 * predicted


@pytest.mark.parametrize("kwargs, message", [
    ({"steps": 0}, r"measure\(steps=0\): expected a whole number >= 1"),
    ({"warmup": -1}, r"measure\(warmup=-1\): expected a whole number >= 0"),
    ({"device": "gpu"}, r"measure\(device='gpu'\): expected 'cpu', 'cuda' or None"),
])
def test_bad_measure_arguments_are_clear_errors_before_anything_runs(kwargs, message):
    """steps=0 ran every mode and failed with 'StatisticsError: no median for empty data'; device='gpu'
    with torch's own device-string error."""
    with pytest.raises(ValueError, match=message):
        measure(load_config(CONFIG), **kwargs)


def test_measure_takes_the_config_forms_apply_takes():
    """A dict in the YAML layout failed with "AttributeError: 'dict' object has no attribute 'parallel'"."""
    measured = measure(CONFIG, steps=1, warmup=0, select=False)
    assert measured.trace.num_layers == 3


@pytest.mark.parametrize("budget", [0, -1, 1.5, "1MiB", None, True])
def test_plan_budget_refuses_a_budget_that_is_not_a_byte_count(planner, budget):
    """0, -1 and 1.5 were 'cannot be met' BudgetErrors; '1MiB' and None failed comparing int and str."""
    with pytest.raises(ValueError, match=r"budget: got .*; expected a whole number of bytes >= 1 "
                                         r"\(swapkit\.plan\.size\.parse_size reads a size such as '64MiB'\)"):
        plan_budget(planner, budget)


@pytest.mark.parametrize("count", [2, 4])
def test_predict_refuses_a_choice_count_other_than_the_layer_count(planner, count):
    """Too few choices failed with an IndexError; too many were predicted with the extras ignored."""
    with pytest.raises(ValueError, match=f"predict: got {count} choices for a model of 3 layers"):
        planner.predict((KEEP,) * count)


def test_the_report_stays_aligned_when_a_decision_is_longer_than_its_column(planner):
    """A swap of four scopes (51 characters) pushed its row's numbers out of their columns."""
    from swapkit.plan.emit import table

    figures = {"saved_bytes": 2**20, "swapped_bytes": 2**19, "forward_seconds": 1e-3, "predicted_cost_seconds": 0.0}
    rows = [{"layer": 0, "decision": "keep", **figures},
            {"layer": 1, "decision": "swap attention.wq, attention_norm, feed_forward, ffn_norm k=8", **figures}]
    head, *cells = table(rows, plan_budget(planner, 1 << 40)).splitlines()[:3]
    assert len({len(head), *map(len, cells)}) == 1  # every column right-aligned at the same place
