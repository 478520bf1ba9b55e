"""Does it fit? Swap and recompute under a device-memory cap that the baseline does not fit in.

The other benchmarks read memory off counters; this one gives the GPU less memory than the plain
model needs and trains. ``torch.cuda.set_per_process_memory_fraction`` caps what PyTorch's caching
allocator may reserve, so a variant fits when its reserved bytes stay under the cap, whatever its
allocated bytes say (Note [The cap is on reserved bytes]).

First the baseline runs uncapped: its peak reserved bytes over a warm-up and a few steps are what
the model *needs*. Then the allocator is capped at ``--cap`` times that, and every variant (its own
model copy, same seed) runs ``--warmup`` + ``--steps`` steps, in ``--rounds`` interleaved rounds, each
round on a freshly built model after ``torch.cuda.empty_cache()``. Per variant: whether it fit (or
the step it ran out of memory at), the median step time and its ratio to the uncapped baseline's,
peak reserved and allocated bytes, and the allocator's retries: mallocs that found no free block
under the cap, freed every cached block (which synchronizes the device) and tried again.

Usage::

    python benchmarks/memory_cap.py --config benchmarks/configs/gpu.yaml --cap 0.6 --out bench-out/cap
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from common import environment, hardware_line, load_setup, make_batch, output_dir, positive_int
from variants import BASELINE, FULL_RECOMPUTE, LAYER_SWAP, Runner, Variant, main_variants

MiB = 1 << 20
#: Note [A model whose activations are a small part of its memory]
GPU_CONFIG = Path(__file__).resolve().parent / "configs" / "gpu.yaml"
#: The variants run under the cap: the baseline (which should not fit), and the two swaps and
#: recompute strategies that cut the most memory in swap_vs_recompute.py.
CAPPED = (BASELINE, LAYER_SWAP, "swap op attention+feed_forward", FULL_RECOMPUTE, "swap layer + recompute feed_forward")

# Note [The cap is on reserved bytes]
# ``set_per_process_memory_fraction`` limits the caching allocator's reserved bytes: the blocks it
# holds, free or not. A block can be free yet not reusable: the CUDA engine frees a swapped
# storage as soon as its device-to-host copy is queued, and the allocator hands the block out
# again only after the side stream ran that copy (``swapkit.engine.cuda`` Note [Copy sources are
# released in stream order]). When the CPU runs ahead of the GPU, such blocks pile up; at the cap
# the allocator frees its cached blocks, which waits for those copies, and retries. So a variant
# that fits by ``max_memory_allocated`` may still hit the cap, or fit at the cost of device
# synchronizations: the retries column counts them, and the time column shows what they cost.

# Note [A model whose activations are a small part of its memory]
# The cap is a fraction of the baseline's whole reserved memory: parameters, gradients, the
# allocator's rounding and its expandable segment's granularity, besides the activations. On the
# CPU benchmarks' default model (88 MiB of activations in 182 MiB reserved, on an H100) a cap of 0.6
# leaves too little for any variant, full recompute included, and every row read "out of memory at
# step 0": a run that measured nothing. So the default is the GPU-sized config, and a run in which
# nothing fit says why and what to change instead of printing a table of failures.


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(GPU_CONFIG),
                        help="swapkit YAML: model sizes from model.model_config, batch from train (default: "
                             "benchmarks/configs/gpu.yaml, whose activations dominate the step's memory)")
    parser.add_argument("--cap", type=float, default=0.6,
                        help="the allocator's cap as a fraction of the baseline's uncapped peak reserved bytes")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds over the variants")
    parser.add_argument("--prefetch", type=positive_int, default=8, help="backward_prefetch of the swap variants")
    parser.add_argument("--out", type=output_dir, default=Path("bench-out/memory_cap"))
    args = parser.parse_args(argv)
    if not 0 < args.cap <= 1:
        parser.error(f"--cap: got {args.cap}; expected a fraction in (0, 1]")
    for name in ("warmup", "steps", "rounds"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            least = "an integer >= 0" if name == "warmup" else "a positive integer"  # no warm-up is allowed
            parser.error(f"--{name}: got {getattr(args, name)}; expected {least}")
    return args


def run_round(runner_args: tuple[Variant, Any], batch: Any, warmup: int, steps: int) -> dict[str, Any]:
    """One variant on a fresh model: ``warmup`` + ``steps`` steps, or the step it ran out of memory at."""
    device = batch[0].device
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
    runner, times, step, oom_at, peaks = None, [], 0, None, [(0, 0)]
    try:
        runner = Runner(*runner_args)
        for step in range(1, warmup + steps + 1):
            sample = runner.step(batch, record=False)  # resets the peak counters first (Note [A step's CUDA peak])
            peaks.append((torch.cuda.max_memory_reserved(device), torch.cuda.max_memory_allocated(device)))
            if step > warmup:
                times.append(sample.seconds)
    except torch.OutOfMemoryError:
        oom_at = step  # 0: building the model ran out
        peaks.append((torch.cuda.max_memory_reserved(device), torch.cuda.max_memory_allocated(device)))
    finally:
        if runner is not None:
            runner.close()
        del runner
    retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0) - retries
    return {"times": times, "oom_at_step": oom_at, "alloc_retries": retries,
            "peak_reserved_bytes": max(r for r, _ in peaks), "peak_allocated_bytes": max(a for _, a in peaks)}


def summarize(name: str, rounds: list[dict[str, Any]], baseline_s: float) -> dict[str, Any]:
    times = [t for r in rounds for t in r["times"]]
    ooms = [r["oom_at_step"] for r in rounds if r["oom_at_step"] is not None]
    median = statistics.median(times) if times else None
    return {"name": name, "fits": not ooms, "oom_at_steps": ooms, "step_time_median_s": median,
            "time_ratio": median / baseline_s if median and not ooms else None,
            "alloc_retries_per_round": [r["alloc_retries"] for r in rounds],
            "peak_reserved_bytes": max(r["peak_reserved_bytes"] for r in rounds),
            "peak_allocated_bytes": max(r["peak_allocated_bytes"] for r in rounds)}


def report_lines(results: dict[str, Any]) -> list[str]:
    env, cap = results["env"], results["cap"]
    lines = ["# swapkit benchmark: training under a device-memory cap", "",
             f"**Hardware/versions:** {hardware_line(env)}", "",
             f"The baseline's uncapped peak reserved memory: {cap['need_bytes'] / MiB:.0f} MiB, step "
             f"{cap['baseline_uncapped_s'] * 1e3:.1f} ms (median). Cap: {cap['fraction']} of it, "
             f"{cap['cap_bytes'] / MiB:.0f} MiB (`set_per_process_memory_fraction({cap['process_fraction']:.4f})`). "
             f"{results['run']['rounds']} interleaved rounds of {results['run']['warmup']} warm-up + "
             f"{results['run']['steps']} timed steps per variant; swap variants use backward_prefetch "
             f"{results['run']['prefetch']}; a step is forward + loss + backward. "
             f"`PYTORCH_CUDA_ALLOC_CONF={env.get('pytorch_cuda_alloc_conf')}`.", "",
             "| variant | fits under the cap | step ms (median) | time / uncapped baseline | peak reserved MiB | "
             "peak allocated MiB | allocator retries per round |", "|---|---|---|---|---|---|---|"]
    for row in results["variants"]:
        fits = "yes" if row["fits"] else f"no: out of memory at step {', '.join(map(str, row['oom_at_steps']))}"
        ms = f"{row['step_time_median_s'] * 1e3:.1f}" if row["step_time_median_s"] and row["fits"] else "—"
        ratio = f"{row['time_ratio']:.3f}" if row["time_ratio"] else "—"
        lines.append(f"| {row['name']} | {fits} | {ms} | {ratio} | {row['peak_reserved_bytes'] / MiB:.0f} | "
                     f"{row['peak_allocated_bytes'] / MiB:.0f} | {row['alloc_retries_per_round']} |")
    if not any(row["fits"] for row in results["variants"]):
        lines += ["", nothing_fit(results)]
    return lines + ["", "Allocator retries: mallocs that found no block under the cap, freed the cache "
                        "(synchronizing the device) and retried (Note [The cap is on reserved bytes] in "
                        "benchmarks/memory_cap.py)."]


def nothing_fit(results: dict[str, Any]) -> str:
    """Note [A model whose activations are a small part of its memory]"""
    cap = results["cap"]
    return (f"**Nothing fit under the cap** ({cap['cap_bytes'] / MiB:.0f} MiB, {cap['fraction']} of "
            f"{cap['need_bytes'] / MiB:.0f} MiB): not even the variants that keep the fewest activations, so "
            "the model's memory besides its activations (parameters, gradients, the allocator's rounding) is "
            "most of what it needs, and this run measured nothing. Raise --cap, or use a config whose "
            "activations dominate its memory (the default, benchmarks/configs/gpu.yaml).")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(f"memory_cap.py needs a CUDA device (torch {torch.__version__} sees none): the cap is the "
              "CUDA caching allocator's; on CPU use swap_vs_recompute.py", file=sys.stderr)
        return 2
    # What swapkit train sets (swapkit.train.loop.resolve_device); before the first CUDA allocation, and
    # the user's own setting wins: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False measures without.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    logging.getLogger("swapkit").setLevel(logging.ERROR)
    started = time.perf_counter()
    setup = load_setup(args.config, False, "cuda")
    batch = make_batch(setup)
    by_name = {v.name: v for v in main_variants(setup, args.prefetch)}
    env = environment(setup, "cuda", {name: by_name[name].sections for name in CAPPED})
    env["pytorch_cuda_alloc_conf"] = os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    uncapped = run_round((by_name[BASELINE], setup), batch, args.warmup, args.steps)
    need = uncapped["peak_reserved_bytes"]
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    fraction = args.cap * need / total
    torch.cuda.set_per_process_memory_fraction(fraction, torch.cuda.current_device())
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in CAPPED}
    for _ in range(args.rounds):
        for name in CAPPED:
            rounds[name].append(run_round((by_name[name], setup), batch, args.warmup, args.steps))
    baseline_s = statistics.median(uncapped["times"])
    env["load_average_at_end"] = os.getloadavg()
    env["wall_seconds"] = round(time.perf_counter() - started, 1)
    results = {"env": env, "run": vars(args) | {"out": str(args.out)},
               "cap": {"fraction": args.cap, "need_bytes": need, "cap_bytes": int(fraction * total),
                       "process_fraction": fraction, "baseline_uncapped_s": baseline_s,
                       "baseline_uncapped": uncapped},
               "variants": [summarize(name, rounds[name], baseline_s) for name in CAPPED]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memory_cap.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    text = "\n".join(report_lines(results)) + "\n"
    (args.out / "memory_cap.md").write_text(text)
    print(text)
    if not any(row["fits"] for row in results["variants"]):
        print(f"memory_cap.py: {nothing_fit(results)}".replace("**", ""), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
