"""The budget planner against fixed strategies: predicted vs measured, and the memory/time frontier.

What it measures
  For each emulated link of the thread engine (``free``: no throttle, where the cost model says
  swapping costs nothing; ``slow``: 1 GB/s and 0.5 ms per copy, where it does not), the planner
  measures the model (``swapkit.planner.measure``) and plans at 0.8, 0.5 and 0.25 of the
  keep-everything peak. Each planned config and each fixed variant (keep, layer swap k=1 and k=8,
  op swap attention+feed_forward, full recompute, Megatron selective mlp, layer swap + recompute
  feed_forward) runs on its own model copy, interleaved (A B C ... A B C ...) after warm-up, through
  the training step the planner measured (``swapkit.train.loop``: forward, backward, clip, AdamW).
  Reported per budget: predicted and measured peak (the session's ``peak_device_bytes``, max over
  the timed steps) and step time (median), and the fastest fixed variant whose measured peak fits
  the same budget. Writes OUT/results.json, OUT/results.md and OUT/planner_tradeoff.png.

Run (from the repository root):
    python benchmarks/planner_frontier.py                       # -> bench-out/planner/
    python benchmarks/planner_frontier.py --out benchmarks/results/planner  # the committed results
    python benchmarks/planner_frontier.py --quick
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import torch  # noqa: E402

from common import (DEFAULT_BATCH, DEFAULT_MODEL, QUICK_BATCH, QUICK_MODEL, counted, cpu_model,  # noqa: E402
                    load_average_text, output_dir, positive_int)
from swapkit.load import load_config  # noqa: E402
from swapkit.plan.emit import planned_sections  # noqa: E402
from swapkit.plan.planner import KEEP, RECOMPUTE, BudgetError, Choice, Planner, plan_budget  # noqa: E402
from swapkit.planner import measure  # noqa: E402
from swapkit.train.loop import _start, _train_step  # noqa: E402

DEFAULT_OUT = Path("bench-out/planner")  # git-ignored; benchmarks/results/planner only with an explicit --out
FRACTIONS = (0.8, 0.5, 0.25)
LINKS = {"free": {}, "slow": {"latency_s": 0.0005, "bandwidth_gbps": 1.0}}
MIB = 2**20
QUICK_VARIANTS = ("keep (session, nothing configured)", "swap layer k=8", "recompute full")


def fixed_variants(num_layers: int) -> dict[str, dict[str, Any]]:
    layers = list(range(num_layers))
    swap = lambda k: {"swap": True, "layer_swap": [{"backward_prefetch": k, "layers": True}]}  # noqa: E731
    return {
        "keep (session, nothing configured)": {},
        "swap layer k=1": {"swap_config": swap(1)},
        "swap layer k=8": {"swap_config": swap(8)},
        "swap op attention+feed_forward k=8": {"swap_config": {"swap": True, "op_swap": [
            {"op_name": ["attention", "feed_forward"], "backward_prefetch": 8, "layers": True}]}},
        "recompute full": {"recompute_config": {"recompute": True}},
        "recompute selective mlp (Megatron)": {"recompute_config": {"recompute_granularity": "selective",
                                                                   "recompute_modules": ["mlp"]}},
        "swap layer k=8 + recompute feed_forward": {"swap_config": swap(8), "recompute_config": {
            "recompute": False, "select_recompute": {"feed_forward": layers}}},
    }


def fixed_choices(num_layers: int) -> dict[str, tuple[Choice, ...]]:
    """The fixed variants the planner's choices can express, for their predictions."""
    every = lambda choice: (choice,) * num_layers  # noqa: E731
    return {"keep (session, nothing configured)": every(KEEP), "swap layer k=1": every(Choice("swap", ("",), 1)),
            "swap layer k=8": every(Choice("swap", ("",), 8)),
            "swap op attention+feed_forward k=8": every(Choice("swap", ("attention", "feed_forward"), 8)),
            "recompute full": every(RECOMPUTE),
            "swap layer k=8 + recompute feed_forward": every(Choice("swap", ("",), 8, "feed_forward"))}


def base_config(model: dict, batch: int, link: dict) -> dict[str, Any]:
    return {"model": {"model_config": dict(model)},
            "runtime": {"engine": "thread", "engine_options": dict(link)},
            "train": {"steps": 1000, "batch_size": batch, "lr": 1e-4, "seed": 0}}


def variant_config(base: dict[str, Any], sections: dict[str, Any]) -> dict[str, Any]:
    """A variant's config: ``base`` with its sections; the emulated link (``runtime``) only where the
    variant swaps (one that swaps nothing, a recompute-only plan's ``swap: true`` with empty lists
    included, would be warned that its engine settings do nothing)."""
    swap = sections.get("swap_config", {})
    lists = [swap.get(key) for key in ("layer_swap", "op_swap")]  # both absent: MindFormers' default strategy
    swaps = bool(swap.get("swap")) and (any(lists) or all(entries is None for entries in lists))
    return {**{key: value for key, value in base.items() if swaps or key != "runtime"}, **sections}


