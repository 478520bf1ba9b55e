"""``swapkit train``: train the built-in model on synthetic tokens under the config's plan.

The loop is deliberately plain — AdamW, gradient accumulation, optional clipping, fp32 or bf16
autocast — so that what changes between two runs is only what swapkit does with the saved
activations. :func:`train` is the reusable entry point (CLI, tests, benchmarks). Data lives in
:mod:`swapkit.train.data`, checkpoints in :mod:`swapkit.train.checkpoint`, metrics and the summary
in :mod:`swapkit.train.summary`.
"""
from __future__ import annotations

import logging
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import psutil
import torch
from tqdm import tqdm

import swapkit
from swapkit.config.errors import ConfigError, Problem, clip, show
from swapkit.config.schema import LIMITS
from swapkit.config.types import Config
from swapkit.load import load_config
from swapkit.train.checkpoint import checkpoint_due, earlier_run_problems, ran_since_resume, resume, save_checkpoint
from swapkit.train.collector import collector_schedule
from swapkit.train.budget import check_memory
from swapkit.train.data import SyntheticTokens
from swapkit.train.errors import RunFailed
from swapkit.train.files import check_output_file, prepare_output_dir, raise_problems
from swapkit.train.model import LlamaModel, build_model, lm_loss
from swapkit.train.state import RunState, TrainResult
from swapkit.train.summary import human_bytes, step_record, summarize, write_metrics, write_metrics_due

logger = logging.getLogger(__name__)


def train(config: Config | Mapping[str, Any] | str | Path, steps: int | None = None, device: str | None = None,
          metrics_out: str | Path | None = None, progress: bool = True) -> TrainResult:
    """Train the built-in model with the config's recompute and swap plan applied.

    Args:
        config: a :class:`Config`, a dict in the YAML layout, or a YAML path.
        steps: total number of optimizer steps (overrides ``train.steps``).
        device: ``"cpu"`` or ``"cuda"`` (overrides ``train.device``).
        metrics_out: JSON file rewritten after steps as time allows and at the end (Note [Metrics writes];
            Note [Memory figures] for its meaning).
        progress: show a tqdm bar on stderr (only when it is a terminal).

    Returns:
        A :class:`TrainResult`; :func:`format_summary` renders its summary as the CLI's table.

    Raises:
        ConfigError: invalid config, ``cuda`` without CUDA, ``resume`` without ``save_dir``, an output path
            that cannot be written, a fresh run in a ``save_dir`` holding checkpoints, sizes that cannot fit
            in memory, a checkpoint of another model or data.
        RunFailed: a NaN or infinite loss (naming the step), a file that could not be written (disk full),
            a model that could not be allocated.
        KeyboardInterrupt: after removing the session and writing the metrics so far.

    Example:
        >>> result = train("configs/tiny.yaml", steps=2, progress=False)  # doctest: +SKIP
        >>> result.losses  # doctest: +SKIP
    """
    config = config if isinstance(config, Config) else load_config(config)
    _warn_single_process(config)
    swapkit.build_plan(config)  # the built-in model needs num_layers: a missing one is a ConfigError here
    device, total_steps = resolve_device(config, device), resolve_steps(config, steps)
    preflight(config, device, metrics_out)
    run = _start(config, device, total_steps, metrics_out)
    try:
        _loop(run, progress)
    except BaseException as err:
        _close(run, "interrupted" if isinstance(err, KeyboardInterrupt) else "failed")
        raise
    _close(run, "completed")
    return TrainResult([r["loss"] for r in run.records], run.records, summarize(run))


# ---------------------------------------------------------------------- setup

def _warn_single_process(config: Config) -> None:
    parallel = config.parallel
    if parallel.pipeline_stage * parallel.data_parallel > 1:
        logger.warning("parallel_config asks for %d x %d ranks but train() runs the whole model in this process "
                       "(micro_batch_num, data_parallel and pipeline_schedule unused); run `swapkit train CONFIG` "
                       "or swapkit.distributed.launch.launch for pipeline / data parallel",
                       parallel.pipeline_stage, parallel.data_parallel)


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


