r"""Model presets: MindFormers / Megatron / swapkit scope names onto a model family's real modules.

A MindFormers config names the ops of MindFormers' Llama layer (``attention``, ``feed_forward\.mul``,
``.*\.flash_attention``, ``.*\.norm``), Megatron names modules (``core_attn``, ``mlp``, ``layernorm``).
A Hugging Face Llama calls them ``self_attn``, ``mlp``, ``input_layernorm`` ... A preset says, per
family, which real scope each *role* is, so the defaults and a MindFormers file work unchanged.

Pure data and pure resolution: no torch, no transformers. ``swapkit.apply`` picks a preset from
``model.model_config.preset`` or, for a transformers model, from its ``config.model_type``.

Note [Preset translation]
Only patterns written *exactly* as one of the role aliases below are translated (``attention``,
``feed_forward\.w1\.activation\.silu``, ...); any other pattern is a real path in the user's model
and is used as written. A role the family has no module for (the elementwise multiply of a gated
MLP is a ``*`` inside ``forward`` in HF Llama) translates to nothing and the log says so: we never
guess a neighbouring module. Core attention (MindFormers' ``flash_attention``, Megatron's
``core_attn``) is a function call inside the attention module in every HF family, so it maps to the
whole attention module, and the log says that too.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

#: Role -> MindFormers / swapkit / Megatron spellings a config may use for it (exact pattern strings).
ALIASES: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "attention": ("attention",),
    "core_attention": (r".*\.flash_attention", r"attention\.flash_attention", "flash_attention"),
    "mlp": ("feed_forward",),
    "attention_norm": ("attention_norm",),
    "ffn_norm": ("ffn_norm",),
    "norms": (r".*\.norm", ".*_norm"),
    "activation": (r"feed_forward\.w1\.activation\.silu", r"feed_forward\.w1\.activation"),
    "gated_mul": (r"feed_forward\.mul",),
    "q": (r"attention\.wq",), "k": (r"attention\.wk",), "v": (r"attention\.wv",), "o": (r"attention\.wo",),
    "w1": (r"feed_forward\.w1",), "w2": (r"feed_forward\.w2",), "w3": (r"feed_forward\.w3",),
})

#: Megatron ``recompute_modules`` -> role (``module_scopes`` of a preset).
MEGATRON_ROLES: Mapping[str, str] = MappingProxyType({
    "core_attn": "core_attention", "mlp": "mlp", "layernorm": "norms", "moe_act": "moe_act",
    "moe": "moe", "shared_experts": "shared_experts",
})


@dataclass(frozen=True)
class Preset:
    """One model family: role -> real op patterns (``()`` = no module in this family, see ``why``)."""

    name: str
    model_types: tuple[str, ...]
    scopes: Mapping[str, tuple[str, ...]]
    why: Mapping[str, str] = field(default_factory=dict)

    def role_of(self, pattern: str) -> str | None:
        return next((role for role, spellings in ALIASES.items() if pattern in spellings), None)

    def translate(self, pattern: str) -> tuple[tuple[str, ...], str | None]:
        """Real patterns for a written one, and a log note when it was translated.

        See Note [Preset translation].
        """
        role = self.role_of(pattern)
        if role is None or (role not in self.scopes and role not in self.why):
            return (pattern,), None
        real = self.scopes.get(role, ())
        if not real:
            return (), (f"'{pattern}' has no module in {self.name} models: {self.why.get(role, 'not a module')}; "
                        "it does nothing there")
        note = f"'{pattern}' -> {', '.join(_quoted(p) for p in real)}"
        if role == "core_attention":
            note += " (core attention is a function inside the attention module: the whole module is used)"
        return real, f"preset {self.name}: {note}"

    def module_scopes(self) -> dict[str, tuple[str, ...]]:
        """Megatron ``recompute_modules`` -> this family's op patterns (modules it has)."""
        return {module: self.scopes[role] for module, role in MEGATRON_ROLES.items() if self.scopes.get(role)}


def _quoted(pattern: str) -> str:
    return "'" + pattern + "'"


