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
"""
from __future__ import annotations

import argparse
import json
import sys
import time
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
FRACTIONS = (0.8, 0.55, 0.35)


def stage_config(schedule: str) -> dict[str, Any]:
    return {"model": {"model_config": dict(MODEL)},
            "parallel_config": {"pipeline_stage": 2, "micro_batch_num": 4, "pipeline_schedule": schedule},
            "train": {"batch_size": 2, "steps": 4}, "runtime": {"min_offload_bytes": 0}}


def one_schedule(schedule: str) -> list[dict[str, Any]]:
    raw = stage_config(schedule)
    config = load_config(raw)
    measured = measure_stages(config, steps=3, warmup=1)
    baselines = [p.planned.baseline.peak_device_bytes for p in plan_stages(config, "1TiB", measured=measured)]
    rows = []
    for fraction in FRACTIONS:
        budget = int(fraction * min(baselines))
        start = time.perf_counter()
        plan = BudgetPlan(*stage_plan_parts(config, raw, str(budget), measured=measured))
        planning = time.perf_counter() - start
        result = launch(load_config(plan.config), torch.device("cpu"), steps=4, progress=False)
        for stage, predicted in enumerate(plan.document["stages"]):
            peaks = [step["stages"][stage]["peak_device_bytes"] for step in result.steps[1:]]
            rows.append({"schedule": schedule, "fraction": fraction, "budget_bytes": budget, "stage": stage,
                         "baseline_bytes": baselines[stage], "predicted_bytes": predicted["predicted"]
                         ["peak_device_bytes"], "measured_bytes": max(peaks), "planning_seconds": planning,
                         "decisions": [row["decision"] for row in plan.document["layers"] if row["stage"] == stage]})
    return rows


def markdown(rows: list[dict[str, Any]], env: dict[str, Any]) -> str:
    lines = ["| schedule | budget (x smaller baseline) | stage | predicted peak | measured peak | measured / "
             "predicted | under budget |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['schedule']} | {row['budget_bytes']} ({row['fraction']}) | {row['stage']} | "
                     f"{row['predicted_bytes']} | {row['measured_bytes']} | "
                     f"{row['measured_bytes'] / row['predicted_bytes']:.3f} | "
                     f"{'yes' if row['measured_bytes'] <= row['budget_bytes'] else 'NO'} |")
    lines += ["", f"torch {env['torch']}, {env['platform']}, {env['cpu_count']} CPUs; model {MODEL}, "
              "2 stages, 4 micro-batches of 2 rows, thread engine (real copy thread)"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=output_dir, default="bench-out/planner_stages")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [row for schedule in ("1f1b", "gpipe") for row in one_schedule(schedule)]
    env = environment(load_config(stage_config("1f1b")), torch.device("cpu"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"rows": rows, "env": env}, indent=2) + "\n", encoding="utf-8")
    text = markdown(rows, env)
    (out / "results.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