def resolve_steps(config: Config, steps: int | None) -> int:
    """``--steps`` or ``train.steps``, checked (and ``train.resume`` and ``train.save_interval`` need
    ``train.save_dir``)."""
    if steps is not None and not 1 <= steps <= LIMITS["steps"]:
        bound = ">= 1" if steps < 1 else f"<= {LIMITS['steps']:,}"
        raise ConfigError([Problem("--steps", f"got {show(steps)}; expected an integer {bound}")], config.source)
    if config.train.resume and not config.train.save_dir:
        raise ConfigError([Problem("train.resume", "is true but train.save_dir is not set; "
                                                   "set train.save_dir to the checkpoint folder")], config.source)
    if config.train.save_interval is not None and not config.train.save_dir:
        raise ConfigError([Problem("train.save_interval", f"is {config.train.save_interval} but train.save_dir is "
                                   "not set, so no checkpoint is written; set train.save_dir to the checkpoint "
                                   "folder, or remove save_interval")], config.source)
    return steps if steps is not None else config.train.steps


def engine_problems(config: Config, device: torch.device) -> list[Problem]:
    """``runtime.engine: cuda`` for a model that is not on a CUDA device (empty when they agree)."""
    if config.runtime.engine == "cuda" and device.type != "cuda":
        return [Problem("runtime.engine", f"got 'cuda' but the model trains on {device}; set "
                                          "runtime.engine: auto (or thread), or train.device: cuda")]
    return []


# Note [Layer paths of the built-in model]
# `swapkit train` and the budget planner (without --model) run the built-in model, whose layer
# container is `layers`. They bound it by that name and ignored `model.model_config.layers_path` and
# `swapkit plan --budget --layers`, so a misspelt path trained silently where plain `swapkit plan`
# refuses it. A path other than the built-in model's container is now a problem there too.
BUILTIN_LAYERS = "layers"


def builtin_layers_problems(config: Config, layers: str | None = None) -> list[Problem]:
    """A layer path written for the built-in model (config or ``--layers``) that is not its container.

    Note [Layer paths of the built-in model]
    """
    problems = []
    written = config.model.layers_path
    if written is not None and written not in (BUILTIN_LAYERS, (BUILTIN_LAYERS,)):
        problems.append(Problem("model.model_config.layers_path", f"got {show(written)}; the built-in model keeps its "
                                f"layers in {BUILTIN_LAYERS!r}: write {BUILTIN_LAYERS} or leave the key out"))
    if layers is not None and layers != BUILTIN_LAYERS:
        problems.append(Problem("--layers", f"got {show(layers)}; the built-in model keeps its layers in "
                                f"{BUILTIN_LAYERS!r}: drop --layers, or add --model for the model it names"))
    return problems


def preflight(config: Config, device: torch.device, metrics_out: str | Path | None, memory: bool = True) -> None:
    """Everything that can be checked before the first step: engine, memory, output paths (exit 2).

    Args:
        config: the run's config.
        device: where it trains.
        metrics_out: the ``--metrics-out`` file, or ``None``.
        memory: also check the memory estimate against this machine (not for ranks that may run elsewhere).

    Raises:
        ConfigError: every problem found.
    """
    problems = engine_problems(config, device) + builtin_layers_problems(config)
    problems += earlier_run_problems(config.train.save_dir, config.train.resume)
    if metrics_out is not None:
        check_output_file(Path(metrics_out), "--metrics-out", problems, config.source)
    if config.train.save_dir:
        prepare_output_dir(Path(config.train.save_dir), "train.save_dir", "step_*.pt", problems)
    raise_problems(problems, config.source)
    if memory:
        check_memory(config, device)


