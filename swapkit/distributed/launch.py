"""Starting the ranks of ``swapkit train`` when ``parallel_config`` asks for several.

Note [Who starts the ranks]
Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` in the environment) every process is already a rank:
it joins the process group through ``env://`` and runs its part. Otherwise ``swapkit train``
starts ``pipeline_stage x data_parallel`` processes itself (``torch.multiprocessing``: forked from a
preloaded server on the CPU, spawned on CUDA, swapkit.distributed.rank_start Note [Ranks forked from
a preloaded server]) that meet at a ``FileStore`` in a temporary folder, so one command trains on one CPU box.
Rank 0 hands its :class:`TrainResult` back to the parent through a file. When a rank raises,
``torch.multiprocessing`` stops the others and the parent raises :class:`RankFailed` with that
rank's traceback; a rank stuck in a collective gives up after ``train.collective_timeout_s``.
Backend: ``gloo`` on CPU, ``nccl`` on CUDA (one GPU per rank).

Note [The first failure is the cause]
When one rank raises, its peers soon fail too: their collectives see the connection drop. Which
of those failures ``torch.multiprocessing`` notices first is a race, so each started rank writes
its traceback and the time it failed to the run's folder, and the parent reports the earliest.

Note [Checks before the ranks start]
One process checks its outputs (``--metrics-out``, ``train.save_dir``), the engine against the
device and the memory estimate before its first step (swapkit.train.loop ``preflight``); a run on
several ranks does the same before any rank starts, so a typo in a path is exit 2 at once, not a
traceback after the first step trained. So are the config's op patterns, which one process meets in
``swapkit.apply``: ``swapkit train`` binds them to the built-in model on the meta device before it
launches (``swapkit.cli._check_builtin_patterns``), where each rank would raise ``BindError``.
The memory estimate is the whole model's single-process step, a lower bound of what all ranks
together need: it is checked only where every rank shares this machine's memory (CPU ranks started
by ``swapkit train``). With one GPU per rank, or under ``torchrun`` (whose ranks may be on other
machines), each rank holds a part and the check is skipped.

Note [Ranks this machine can hold]
``swapkit train`` starts ``pipeline_stage x data_parallel`` processes on this machine, and the schema
allows ``data_parallel`` up to 65,536. CPU ranks are forked from a fork server that imported torch
(swapkit.distributed.rank_start Note [Ranks forked from a preloaded server]): the server holds
``SERVER_PROCESS_BYTES`` (256 MiB; 298 MiB resident measured with torch 2.13), and each rank shares its
pages and writes at least ``RANK_PROCESS_BYTES`` (16 MiB) of its own before it builds anything (25-28 MiB
unique to each rank of the tiny pipeline at its first log line, 50-62 MiB after five steps). When the
server and the ranks exceed the memory available, the start would only end in the kernel's
out-of-memory killer (or a machine swapping for minutes): a config error, checked before any rank
starts. CUDA ranks are bounded by the GPU count instead; ``torchrun`` started its ranks itself.

Note [Errors a rank reports as they are]
A rank meets some of the user's mistakes only once it runs: resuming a checkpoint whose config
differs, or none that is valid (:class:`ConfigError`), a NaN loss (:class:`RunFailed`). In one
process the CLI prints those as one message with exit 2 or 1; from a rank they would reach the
parent as a traceback in :class:`RankFailed`. So a rank that fails with one of them also writes
its problems (plain data: ``Problem`` records or the message) next to its traceback, and the parent
raises the same error again when that rank failed first, so the CLI reports it exactly as it
reports the single-process one.
A collective that timed out is reported the same way, as a :class:`RunFailed` naming
``train.collective_timeout_s`` and what it means (a peer stopped answering) beside torch's words:
the traceback of gloo's ``Timed out waiting 10000ms for send operation to complete`` named neither.

Note [Each stage logs its own layers]
MindFormers logs its ``Set ...`` lines in every stage's process, for the layers that stage builds;
the ``num_layers per stage`` and ``Formative ...`` lines describe the whole model and are the same
on every stage. Here the ranks share one terminal, so rank 0 logs everything at the CLI's level and
the first data-parallel rank of every other stage (ranks ``1 .. P-1``: rank ``= dp_rank * P + pp_rank``,
``swapkit.distributed.train.Topology``) logs its own INFO lines (its layers' ``Set ...`` lines, its checkpoints) but
not the whole-model lines, which rank 0 already printed: they are the plan's own log lines, known
before any rank starts. The other data-parallel replicas repeat their stage: WARNING and above only.

Note [Peers of a failed rank]
When a rank fails, ``torch.multiprocessing``'s join stops the others: with no grace period it sends
SIGTERM at once and SIGKILL 30 s later. A peer in a collective fails by itself as soon as the failed
rank's connections close, but one still in the rendezvous (``init_process_group`` waiting at the
store for a rank that died before it came, up to ``train.collective_timeout_s``) is in native code,
where SIGTERM runs no handler: the run ended 40-50 s after a rank died at its start. So the join gets
``FAILED_RANK_GRACE_S``: the peers have that long to end on their own (recording their own failures,
Note [The first failure is the cause]), then SIGTERM, then as long again before SIGKILL. The run has
failed either way; the grace only lets the peers end cleanly when they can.

Note [A rank's progress bar lock]
tqdm guards its bars with a ``multiprocessing`` lock, created with the first bar (every rank creates
one, hidden on all but rank 0). In a rank forked from the fork server that lock is a named POSIX
semaphore registered with the parent's resource tracker, and a rank killed with SIGKILL never
unregisters it: after swapkit's one line the tracker warned ``There appear to be 1 leaked semaphore
objects to clean up at shutdown``. A rank has one bar and no child processes that share it, so it
uses a thread lock.

SIGINT, SIGTERM and SIGHUP: ``swapkit.distributed.signals`` Note [Stopping the ranks] (the parent) and
Note [Interrupts and finalizers] (each rank, started by ``swapkit train`` or by torchrun).
"""
from __future__ import annotations

