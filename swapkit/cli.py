"""``swapkit`` command line: ``swapkit plan CONFIG`` and ``swapkit train CONFIG``.

Exit status: 0 success, 1 runtime failure, 2 bad config or usage, 130 interrupted (Ctrl-C, SIGINT), 143
stopped by SIGTERM (``128 + signal``; ``swapkit.distributed.signals`` Note [Stopping the ranks]).
Logs go to stderr on the ``swapkit`` logger in MindFormers' ``LEVEL - message`` form.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import TYPE_CHECKING, Any, Sequence

from swapkit.config.errors import BindError, ConfigError, Problem, clip
from swapkit.config.loader import CommandLineOverrides
from swapkit.distributed.signals import Interrupted
from swapkit.logs import quieter

if TYPE_CHECKING:
    from swapkit.config.types import Config
    from swapkit.plan.plan import Plan
    from swapkit.planner.command import BudgetPlan

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
logger = logging.getLogger("swapkit")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = _parse(parser, argv)
    if hasattr(args, "overrides"):  # loader Note [Naming an override]
        args.overrides = CommandLineOverrides(args.overrides)
    _configure_logging(args.verbose)
    try:
        return args.run(args)
    except (ConfigError, BindError) as err:
        print(f"swapkit: {_blamed(err, getattr(args, 'overrides', ()))}", file=sys.stderr)
        return EXIT_USAGE
    except Interrupted as err:  # swapkit train's processes: SIGINT, SIGTERM or SIGHUP, named
        sys.stderr.write(f"swapkit: {err}\n")  # one write: torchrun's ranks share the terminal
        return 128 + err.signum
    except KeyboardInterrupt:
        print("swapkit: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as err:  # noqa: BLE001 - Note [No traceback]
        print(f"swapkit: {_failure(err, args.verbose)}", file=sys.stderr)
        return EXIT_FAILED


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser.parse_args``; an override written without ``--set`` (``swapkit train cfg.yaml a.b=1``, as torchtune
    and Hydra take one) is a usage error that names ``--set``, not only argparse's "unrecognized arguments"."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        overrides = [item for item in extra if "=" in item and not item.startswith("-")]
        sets = " ".join(f"--set {item}" for item in overrides)
        fix = f"; to override a config value write {sets}" if overrides else ""
        parser.error(f"unrecognized arguments: {' '.join(extra)}{fix}")
    return args


def _blamed(err: ConfigError | BindError, overrides: Sequence[str]) -> ConfigError | BindError:
    """``err`` with its problems at keys that ``--set`` wrote naming that ``--set``: the loader does this
    for what it checks; this covers the checks made later (``runtime.engine`` against the device,
    ``train.resume`` without ``train.save_dir``, ``train.device: cuda`` without CUDA).
    ``swapkit.config.loader`` Note [Blame the command line]."""
    if not isinstance(err, ConfigError) or not overrides:
        return err
    from swapkit.config.errors import Problems
    from swapkit.config.loader import blame_overrides

    problems = Problems()
    problems.items = list(err.problems)
    blame_overrides(problems, overrides)
    return ConfigError(problems.items, err.source)


# Note [No traceback]
# Whatever goes wrong, the CLI ends with one message and an exit status, never a Python traceback:
# config and usage problems are ConfigErrors (2); failures the run can explain (NaN loss, a full
# disk, memory that cannot be allocated) are RunFailed (1); anything else is reported as an
# internal error with its type and a clipped message (1), and `-v` logs the traceback for a bug report.
def _failure(err: Exception, verbose: bool) -> str:
    from swapkit.train.errors import RunFailed

    if isinstance(err, RunFailed):
        return clip(str(err), 2000)
    text = str(err)[:500].lower()
    if isinstance(err, MemoryError) or "out of memory" in text or "can't allocate memory" in text:
        return (f"out of memory: {clip(str(err) or type(err).__name__, 300)}; reduce train.batch_size, "
                "model.model_config sizes or num_layers")
    if verbose:
        logger.exception("swapkit: traceback of the failure")
    hint = "" if verbose else "; rerun with -v for the traceback"
    return f"failed: {_with_causes(err)}{hint}"


def _with_causes(err: BaseException, depth: int = 3) -> str:
    """``Type: message`` of ``err`` and of the errors it was raised from (``raise ... from``), each on one line:
    torch's pipeline stages wrap a stage's forward or backward error in a RuntimeError of their own whose
    indented, multi-line text (``[Stage 1] failed to run forward: args: ...``) does not name it."""
    parts = []
    while err is not None and len(parts) < depth:
        parts.append(f"{type(err).__name__}: {clip(' '.join(str(err).split()), 500)}")
        err = err.__cause__
    return "; caused by ".join(parts)


DESCRIPTION = ("Activation memory per layer and per operator (swap, recompute or keep), driven by "
               "MindFormers-style YAML: 'swapkit plan CONFIG' shows what a config does, 'swapkit train CONFIG' "
               "trains the built-in model with it.")


def _parser() -> argparse.ArgumentParser:
    from swapkit import __version__

    parser = argparse.ArgumentParser(prog="swapkit", description=DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"swapkit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    plan = sub.add_parser("plan", help="print the per-layer plan and a summary (MindFormers' log lines with --log)",
                          description="Print the per-layer plan of a config and a short summary; warnings go to "
                                      "stderr, MindFormers' log lines too with --log.")
    plan.add_argument("config", help="YAML config file")
    plan.add_argument("--json", action="store_true", help="print the plan as one JSON document on stdout")
    plan.add_argument("--log", action="store_true",
                      help="also print MindFormers' log lines (Formative ..., Set ...) on stderr")
    plan.add_argument("--model", metavar="SPEC",
                      help="resolve against this model, built on the meta device: pkg.module:factory, "
                           "hf:<model_type> or hf:<path to config.json> (default: the built-in model)")
    plan.add_argument("--layers", metavar="PATH", help="dotted path of the model's layer container, e.g. model.layers")
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                      help="override a config value, e.g. --set swap_config.swap=true (repeatable)")
    plan.add_argument("--budget", metavar="SIZE", help="measure a step and plan swap/recompute so the peak of "
                      "device-resident saved bytes fits SIZE (64MiB, 1.5GiB, bytes)")
    plan.add_argument("--out", metavar="FILE", help="with --budget: write the planned YAML config here")
    plan.add_argument("--device", choices=("cpu", "cuda"), help="with --budget: override train.device")
    _verbose(plan)
    plan.set_defaults(run=run_plan)

    train = sub.add_parser("train", help="train the built-in model as the config says",
                           description="Train the built-in Llama-style model with the config's swap and recompute "
                                       "strategy and print a summary.")
    train.add_argument("config", help="YAML config file")
    train.add_argument("--steps", type=int, help="override train.steps")  # range checked with train.steps
    train.add_argument("--device", choices=("cpu", "cuda"), help="override train.device")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config value, e.g. --set train.lr=1e-3 (repeatable)")
    train.add_argument("--metrics-out", metavar="FILE", help="write per-step metrics and a summary as JSON")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument("--budget", metavar="SIZE", help="plan under this memory budget first (as swapkit plan "
                       "--budget) and train with the planned config")
    _verbose(train)
    train.set_defaults(run=run_train)
    return parser


def _verbose(command: argparse.ArgumentParser) -> None:
    """``-v`` after the command too (``swapkit train CONFIG -v``), as users write it; not given there,
    the value before the command stands (SUPPRESS leaves it alone)."""
    command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                         help="debug logging (same as swapkit -v)")


def _configure_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s - %(message)s"))
    logger.handlers[:] = [handler]
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)
    logger.propagate = False
    # the planner's progress shows where its measurement runs' own lines are hidden
    # (swapkit.planner.progress Note [An emulated link makes planning slow])
    logging.getLogger("swapkit.planner.progress").setLevel(logging.DEBUG if verbose else logging.INFO)


def run_plan(args: argparse.Namespace) -> int:
    """Run ``swapkit plan``: the table and a summary on stdout (or JSON), warnings on stderr."""
    if args.budget is not None:
        return run_budget_plan(args)
    if args.out is not None or args.device is not None:
        raise ConfigError([Problem("--out" if args.out is not None else "--device",
                                   "only works with --budget SIZE; add --budget or drop it")])
    from swapkit.load import load_config

    if not (args.log or args.verbose):
        logger.setLevel(logging.WARNING)
    config = load_config(args.config, args.overrides)  # before importing torch: a bad config fails fast
    from swapkit.plan.report import plan_report, summary, table, with_exact_overridden

    model, plan = _plan_model(args, config)
    for line in plan.log_lines() + list(plan.notes):
        logger.info(line)
    for message in plan.warnings:
        logger.warning(message)
    trees = _matched_trees(args, config, model, plan)
    for level, message in plan_report(plan, trees):
        logger.log(logging.getLevelName(level), message)
    plan = with_exact_overridden(plan, trees)
    print(json.dumps(plan.to_json(), indent=2) if args.json else table(plan) + "\n\n" + "\n".join(summary(plan)))
    return EXIT_OK


def _matched_trees(args: argparse.Namespace, config: Config, model: Any, plan: Plan) -> list[dict]:
    """The bound layers' module trees; an op pattern that matches no sub-module in any layer is a
    ConfigError (exit 2) with a did-you-mean."""
    from swapkit.config.errors import Problems
    from swapkit.config.loader import blame_overrides
    from swapkit.plan.report import unmatched_problems
    from swapkit.runtime.binding import bind, module_tree

    binding = bind(model, plan, _layers_path(args, config))
    trees = [module_tree(layer.module) for layer in binding.layers]
    problems = Problems()
    problems.items = unmatched_problems(plan, trees, f"{type(model).__name__}.{binding.layers_path}")
    blame_overrides(problems, args.overrides)  # Note [Blame the command line]
    problems.raise_if_any(config.source)
    return trees


def _layers_path(args: argparse.Namespace, config: Config) -> str | None:
    """``--layers``; for the built-in model without it, the container ``swapkit train`` binds (auto-detection
    finds no container of *repeated* layers in a one-layer model; swapkit.train.loop Note [Layer paths of
    the built-in model])."""
    from swapkit.train.loop import BUILTIN_LAYERS

    layers = getattr(args, "layers", None)
    if layers is None and getattr(args, "model", None) is None and config.model.layers_path is None:
        return BUILTIN_LAYERS
    return layers


def _check_patterns(args: argparse.Namespace) -> None:
    """``--budget``: the input's op patterns are checked against the model as plain ``swapkit plan``
    checks them, before anything is measured (they add candidate scopes for the planner;
    ``swapkit.planner.command`` Note [The sections --budget replaces])."""
    from swapkit.load import validated_config

    if getattr(args, "model", None) and not args.model.startswith("hf:"):
        return  # refused by budget_plan, naming --model, before any user code is imported
    config = validated_config(args.config, args.overrides)  # its warnings: when budget_plan loads it
    if getattr(args, "model", None) is None:
        _check_builtin_patterns(args, config)
    else:
        _matched_trees(args, config, *_plan_model(args, config))


def _check_builtin_patterns(args: argparse.Namespace, config: Config) -> None:
    """The built-in model's layer path (named first, as budget_plan does), then the config's op
    patterns against that model on the meta device: a ConfigError (exit 2) for either."""
    from swapkit.train.files import raise_problems
    from swapkit.train.loop import builtin_layers_problems

    raise_problems(builtin_layers_problems(config, getattr(args, "layers", None)), config.source)
    _matched_trees(args, config, *_plan_model(args, config))


def run_budget_plan(args: argparse.Namespace) -> int:
    """``swapkit plan --budget``: the report (or JSON) on stdout, the YAML to --out; without --out the
    report as YAML comments above the YAML, so stdout is one document that loads."""
    from swapkit.plan.planner import BudgetError
    from swapkit.planner.command import budget_plan, write

    _check_outputs({"--out": args.out}, args.config)
    if not (args.log or args.verbose):  # as plain `swapkit plan`: the measurement runs' log lines with --log
        logger.setLevel(logging.WARNING)
    _check_patterns(args)
    try:
        plan = budget_plan(args.config, args.overrides, args.budget, args.device, args.model, args.layers)
    except BudgetError as err:
        print(f"swapkit: {err}", file=sys.stderr)
        return EXIT_USAGE
    write(plan, args.out)
    if args.json:
        print(json.dumps(plan.document, indent=2))
    elif args.out is None:  # one YAML document: `> planned.yaml` writes a config that loads
        print("\n".join(f"# {line}".rstrip() for line in plan.report.splitlines()))
        print(plan.yaml())
    else:
        print(plan.report)
    return EXIT_OK


def _check_outputs(paths: dict[str, str | None], config: str) -> None:
    """The files a ``--budget`` command writes can be written (exit 2), checked before the planner
    spends its measurement runs rather than failing after them; none of them is the input ``config``."""
    from pathlib import Path

    from swapkit.train.files import check_output_file

    problems: list[Problem] = []
    for key, path in paths.items():
        if path is not None:
            check_output_file(Path(path), key, problems, config)
    if problems:
        raise ConfigError(problems)


def _check_before_planning(args: argparse.Namespace) -> None:
    """``swapkit train --budget``: what training would refuse (``--steps``, ``--metrics-out``, ``train.resume``
    without ``train.save_dir``, a fresh run over an earlier run's checkpoints, a resume from a checkpoint
    of another model or data) is refused before the measurement runs, not after them."""
    from swapkit.load import validated_config
    from swapkit.train.checkpoint import check_resume_early, earlier_run_problems
    from swapkit.train.files import raise_problems
    from swapkit.train.loop import resolve_steps

    _check_outputs({"--metrics-out": args.metrics_out}, args.config)
    config = validated_config(args.config, args.overrides)  # its warnings: when budget_plan loads it
    resolve_steps(config, args.steps)
    raise_problems(earlier_run_problems(config.train.save_dir, config.train.resume), config.source)
    with quieter("swapkit.train.checkpoint", logging.ERROR):  # the resume itself warns about broken files
        check_resume_early(config)


def _plan_model(args: argparse.Namespace, config: Config) -> tuple[Any, Plan]:
    """The model ``swapkit plan`` resolves against (meta device) and the plan for it."""
    from swapkit.config.errors import Problem
    from swapkit.plan.plan import build_plan
    from swapkit.runtime.resolve import resolve_plan

    if getattr(args, "model", None) is None:  # swapkit train has no --model
        from swapkit.train.model import build_model

        plan = build_plan(config)  # the built-in model needs num_layers from the config
        return build_model(config.model, device="meta"), plan  # op paths of the built-in model, no memory
    from swapkit.integrations.models import build_meta_model

    try:
        model = build_meta_model(args.model)
    except ValueError as err:
        raise ConfigError([Problem("--model", str(err).removeprefix("--model "))]) from None
    return model, resolve_plan(model, config, getattr(args, "layers", None))


def run_train(args: argparse.Namespace) -> int:
    """Run ``swapkit train``; a bad config or device raises :class:`ConfigError` (exit 2)."""
    from swapkit.load import load_config

    if args.budget is not None:
        return run_budget_train(args)
    config = load_config(args.config, args.overrides)  # before importing torch: a bad config fails fast
    return _train(config, args)


def _train(config: Config, args: argparse.Namespace, plan: BudgetPlan | None = None) -> int:
    """Train ``config`` in this process, or one process per rank for a pipeline / data-parallel config;
    with the ``plan`` it came from (``--budget``), its measured peaks are checked against the budget."""
    from swapkit.distributed.signals import StopOnSignal

    with StopOnSignal():  # SIGINT / SIGTERM / SIGHUP: one Interrupted, never lost in a finalizer (Note [Stopped early])
        return _train_stoppable(config, args, plan)


# Note [Stopped early]
# The fork server of a run's CPU ranks starts before this process imports torch (rank_start Note [The
# server starts first]), and the ranks' launch installs its own handlers (signals Note [Stopping the
# ranks]) seconds later. A SIGTERM or SIGHUP in between met the default action: the process died with
# no word and left the server's socket folder (`pymp-*`) in TMPDIR, which only an orderly exit removes.
# The stop handlers are therefore installed before the server starts: a stop then is one Interrupted
# line and an orderly exit (the server ends when this process's pipe to it closes); launch's handlers
# take over while the ranks run and hand back when they end.
def _train_stoppable(config: Config, args: argparse.Namespace, plan: BudgetPlan | None) -> int:
    _start_rank_server(config, args)  # before torch loads here: rank_start Note [The server starts first]
    from swapkit.distributed.launch import RankFailed, launch, world_size
    from swapkit.train import format_summary, train
    from swapkit.train.loop import resolve_device, resolve_steps

    if world_size(config) == 1:
        result = train(config, steps=args.steps, device=args.device, metrics_out=args.metrics_out,
                       progress=not args.no_progress)
    else:  # pipeline and/or data parallel: one process per rank
        # an op pattern no layer has is exit 2 here, as in one process, not a rank's BindError traceback
        with quieter("swapkit.runtime.binding", logging.WARNING):  # its "Bound layers" line is each rank's to say
            _check_builtin_patterns(args, config)  # launch.py Note [Checks before the ranks start]
        try:
            result = launch(config, resolve_device(config, args.device), steps=resolve_steps(config, args.steps),
                            metrics_out=args.metrics_out, progress=not args.no_progress)
        except RankFailed as err:
            print(f"swapkit: {err}", file=sys.stderr)
            return EXIT_FAILED
    if result is not None:  # under torchrun only rank 0 has the result
        print(format_summary(result.summary if plan is None else _budget_checked(plan, result.summary,
                                                                                 args.metrics_out)))
    return EXIT_OK


def _start_rank_server(config: Config, args: argparse.Namespace) -> None:
    """The fork server of a run's CPU ranks, started while this process has not imported torch yet
    (swapkit.distributed.rank_start Note [The server starts first]); not for one process, CUDA ranks
    (spawned) or torchrun's ranks."""
    from swapkit.distributed.rank_start import start_method, world_size

    if world_size(config) > 1 and (args.device or config.train.device) == "cpu" and "RANK" not in os.environ:
        start_method("cpu", warn=False)  # launch asks again, and warns if the server cannot start


