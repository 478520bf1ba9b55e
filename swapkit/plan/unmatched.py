r"""Patterns that match no sub-module: warnings for some layers, errors with hints for all of them.

Pure: layers are trees of child names (see :mod:`swapkit.plan.report`). The hints speak both
languages a config may use: the layers' real child names and, when a model preset translated
the config (:mod:`swapkit.plan.presets`), the MindFormers / swapkit names the preset maps
(``attention``, ``feed_forward``, ``attention_norm``, ``attention\.wq`` ...).

Note [Unmatched after translation]
The plan holds the patterns *after* the preset translated them: a config that wrote ``attention``
(or left ``swap: true`` to swapkit's default ``.*\.flash_attention``) is planned as ``self_attn``
for Llama. When such a pattern matches nothing, naming only ``self_attn`` blames a pattern the user
never wrote. The error names the written pattern(s) that produced it (read back from the plan's
Formative, which keeps what was written), and says whether the preset fits the model at all: when
the written name matches the layers as written, the model already uses MindFormers' names (the
built-in model) and needs no preset; when none of the preset's scopes is in the layers, the preset
is for another model family.
"""
from __future__ import annotations

import difflib
import re

from swapkit.config.errors import Problem
from swapkit.plan import patterns
from swapkit.plan.normalize import DEFAULT_SWAP_OP
from swapkit.plan.origins import MODULE_SCOPES, Origin, find
from swapkit.plan.plan import Plan
from swapkit.plan.presets import ALIASES, Preset, preset_named

#: A suggestion is kept when it scores at least this, and at most ``_SPREAD`` below the best one.
_CUTOFF, _SPREAD = 0.6, 0.1
_PLAIN_NAME = re.compile(r"[A-Za-z_][\w]*(\\\.[A-Za-z_]\w*)*")


def quoted(pattern: str) -> str:
    r"""A pattern in quotes as written (``'attn\.qkv'``; ``repr`` would double the backslash)."""
    return "'" + pattern + "'"


def unmatched(plan: Plan, trees: list[dict]) -> list[str]:
    """Warnings for patterns that match in some bound layers but not in others they apply to.

    A pattern that matches in no layer at all is an error instead (:func:`unmatched_errors`).
    """
    return [f"{kind} pattern {quoted(pattern)} matches no sub-module in layer(s) {layers}; it has no effect there"
            for (kind, pattern), layers in _missing(plan, trees).items() if _matches_somewhere(pattern, trees)]


def unmatched_errors(plan: Plan, trees: list[dict], model_name: str = "the model") -> list[str]:
    """:func:`unmatched_problems` as ``key.path: message`` lines."""
    return [str(problem) for problem in unmatched_problems(plan, trees, model_name)]


def unmatched_problems(plan: Plan, trees: list[dict], model_name: str = "the model") -> list[Problem]:
    """One problem per pattern that matches no sub-module in any bound layer (a config that does nothing).

    Each names the key the pattern was written at (Note [Where a pattern was written]) and carries a
    hint and a fix: a did-you-mean over the layers' real names and the preset's names, the ``\\.``
    separator when a dotted path was written, how the preset produced the pattern (Note [Unmatched
    after translation]), or, for a default pattern list, the explicit list to write instead.
    """
    paths = sorted({path for tree in trees for path in _all_paths(tree)})
    preset = preset_named(plan.preset) if plan.preset else None
    found: list[Problem] = []
    defaults: dict[tuple[str, str | None], tuple[Origin, list[str]]] = {}
    for (kind, pattern), _ in _missing(plan, trees).items():
        if _matches_somewhere(pattern, trees):
            continue
        written = _written_for(pattern, preset, plan)
        origin = find(plan.origins, kind, [pattern, *written])
        if origin is not None and origin.default is not None and not written and pattern != DEFAULT_SWAP_OP:
            defaults.setdefault((origin.path, origin.module), (origin, []))[1].append(pattern)
            continue
        message = _unmatched_error(kind, pattern, paths, model_name, preset, plan, trees)
        found.append(Problem(origin.path if origin else "", message))
    for origin, pattern in _unapplied(plan, trees, preset):
        found.append(Problem(origin.path, _unmatched_error(origin.kind, pattern, paths, model_name, preset, plan,
                                                           trees)))
    return found + [Problem(origin.path, _default_error(origin, names, paths, model_name))
                    for origin, names in defaults.values()]


