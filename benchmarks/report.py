"""Render benchmark results: results.json, results.md (markdown tables) and the two plots."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

from common import counted, hardware_line, load_warning  # noqa: E402
from variants import ACCOUNTING, BASELINE, FULL_RECOMPUTE, LAYER_SWAP  # noqa: E402

MIB = 2**20
MEMORY_NOTE = ("On CPU the \"device\" and the host share RAM, so memory is the swap session's accounting of "
               "device-resident saved bytes (parameters excluded), not the process's RSS. The baseline's memory "
               "figure comes from a swapkit session with nothing configured (it keeps every tensor: accounting "
               "only). The probe columns count independently of the session's hooks: bytes of storages created "
               "during the step and still alive (TorchDispatchMode + weak references, parameters excluded), at "
               "the end of the forward and at their peak over the whole step; the step peak also holds the "
               "gradients and what backward re-materializes (recomputed layers, prefetched buffers).")


def write_all(results: dict[str, Any], out: Path) -> str:
    """Write results.json, results.md, tradeoff.png and prefetch_sweep.png; return the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    markdown = render_markdown(results)
    (out / "results.md").write_text(markdown)
    plot_tradeoff(results["variants"], out / "tradeoff.png")
    if results["sweep"]["rows"]:
        plot_sweep(results["sweep"]["rows"], out / "prefetch_sweep.png")
    return markdown


def _mib(value: Any) -> str:
    return "—" if value is None else f"{value / MIB:.1f}"


def _num(value: Any, fmt: str = "{:.3f}") -> str:
    return "—" if value is None else fmt.format(value)


def _ms(value: Any) -> str:
    return "—" if value is None else f"{value * 1e3:.1f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


#: Below this share of its wall time on a core, a one-thread baseline step was kept off the cores by others.
ON_CORE_SHARE = 0.8