def _decoder(name: str, model_types: tuple[str, ...], attn: str = "self_attn", mlp: str = "mlp",
             norms: tuple[str, str] = ("input_layernorm", "post_attention_layernorm"),
             proj: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj"),
             ffn: tuple[str | None, str | None, str | None] = ("gate_proj", "down_proj", "up_proj"),
             act: str | None = "act_fn", extra_norms: tuple[str, ...] = (),
             more: Mapping[str, tuple[str, ...]] | None = None) -> Preset:
    """A pre-norm decoder family whose layers have an attention, an MLP and named norms."""
    scopes: dict[str, tuple[str, ...]] = {
        "attention": (attn,), "core_attention": (attn,), "mlp": (mlp,),
        "attention_norm": (norms[0],), "ffn_norm": (norms[1],) if norms[1] else (),
        "norms": _alternatives(tuple(n for n in norms if n) + extra_norms),
        "activation": (f"{mlp}\\.{act}",) if act else (), "gated_mul": (),
    }
    scopes.update({role: (f"{attn}\\.{p}",) for role, p in zip("qkvo", proj) if p})
    scopes.update({role: (f"{mlp}\\.{p}",) for role, p in zip(("w1", "w2", "w3"), ffn) if p})
    scopes.update(more or {})
    gated = f"the elementwise product in {name}'s gated MLP is computed inside its forward, not by a module"
    why = {"gated_mul": gated if scopes.get("w3") or not scopes.get("w1") else f"{name}'s MLP is not gated"}
    why.update({role: f"{name} has no separate module for it" for role in ("q", "k", "v", "o", "w1", "w2", "w3",
                                                                            "ffn_norm", "activation")
                if not scopes.get(role)})
    return Preset(name, model_types, MappingProxyType({k: v for k, v in scopes.items() if v}),
                  MappingProxyType(why))


def _alternatives(names: tuple[str, ...]) -> tuple[str, ...]:
    """One pattern ``(a|b)`` when every name is one component, else one pattern per name."""
    if len(names) == 1 or any("\\." in name for name in names):
        return names
    return (f"({'|'.join(names)})",)


_MOE = MappingProxyType({"moe": ("mlp",), "moe_act": (r"mlp\.experts\.act_fn",)})
PRESETS: tuple[Preset, ...] = (
    _decoder("llama", ("llama",)),
    _decoder("mistral", ("mistral",)),
    _decoder("qwen2", ("qwen2",)),
    _decoder("qwen3", ("qwen3",)),
    _decoder("qwen2_moe", ("qwen2_moe",), act=None, ffn=(None, None, None), more={**_MOE, "shared_experts": (r"mlp\.shared_expert",)}),
    _decoder("qwen3_moe", ("qwen3_moe",), act=None, ffn=(None, None, None), more=_MOE),
    _decoder("mixtral", ("mixtral",), act=None, ffn=(None, None, None), more=_MOE),
    _decoder("gemma2", ("gemma2",), extra_norms=("pre_feedforward_layernorm", "post_feedforward_layernorm")),
    _decoder("gemma3", ("gemma3", "gemma3_text"),
             extra_norms=("pre_feedforward_layernorm", "post_feedforward_layernorm")),
    _decoder("phi3", ("phi3",), proj=(None, None, None, "o_proj"), ffn=(None, "down_proj", None),
             act="activation_fn"),
    _decoder("gpt2", ("gpt2",), attn="attn", norms=("ln_1", "ln_2"), proj=(None, None, None, "c_proj"),
             ffn=("c_fc", "c_proj", None), act="act"),
    _decoder("gpt_neox", ("gpt_neox",), attn="attention", proj=(None, None, None, "dense"),
             ffn=("dense_h_to_4h", "dense_4h_to_h", None), act="act"),
    _decoder("falcon", ("falcon",), attn="self_attention", norms=("input_layernorm", ""),
             proj=(None, None, None, "dense"), ffn=("dense_h_to_4h", "dense_4h_to_h", None), act="act"),
    _decoder("bert", ("bert",), attn="attention", mlp="intermediate", norms=(r"attention\.output\.LayerNorm",
             r"output\.LayerNorm"), proj=(r"self\.query", r"self\.key", r"self\.value", r"output\.dense"),
             ffn=("dense", None, None), act="intermediate_act_fn",
             more={"mlp": ("intermediate", "output")}),
    _decoder("t5", ("t5",), attn=r"layer\.0\.SelfAttention", mlp=r"layer\..*\.DenseReluDense",
             norms=(r"layer\.0\.layer_norm", ""), proj=("q", "k", "v", "o"), ffn=("wi", "wo", None), act="act",
             more={"norms": (r"layer\..*\.layer_norm",)}),
    _decoder("vit", ("vit",), attn="attention", norms=("layernorm_before", "layernorm_after"),
             ffn=("fc1", "fc2", None), act="activation_fn"),
)


def preset_named(name: str) -> Preset:
    """The preset called ``name``.

    Raises:
        ValueError: naming the known presets and the closest one.
    """
    for preset in PRESETS:
        if name == preset.name:
            return preset
    names = [p.name for p in PRESETS]
    close = difflib.get_close_matches(name, names, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ValueError(f"unknown model preset {name!r}; {hint}known presets: {', '.join(names)}")


def preset_for_model_type(model_type: str) -> Preset | None:
    """The preset of a transformers ``config.model_type``, or ``None`` when swapkit has none."""
    return next((p for p in PRESETS if model_type in p.model_types), None)
