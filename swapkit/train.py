"""``swapkit train``: train the built-in model on synthetic tokens under the config's plan.

The loop is deliberately plain — AdamW, gradient accumulation, optional clipping, fp32 or bf16
autocast — so that what changes between two runs is only what swapkit does with the saved
activations. :func:`train` is the reusable entry point (tests, benchmarks); :func:`train_from_args`
is what the CLI calls.

Note [Synthetic data]
The tokens follow a fixed random permutation of the vocabulary drawn from ``train.seed``:
``x[t+1] = successor[x[t]]``, each sequence from a random start. A model learns it within a few
dozen steps, so a decreasing loss says the loop works, and no download is needed. The batch of
(step, micro-batch) comes from a generator seeded by a hash of ``(seed, step, micro)`` alone: it
does not depend on what ran before, which is what makes a resumed run equal to an uninterrupted one.

Note [Exact resume]
A checkpoint holds the model and optimizer state dicts, the step, the RNG states and the metrics
so far. swapkit's wrappers replace ``forward`` on instances and insert no module (see
:mod:`swapkit.recompute`), so the state dict keys are those of a plain model. Data is a pure
function of the step (Note [Synthetic data]), so continuing from step k gives the same losses, bit
for bit, as never stopping.

Note [Memory figures]
``peak_device_bytes`` and friends are the swap session's accounting of device-resident saved
activations. On CPU the "device" and the host share RAM: they are not the process's RSS. On CUDA
the summary adds ``torch.cuda.max_memory_allocated``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Mapping

import psutil
import torch
from tqdm import tqdm

import swapkit
from swapkit.config import Config
from swapkit.errors import ConfigError, Problem
from swapkit.loader import load_config
from swapkit.model import LlamaModel, build_model, lm_loss
from swapkit.session import SwapSession
from swapkit.stats import SwapStats

logger = logging.getLogger(__name__)

CHECKPOINT_GLOB = "step_*.pt"
SUMMED_STATS = ("saved_bytes", "offloaded_bytes", "prefetched_bytes", "late_fetches", "wait_seconds")
PEAK_STATS = ("peak_device_bytes", "host_pool_bytes")


@dataclass(frozen=True)
class SyntheticTokens:
    """Seeded next-token data; Note [Synthetic data]."""

    seed: int
    batch_size: int
    seq_length: int
    vocab_size: int

    @cached_property
    def successor(self) -> torch.Tensor:
        return torch.randperm(self.vocab_size, generator=torch.Generator().manual_seed(self.seed))

    def batch(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets ``[batch_size, seq_length]`` of micro-batch ``micro`` of ``step``."""
        key = hashlib.blake2b(f"{self.seed}:{step}:{micro}".encode(), digest_size=8).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(key, "little"))
        tokens = torch.empty(self.batch_size, self.seq_length + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab_size, (self.batch_size,), generator=gen)
        for t in range(1, self.seq_length + 1):
            tokens[:, t] = self.successor[tokens[:, t - 1]]
        return tokens[:, :-1], tokens[:, 1:]


@dataclass
class TrainResult:
    """What a run produced: ``losses[i]`` is the loss of step ``i + 1`` (resumed steps included)."""

    losses: list[float]
    steps: list[dict[str, Any]]
    summary: dict[str, Any]


@dataclass
class RunState:
    """Everything one training run holds; built by :func:`_start`, closed by :func:`train`."""

    config: Config
    device: torch.device
    total_steps: int
    model: LlamaModel
    optimizer: torch.optim.Optimizer
    data: SyntheticTokens
    session: SwapSession | None = None
    step: int = 0  # completed steps
    records: list[dict[str, Any]] = field(default_factory=list)
    env: dict[str, Any] = field(default_factory=dict)
    metrics_out: Path | None = None
    status: str = "running"


def train_from_args(args: argparse.Namespace) -> int:
    """Run ``swapkit train`` from parsed CLI arguments; returns the exit status.

    Raises:
        ConfigError: bad config or device (the CLI exits 2); KeyboardInterrupt propagates (130).
    """
    config = load_config(args.config, args.overrides)
    result = train(config, steps=args.steps, device=args.device, metrics_out=args.metrics_out,
                   progress=not args.no_progress)
    print(format_summary(result.summary))
    return 0


