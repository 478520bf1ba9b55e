"""The Plan: per-layer decisions (full / select / comm recompute, layer and op swaps).

Precedence: full recompute beats select; excludes were applied during normalization; recompute
beats swap, and every swap that a recompute decision makes pointless is listed in
``overridden``. Pure Python: no torch and no model needed.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass, replace
from functools import lru_cache
from typing import Any, Callable

from swapkit.plan import patterns
from swapkit.config.megatron import unmapped_modules
from swapkit.config.types import Config, MegatronRecompute, MindFormersRecompute, RuntimeConfig
from swapkit.config.errors import Problems, show
from swapkit.config.fields import INVALID
from swapkit.plan.idle import idle_excludes, idle_selects, selects
from swapkit.plan.layout import Layout, build_layout
from swapkit.plan.megatron import describe, megatron_formative, megatron_layers
from swapkit.plan.normalize import Formative, normalize_recompute, normalize_swap, swap_mode_warnings
from swapkit.plan.origins import Origin, pattern_origins
from swapkit.plan.presets import Preset, preset_named

NUM_LAYERS_FIX = ("missing; give the layer count, or pass the model to swapkit.apply (or `swapkit plan --model`), "
                  "which counts the layers of its layer container")


def swap_counts(layers: Any) -> str:
    """``'4'``, or ``'4 (+2 overridden by recompute)'`` when recompute overrides every swap of some layers:
    how many layers swap, as a session's ``repr`` says it."""
    configured = sum(layer.swaps for layer in layers)
    acting = sum(layer.swaps_in_effect for layer in layers)
    return f"{acting}" if acting == configured else f"{acting} (+{configured - acting} overridden by recompute)"


@dataclass(frozen=True)
class LayerPlan:
    """Everything the config asks for on one layer."""

    layer: int
    stage: int
    chunk: int
    full: bool = False
    unit: tuple[int, int] | None = None  # layers checkpointed together with this one (first, last)
    select: tuple[str, ...] = ()
    comm: tuple[str, ...] = ()
    layer_swap: int | None = None
    op_swap: tuple[tuple[str, int], ...] = ()
    overridden: tuple[str, ...] = ()

    @property
    def swaps(self) -> bool:
        """A layer or op swap is configured here (recompute may still override it: ``overridden``)."""
        return self.layer_swap is not None or bool(self.op_swap)

    @property
    def swaps_in_effect(self) -> bool:
        """Some configured swap acts: recompute does not override it (``overridden``)."""
        return ((self.layer_swap is not None and "layer" not in self.overridden)
                or any(pattern not in self.overridden for pattern, _ in self.op_swap))

    @property
    def recomputes(self) -> bool:
        """The whole layer, or some op scope of it, is recomputed."""
        return self.full or bool(self.select or self.comm)

    def to_json(self) -> dict[str, Any]:
        return {
            "layer": self.layer, "stage": self.stage, "chunk": self.chunk, "full": self.full,
            "unit": list(self.unit) if self.unit else None,
            "select": list(self.select), "comm": list(self.comm), "layer_swap": self.layer_swap,
            "op_swap": [[pattern, prefetch] for pattern, prefetch in self.op_swap],
            "overridden": list(self.overridden),
        }