import datetime
import logging
import os
import pickle
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

from swapkit.config.errors import ConfigError, Problem, clip
from swapkit.config.types import Config
from swapkit.distributed.agree import check_ranks_agree
from swapkit.distributed.pipeline import micro_batch_problems
from swapkit.distributed.rank_end import end_processes, leave_no_files, rank_processes
from swapkit.distributed.rank_start import RankStart, start_method, world_size
from swapkit.distributed.signals import (
    POLL_S, STOP_GRACE_S, ForwardSignals, StopOnSignal, ignore_stop_signals, stop_signals_blocked,
    stop_when_parent_dies, stopped_ranks, unblock_stop_signals,
)
from swapkit.logs import quieter
from swapkit.plan.plan import build_plan
from swapkit.train.errors import RunFailed
from swapkit.train.loop import preflight
from swapkit.train.state import TrainResult
from swapkit.train.summary import human_bytes

logger = logging.getLogger(__name__)

#: Note [Ranks this machine can hold]: lower bounds of the fork server (torch imported) and of a rank's own pages
SERVER_PROCESS_BYTES = 256 * 2**20
RANK_PROCESS_BYTES = 16 * 2**20
#: Note [Peers of a failed rank]: how long they get to end on their own, then again after SIGTERM
FAILED_RANK_GRACE_S = 2.0


class RankFailed(RuntimeError):
    """A rank of a multi-process ``swapkit train`` raised; the message holds its error."""