def _start(config: Config, device: torch.device, total_steps: int, metrics_out: str | Path | None) -> RunState:
    cfg = config.train
    torch.manual_seed(cfg.seed)
    model = _build(config, device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    data = SyntheticTokens(cfg.seed, cfg.batch_size, config.model.seq_length, config.model.vocab_size)
    run = RunState(config, device, total_steps, model, optimizer, data,
                   metrics_out=Path(metrics_out) if metrics_out else None, env=environment(config, device))
    if cfg.resume:
        resume(run)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    run.session = swapkit.apply(model, config, layers=BUILTIN_LAYERS)
    return run


def _build(config: Config, device: torch.device) -> LlamaModel:
    try:
        return build_model(config.model, seed=config.train.seed, device=device)
    except (RuntimeError, MemoryError) as err:  # allocation failures the estimate did not foresee
        raise RunFailed(f"cannot build the built-in model on {device}: {clip(str(err), 300)}; reduce "
                        "model.model_config sizes (vocab_size, hidden_size, intermediate_size, num_layers)") from err


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
    drive(run, progress, lambda step: _train_step(run, step), _report_step)


def drive(run: RunState, progress: bool, train_step: Callable[[int], dict[str, Any] | None],
          report: Callable[[RunState, dict[str, Any], tqdm, bool], None]) -> None:
    """Run ``train_step(step)`` until ``run.total_steps``: record, report, write metrics, checkpoint.

    A ``None`` record (a pipeline rank that holds no loss) is not recorded; the step still counts.
    """
    bar_off = not progress or sys.stderr is None or not sys.stderr.isatty()  # None: started with 2>&-
    with tqdm(total=run.total_steps, initial=run.step, disable=bar_off, unit="step", file=sys.stderr,
              dynamic_ncols=True, desc="swapkit train") as bar, \
            collector_schedule(run.config.train.gc_interval) as after_step:
        while run.step < run.total_steps:
            record = train_step(run.step + 1)
            run.step += 1
            after_step(run.step)
            if record is not None:
                run.records.append(record)
                report(run, record, bar, bar_off)
                write_metrics_due(run)  # Note [Metrics writes] in swapkit.train.summary
            if checkpoint_due(run):
                save_checkpoint(run)


def _train_step(run: RunState, step: int) -> dict[str, Any]:
    start = time.perf_counter()
    run.optimizer.zero_grad(set_to_none=True)
    accumulation = run.config.train.gradient_accumulation_steps
    loss, stats = 0.0, []
    for micro in range(accumulation):
        loss += _micro_step(run, step, micro, accumulation)
        stats.append(run.session.stats)
    check_finite(run, step, loss)
    if run.config.train.grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.config.train.grad_clip)
    run.optimizer.step()
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)
    return step_record(step, loss, time.perf_counter() - start, stats)


def check_finite(run: RunState, step: int, loss: float) -> None:
    """A NaN or infinite loss stops the run before the optimizer spreads it into the weights."""
    if not math.isfinite(loss):
        cfg = run.config.train
        raise RunFailed(f"the loss is {loss} at step {step}; the run stopped before updating the weights. "
                        f"Lower train.lr ({cfg.lr:g}), set train.grad_clip (now {cfg.grad_clip}) or check "
                        "model.model_config (rms_norm_eps, rope_theta)")


def _micro_step(run: RunState, step: int, micro: int, accumulation: int) -> float:
    inputs, targets = (t.to(run.device) for t in run.data.batch(step, micro))
    bf16 = run.config.train.dtype == "bf16"
    with run.session:  # forward and backward of one micro-batch are one swap step
        with torch.autocast(run.device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = run.model(inputs)
        loss = lm_loss(logits, targets) / accumulation
        loss.backward()
    return loss.item()


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
    if status == "completed" and run.config.train.save_dir and run.records and ran_since_resume(run):
        save_checkpoint(run)  # Note [Nothing to run] in swapkit.train.checkpoint
    write_metrics(run)