@dataclass(frozen=True)
class Plan:
    """The resolved strategy for every layer, plus what the runtime needs to apply it."""

    layout: Layout
    formative: Formative
    layers: tuple[LayerPlan, ...]
    dialect: str
    swap: bool
    use_reentrant: bool
    runtime: RuntimeConfig
    layers_path: str | tuple[str, ...] | None = None  # one container or several, numbered in order
    summary: str | None = None  # one line describing a Megatron strategy
    preset: str | None = None  # the model family whose names the patterns were translated to
    notes: tuple[str, ...] = ()  # how the preset translated MindFormers / Megatron names (INFO lines)
    warnings: tuple[str, ...] = ()  # settings that are accepted but (partly) do nothing
    origins: tuple[Origin, ...] = ()  # the key path of each op pattern (Note [Where a pattern was written])

    def log_lines(self) -> list[str]:
        """Layout and "Formative ..." lines exactly as MindFormers logs them."""
        lines = self.layout.log_lines() + self.formative.log_lines(self.swap)
        return lines + ([self.summary] if self.summary else [])

    def stage_layers(self, stage: int) -> list[list[int]]:
        """Global layer ids of each interleave chunk of pipeline stage ``stage``.

        Chunk ``v`` of stage ``s`` is torch's pipeline stage index ``v * P + s``
        (``torch.distributed.pipelining`` numbers the chunks of an interleaved schedule that way).

        Raises:
            ValueError: ``stage`` is not in ``range(pipeline_stage)``.

        Example:
            >>> from swapkit import load_config
            >>> plan = build_plan(load_config({"model": {"model_config": {"num_layers": 4, "pp_interleave_num": 2}},
            ...                                "parallel_config": {"pipeline_stage": 2}}))
            >>> plan.stage_layers(1)
            [[1], [3]]
        """
        layout = self.layout
        if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage < layout.pipeline_stage:
            raise ValueError(f"stage={stage!r} is not a pipeline stage of this plan; expected an integer in "
                             f"0..{layout.pipeline_stage - 1} (parallel_config.pipeline_stage: {layout.pipeline_stage})")
        return [list(layout.chunk_layers(v, stage)) for v in range(layout.pp_interleave_num)]

    def to_json(self) -> dict[str, Any]:
        layout = self.layout
        return {
            "dialect": self.dialect,
            "swap": self.swap,
            "preset": self.preset,
            "layout": {
                "num_layers": layout.num_layers, "pipeline_stage": layout.pipeline_stage,
                "pp_interleave_num": layout.pp_interleave_num,
                "layer_list": [list(r) for r in layout.layer_list], "layer_accu": [list(r) for r in layout.layer_accu],
                "pp_ids": list(layout.pp_ids), "interleave_ids": list(layout.interleave_ids),
            },
            "formative": self.formative.to_json(),
            "layers": [layer.to_json() for layer in self.layers],
        }


def build_plan(config: Config, preset: Preset | None = None) -> Plan:
    """Resolve a config into per-layer decisions.

    Args:
        config: a loaded config (``model_config.num_layers`` must be known here).
        preset: the model family to translate scope names to; ``model_config.preset`` wins over it.

    Raises:
        ConfigError: if the config is inconsistent (a hand-built ``Config`` is checked here too).

    Example:
        >>> from swapkit import load_config
        >>> plan = build_plan(load_config({"model": {"model_config": {"num_layers": 2}},
        ...                                "recompute_config": {"recompute": True}}))
        >>> [layer.full for layer in plan.layers]
        [True, True]
    """
    problems = Problems()
    plan = check_plan(config, problems, preset)
    problems.raise_if_any(config.source)
    return plan


