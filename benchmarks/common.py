"""Shared pieces of the benchmarks: the model under test, one timed step, the environment record.

Note [What a step is]
A benchmark step is one forward, the loss and one backward with the gradients set to ``None``
first; there is no optimizer, so every variant's weights stay identical to the baseline's for the
whole run and their losses and gradients can be compared at any time. On CUDA the step
synchronizes before reading the clock at both ends, so the time covers all queued kernels and
copies.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager

import psutil
import torch

import swapkit
from swapkit.config.errors import ConfigError
from swapkit.config.types import ModelConfig
from swapkit.load import load_config
from swapkit.train.model import build_model, lm_loss

#: The default model: a CPU step (forward + backward) takes roughly 100 ms on 2 cores.
DEFAULT_MODEL = {"num_layers": 4, "hidden_size": 256, "num_heads": 4, "intermediate_size": 704,
                 "vocab_size": 256, "seq_length": 256}
#: ``--quick``: small enough that the whole script finishes in well under a minute on 2 cores.
QUICK_MODEL = {"num_layers": 2, "hidden_size": 128, "num_heads": 2, "intermediate_size": 352,
               "vocab_size": 256, "seq_length": 128}
DEFAULT_BATCH, QUICK_BATCH = 4, 2


def counted(count: int, noun: str) -> str:
    """``1 warm-up step``, ``3 warm-up steps``: a count with its noun in the right number."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def positive_int(text: str) -> int:
    """An ``argparse`` type: a count such as ``--reps`` or ``--prefetch``, at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"got {text!r}; expected a whole number >= 1")
    return value


def positive_float(text: str) -> float:
    """An ``argparse`` type: a finite number above 0, such as ``--link-fraction``."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"got {text!r}; expected a number > 0")
    return value


def output_dir(text: str) -> Path:
    """An ``argparse`` type: a folder that exists or can be created (no file on its path)."""
    path = Path(text)
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"got {text!r}; {existing} is a file, not a folder: choose another path")
    return path


@dataclass(frozen=True)
class Setup:
    """What every variant shares: model sizes (YAML ``model_config``), batch, device, seed."""

    model_config: dict[str, Any]
    batch_size: int
    device: torch.device
    seed: int = 0
    runtime: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def model(self) -> ModelConfig:
        return ModelConfig(**self.model_config)

    def swapkit_config(self, sections: dict[str, Any], runtime: dict[str, Any] | None = None) -> dict[str, Any]:
        """A full config dict in the YAML layout: the shared model and runtime plus ``sections``."""
        return {"model": {"model_config": dict(self.model_config)},
                "runtime": {**self.runtime, **(runtime or {})}, **sections}


