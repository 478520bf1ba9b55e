"""The Megatron recompute dialect (seeds 000 and 002): reading and validating its keys.

Rules follow Megatron-Core's ``TransformerConfig`` checks: ``selective`` takes no
``recompute_method`` / ``recompute_num_layers`` and a non-empty module list; ``full`` needs both a
method and a layer count; ``recompute_activations: true`` means selective;
``distribute_saved_activations`` only goes with full granularity. The per-layer translation lives
in :mod:`swapkit.plan.megatron`.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

from swapkit.config import fields as F
from swapkit.config.errors import Problems, join
from swapkit.config.types import BUILTIN_MODULE_SCOPES, MEGATRON_MODULES, MegatronRecompute

GRANULARITY_FIX = "set recompute_granularity: full (with recompute_method and recompute_num_layers) or selective"


def read_megatron(values: dict, given: set[str], path: str, problems: Problems, notices: list[str]) -> MegatronRecompute:
    """Check the Megatron keys together (their rules depend on each other).

    Any problem found here marks the result invalid, so the plan is not built from it. Whether each
    module has an op scope depends on the model (its preset may map ``moe_act``, ...), so
    :func:`swapkit.plan.plan.build_plan` checks that (:func:`unmapped_modules`).
    """
    before = len(problems)
    written = set_keys(values, given)
    granularity = values["recompute_granularity"]
    if values["recompute_activations"] is True:
        if granularity == "full":  # keep full, so that only the contradiction is reported
            problems.add(join(path, "recompute_activations"), "true means selective recompute, which contradicts "
                         "recompute_granularity: full; remove one of them")
        elif granularity is not F.INVALID:
            granularity = "selective"
    scopes = _module_scopes(values["module_scopes"], join(path, "module_scopes"), problems)
    modules = values["recompute_modules"]
    if granularity is None:
        for key in ("recompute_method", "recompute_num_layers", "recompute_modules", "distribute_saved_activations",
                    "module_scopes"):
            if key in written:
                problems.add(join(path, key), f"has no meaning without recompute_granularity; {GRANULARITY_FIX}")
    elif granularity == "selective":
        modules = _check_selective(values, written, modules or ("core_attn",), path, problems)
    elif granularity == "full":
        _check_full(values, written, path, problems)
    distribute = values["distribute_saved_activations"]
    if distribute is True and granularity == "selective":
        problems.bad(join(path, "distribute_saved_activations"), True,
                     "false unless recompute_granularity is full (Megatron rule)")
    elif distribute is True and granularity == "full":
        notices.append(join(path, "distribute_saved_activations"))  # needs tensor parallelism
    return MegatronRecompute(
        recompute_granularity=granularity if len(problems) == before else F.INVALID,
        recompute_method=values["recompute_method"],
        recompute_num_layers=values["recompute_num_layers"],
        recompute_modules=modules if granularity == "selective" else None,
        distribute_saved_activations=bool(distribute),
        module_scopes=scopes if scopes is not F.INVALID else dict(BUILTIN_MODULE_SCOPES),
        use_reentrant=values["use_reentrant"],
        given=_given(given, values["module_scopes"]),
    )


# Note [A key given as null is not written]
# Megatron's recompute keys default to None (distribute_saved_activations to False), and recipes turn
# recompute off by writing those defaults out: seed 000's Llama3 recipe sets `recompute_granularity =
# None` and `recompute_modules = None`. Such a key is not a setting, so the rules that refuse a key
# without granularity, or one that the granularity does not take, look only at the keys written with
# another value (the keys written at all are still recorded in `given`, for the errors that name them).
def set_keys(values: dict, given: set[str]) -> set[str]:
    """The keys of ``given`` written with a value other than their default (Note [A key given as null is not
    written])."""
    return {key for key in given if values.get(key) is not None and values.get(key) is not False}


def megatron_warnings(recompute: Any) -> list[str]:
    """A module listed twice in ``recompute_modules``: the repeat does nothing (Megatron-Core checks
    only the names, so a typo'd copy of a line passes there silently too)."""
    if not isinstance(recompute, MegatronRecompute):
        return []
    out = _idle_module_scopes(recompute)
    modules = recompute.recompute_modules
    if not isinstance(modules, tuple):  # None, or F.INVALID (already an error)
        return out
    repeated = sorted(m for m, count in Counter(modules).items() if count > 1)
    if not repeated:
        return out
    return out + [f"recompute_config.recompute_modules lists {repeated} more than once ({list(modules)}); a module is "
            "recomputed once, the repeats do nothing: list each module once"]


def _idle_module_scopes(recompute: MegatronRecompute) -> list[str]:
    """``module_scopes`` with full granularity: only selective recompute reads it."""
    if recompute.recompute_granularity != "full" or "module_scopes" not in recompute.given:
        return []
    return ["recompute_config.module_scopes maps recompute_modules to op scopes, which only recompute_granularity: "
            "selective uses; it does nothing with full: remove it"]


def _given(given: set[str], module_scopes: Any) -> tuple[str, ...]:
    """The keys written, with ``module_scopes.<module>`` for each module the user mapped."""
    mapped = [f"module_scopes.{name}" for name in module_scopes] if isinstance(module_scopes, dict) else []
    return tuple(sorted(given)) + tuple(mapped)


def _check_selective(values: dict, written: set[str], modules: Any, path: str, problems: Problems) -> Any:
    if "recompute_method" in written:
        problems.add(join(path, "recompute_method"), "is not supported with recompute_granularity: selective "
                     "(Megatron rule); remove it, or use recompute_granularity: full")
    if values["recompute_num_layers"] is not None:
        problems.add(join(path, "recompute_num_layers"), "selective recompute takes no recompute_num_layers "
                     "(Megatron rule); remove it")
    if modules is F.INVALID:
        return modules
    unknown = [m for m in modules if m not in MEGATRON_MODULES]
    if unknown:
        problems.bad(join(path, "recompute_modules"), list(modules), "Megatron module names",
                     f"unknown {unknown}; valid modules: {', '.join(MEGATRON_MODULES)}")
    return modules


def unmapped_modules(modules: Any, scopes: Any, path: str, problems: Problems, where: str = "this model") -> None:
    """Each selected module needs an op scope (from ``module_scopes`` or the model's preset)."""
    for m in [m for m in modules or () if m not in scopes]:
        problems.add(join(path, "recompute_modules"), f"module {m!r} has no op scope in {where}; add "
                     f"recompute_config.module_scopes.{m}: '<op pattern>' (mapped: {', '.join(scopes)}), or set "
                     "model.model_config.preset to a model family that has it")


def _check_full(values: dict, written: set[str], path: str, problems: Problems) -> None:
    if values["recompute_method"] is None:
        problems.add(join(path, "recompute_method"), "is required with recompute_granularity: full; "
                     "use uniform or block")
    if values["recompute_num_layers"] is None:
        problems.add(join(path, "recompute_num_layers"), "is required with recompute_granularity: full; "
                     "give the layers per checkpoint unit (uniform) or per stage (block)")
    if "recompute_modules" in written:
        problems.add(join(path, "recompute_modules"), "applies only to recompute_granularity: selective; remove it")


def _module_scopes(value: Any, path: str, problems: Problems) -> Any:
    scopes = dict(BUILTIN_MODULE_SCOPES)
    if value is None or value is F.INVALID:
        return scopes if value is None else value
    for name, patterns in value.items():
        key_path = join(path, name)
        if name not in MEGATRON_MODULES:
            problems.bad(key_path, name, f"a Megatron module name ({', '.join(MEGATRON_MODULES)})")
            continue
        names = F.string_list(patterns, key_path, problems)
        if names is not F.INVALID and F.INVALID not in [F.pattern(p, key_path, problems) for p in names]:
            scopes[name] = names
    return scopes