def check(config: Config, device: torch.device) -> None:
    """Problems a multi-process run would only meet inside its ranks, raised before any starts.

    Raises:
        ConfigError: every problem, with its key path.
    """
    problems, parallel = [], config.parallel
    chunks = config.model.pp_interleave_num
    if config.train.gradient_accumulation_steps != 1:
        problems.append(Problem("train.gradient_accumulation_steps", f"got {config.train.gradient_accumulation_steps}"
                                "; with several ranks the micro-batches are parallel_config.micro_batch_num, set "
                                "gradient_accumulation_steps to 1"))
    if parallel.pipeline_schedule in ("gpipe", "1f1b") and chunks > 1:
        problems.append(Problem("parallel_config.pipeline_schedule", f"got {parallel.pipeline_schedule!r} but "
                                f"model.model_config.pp_interleave_num is {chunks}; use interleaved_1f1b"))
    problems += micro_batch_problems(config)  # pipeline.py Note [Micro-batch counts per schedule]
    if device.type == "cuda" and "RANK" not in os.environ and torch.cuda.device_count() < world_size(config):
        problems.append(Problem("parallel_config", f"asks for {world_size(config)} ranks but only "
                                f"{torch.cuda.device_count()} GPU(s) are visible; one rank per GPU"))
    if device.type == "cpu" and "RANK" not in os.environ:
        problems += _rank_memory(config)
    if problems:
        raise ConfigError(problems, config.source)


def _rank_memory(config: Config) -> list[Problem]:
    """Note [Ranks this machine can hold]"""
    world, have = world_size(config), psutil.virtual_memory().available
    need = SERVER_PROCESS_BYTES + world * RANK_PROCESS_BYTES
    if need <= have:
        return []
    parallel = config.parallel
    return [Problem("parallel_config", f"asks for {world:,} rank processes on this machine (pipeline_stage "
                    f"{parallel.pipeline_stage} x data_parallel {parallel.data_parallel}); each holds at least "
                    f"{human_bytes(RANK_PROCESS_BYTES)} of its own before it builds anything, beside the "
                    f"{human_bytes(SERVER_PROCESS_BYTES)} of the process with torch loaded that they are forked from: "
                    f"{human_bytes(need)}, but {human_bytes(have)} is available. Lower "
                    "pipeline_stage x data_parallel, or start the ranks on several machines with torchrun")]


def launch(config: Config, device: torch.device, **options: Any) -> TrainResult | None:
    """Run every rank (Note [Who starts the ranks]); rank 0's result, ``None`` on other torchrun ranks.

    Raises:
        RankFailed: a rank raised (its traceback is in the message).
        ConfigError, RunFailed: the rank that failed first raised this (Note [Errors a rank reports as they are]).
        Interrupted: SIGINT, SIGTERM or SIGHUP; every rank was stopped and reaped first (Note [Stopping the ranks]).
    """
    check(config, device)
    world = world_size(config)
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    writes_metrics = not torchrun or os.environ["RANK"] == "0"  # only rank 0 writes them, maybe on another machine
    preflight(config, device, options.get("metrics_out") if writes_metrics else None,  # Note [Checks before the ...]
              memory=not torchrun and device.type == "cpu")
    if torchrun:
        with StopOnSignal():
            return _torchrun_rank(config, device, world, options)
    with tempfile.TemporaryDirectory(prefix="swapkit-ranks-") as folder, ForwardSignals() as signals:
        with stop_signals_blocked():  # the ranks (and a fork server) start with them blocked (Note [Ranks start deaf])
            method = start_method(device.type)  # rank_start Note [Ranks forked from a preloaded server]
            started = time.time() - 10  # psutil's start times can be a second early (whole-second boot time)
            context = mp.start_processes(_started_rank, args=(world, config, device.type, folder, logger_level(),
                                                              options, RankStart()),
                                         nprocs=world, join=False, start_method=method)
        ranks = rank_processes(context.processes, started)
        try:
            # torch.multiprocessing logs a WARNING per rank it terminates after one failed; swapkit's message
            with quieter("torch.multiprocessing.spawn", logging.ERROR):  # says so once ("the other ranks ...")
                _join(context, Path(folder), signals)
        finally:
            end_processes(ranks, STOP_GRACE_S)  # rank_end Note [A rank has ended when its process has]
            _remove_error_files(context)
        return torch.load(Path(folder) / "result.pt", weights_only=False)