def train(config: Config | Mapping[str, Any] | str | Path, steps: int | None = None, device: str | None = None,
          metrics_out: str | Path | None = None, progress: bool = True) -> TrainResult:
    """Train the built-in model with the config's recompute and swap plan applied.

    Args:
        config: a :class:`Config`, a dict in the YAML layout, or a YAML path.
        steps: total number of optimizer steps (overrides ``train.steps``).
        device: ``"cpu"`` or ``"cuda"`` (overrides ``train.device``).
        metrics_out: JSON file rewritten after every step (Note [Memory figures] for its meaning).
        progress: show a tqdm bar on stderr (only when it is a terminal).

    Returns:
        A :class:`TrainResult`; :func:`format_summary` renders its summary as the CLI's table.

    Raises:
        ConfigError: invalid config, ``cuda`` without CUDA, ``resume`` without ``save_dir``.
        KeyboardInterrupt: after removing the session and writing the metrics so far.

    Example:
        >>> result = train("configs/tiny.yaml", steps=2, progress=False)  # doctest: +SKIP
        >>> result.losses  # doctest: +SKIP
    """
    config = config if isinstance(config, Config) else load_config(config)
    run = _start(config, resolve_device(config, device), _resolve_steps(config, steps), metrics_out)
    try:
        _loop(run, progress)
    except BaseException as err:
        _close(run, "interrupted" if isinstance(err, KeyboardInterrupt) else "failed")
        raise
    _close(run, "completed")
    return TrainResult([r["loss"] for r in run.records], run.records, summarize(run))


# ---------------------------------------------------------------------- setup

def resolve_device(config: Config, override: str | None = None) -> torch.device:
    """The device to train on; for CUDA also the allocator setting (before any CUDA allocation).

    Raises:
        ConfigError: ``cuda`` was asked for and ``torch.cuda.is_available()`` is false.
    """
    name, key = (override, "--device") if override else (config.train.device, "train.device")
    if name == "cuda":
        # Must precede the first CUDA allocation; the user's own setting wins.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        if not torch.cuda.is_available():
            raise ConfigError([Problem(key, f"got 'cuda' but CUDA is not available (torch {torch.__version__}, "
                                            "no usable GPU or a CPU-only build); use --device cpu")], config.source)
    return torch.device(name)


def _resolve_steps(config: Config, steps: int | None) -> int:
    if steps is not None and steps < 1:
        raise ConfigError([Problem("--steps", f"got {steps}; expected an integer >= 1")], config.source)
    if config.train.resume and not config.train.save_dir:
        raise ConfigError([Problem("train.resume", "is true but train.save_dir is not set; "
                                                   "set train.save_dir to the checkpoint folder")], config.source)
    return steps if steps is not None else config.train.steps


