"""The budget planner per pipeline stage: predicted vs measured peak of each stage.

What it measures
  For GPipe and 1F1B on 2 pipeline stages (built-in model, 4 micro-batches), the planner measures
  each stage's layers in this process (``swapkit.planner.stages``) and plans at 0.8, 0.55 and 0.35
  of the smaller stage's keep-everything peak (one budget for both stages). Each planned config
  then trains through ``swapkit train``'s own multi-process path (``swapkit.distributed.launch``:
  2 gloo ranks, the thread engine with its copy thread, i.e. real copy timing) for 4 steps; per
  stage the predicted and the measured ``peak_device_bytes`` (max over steps 2-4, the steady
  steps the planner predicts) are reported, with the budget. Writes OUT/results.json and
  OUT/results.md.

Run (from the repository root):
    python benchmarks/planner_stages.py                                    # -> bench-out/planner_stages/
    python benchmarks/planner_stages.py --out benchmarks/results/planner_stages
    python benchmarks/planner_stages.py --quick                            # 4 layers, 1F1B, one budget, 2 steps
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from swapkit.distributed.launch import launch
from swapkit.load import load_config
from swapkit.planner.command import BudgetPlan
from swapkit.planner.stages import measure_stages, plan_stages, stage_plan_parts
from swapkit.train.loop import environment

from common import output_dir

MODEL = {"num_layers": 8, "hidden_size": 64, "num_heads": 4, "intermediate_size": 128, "vocab_size": 128,
         "seq_length": 64}
QUICK_MODEL = {"num_layers": 4, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "vocab_size": 64,
               "seq_length": 32}
FRACTIONS = (0.8, 0.55, 0.35)
RUNTIME = {"min_offload_bytes": 0}  # the planned configs' (swap even the smallest saved tensor)


@dataclass(frozen=True)
class RunPlan:
    """How much to run: the model, the schedules, the budgets, the measured and the trained steps."""

    model: dict[str, Any]
    schedules: tuple[str, ...]
    fractions: tuple[float, ...]
    measure_steps: int
    train_steps: int  # the peaks compared are those of steps 2..train_steps (the steady ones)


FULL = RunPlan(MODEL, ("1f1b", "gpipe"), FRACTIONS, 3, 4)
QUICK = RunPlan(QUICK_MODEL, ("1f1b",), (0.55,), 2, 2)


def stage_config(schedule: str, plan: RunPlan = FULL) -> dict[str, Any]:
    return {"model": {"model_config": dict(plan.model)},
            "parallel_config": {"pipeline_stage": 2, "micro_batch_num": 4, "pipeline_schedule": schedule},
            "train": {"batch_size": 2, "steps": plan.train_steps}, "runtime": dict(RUNTIME)}


def trained_config(planned: dict[str, Any]) -> dict[str, Any]:
    """The planned config as trained: without the runtime settings where it swaps nothing (a
    recompute-only plan's ``swap: true`` with empty lists), which would only be warned about as doing
    nothing in every rank; the benchmark wrote them, not a user."""
    swap = planned.get("swap_config", {})
    swaps = bool(swap.get("swap")) and any(swap.get(key) for key in ("layer_swap", "op_swap"))
    return planned if swaps else {key: value for key, value in planned.items() if key != "runtime"}


def one_schedule(schedule: str, plan: RunPlan = FULL) -> list[dict[str, Any]]:
    raw = stage_config(schedule, plan)
    config = load_config(raw)
    measured = measure_stages(config, steps=plan.measure_steps, warmup=1)
    baselines = [p.planned.baseline.peak_device_bytes for p in plan_stages(config, "1TiB", measured=measured)]
    rows = []
    for fraction in plan.fractions:
        budget = int(fraction * min(baselines))
        start = time.perf_counter()
        planned = BudgetPlan(*stage_plan_parts(config, raw, str(budget), measured=measured))
        planning = time.perf_counter() - start
        result = launch(load_config(trained_config(planned.config)), torch.device("cpu"), steps=plan.train_steps,
                        progress=False)
        for stage, predicted in enumerate(planned.document["stages"]):
            peaks = [step["stages"][stage]["peak_device_bytes"] for step in result.steps[1:]]
            rows.append({"schedule": schedule, "fraction": fraction, "budget_bytes": budget, "stage": stage,
                         "baseline_bytes": baselines[stage], "predicted_bytes": predicted["predicted"]
                         ["peak_device_bytes"], "measured_bytes": max(peaks), "planning_seconds": planning,
                         "decisions": [row["decision"] for row in planned.document["layers"]
                                       if row["stage"] == stage]})
    return rows


def markdown(rows: list[dict[str, Any]], env: dict[str, Any], model: dict[str, Any] = MODEL) -> str:
    lines = ["| schedule | budget (x smaller baseline) | stage | predicted peak | measured peak | measured / "
             "predicted | under budget |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['schedule']} | {row['budget_bytes']} ({row['fraction']}) | {row['stage']} | "
                     f"{row['predicted_bytes']} | {row['measured_bytes']} | "
                     f"{row['measured_bytes'] / row['predicted_bytes']:.3f} | "
                     f"{'yes' if row['measured_bytes'] <= row['budget_bytes'] else 'NO'} |")
    lines += ["", f"torch {env['torch']}, {env['platform']}, {env['cpu_count']} CPUs; model {model}, "
              "2 stages, 4 micro-batches of 2 rows, thread engine (real copy thread)"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=output_dir, default="bench-out/planner_stages")
    parser.add_argument("--quick", action="store_true", help="4 layers, 1F1B only, one budget, 2 trained steps "
                        "(a smoke run: seconds, not minutes)")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    torch.set_num_threads(1)
    rows = [row for schedule in plan.schedules for row in one_schedule(schedule, plan)]
    env = environment(load_config(stage_config(plan.schedules[0], plan)), torch.device("cpu"))
    env["quick"] = args.quick
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"rows": rows, "env": env}, indent=2) + "\n", encoding="utf-8")
    text = markdown(rows, env, plan.model)
    (out / "results.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