def _off_core_warning(env: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """Note [Contention the load average misses]
    The load average is a one-minute mean: a short run that starts beside a busy process, or one that
    just started, reads a low load while it shares the cores. With one torch thread on the CPU, the
    baseline's step runs entirely on the measuring thread, so its main-thread CPU time is its wall time
    on an uncontended core (0.999 and 1.000 in two quick runs on the idle 2-core machine) and falls well below that when
    another process takes the core (0.6 beside two test runs whose load average had not yet passed
    the core count). That share is read directly from the run, so it is the signal used when the load
    average says nothing."""
    base = next((r for r in rows if r["name"] == BASELINE), None)
    if (env.get("torch_threads") != 1 or str(env.get("device", "cpu")) != "cpu" or base is None
            or not base.get("step_time_median_s") or base.get("main_thread_cpu_median_s") is None):
        return []
    share = base["main_thread_cpu_median_s"] / base["step_time_median_s"]
    if share >= ON_CORE_SHARE:
        return []
    return [f"the machine was loaded: the baseline's one-thread steps ran on a core only {share:.0%} of their wall "
            "time (other processes took the cores), so step times and the copy thread's pace are noisy; rerun on an "
            "idle machine"]


def _link_warning(rows: list[dict[str, Any]], link: dict[str, Any] | None) -> list[str]:
    """Note [A link calibrated under contention]
    The sweep's emulated link is sized from the plain model's forward, timed on its own just before the
    sweep (sweep.py Note [Emulated link]). On the shared 2-core machine, with two torch threads, that
    forward once measured 57-254 ms in --quick runs whose whole baseline step (forward and backward) took
    20-23 ms in the same run: another process had taken a core for those moments, the link came out up
    to 75 times too slow and the sweep's step times 9-11 times the baseline's, with no warning (the load
    average stayed under the core count). A forward longer than the whole step cannot be the model's, so
    it marks the sweep as measured under contention."""
    base = next((r for r in rows if r["name"] == BASELINE), None)
    forward, step = (link or {}).get("model_forward_s"), (base or {}).get("step_time_median_s")
    if not forward or not step or forward <= step:
        return []
    return [f"the prefetch sweep's link was sized from a forward of {forward * 1e3:.1f} ms, longer than the "
            f"baseline's whole training step ({step * 1e3:.1f} ms): the machine was contended while it was "
            "measured, so the sweep's link is too slow and its rows are not comparable; rerun on an idle machine"]


def hygiene_warnings(env: dict[str, Any], rows: list[dict[str, Any]], link: dict[str, Any] | None = None) -> list[str]:
    """Reasons to distrust this run: a loaded machine, a variant that adds work measured faster, or a
    sweep link sized from a contended forward (Note [A link calibrated under contention])."""
    warnings = _link_warning(rows, link)
    loaded = load_warning(env["cpu_count"], env["load_average_at_start"], env.get("load_average_at_end"))
    warnings += loaded
    if not loaded:
        warnings += _off_core_warning(env, rows)
    faster = [r for r in rows if r["name"] not in (BASELINE, ACCOUNTING) and r["time_ratio"] is not None
              and r["time_ratio"] < 1]
    for r in faster:
        warnings.append(f"{r['name']} measured faster than the baseline (time ratio {r['time_ratio']:.3f}) although "
                        "it adds work (copies or recompute): noise dominates; more --reps or an idle machine")
    for r in rows:
        if "baseline_reprobe_equal" in r.get("checks", {}) and not (r["checks"].get("grads_equal")
                                                                     and r["checks"].get("loss_equal")):
            cause = ("the baseline also differed from itself when probed again: the machine's math was not "
                     "deterministic here, a benchmark artifact" if not r["checks"]["baseline_reprobe_equal"] else
                     "the baseline matched itself when probed again: look at this variant")
            warnings.append(f"{r['name']}: loss or gradients differ from the baseline's; {cause}")
    return warnings


def render_markdown(results: dict[str, Any]) -> str:
    env = results["env"]
    marks = [f"> **WARNING:** {w}" for w in results.get("warnings", ())]
    lines = ["# swapkit benchmark: swap vs recompute", "", *marks, *([""] if marks else []),
             f"**Hardware/versions:** {hardware_line(env)}", "",
             _setup_line(results), "", MEMORY_NOTE, "", "## Variants", ""]
    lines += variant_table(results["variants"], env["device"].startswith("cuda"))
    lines += ["", *_notes(results["variants"]), *[f"- {note}" for note in env.get("skipped_peers", ())]]
    lines += ["", "## Checks", ""] + check_table(results["variants"])
    lines += ["", "## Targets", "", *target_lines(results["variants"])]
    lines += overhead_section(results.get("layer_swap_overhead"), results["env"])
    lines += ["", "## Prefetch-distance sweep (layer swap)", "", *sweep_section(results["sweep"])]
    lines += ["", "## Per-tensor overhead (microbenchmark)", "", *micro_section(results["microbench"])]
    return "\n".join(lines) + "\n"


def _setup_line(results: dict[str, Any]) -> str:
    cfg, run = results["env"]["config"], results["run"]
    model = ", ".join(f"{k} {v}" for k, v in cfg["model_config"].items() if k in _SIZE_KEYS)
    return (f"**Model:** built-in Llama-style, {model}, batch {cfg['batch_size']}. **Run:** "
            f"{counted(run['warmup'], 'warm-up step')} then {counted(run['reps'], 'interleaved repetition')} per "
            f"variant; swap variants use backward_prefetch {run['prefetch']}; a step is forward + loss + backward "
            "(no optimizer). Time ratio = median over repetitions of (variant step / baseline step in the same "
            "repetition).")


_SIZE_KEYS = ("num_layers", "hidden_size", "num_heads", "intermediate_size", "vocab_size", "seq_length")


def variant_table(rows: list[dict[str, Any]], cuda: bool) -> list[str]:
    header = ["variant", "time ratio", "step ms", "peak saved MiB (session)", "memory ratio",
              "probe: live at fwd end MiB", "probe: step peak MiB", "probe peak ratio", "moved MiB/step",
              "late fetches", "exposed wait ms", "host pool MiB"]
    header += ["cuda step peak MiB", "cuda ratio"] if cuda else []
    body = []
    for r in rows:
        line = [r["name"], _num(r["time_ratio"]), _ms(r["step_time_median_s"]), _mib(r["peak_device_bytes"]),
                _num(r["memory_ratio"]), _mib(r["probe_forward_end_bytes"]), _mib(r["probe_peak_live_bytes"]),
                _num(r["probe_peak_ratio"]),
                _mib(r["moved_bytes"]), _num(r["late_fetches"], "{:g}"), _ms(r["wait_seconds"]),
                _mib(r["host_pool_bytes"])]
        line += [_mib(r["cuda_step_peak_bytes"]), _num(r["cuda_memory_ratio"])] if cuda else []
        body.append(line)
    return _table(header, body)


def _notes(rows: list[dict[str, Any]]) -> list[str]:
    return [f"- *{r['name']}*: {r['note']}" for r in rows if r["note"]]


def check_table(rows: list[dict[str, Any]]) -> list[str]:
    header = ["variant", "parameter bytes moved", "storages moved twice", "copies = offloaded_tensors",
              "offloaded <= saved", "parameter MiB skipped", "loss == baseline", "grads vs baseline"]
    body = []
    for r in rows:
        c = r["checks"]
        moved = c.get("offload_copies") is not None
        body.append([r["name"], str(c["parameter_bytes_moved"]) if moved else "—",
                     str(c["moved_twice"]) if moved else "—",
                     str(c["offload_copies"] == c["stats_offloaded_tensors"]) if moved else "—",
                     str(c["offloaded_le_saved"]) if moved else "—",
                     _mib(c["parameter_bytes_skipped"]) if moved else "—", _yes(c.get("loss_equal")),
                     _grads(c)])
    return _table(header, body)


def _yes(value: Any) -> str:
    return "—" if value is None else ("yes" if value else "no")


def _grads(checks: dict[str, Any]) -> str:
    if "grads_equal" not in checks:
        return "—"
    return "bit-identical" if checks["grads_equal"] else f"max abs diff {checks['grad_max_abs_diff']:.2e}"


def _row(rows: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["name"] == name), None)