def _start(config: Config, device: torch.device, total_steps: int, metrics_out: str | Path | None) -> RunState:
    cfg = config.train
    torch.manual_seed(cfg.seed)
    model = build_model(config.model, seed=cfg.seed, device=device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    data = SyntheticTokens(cfg.seed, cfg.batch_size, config.model.seq_length, config.model.vocab_size)
    run = RunState(config, device, total_steps, model, optimizer, data,
                   metrics_out=Path(metrics_out) if metrics_out else None, env=environment(config, device))
    if cfg.resume:
        _resume(run)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    run.session = swapkit.apply(model, config, layers="layers")
    return run


def environment(config: Config, device: torch.device) -> dict[str, Any]:
    """Versions and hardware to record next to the numbers."""
    env = {"swapkit": swapkit.__version__, "torch": torch.__version__, "python": platform.python_version(),
           "platform": platform.platform(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "ram_bytes": psutil.virtual_memory().total,
           "device": str(device), "dtype": config.train.dtype, "config": config.source}
    if device.type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                   pytorch_cuda_alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    return env


# ---------------------------------------------------------------------- the loop

def _loop(run: RunState, progress: bool) -> None:
    bar_off = not progress or not sys.stderr.isatty()
    with tqdm(total=run.total_steps, initial=run.step, disable=bar_off, unit="step", file=sys.stderr,
              dynamic_ncols=True, desc="swapkit train") as bar:
        while run.step < run.total_steps:
            record = _train_step(run, run.step + 1)
            run.step += 1
            run.records.append(record)
            _report_step(run, record, bar, bar_off)
            _write_metrics(run)
            if _checkpoint_due(run):
                save_checkpoint(run)


def _train_step(run: RunState, step: int) -> dict[str, Any]:
    start = time.perf_counter()
    run.optimizer.zero_grad(set_to_none=True)
    accumulation = run.config.train.gradient_accumulation_steps
    loss, stats = 0.0, []
    for micro in range(accumulation):
        loss += _micro_step(run, step, micro, accumulation)
        stats.append(run.session.stats)
    if run.config.train.grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.config.train.grad_clip)
    run.optimizer.step()
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)
    return _step_record(step, loss, time.perf_counter() - start, stats)


def _micro_step(run: RunState, step: int, micro: int, accumulation: int) -> float:
    inputs, targets = (t.to(run.device) for t in run.data.batch(step, micro))
    bf16 = run.config.train.dtype == "bf16"
    with run.session:  # forward and backward of one micro-batch are one swap step
        with torch.autocast(run.device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = run.model(inputs)
        loss = lm_loss(logits, targets) / accumulation
        loss.backward()
    return loss.item()


def _step_record(step: int, loss: float, seconds: float, stats: list[SwapStats]) -> dict[str, Any]:
    """One entry of ``metrics["steps"]``: the micro-batches' stats summed (bytes, waits) or maxed (peaks)."""
    record: dict[str, Any] = {"step": step, "loss": loss, "step_time_s": seconds}
    record.update({key: sum(getattr(s, key) for s in stats) for key in SUMMED_STATS})
    record.update({key: max(getattr(s, key) for s in stats) for key in PEAK_STATS})
    return record


def _report_step(run: RunState, record: dict[str, Any], bar: tqdm, bar_off: bool) -> None:
    figures = {"loss": f"{record['loss']:.4f}", "time": f"{record['step_time_s'] * 1e3:.0f}ms",
               "peak": human_bytes(record["peak_device_bytes"]), "offloaded": human_bytes(record["offloaded_bytes"])}
    if bar_off:
        logger.info("step %d/%d %s", record["step"], run.total_steps,
                    " ".join(f"{k} {v}" for k, v in figures.items()))
    bar.set_postfix(figures, refresh=False)
    bar.update(1)


def _close(run: RunState, status: str) -> None:
    """Remove the session, then save and write what the run has (also after Ctrl-C)."""
    run.session.remove()
    run.status = status
    if status == "completed" and run.config.train.save_dir and run.records:
        save_checkpoint(run)
    _write_metrics(run)


# ---------------------------------------------------------------------- checkpoints (Note [Exact resume])

def _checkpoint_due(run: RunState) -> bool:
    interval = run.config.train.save_interval
    return bool(run.config.train.save_dir and interval and run.step % interval == 0 and run.step < run.total_steps)


def save_checkpoint(run: RunState) -> Path:
    """Write ``save_dir/step_NNNNNNN.pt`` atomically; returns its path."""
    folder = Path(run.config.train.save_dir)
    folder.mkdir(parents=True, exist_ok=True)
    rng = {"torch": torch.get_rng_state()}
    if run.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(run.device)
    state = {"step": run.step, "model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(),
             "rng": rng, "records": run.records}
    path = folder / f"step_{run.step:07d}.pt"
    torch.save(state, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)
    logger.info("saved checkpoint %s", path)
    return path


def latest_checkpoint(save_dir: str | Path) -> Path | None:
    """The checkpoint with the highest step in ``save_dir``, or ``None``."""
    paths = sorted(Path(save_dir).glob(CHECKPOINT_GLOB))
    return paths[-1] if paths else None


def _resume(run: RunState) -> None:
    path = latest_checkpoint(run.config.train.save_dir)
    if path is None:
        logger.warning("train.resume: no checkpoint in %s; starting from step 0", run.config.train.save_dir)
        return
    state = torch.load(path, map_location=run.device, weights_only=True)
    try:
        run.model.load_state_dict(state["model"])
    except RuntimeError as err:
        raise ConfigError([Problem("train.resume", f"{path} does not fit model.model_config: {err}")]) from None
    run.optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["torch"].cpu())
    if "cuda" in state["rng"] and run.device.type == "cuda":
        torch.cuda.set_rng_state(state["rng"]["cuda"].cpu(), run.device)
    run.step, run.records = state["step"], list(state["records"])
    logger.info("resumed from %s at step %d", path, run.step)