def _missing(plan: Plan, trees: list[dict]) -> dict[tuple[str, str], list[int]]:
    """(setting, pattern) -> the layers it applies to where it matches nothing."""
    select_kind = MODULE_SCOPES if plan.dialect == "megatron" else "select_recompute"
    missing: dict[tuple[str, str], list[int]] = {}
    for layer, tree in zip(plan.layers, trees):
        for kind, pattern_list in ((select_kind, layer.select), ("select_comm_recompute", layer.comm),
                                   ("op_swap", tuple(p for p, _ in layer.op_swap))):
            for pattern in pattern_list:
                if not patterns.resolve(tree, pattern):
                    missing.setdefault((kind, pattern), []).append(layer.layer)
    return missing


# Note [Patterns that apply to no layer]
# _missing checks the patterns the plan applies to some layer. A written pattern may apply to none: its
# counts select no layer (`{atention_norm: [0]}`), full recompute wins on every layer it selects
# (`recompute: true` beside a select dict, as MindFormers files often have), or it is an op_swap entry
# while swap_config.swap is false (the section is validated even then, DESIGN §3). Its typo was never
# checked, and surfaced only once another setting changed. Each pattern written in the config (not a
# default one: `select_recompute: [0]` turns the defaults off, and names nothing the model must have)
# that applies to no layer is checked against the layers too, translated by the preset as the plan
# would; one the preset drops (its family has no such module) is left to the preset's own warning.
def _unapplied(plan: Plan, trees: list[dict], preset: Preset | None) -> list[tuple[Origin, str]]:
    """(origin, pattern as planned) of each written pattern that applies to no layer and matches in none
    (Note [Patterns that apply to no layer])."""
    applied = {p for layer in plan.layers for p in layer.select + layer.comm + tuple(p for p, _ in layer.op_swap)}
    out = []
    for origin in plan.origins:
        real = preset.translate(origin.pattern)[0] if preset else (origin.pattern,)
        if origin.default is not None or not real or any(p in applied for p in real):
            continue
        if not any(_matches_somewhere(p, trees) for p in real):
            out.append((origin, real[0]))
    return out


def _matches_somewhere(pattern: str, trees: list[dict]) -> bool:
    return any(patterns.resolve(tree, pattern) for tree in trees)


def _all_paths(tree: dict, prefix: str = "") -> list[str]:
    out: list[str] = []
    for name, subtree in tree.items():
        path = f"{prefix}.{name}" if prefix else name
        out += [path] + _all_paths(subtree, path)
    return out


def _unmatched_error(kind: str, pattern: str, paths: list[str], model_name: str, preset: Preset | None,
                     plan: Plan, trees: list[dict]) -> str:
    message = f"{kind} pattern {quoted(pattern)} matches no sub-module in any layer of {model_name}"
    written = _written_for(pattern, preset, plan)
    if written:
        return f"{message}. {_translated_hint(pattern, written, preset, trees, paths)}"
    if pattern == DEFAULT_SWAP_OP:
        return f"{message}. {_default_op_hint(paths)}"
    hint = _dotted_hint(pattern, paths, preset) or _inside_hint(pattern, preset)
    return f"{message}. {hint}" if hint else f"{message}; {_did_you_mean(pattern, paths, preset)}"


#: Child names that play a role, for the example in a fix (``attn`` for attention, ``mlp`` for the MLP, ...).
_ROLE_NAMES = {"attention": r"attn|attention", "feed_forward": r"mlp|ffn|feed_forward|fc", "norm": r"norm|ln"}
#: The role of each default pattern list, and of each Megatron module.
_ROLE_OF = {"select_recompute": "feed_forward", "select_comm_recompute": "norm", "core_attn": "attention",
            "mlp": "feed_forward", "layernorm": "norm"}