def _join(context: Any, folder: Path, signals: ForwardSignals) -> None:
    """Wait for the ranks; on a stop signal stop them all (Note [Stopping the ranks])."""
    done = False
    try:
        while not done and signals.signum is None:
            done = context.join(timeout=POLL_S, grace_period=FAILED_RANK_GRACE_S)  # Note [Peers of a failed rank]
    except mp.ProcessRaisedException as err:
        if signals.signum is None:
            raise _first_failure(folder, err.error_index, str(err)) from None
    except mp.ProcessExitedException as err:
        if signals.signum is None:
            raise RankFailed(exit_message(err)) from None
    if not done or (signals.signum is not None and not (folder / "result.pt").exists()):
        # a stop signal, also when a rank then failed because its peers were stopping, or when every
        # rank ended within the join that saw the signal without rank 0 writing its result
        killed = signals.stop(context.processes, STOP_GRACE_S)
        finished = len(list(folder.glob("done*")))  # ranks that had ended on their own
        raise stopped_ranks(signals.signum, len(context.processes) - finished, killed)


def exit_message(err: mp.ProcessExitedException) -> str:
    """A rank that ended without a Python error: killed by a signal (most often the out-of-memory killer)."""
    if err.signal_name is None:
        server = ", or the fork server it was forked from died (every rank it forked then reads as 255)" \
            if err.exit_code == 255 else ""
        return f"rank {err.error_index} exited with code {err.exit_code} without a Python error{server}; the other " \
               "ranks were stopped"
    oom = " (the kernel's out-of-memory killer, or kill -9: check dmesg; lower train.batch_size or the " \
          "model sizes if memory ran out)" if err.signal_name == "SIGKILL" else ""
    return f"rank {err.error_index} was killed by {err.signal_name}{oom}; the other ranks were stopped"


def _remove_error_files(context: Any) -> None:
    """``torch.multiprocessing`` leaves a failed rank's error file in the temporary folder."""
    for name in context.error_files:
        Path(name).unlink(missing_ok=True)


def _first_failure(folder: Path, noticed: int, message: str) -> Exception:
    """Note [The first failure is the cause]; Note [Errors a rank reports as they are]"""
    failures = sorted((float(path.read_text().split("\n", 1)[0]), int(path.stem[len("failed"):]), path)
                      for path in folder.glob("failed*.txt"))
    if not failures:
        return RankFailed(f"rank {noticed} failed:\n{message}")
    _, rank, path = failures[0]
    reportable = path.with_suffix(".pkl")
    if reportable.exists():
        return _reported_error(rank, pickle.loads(reportable.read_bytes()))
    others = f" ({len(failures) - 1} other rank(s) failed after it)" if len(failures) > 1 else ""
    return RankFailed(f"rank {rank} failed{others}:\n{path.read_text().split(chr(10), 1)[1]}")


def _reportable(err: BaseException, collective_timeout_s: float) -> tuple | None:
    """What the parent needs to raise ``err`` again (Note [Errors a rank reports as they are])."""
    if isinstance(err, ConfigError):
        return ("config", list(err.problems), err.source)
    if isinstance(err, RunFailed):
        return ("run", str(err))
    timeout = _collective_timeout(err)
    if timeout is not None:
        return ("run", f"a collective waited train.collective_timeout_s ({collective_timeout_s:g} s) for another "
                       "rank and gave up: a rank stopped answering (stuck, or much slower than the others: then "
                       f"raise train.collective_timeout_s); torch: {type(timeout).__name__}: {clip(str(timeout), 500)}")
    return None


def _collective_timeout(err: BaseException | None) -> BaseException | None:
    """The error in ``err``'s chain of causes (a pipeline stage wraps the error of its forward or backward) in
    which gloo or NCCL says a collective waited ``train.collective_timeout_s``."""
    while err is not None:
        text = str(err)
        if isinstance(err, RuntimeError) and ("Timed out waiting" in text or "collective operation timeout" in text):
            return err
        err = err.__cause__
    return None


def _reported_error(rank: int, record: tuple) -> Exception:
    if record[0] == "config":
        return ConfigError(record[1], record[2])
    return RunFailed(f"rank {rank}: {record[1]}")


def logger_level() -> int:
    return logging.getLogger("swapkit").getEffectiveLevel()