def target_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Each target with its measured figure and whether it was met (targets, not tests)."""
    layer, full = _row(rows, LAYER_SWAP), _row(rows, FULL_RECOMPUTE)
    lines = []
    if layer is not None and layer["memory_ratio"] is not None:
        cut = 1 - layer["memory_ratio"]
        lines.append(f"- Swap every layer cuts peak device-resident saved bytes by >= 75%: measured "
                     f"{cut:.1%} (ratio {layer['memory_ratio']:.3f}) — {'MET' if cut >= 0.75 else 'MISSED'}.")
        ratio = layer["time_ratio"]
        lines.append(f"- Swap every layer within 1.05 of baseline step time: measured {ratio:.3f} "
                     f"({layer['late_fetches']:g} late fetches, {layer['wait_seconds'] * 1e3:.1f} ms exposed wait "
                     f"per step) — {'MET' if ratio <= 1.05 else 'MISSED'}.")
    if full is not None:
        lines.append(f"- Full recompute beside it: time ratio {full['time_ratio']:.3f}, memory ratio "
                     f"{_num(full['memory_ratio'])} (session), step-peak ratio {_num(full['probe_peak_ratio'])} "
                     f"(probe; the layer swap: {_num(layer['probe_peak_ratio'] if layer else None)}).")
    lines += _move_lines(rows)
    return lines


def _move_lines(rows: list[dict[str, Any]]) -> list[str]:
    checked = [r for r in rows if r["checks"].get("offload_copies") is not None]
    params = sum(r["checks"]["parameter_bytes_moved"] for r in checked)
    twice = sum(r["checks"]["moved_twice"] for r in checked)
    return [f"- Zero parameter bytes moved: {params} bytes over {len(checked)} swapkit variants — "
            f"{'MET' if params == 0 else 'MISSED'}.",
            f"- No storage moved twice in a step: {twice} repeated copies — {'MET' if twice == 0 else 'MISSED'}."]


def overhead_section(estimate: dict[str, Any] | None, env: dict[str, Any]) -> list[str]:
    """The CPU layer swap's extra time, split by :func:`measure.overhead_estimate`."""
    if estimate is None:
        return []
    copy = estimate["copy"]
    return ["", "### Where the layer swap's extra time goes (CPU estimate)", "",
            f"Measured extra per step: {_ms(estimate['measured_extra_s'])} ms. Copy-thread work (round trips timed "
            "through the engine): every swapped "
            f"byte is copied out into a reused pool buffer ({copy['reused_buffer_gbps']:.1f} GB/s measured for a "
            f"{copy['bytes'] / MIB:.1f} MiB tensor) and back into a freshly allocated buffer "
            f"({copy['fresh_buffer_gbps']:.1f} GB/s), about "
            f"{_ms(estimate['worker_copy_s'])} ms of copy-thread CPU time per step ({env['torch_threads']} compute "
            f"threads on {env['cpu_count']} cores: {_core_note(env)}; a GPU's copy engine uses no CPU core). "
            f"Main-thread hook work (per-tensor costs from the microbenchmark below): about "
            f"{_ms(estimate['main_thread_hooks_s'])} ms per step. The main thread's own CPU time grew by "
            f"{_ms(estimate['main_thread_cpu_extra_s'])} ms per step (hooks, and compute slowed by the copy thread's "
            f"memory traffic); the other {_ms(estimate['main_thread_off_cpu_extra_s'])} ms it was off the CPU: "
            "waiting for a core (the copy thread's memcpy takes one of the cores the compute threads use) or for "
            "the GIL (the copy thread runs Python around every copy)."
            + _verify_note(copy)]