def _default_error(origin: Origin, names: list[str], paths: list[str], model_name: str) -> str:
    """A default pattern list (or a Megatron module's built-in scope) that binds nowhere: the explicit
    setting to write instead (Note [Where a pattern was written])."""
    children = [p for p in paths if "." not in p]
    example = _example(_ROLE_OF.get(origin.module or origin.kind), children)
    nowhere = (f"{'it matches' if len(names) == 1 else 'they match'} no sub-module in any layer of {model_name}; "
               f"its layers' children are: {', '.join(children)}")
    shown = ", ".join(quoted(n) for n in names)
    if origin.module is not None:
        return (f"got {origin.default}, so module {origin.module!r} is recomputed at swapkit's built-in scope "
                f"{shown} (the built-in model's name), and {nowhere}. Map the module to this model's scope: "
                f"recompute_config.module_scopes: {{{origin.module}: {example}}}, or set model.model_config.preset "
                "to the model family")
    key = origin.path.rsplit(".", 1)[-1]
    return (f"got {origin.default}, which selects the default op pattern{'s' if len(names) > 1 else ''} {shown} "
            f"(MindFormers' Llama names, which swapkit's built-in model has), and {nowhere}. Write an explicit op "
            f"list instead, e.g. {key}: {{{example}: {origin.default}}}, or set "
            "model.model_config.preset to the model family")


def _example(role: str | None, children: list[str]) -> str:
    """A child name for ``role`` (the first child when none has a telling name), as a YAML scalar."""
    regex = _ROLE_NAMES.get(role or "")
    telling = [c for c in children if regex and re.search(regex, c, re.IGNORECASE)]
    return (telling or children or ["<scope>"])[0]


def _default_op_hint(paths: list[str]) -> str:
    attention = [p for p in paths if _attention_like(p.split(".")[-1])]
    found = ", ".join(attention[:6]) or "none"
    return (f"It is swapkit's default swap op (swap_config.swap: true without layer_swap/op_swap) and this model "
            f"has no flash_attention scope; attention-like scopes found: {found}. Set model.model_config.preset "
            "to the model family, or write swap_config.op_swap: [{op_name: "
            f"{_as_pattern(attention[0]) if attention else '<scope>'}, backward_prefetch: 1, layers: true}}]")


def _attention_like(name: str) -> bool:
    """An attention scope's name; norms named after attention (``post_attention_layernorm``,
    ``attention_norm``) are norms, and swapping one would not swap the attention."""
    return bool(re.search(r"attn|attention", name, re.IGNORECASE)) and "norm" not in name.lower()


def _written_for(pattern: str, preset: Preset | None, plan: Plan) -> list[str]:
    """The written patterns the preset translated into ``pattern`` (Note [Unmatched after translation])."""
    if preset is None:
        return []
    formative = plan.formative
    written = list(formative.select_recompute) + list(formative.select_comm_recompute) + list(formative.op_swap)
    return [w for w in dict.fromkeys(written) if w != pattern and pattern in preset.translate(w)[0]]


def _translated_hint(pattern: str, written: list[str], preset: Preset, trees: list[dict], paths: list[str]) -> str:
    sources = ", ".join(_source(w) for w in written)
    hint = f"The {preset.name} model preset translated {sources} to {quoted(pattern)}"
    as_written = [w for w in written if _matches_somewhere(w, trees)]
    if as_written:
        return (f"{hint}, but {quoted(as_written[0])} matches this model's layers as written: the model already "
                f"uses MindFormers' scope names (as swapkit's built-in model does) and needs no preset: remove "
                "model.model_config.preset")
    if not _fits(preset, trees):
        return (f"{hint}; the {preset.name} preset does not fit this model: its attention scope "
                f"{', '.join(quoted(p) for p in preset.scopes['attention'])} is not in its layers. Set "
                "model.model_config.preset to the model's family or remove it")
    children = ", ".join(p for p in paths if "." not in p)
    return f"{hint}; this model's layers have no such scope. Write the scope's real name (children: {children})"


def _source(written: str) -> str:
    if written == DEFAULT_SWAP_OP:
        return f"{quoted(written)} (swapkit's default swap op for swap_config.swap: true)"
    return quoted(written)