def _budget_checked(plan: BudgetPlan, summary: dict[str, Any], metrics_out: str | None) -> dict[str, Any]:
    from swapkit.planner.command import budget_check, record_budget_check

    checked = budget_check(plan, summary)  # swapkit.planner.command Note [Measured peak over budget]
    record_budget_check(metrics_out, checked)  # the metrics file says it too, not only the printed summary
    return checked


def run_budget_train(args: argparse.Namespace) -> int:
    """``swapkit train --budget``: plan first (report to stderr), then train the planned config."""
    from swapkit.plan.planner import BudgetError
    from swapkit.planner.command import budget_plan, write

    _check_before_planning(args)
    level = logger.level
    if not args.verbose:  # the measurement runs' own log lines (every mode's Set ... lines) only with -v
        logger.setLevel(logging.WARNING)
    try:
        _check_patterns(args)
        plan = budget_plan(args.config, args.overrides, args.budget, args.device)
    except BudgetError as err:
        print(f"swapkit: {err}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        logger.setLevel(level)
    write(plan, None)
    print(plan.report, file=sys.stderr)
    from swapkit.load import validated_config

    # the input's warnings were logged when budget_plan loaded it; the planned config repeats them
    return _train(validated_config(plan.config), args, plan)  # a pipeline config trains on one process per stage


if __name__ == "__main__":
    sys.exit(main())