def _torchrun_rank(config: Config, device: torch.device, world: int, options: dict) -> TrainResult | None:
    if int(os.environ["WORLD_SIZE"]) != world:
        raise ConfigError([Problem("parallel_config", f"pipeline_stage x data_parallel = {world} but torchrun "
                                   f"started WORLD_SIZE={os.environ['WORLD_SIZE']} processes; make them agree")],
                          config.source)
    rank = int(os.environ["RANK"])
    _configure_child_logging(rank, logger_level(), config)
    _init(config, device, rank, world, "env://")
    return _run(config, device, rank, world, options)


def _started_rank(rank: int, world: int, config: Config, device_type: str, folder: str, level: int,
                  options: dict, start: RankStart) -> None:
    StopOnSignal().install()  # Note [Interrupts and finalizers]; torch.multiprocessing exits quietly on Interrupted
    start.take()  # the parent's environment and streams (rank_start Note [Ranks forked from a preloaded server])
    tqdm.set_lock(threading.RLock())  # Note [A rank's progress bar lock]
    parent = stop_when_parent_dies(start.parent)  # Note [No rank outlives its parent]
    try:
        unblock_stop_signals()  # a stop that came while this rank started is raised here (Note [Ranks start deaf])
        _rank_main(rank, world, config, device_type, folder, level, options)
    except Exception:
        if not parent.gone():
            raise  # torch.multiprocessing writes it to its error file for the parent
        # nobody reads that file now: rank_end Note [An orphaned rank removes the run's files]
        raise SystemExit(1) from None
    finally:  # ending: a late signal must not raise in the interpreter's shutdown (the parent reaps this rank)
        ignore_stop_signals()
        if parent.gone():
            leave_no_files(folder)


def _rank_main(rank: int, world: int, config: Config, device_type: str, folder: str, level: int,
               options: dict) -> None:
    _configure_child_logging(rank, level, config)
    device = torch.device(device_type)
    _init(config, device, rank, world, Path(folder, "store").as_uri())
    try:
        result = _run(config, device, rank, world, options)
    except BaseException as err:
        reportable = _reportable(err, config.train.collective_timeout_s)
        if reportable is not None:  # before the traceback file, which the parent looks for first
            Path(folder, f"failed{rank}.pkl").write_bytes(pickle.dumps(reportable))
        Path(folder, f"failed{rank}.txt").write_text(f"{time.time()}\n{traceback.format_exc()}")
        raise
    if rank == 0:
        torch.save(result, Path(folder) / "result.pt")
    Path(folder, f"done{rank}").touch()


def _init(config: Config, device: torch.device, rank: int, world: int, init_method: str) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=config.train.collective_timeout_s))


def _run(config: Config, device: torch.device, rank: int, world: int, options: dict) -> TrainResult | None:
    from swapkit.distributed.train import train_rank  # torch.distributed.fsdp and pipelining load in the ranks only

    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    try:
        check_ranks_agree(config, options["steps"], device)  # agree.py Note [Every rank trains the same run]
        return train_rank(config, device, rank, world, **options)
    finally:
        dist.destroy_process_group()


def _configure_child_logging(rank: int, level: int, config: Config) -> None:
    """Ranks log like the CLI, prefixed with their rank (Note [Each stage logs its own layers])."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s - %(message)s"))
    stage_logger = 0 < rank < config.parallel.pipeline_stage
    if stage_logger:
        handler.addFilter(_SkipLines(_whole_model_lines(config)))
    swapkit_logger = logging.getLogger("swapkit")
    swapkit_logger.handlers[:] = [handler]
    swapkit_logger.setLevel(level if rank == 0 or stage_logger else max(level, logging.WARNING))
    swapkit_logger.propagate = False


def _whole_model_lines(config: Config) -> frozenset[str]:
    plan = build_plan(config)
    return frozenset(plan.log_lines() + list(plan.notes))


class _SkipLines(logging.Filter):
    """Drops INFO records whose text rank 0 logs too (Note [Each stage logs its own layers])."""

    def __init__(self, lines: frozenset[str]):
        super().__init__()
        self.lines = lines

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.INFO or record.getMessage() not in self.lines