def _fits(preset: Preset, trees: list[dict]) -> bool:
    """The preset's attention scope is in the layers (every family has one; names like ``mlp`` are
    shared by many families and tell nothing)."""
    attention = preset.scopes.get("attention", ())
    return not attention or any(_matches_somewhere(p, trees) for p in attention)


def _dotted_hint(pattern: str, paths: list[str], preset: Preset | None) -> str | None:
    """The separator hint when ``pattern`` is a dotted path of the model or a preset name with dots."""
    if patterns.display(pattern) != pattern or "." not in pattern:
        return None
    as_pattern = _as_pattern(pattern)
    aliases = _aliases(preset)
    if pattern not in paths and as_pattern not in aliases:
        return None
    note = f" ({aliases[as_pattern]})" if as_pattern in aliases else ""
    return ("Components of a pattern are separated by the two characters \\. (a bare '.' is a regex wildcard "
            f"inside one name): write {quoted(as_pattern)}{note}")


def _inside_hint(pattern: str, preset: Preset | None) -> str | None:
    """Preset names used inside a larger regex (``attention\\.wq|attention\\.wk``): not translated."""
    aliases = _aliases(preset)
    alternatives = re.split(r"[|()]", pattern)
    inside = [a for a in alternatives if a in aliases]
    if "|" not in pattern or not inside or preset is None:
        return None
    return (f"The {preset.name} preset translates a pattern only when it is written exactly as one of its names, "
            f"not inside a larger regex: write {' and '.join(quoted(a) for a in inside)} as separate entries "
            f"({'; '.join(f'{quoted(a)}: {aliases[a]}' for a in inside)})")


def _aliases(preset: Preset | None) -> dict[str, str]:
    """The preset's plain source names -> what it does with each (``"the llama preset maps it to self_attn"``)."""
    if preset is None:
        return {}
    out: dict[str, str] = {}
    for role, spellings in ALIASES.items():
        real = preset.scopes.get(role)
        if real is None and role not in preset.why:
            continue
        what = (f"the {preset.name} preset maps it to {', '.join(real)}" if real
                else f"the {preset.name} preset has no module for it: {preset.why[role]}")
        out.update({s: what for s in spellings if _PLAIN_NAME.fullmatch(s)})
    return out


def _did_you_mean(pattern: str, paths: list[str], preset: Preset | None) -> str:
    """Close names among the layers' real paths and the preset's source names, best first."""
    aliases = _aliases(preset)
    candidates = {_as_pattern(p): "" for p in paths}
    candidates.update({a: f" ({what})" for a, what in aliases.items() if a not in candidates})
    close = _closest(patterns.display(pattern), candidates)
    if close:
        fix = quoted(close[0]) if len(close) == 1 else "one of them"
        return ("did you mean " + " or ".join(quoted(c) + candidates[c] for c in close)
                + f"? Replace {quoted(pattern)} with {fix}")
    hint = f"its layers' children are: {', '.join(p for p in paths if '.' not in p)}"
    plain = [a for a in aliases if "\\" not in a]
    hint += f"; names the {preset.name} preset translates: {', '.join(plain)}" if plain and preset else ""
    return f"{hint}. {_names_fix(paths)}"


def _names_fix(paths: list[str]) -> str:
    """How to write a pattern that binds: a child's name, or a path below one with \\. between names."""
    below = next((p for p in paths if "." in p), None)
    example = f" (e.g. {quoted(_as_pattern(below))})" if below else ""
    return f"Write one of these names, or a path below one with \\. between the names{example}"


def _closest(word: str, candidates: dict[str, str]) -> list[str]:
    """Up to three candidates (compared as dotted paths) that score near the best one."""
    scored = sorted(((difflib.SequenceMatcher(None, word, patterns.display(c)).ratio(), c) for c in candidates),
                    key=lambda sc: -sc[0])
    best = scored[0][0] if scored else 0.0
    return [c for score, c in scored[:3] if score >= _CUTOFF and score >= best - _SPREAD]


def _as_pattern(path: str) -> str:
    return path.replace(".", patterns.SEPARATOR)
