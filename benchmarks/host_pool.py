"""Host bytes held for swapped activations: swapkit's slab pool against power-of-two pinned blocks.

For each mix of buffer sizes (the storages one forward of the benchmark model saves, and the
activations one Llama-3-8B layer saves at sequence 8192 in bf16), every "step" acquires one host
buffer per size in forward order and gives them back in reverse, as a swap step does. Per mix:

* swapkit ``HostPool`` (``swapkit.engine.make_pool``): bytes its slabs hold (on CUDA, what
  ``cudaHostRegister`` pinned), new slabs after the first step, and the CPU time of one
  acquire + release;
* power-of-two blocks: on CUDA ``torch.empty(n, pin_memory=True)`` for real, read from
  ``torch.cuda.host_memory_stats()``; on CPU the bytes the CachingHostAllocator would hold,
  ``sum(PowerOf2Ceil(n))`` (modelled, marked so).

Usage::

    python benchmarks/host_pool.py --quick                 # CPU, seconds
    python benchmarks/host_pool.py --device cuda --out benchmarks/results
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from swapkit.engine import ThreadCopyEngine, make_pool
from swapkit.train.model import lm_loss

from common import (environment, fresh_model, hardware_line, load_setup, load_warning, make_batch, output_dir,
                    positive_int, warning_lines)

MiB = 1 << 20


def llama3_8b_layer(seq: int = 8192) -> list[int]:
    """Bytes of the activations one Llama-3-8B decoder layer saves (micro-batch 1, bf16): norm inputs
    and outputs, q/k/v, attention output and its log-sum-exp, o_proj input, gate/up/silu/product."""
    hidden, inter, kv, heads, bf16 = 4096, 14336, 1024, 32, 2
    return [seq * hidden * bf16, seq * hidden * bf16, seq * hidden * bf16, seq * kv * bf16, seq * kv * bf16,
            seq * hidden * bf16, seq * heads * 4, seq * hidden * bf16, seq * hidden * bf16, seq * hidden * bf16,
            seq * inter * bf16, seq * inter * bf16, seq * inter * bf16, seq * inter * bf16]


def saved_storage_sizes(setup: Any) -> list[int]:
    """Bytes of every distinct non-parameter storage one forward of the benchmark model saves."""
    model, batch = fresh_model(setup), make_batch(setup)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    sizes: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.nbytes():
            sizes.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lm_loss(model(batch[0]), batch[1])
    return list(sizes.values())


def power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


def slab_pool_run(sizes: list[int], device: torch.device, steps: int) -> dict[str, Any]:
    """``steps`` acquire-all / release-in-reverse rounds through the session's pool."""
    if device.type == "cuda":
        from swapkit.engine.cuda import CudaCopyEngine

        engine: Any = CudaCopyEngine(device)
    else:
        engine = ThreadCopyEngine(device)
    pool = make_pool(engine, None)
    held, elapsed = [], 0.0
    for _ in range(steps):
        start = time.thread_time()
        buffers = [pool.acquire(n) for n in sizes]
        for buffer in reversed(buffers):
            pool.release(buffer)
        elapsed += time.thread_time() - start
        held.append((pool.total_bytes, pool.allocations))
    engine.close()
    pool.clear()
    return {"held_bytes": held[-1][0], "slabs": held[-1][1], "new_slabs_after_first_step": held[-1][1] - held[0][1],
            "held_bytes_flat_after_first_step": len(set(held)) == 1,
            "us_per_acquire_release": elapsed / (steps * len(sizes)) * 1e6}


def pinned_power_of_two_run(sizes: list[int], steps: int) -> dict[str, Any]:
    """The same rounds with ``torch.empty(n, pin_memory=True)``; bytes from the host allocator's stats."""
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    for _ in range(steps):
        buffers = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in sizes]
        del buffers
    held = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) - before
    return {"held_bytes": held, "measured": True}


def compare(name: str, sizes: list[int], device: torch.device, steps: int) -> dict[str, Any]:
    data = sum(sizes)
    pool = slab_pool_run(sizes, device, steps)
    if device.type == "cuda":
        pow2 = pinned_power_of_two_run(sizes, steps)
    else:
        pow2 = {"held_bytes": sum(power_of_two(n) for n in sizes), "measured": False}
    return {"mix": name, "buffers": len(sizes), "data_bytes": data, "slab_pool": pool,
            "slab_pool_ratio": pool["held_bytes"] / data, "power_of_two": pow2,
            "power_of_two_ratio": pow2["held_bytes"] / data}


def markdown(env: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    warnings = load_warning(env["cpu_count"], env["load_average_at_start"], env.get("load_average_at_end"))
    lines = ["# Host bytes held for swapped activations", "", *warning_lines(warnings), hardware_line(env), "",
             "| mix | buffers | data MiB | slab pool MiB (x data) | slabs | new slabs after step 1 "
             "| µs acquire+release | power-of-two MiB (x data) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pool, pow2 = r["slab_pool"], r["power_of_two"]
        how = "measured" if pow2["measured"] else "modelled"
        lines.append(f"| {r['mix']} | {r['buffers']} | {r['data_bytes'] / MiB:.1f} | {pool['held_bytes'] / MiB:.1f} "
                     f"({r['slab_pool_ratio']:.3f}) | {pool['slabs']} | {pool['new_slabs_after_first_step']} | "
                     f"{pool['us_per_acquire_release']:.2f} | {pow2['held_bytes'] / MiB:.1f} "
                     f"({r['power_of_two_ratio']:.3f}, {how}) |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--quick", action="store_true", help="small model, few steps")
    parser.add_argument("--config", help="swapkit YAML: the benchmark model's sizes")
    parser.add_argument("--steps", type=positive_int, help="rounds per mix (default 50, --quick 5)")
    parser.add_argument("--out", type=output_dir, default=Path("bench-out"), help="output folder (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"--device cuda: CUDA is not available (torch {torch.__version__}); use --device cpu", file=sys.stderr)
        return 2
    setup = load_setup(args.config, args.quick, args.device)
    steps = args.steps or (5 if args.quick else 50)
    seq = 2048 if args.quick else 8192
    mixes = {"benchmark model, one forward": saved_storage_sizes(setup),
             f"Llama-3-8B layer, seq {seq}, bf16": llama3_8b_layer(seq)}
    env = environment(setup, "cuda" if setup.device.type == "cuda" else "thread", {})  # load average before measuring
    rows = [compare(name, sizes, setup.device, steps) for name, sizes in mixes.items()]
    env["load_average_at_end"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    warnings = load_warning(env["cpu_count"], env["load_average_at_start"], env["load_average_at_end"])
    for warning in warnings:  # the µs per acquire + release is a timing (Note [Loaded machines] in common.py)
        print(f"WARNING: {warning}", file=sys.stderr)
    (args.out / "host_pool.json").write_text(json.dumps({"env": env, "steps": steps, "rows": rows,
                                                         "warnings": warnings}, indent=1))
    (args.out / "host_pool.md").write_text(markdown(env, rows))
    print(markdown(env, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