def load_setup(config: str | None, quick: bool, device: str) -> Setup:
    """Model sizes and batch from ``--config`` (validated by swapkit's loader), else the defaults.

    Raises:
        SystemExit: status 2 for a bad ``--config``, its problems on stderr (no traceback).
    """
    if config is None:
        model, batch = (QUICK_MODEL, QUICK_BATCH) if quick else (DEFAULT_MODEL, DEFAULT_BATCH)
        return Setup(dict(model), batch, torch.device(device))
    try:
        loaded = load_config(config)
    except ConfigError as err:
        print(f"--config: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    model = {k: v for k, v in dataclasses.asdict(loaded.model).items() if v is not None}
    runtime = {k: v for k, v in dataclasses.asdict(loaded.runtime).items() if v is not None}
    runtime["engine_options"] = {k: v for k, v in runtime["engine_options"].items() if v is not None}
    return Setup(model, loaded.train.batch_size, torch.device(device), loaded.train.seed, runtime)


def make_batch(setup: Setup) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded random tokens and targets ``[batch, seq]`` on the device."""
    cfg = setup.model
    gen = torch.Generator().manual_seed(setup.seed + 1)
    tokens = torch.randint(cfg.vocab_size, (setup.batch_size, cfg.seq_length + 1), generator=gen)
    return tokens[:, :-1].to(setup.device), tokens[:, 1:].to(setup.device)


def fresh_model(setup: Setup) -> torch.nn.Module:
    """A new copy of the built-in model; the same seed gives every variant identical weights."""
    model = build_model(setup.model, seed=setup.seed, device=setup.device)
    model.train()
    return model


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
               context: Callable[[], ContextManager], backward_inside: bool = True) -> tuple[float, float]:
    """One step (Note [What a step is]) under ``context``; returns (wall seconds, main-thread CPU
    seconds). Their difference is time the calling thread was off the CPU: waiting for the GIL, for
    a core, or for a copy.

    ``backward_inside`` puts the backward inside the context (swapkit sessions); peers that, like
    ``save_on_cpu``, are documented around the forward get ``False``.
    """
    device = batch[0].device
    model.zero_grad(set_to_none=True)
    synchronize(device)
    start, cpu_start = time.perf_counter(), time.thread_time()
    with context():
        loss = lm_loss(model(batch[0]), batch[1])
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()
    synchronize(device)
    return time.perf_counter() - start, time.thread_time() - cpu_start


def environment(setup: Setup, engine: str, variant_configs: dict[str, Any]) -> dict[str, Any]:
    """Hardware, versions and config to record beside the numbers (DESIGN §9)."""
    env = {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "ram_bytes": psutil.virtual_memory().total, "platform": platform.platform(),
           "python": platform.python_version(), "torch": torch.__version__, "swapkit": swapkit.__version__,
           "device": str(setup.device), "engine": engine, "load_average_at_start": os.getloadavg(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "config": {"model_config": setup.model_config, "batch_size": setup.batch_size, "seed": setup.seed,
                      "runtime": setup.runtime, "variants": variant_configs}}
    if setup.device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(setup.device)
        env["cuda"] = torch.version.cuda
        env["driver"] = nvidia_driver()
    return env


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def hardware_line(env: dict[str, Any]) -> str:
    """One line: CPU, cores, RAM, GPU, versions."""
    gpu = f", GPU {env['gpu']} (CUDA {env['cuda']}, driver {env.get('driver') or 'unknown'})" if "gpu" in env else ""
    deterministic = "; deterministic kernels" if env.get("deterministic") else ""
    return (f"{env['cpu']}, {env['cpu_count']} cores ({env['torch_threads']} torch threads), "
            f"{env['ram_bytes'] / 2**30:.0f} GiB RAM{gpu}; torch {env['torch']}, Python {env['python']}, "
            f"swapkit {env['swapkit']}; device {env['device']}, engine {env['engine']}; {env['date']}; "
            f"load average (1/5/15 min) at start {load_average_text(env.get('load_average_at_start'))}, at end "
            f"{load_average_text(env.get('load_average_at_end'))}{deterministic}")


def nvidia_driver() -> str | None:
    """The NVIDIA driver version as ``nvidia-smi`` reports it, or ``None`` where it cannot be read."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0] if out.strip() else None


# Note [Loaded machines]
# Every benchmark that times something reads the load average before and after measuring and, when
# either read is above the core count, says so on stderr, in its JSON (``warnings``) and at the top of
# its Markdown. swap_vs_recompute.py and planner_frontier.py did; host_pool.py (its µs per acquire +
# release), microbench.py and pipeline.py (step times, time ratios) recorded the load or nothing, and
# host_pool's committed result was measured at load 4.48 on 2 cores without a mark.


def load_warning(cores: int | None, *loads: Any) -> list[str]:
    """The loaded-machine warning of every benchmark: a load average above the core count.

    Args:
        cores: ``os.cpu_count()`` of the machine measured (``None`` counts as 1).
        *loads: ``os.getloadavg()`` tuples read around the measurement; ``None`` where one was not read.

    Returns:
        One warning, or none when no 1/5/15-minute load average read went above ``cores``.
    """
    peak = max((max(load) for load in loads if load), default=0.0)
    if peak <= (cores or 1):
        return []
    return [f"the machine was loaded (load average up to {peak:.2f} on {cores or 1} cores): other processes shared "
            "the cores, so step times are noisy; rerun on an idle machine"]


def warning_lines(warnings: list[str]) -> list[str]:
    """The Markdown marks for ``warnings`` at the top of a report, then a blank line (none when there are none)."""
    return [*(f"> **WARNING:** {w}" for w in warnings), ""] if warnings else []


def load_average_text(values: Any) -> str:
    return "—" if values is None else "/".join(f"{x:.2f}" for x in values)