def _verify_note(copy: dict[str, Any]) -> str:
    if "verify_checksum_gbps" not in copy:
        return ""
    return (f" Verify mode adds two checksums per round trip, on the main thread, at "
            f"{copy['verify_checksum_gbps']:.1f} GB/s for the same tensor (one pass over the bytes at memory speed).")


def _core_note(env: dict[str, Any]) -> str:
    if env["torch_threads"] < env["cpu_count"]:
        return "a core is left for the copy thread, which still shares memory bandwidth and caches"
    return "the copy thread competes with them for cores"


def sweep_section(sweep: dict[str, Any]) -> list[str]:
    if not sweep["rows"]:
        return ["(not run)"]
    header = ["backward_prefetch", "step ms", "time ratio", "exposed wait ms", "late fetches",
              "mean prefetch lead (ticks)", "peak saved MiB", "memory ratio", "tail MiB (kept on device)"]
    body = [[str(r["backward_prefetch"]), _ms(r["step_time_median_s"]), _num(r["time_ratio"]), _ms(r["wait_seconds"]),
             _num(r["late_fetches"], "{:g}"), _num(r["mean_prefetch_lead"], "{:.1f}"), _mib(r["peak_device_bytes"]),
             _num(r["memory_ratio"]), _mib(r["tail_bytes"])] for r in sweep["rows"]]
    return [f"**Link:** {sweep['link']['why']}.", ""] + _table(header, body)