def check_plan(config: Config, problems: Problems, preset: Preset | None = None, for_model: bool = True
               ) -> Plan | None:
    """Build the plan, recording every semantic problem in ``problems`` (``None`` if there are any).

    ``for_model=False`` (``load_config``: no model yet) skips what only a model can settle: whether
    each Megatron module has an op scope (the model's preset may map it).
    """
    model, rc = config.model, config.recompute
    if model.num_layers is None:
        problems.add("model.model_config.num_layers", NUM_LAYERS_FIX)
        return None
    preset = _preset(model.preset, preset, problems)
    layout = build_layout(model.num_layers, config.parallel.pipeline_stage, model.pp_interleave_num,
                          model.offset, problems) if valid(model, config.parallel) else None
    swaps = normalize_swap(config.swap, problems) if valid(config.swap) else None
    if layout is None or not valid(rc) or config.swap.swap is INVALID:
        return None
    if isinstance(rc, MegatronRecompute):
        rc = _with_preset_scopes(rc, preset, problems if for_model else Problems())
        if rc is None:
            return None
        decisions = megatron_layers(rc, layout)
        recompute: dict | None = megatron_formative(rc, layout, decisions)
    else:
        recompute = normalize_recompute(rc, layout, config.swap.swap, problems)
    if recompute is None or swaps is None:
        return None
    layer_rules, op_rules = swaps if config.swap.swap else ((), {})
    formative = Formative(**recompute, layer_swap=layer_rules, op_swap=op_rules)
    notes: list[str] = []
    dropped: list[str] = []
    translate = _translator(preset, notes, dropped)
    layers = tuple(
        _layer_plan(i, layout, formative, decisions[i] if isinstance(rc, MegatronRecompute) else None,
                    config.swap.swap, translate)
        for i in range(layout.num_layers)
    )
    swap_mode = config.swap.swap and rc.dialect == "mindformers"
    warnings = (swap_mode_warnings(formative, layout.num_layers) if swap_mode else []) + dropped
    if isinstance(rc, MindFormersRecompute):
        written = normalize_recompute(rc, layout, config.swap.swap, Problems(), excluded=False)
        warnings += idle_excludes(rc, written, layers, layout, config.swap.swap) if written is not None else []
        warnings += idle_selects(rc, formative, layers, layout, config.swap.swap)
    warnings += _idle_reentrant(rc, layers)
    if not any(layer.swaps for layer in layers):
        warnings += inactive_runtime(config.runtime)
    return Plan(layout, formative, layers, rc.dialect, config.swap.swap, rc.use_reentrant, config.runtime,
                model.layers_path, describe(rc) if isinstance(rc, MegatronRecompute) else None,
                preset.name if preset else None, tuple(notes), tuple(warnings), pattern_origins(config))


def _idle_reentrant(rc: Any, layers: tuple[LayerPlan, ...]) -> list[str]:
    """``use_reentrant`` picks the checkpoint implementation: with nothing recomputed it does nothing."""
    if not rc.use_reentrant or any(layer.recomputes for layer in layers):
        return []
    return ["recompute_config.use_reentrant: true has no effect: this config recomputes no layer and no op; set "
            "recompute (or select_recompute) to recompute, or remove use_reentrant"]


def inactive_runtime(runtime: RuntimeConfig) -> list[str]:
    """Every ``runtime`` key but ``native_save`` tunes swapping (its engine, host pool, batches and checks):
    set to other than its default where the plan swaps nothing, each does nothing. ``native_save`` serves a
    keep-only session's saves too (swapkit.runtime.native Note [The native save path]). A default written
    out is not told apart from one left out, and says nothing either way."""
    return [f"runtime.{name}: {show(value)} has no effect: swap_config swaps nothing on this model; set "
            f"swap_config.swap: true with a layer_swap or op_swap, or drop runtime.{name}"
            for name, value in _changed(runtime, RuntimeConfig()) if name != "native_save"]