def run_interleaved(configs: dict[str, dict], reps: int, warmup: int) -> dict[str, dict[str, Any]]:
    """Median step time and max peak per config, runs interleaved in one process."""
    runs = {name: _start(load_config(cfg), torch.device("cpu"), warmup + reps, None) for name, cfg in configs.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    peaks: dict[str, list[int]] = {name: [] for name in runs}
    try:
        for step in range(warmup + reps):
            for name, run in runs.items():
                start = time.perf_counter()
                _train_step(run, step + 1)
                if step >= warmup:
                    times[name].append(time.perf_counter() - start)
                    peaks[name].append(run.session.stats.peak_device_bytes)
    finally:
        for run in runs.values():
            run.session.remove()
    return {name: {"step_seconds": statistics.median(times[name]), "step_times_s": times[name],
                   "peak_device_bytes": max(peaks[name]), "moved_bytes": None} for name in runs}


def paired_ratio(got: dict[str, Any], other: dict[str, Any]) -> float:
    """Median over steps of (``got``'s step / ``other``'s step of the same round), Note [Pairwise ratios] in
    measure.py; rows without per-step times (results from before they were kept) fall back to the medians."""
    if "step_times_s" not in got or "step_times_s" not in other:
        return got["step_seconds"] / other["step_seconds"]
    return statistics.median(a / b for a, b in zip(got["step_times_s"], other["step_times_s"]))


def one_link(name: str, link: dict, model: dict, batch: int, reps: int, warmup: int,
             quick: bool = False) -> dict[str, Any]:
    base = base_config(model, batch, link)
    config = load_config(base)
    measured = measure(config, steps=2 if quick else 5)
    planner = Planner(measured.trace, measured.links, measured.scopes, 1024, host=measured.host(config.runtime))
    baseline = planner.predict((KEEP,) * model["num_layers"])
    fixed = fixed_variants(model["num_layers"])
    if quick:  # a smoke run: three fixed variants
        fixed = {k: v for k, v in fixed.items() if k in (QUICK_VARIANTS)}
    configs = {v: variant_config(base, sections) for v, sections in fixed.items()}
    plans = {}
    for fraction in FRACTIONS:
        budget = int(baseline.peak_device_bytes * fraction)
        try:
            planned = plan_budget(planner, budget)
        except BudgetError as err:
            plans[fraction] = {"budget": budget, "error": str(err)}
            continue
        label = f"planned {fraction}"
        configs[label] = variant_config(base, planned_sections(planned.choices))
        plans[fraction] = {"budget": budget, "label": label, "decisions": [c.describe() for c in planned.choices],
                           "predicted": {**planned.predicted.to_json(),
                                         "uncertain_bytes": planned.predicted.uncertain_bytes}}
    measured_rows = run_interleaved(configs, reps, warmup)
    for variant, choices in fixed_choices(model["num_layers"]).items():
        if variant in measured_rows and (not choices[0].select or choices[0].select in planner.selects):
            measured_rows[variant]["predicted"] = planner.predict(choices).to_json()
    links = {"d2h": vars(measured.links.d2h), "h2d": vars(measured.links.h2d),
             "release_lag_s": measured.links.release_lag_s}
    return {"link": name, "engine_options": link, "measured_link": links, "baseline_predicted":
            baseline.to_json(), "plans": {str(f): _compare(p, measured_rows) for f, p in plans.items()},
            "runs": measured_rows}


def _compare(plan: dict[str, Any], rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    if "error" in plan:
        return plan
    got = rows[plan["label"]]
    fitting = {n: r for n, r in rows.items()
               if not n.startswith("planned") and r["peak_device_bytes"] <= plan["budget"]}
    fastest = min(fitting, key=lambda n: fitting[n]["step_seconds"]) if fitting else None
    predicted = plan["predicted"]
    return {**plan, "measured": got,
            "peak_ratio": got["peak_device_bytes"] / predicted["peak_device_bytes"],
            "time_ratio": got["step_seconds"] / predicted["step_seconds"],
            "fastest_fixed": fastest, "fastest_fixed_seconds": fitting[fastest]["step_seconds"] if fastest else None,
            "planned_vs_fastest": paired_ratio(got, fitting[fastest]) if fastest else None}


def markdown(results: dict[str, Any]) -> str:
    env = results["env"]
    load = max(max(env["load_start"]), max(env["load_end"]))
    warning = ([f"> **WARNING:** the machine was loaded (load average up to {load:.2f} on {env['cpu_count']} "
                "cores): other processes shared the cores, so step times are noisy; rerun on an idle machine", ""]
               if load > (env["cpu_count"] or 1) else [])
    lines = ["# Budget planner: predicted vs measured, planned vs fixed strategies", "", *warning,
             f"{env['cpu']}, {env['cpu_count']} cores ({env['torch_threads']} torch threads), torch {env['torch']}, "
             "load average (1/5/15 min) at start "
             f"{load_average_text(env['load_start'])}, at end {load_average_text(env['load_end'])}; "
             f"model {env['model']}, batch {env['batch']}; "
             f"{counted(env['reps'], 'interleaved timed step')} after {counted(env['warmup'], 'warm-up step')} "
             "per variant. "
             "Memory is the session's accounting of device-resident saved bytes (CPU: not RSS).", ""]
    for link in results["links"]:
        lines += [f"## link `{link['link']}` {link['engine_options'] or '(no throttle)'}", "",
                  f"measured link: {json.dumps(link['measured_link'])}", "",
                  "| budget | decisions | predicted peak MiB | measured peak MiB | peak ratio | predicted ms "
                  "| measured ms | time ratio | fastest fixed that fits | its ms | planned / fastest |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for fraction, plan in link["plans"].items():
            lines.append(_plan_row(fraction, plan))
        lines += ["", "| fixed variant | predicted peak MiB | measured peak MiB | predicted ms | median ms "
                  "| time ratio |", "|---|---|---|---|---|---|"]
        lines += [_fixed_row(n, r) for n, r in link["runs"].items() if not n.startswith("planned")]
        lines.append("")
    return "\n".join(lines) + "\n"


def _fixed_row(name: str, row: dict[str, Any]) -> str:
    p = row.get("predicted")
    if p is None:
        return f"| {name} | — | {row['peak_device_bytes'] / MIB:.2f} | — | {row['step_seconds'] * 1e3:.1f} | — |"
    return (f"| {name} | {p['peak_device_bytes'] / MIB:.2f} | {row['peak_device_bytes'] / MIB:.2f} | "
            f"{p['step_seconds'] * 1e3:.1f} | {row['step_seconds'] * 1e3:.1f} | "
            f"{row['step_seconds'] / p['step_seconds']:.3f} |")


def _plan_row(fraction: str, plan: dict[str, Any]) -> str:
    if "error" in plan:
        return f"| {fraction} ({plan['budget'] / MIB:.2f} MiB) | {plan['error']} | | | | | | | | | |"
    p, m = plan["predicted"], plan["measured"]
    fastest = plan["fastest_fixed"] or "none fits"
    its = f"{plan['fastest_fixed_seconds'] * 1e3:.1f}" if plan["fastest_fixed"] else "—"
    versus = f"{plan['planned_vs_fastest']:.3f}" if plan["fastest_fixed"] else "—"
    return (f"| {fraction} ({plan['budget'] / MIB:.2f} MiB) | {'; '.join(plan['decisions'])} | "
            f"{p['peak_device_bytes'] / MIB:.2f} | {m['peak_device_bytes'] / MIB:.2f} | {plan['peak_ratio']:.3f} | "
            f"{p['step_seconds'] * 1e3:.1f} | {m['step_seconds'] * 1e3:.1f} | {plan['time_ratio']:.3f} | "
            f"{fastest} | {its} | {versus} |")


def plot(results: dict[str, Any], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 5))
    for link, marker in zip(results["links"], ("o", "s")):
        fixed = {n: r for n, r in link["runs"].items() if not n.startswith("planned")}
        ax.scatter([r["step_seconds"] * 1e3 for r in fixed.values()],
                   [r["peak_device_bytes"] / MIB for r in fixed.values()], marker=marker, alpha=0.5,
                   label=f"fixed variants, link {link['link']}")
        planned = sorted((p for p in link["plans"].values() if "measured" in p), key=lambda p: p["budget"])
        ax.plot([p["measured"]["step_seconds"] * 1e3 for p in planned],
                [p["measured"]["peak_device_bytes"] / MIB for p in planned], marker=marker, linewidth=2,
                label=f"planner frontier (measured), link {link['link']}")
    ax.set_xlabel("median step time (ms)")
    ax.set_ylabel("peak device-resident saved MiB (session accounting)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, few repetitions")
    parser.add_argument("--reps", type=positive_int, help="timed interleaved steps per variant (default 15, quick 3)")
    parser.add_argument("--out", type=output_dir, default=DEFAULT_OUT)
    parser.add_argument("--links", nargs="+", choices=sorted(LINKS), default=list(LINKS), help="emulated links")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads (default 1: a core stays free for "
                        "the copy thread, as a GPU's copy engine leaves the SMs alone)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    model, batch = (QUICK_MODEL, QUICK_BATCH) if args.quick else (DEFAULT_MODEL, DEFAULT_BATCH)
    reps, warmup = args.reps or (3 if args.quick else 15), 1 if args.quick else 2
    env = {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
           "torch_threads": torch.get_num_threads(), "model": model,
           "batch": batch, "reps": reps, "warmup": warmup, "load_start": os.getloadavg()}
    links = [one_link(name, link, model, batch, reps, warmup, args.quick) for name, link in LINKS.items()
             if name in args.links]
    env["load_end"] = os.getloadavg()
    results = {"env": env, "links": links}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    text = markdown(results)
    (args.out / "results.md").write_text(text)
    plot(results, args.out / "planner_tradeoff.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