def micro_section(micro: dict[str, Any]) -> list[str]:
    if not micro:
        return ["(not run)"]
    from microbench import LABELS  # the benchmark's own labels, one place
    per, ratio = micro["us_per_saved_tensor"], micro.get("over_identity", {})
    cpu, cpu_ratio = micro.get("cpu_us_per_saved_tensor", {}), micro.get("cpu_over_identity", {})
    body = [[LABELS[k], _ms(v), "—" if k == "none" else f"{per[k]:.2f}",
             f"{ratio[k]:.1f}x" if k in ratio else "—", f"{cpu[k]:.2f}" if k in cpu else "—",
             f"{cpu_ratio[k]:.1f}x" if k in cpu_ratio else "—"] for k, v in micro["step_time_median_s"].items()]
    return [f"A chain of {micro['ops_in_chain']} `sin` ops on {micro['tensor_bytes']}-byte tensors in one layer: "
            f"{micro['saved_tensors_per_step']} saved tensors per step, {micro['reps']} interleaved repetitions. "
            f"Cost = median over repetitions of (step - step of (a) in the same repetition) / saved tensors, on "
            f"the wall clock and on the main thread's CPU clock. The session's bookkeeping costs "
            f"{micro['session_keep_over_identity_us']:.2f} us per tensor over bare identity hooks. In (e) every "
            f"saved tensor is two copy jobs (out and back) whatever its size; (d) coalesces a scope's storages into "
            f"one job each way ({micro.get('swap_copy_jobs', '?')} jobs for {micro['swap_offloaded_tensors']} "
            f"swapped storages, {micro['swap_late_fetches']} late fetches per step).", ""] + \
        _table(["way", "step ms (median)", "us per saved tensor (wall)", "over (b)", "us (main-thread CPU)",
                "over (b), CPU"], body)


def plot_tradeoff(rows: list[dict[str, Any]], path: Path) -> None:
    """Memory against time, one marker per variant, named in a legend beside the axes (no labels on the
    plot, so none can overlap). Memory is the independent live-bytes probe's step peak (on CUDA the
    allocator's peak): it sees what recompute re-materializes, which the session accounting does not."""
    fig, ax = plt.subplots(figsize=(10, 5.5))
    key = "cuda_memory_ratio" if rows[0].get("cuda_memory_ratio") is not None else "probe_peak_ratio"
    shown = [r for r in rows if r["name"] != ACCOUNTING and r.get(key) is not None]
    markers = "osD^vP*Xhp<>"
    for i, r in enumerate(shown):
        ax.scatter(r["time_ratio"], r[key], s=50, marker=markers[i % len(markers)], label=r["name"], zorder=3)
    ax.axvline(1.05, color="grey", linestyle=":", linewidth=1, label="target: step time <= 1.05 x baseline")
    ax.axhline(0.25, color="grey", linestyle="--", linewidth=1, label="target: memory <= 0.25 x baseline (75% cut)")
    ax.set_xlabel(f"step time / {BASELINE} (median of pairwise ratios)")
    cuda_label = "CUDA step peak (max_memory_allocated above the step's start) / baseline"
    ax.set_ylabel(cuda_label if key == "cuda_memory_ratio" else
                  "step-peak live activation bytes / baseline (independent probe)")
    ax.set_title("swap vs recompute: memory against time (lower left is better)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_sweep(rows: list[dict[str, Any]], path: Path) -> None:
    """Per distance, one quantity (one unit) per panel: exposed wait (ms), late fetches (count), ratios."""
    ks = [r["backward_prefetch"] for r in rows]
    fig, (wait, late, ratio) = plt.subplots(1, 3, figsize=(13, 4.2))
    wait.plot(ks, [r["wait_seconds"] * 1e3 for r in rows], "o-")
    wait.set(title="exposed wait", ylabel="ms per step")
    late.plot(ks, [r["late_fetches"] for r in rows], "s-", color="tab:orange")
    late.set(title="late fetches", ylabel="fetches per step")
    ratio.plot(ks, [r["memory_ratio"] for r in rows], "o-", label="peak saved bytes")
    ratio.plot(ks, [r["time_ratio"] for r in rows], "s--", label="step time")
    ratio.set(title="memory held and step time", ylabel="ratio to baseline")
    ratio.legend(fontsize=8)
    for ax in (wait, late, ratio):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_xlabel("backward_prefetch (ticks)")
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