def _changed(settings: Any, defaults: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """``(dotted name, value)`` of each field of a settings dataclass that differs from ``defaults``."""
    out = []
    for item in fields(settings):
        value, default = getattr(settings, item.name), getattr(defaults, item.name)
        if is_dataclass(value):
            out += _changed(value, default, f"{prefix}{item.name}.")
        elif value != default:
            out.append((prefix + item.name, value))
    return out


def _preset(name: str | None, given: Preset | None, problems: Problems) -> Preset | None:
    """``model_config.preset`` if written (it wins over a detected one), else ``given``."""
    if name is None:
        return given
    try:
        return preset_named(name)
    except ValueError as err:
        problems.add("model.model_config.preset", str(err))
        return None


def _with_preset_scopes(rc: MegatronRecompute, preset: Preset | None, problems: Problems) -> MegatronRecompute | None:
    """Megatron modules the preset maps (``moe_act``, ...) join the configured ``module_scopes``;
    ``None`` (and a problem) when a selected module has no scope."""
    scopes = {**(preset.module_scopes() if preset else {}), **rc.module_scopes}
    where = f"{preset.name} models" if preset else "this model"
    before = len(problems)
    unmapped_modules(rc.recompute_modules, scopes, "recompute_config", problems, where)
    return replace(rc, module_scopes=scopes) if len(problems) == before else None


def _translator(preset: Preset | None, notes: list[str], dropped: list[str]
                ) -> Callable[[tuple[str, ...]], tuple[str, ...]]:
    """Maps written patterns to the preset's real ones, recording each translation once in ``notes``;
    a pattern applied to some layer that the family has no module for goes to ``dropped`` (a warning:
    that setting does nothing)."""
    def translate(written: tuple[str, ...]) -> tuple[str, ...]:
        if preset is None:
            return written
        out: list[str] = []
        for pattern in written:
            real, note = preset.translate(pattern)
            where = notes if real else dropped
            if note and note not in where:
                where.append(note)
            out += [p for p in real if p not in out]
        return tuple(out)

    return translate


def valid(*sections: Any) -> bool:
    """No field of these (partly read) config sections failed its check."""
    return not any(value is INVALID for section in sections for value in vars(section).values())


def _layer_plan(i: int, layout: Layout, formative: Formative, megatron: Any, swap_mode: bool,
                translate: Callable[[tuple[str, ...]], tuple[str, ...]]) -> LayerPlan:
    if megatron is not None:
        full, unit, select, comm = megatron.full, megatron.unit, megatron.select, ()
    else:
        def chosen(spec: Any) -> bool:
            return selects(spec, i, layout, swap_mode)

        full = chosen(formative.layer_recompute)
        unit = (i, i) if full else None
        select = () if full else tuple(p for p, spec in formative.select_recompute.items() if chosen(spec))
        comm = () if full else tuple(p for p, spec in formative.select_comm_recompute.items() if chosen(spec))
    select, comm = translate(select), translate(comm)
    layer_swap = next((r.backward_prefetch for r in formative.layer_swap if r.covers(i)), None)
    op_swap = tuple(
        (real, rule.backward_prefetch)
        for pattern, rules in formative.op_swap.items()
        for rule in [next((r for r in rules if r.covers(i)), None)] if rule is not None
        for real in translate((pattern,))
    )
    overridden = _overridden(full, select + comm, layer_swap, op_swap)
    return LayerPlan(i, layout.pp_ids[i], layout.interleave_ids[i], full, unit, select, comm, layer_swap, op_swap,
                     overridden)


def _overridden(full: bool, recomputed: tuple[str, ...], layer_swap: int | None,
                op_swap: tuple[tuple[str, int], ...]) -> tuple[str, ...]:
    """Swaps that cannot act because recompute owns the tensors (DESIGN §4 "Recompute wins").

    Without a model this is decided on the patterns (:func:`swapkit.plan.patterns.covers`); binding to
    a model decides it on the real sub-modules (:func:`swapkit.plan.report.exact_overridden`), which is
    what ``swapkit plan`` prints for the built-in model and what ``apply`` warns about.
    """
    if full:
        return (("layer",) if layer_swap is not None else ()) + tuple(p for p, _ in op_swap)
    try:
        return _covered(recomputed, tuple(p for p, _ in op_swap))
    except patterns.PatternTooSlow as err:
        raise err.at("swap_config.op_swap") from None


@lru_cache(maxsize=1024)
def _covered(recomputed: tuple[str, ...], swapped: tuple[str, ...]) -> tuple[str, ...]:
    """The swapped patterns a recomputed one covers. Layers share these tuples, so the pattern pairs
    are compared once per distinct combination, not once per layer (1024 layers x 100 x 100 patterns)."""
    return tuple(p for p in swapped if any(patterns.covers(r, p) for r in recomputed))