# ---------------------------------------------------------------------- metrics and summary

def _write_metrics(run: RunState) -> None:
    """Rewrite ``--metrics-out`` atomically, so an interrupted run keeps every finished step."""
    if run.metrics_out is None:
        return
    document = {"steps": run.records, "summary": summarize(run), "env": run.env}
    tmp = run.metrics_out.with_name(run.metrics_out.name + ".tmp")
    tmp.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, run.metrics_out)


def summarize(run: RunState) -> dict[str, Any]:
    """Medians, totals and peaks over the steps so far; Note [Memory figures]."""
    summary: dict[str, Any] = {"status": run.status, "steps": len(run.records), "device": str(run.device),
                               "memory_accounting": "swap session (device-resident saved activations)"}
    if not run.records:
        return summary
    column = {key: [r[key] for r in run.records] for key in run.records[0]}
    summary.update(first_loss=column["loss"][0], final_loss=column["loss"][-1],
                   median_step_time_s=statistics.median(column["step_time_s"]),
                   late_fetches=sum(column["late_fetches"]), wait_seconds=sum(column["wait_seconds"]))
    summary.update({key: max(column[key]) for key in PEAK_STATS})
    summary.update({f"{key}_per_step": statistics.median(column[key])
                    for key in ("saved_bytes", "offloaded_bytes", "prefetched_bytes")})
    summary["process_rss_bytes"] = psutil.Process().memory_info().rss  # the whole process, for scale
    if run.device.type == "cuda":
        summary["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated(run.device)
    return summary


def format_summary(summary: Mapping[str, Any]) -> str:
    """The end-of-run table printed to stdout."""
    if not summary.get("steps"):
        return "swapkit train summary: no steps were run"
    where = "session accounting, not RSS" if summary["device"] == "cpu" else "session accounting"
    rows = [("steps", str(summary["steps"])),
            ("loss (first -> final)", f"{summary['first_loss']:.4f} -> {summary['final_loss']:.4f}"),
            ("median step time", f"{summary['median_step_time_s'] * 1e3:.1f} ms"),
            (f"peak device-resident saved bytes ({where})", human_bytes(summary["peak_device_bytes"])),
            ("saved activation bytes per step", human_bytes(summary["saved_bytes_per_step"])),
            ("bytes swapped per step (device -> host)", human_bytes(summary["offloaded_bytes_per_step"])),
            ("bytes prefetched per step (host -> device)", human_bytes(summary["prefetched_bytes_per_step"])),
            ("late fetches (total)", f"{summary['late_fetches']} ({summary['wait_seconds'] * 1e3:.1f} ms waited)"),
            ("host pool bytes", human_bytes(summary["host_pool_bytes"])),
            ("process RSS (psutil, whole process)", human_bytes(summary["process_rss_bytes"]))]
    if "cuda_max_memory_allocated" in summary:
        rows.append(("torch.cuda.max_memory_allocated", human_bytes(summary["cuda_max_memory_allocated"])))
    width = max(len(name) for name, _ in rows)
    return "\n".join(["swapkit train summary"] + [f"  {name.ljust(width)}  {value}" for name, value in rows])


def human_bytes(nbytes: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")
