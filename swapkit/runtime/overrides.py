"""Swaps that something else overrides at run time, and how they are reported.

Note [Swaps nobody reports]
swapkit's own recompute overriding a swap is known from the plan (``Plan.layers[i].overridden``).
Other checkpointing is not: HF's ``gradient_checkpointing_enable()`` (non-reentrant by default
in transformers 5) or the user's ``torch.utils.checkpoint`` run a region under their own
``saved_tensors_hooks``, which are innermost, so the tensors saved there never reach the session:
a swap configured on a scope inside such a region moves nothing. Reentrant checkpointing runs
its forward with grad disabled and saves nothing at all. The session therefore watches each
scope that configures a swap: when one is entered in forward, it notes whether the session's
hooks are the innermost ones and whether grad is enabled; every save marks its scope as having
seen a tensor. When backward begins, a swap scope that saw no tensor is listed in
``SwapStats.unused_swaps`` and logged once per session as a WARNING naming layer and op, with the
cause when it is known. A swap scope whose hooks never ran although its layer ran is reported too
(``torch.compile`` reusing a graph traced before the hooks existed: Dynamo does not guard on
module hooks by default), and so is every swap when no hook ran at all in a forward that saved
tensors; the layers of another pipeline chunk, which do not run in the step, are not. Nor is a step
that continues a ``with`` block whose earlier step ran bound layers and itself runs none: the rest of
a forward after ``torch.autograd.grad`` (a gradient penalty outside the layers) is no bypass, the
earlier step showed the hooks work. A scope that saw no tensor although grad was on and the
session's hooks were innermost, whose module has parameters and all of them frozen, is reported as
frozen (fine-tuning that freezes the first layers: with no input requiring grad either, nothing in
it is saved for backward); that is looked up when the warning is written, once per scope, not on
every entry. A layer swap around an HF-checkpointed layer is caught the same way
(HF checkpoints ``forward``, so the layer's own hooks run outside the region and see nothing).
Another hooks context around the whole forward (``save_on_cpu``, ``allow_mutation_on_saved_tensors``,
a user's ``saved_tensors_hooks``) keeps every tensor from the session: no save reaches it and no
backward it sees begins. So when a ``with`` block ends whose step saved nothing, the swap scopes
entered under other hooks are reported then, and that step's stats become the session's; a step
that saved nothing because its forward ran under ``no_grad`` (an evaluation) is not reported.
When the scope's layer has HF's ``gradient_checkpointing`` attribute set (the usual case:
``TrainingArguments(gradient_checkpointing=True)`` with an op swap), the warning names HF's
checkpointing as the cause and swapkit's recompute as the fix, instead of the generic "another
saved_tensors_hooks context" or "grad disabled", which left the user to guess which context.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Callable

import torch

from swapkit.plan.report import layer_ranges

OTHER_HOOKS = ("it ran inside another saved_tensors_hooks context (a non-reentrant checkpoint such as Hugging "
               "Face's gradient_checkpointing_enable() or torch.utils.checkpoint, or another offloading tool), "
               "which keeps its tensors from swapkit")
NOT_ENTERED = ("its module hooks never ran although its layer did (the module is not called in forward, or it "
               "runs in a graph torch.compile traced before swapkit.apply or for another instance of the same "
               "model class: Dynamo does not guard on module hooks by default, "
               "torch._dynamo.config.skip_nnmodule_hook_guards; apply swapkit before the first compiled call, "
               "or call torch._dynamo.reset() after applying it)")
NO_GRAD = ("it ran with grad disabled (inside a reentrant checkpoint, which recomputes it in backward, or under "
           "torch.no_grad)")
HF_CHECKPOINT = ("its layer is checkpointed by Hugging Face's gradient checkpointing "
                 "(model.gradient_checkpointing_enable() or TrainingArguments(gradient_checkpointing=True)), which "
                 "runs the layer inside another saved_tensors_hooks context (or, reentrant, with grad disabled) and "
                 "keeps its tensors from swapkit")
FROZEN = ("its parameters are frozen (requires_grad=False) and no input of it required grad, so it saved nothing "
          "for backward")

FIXES = {  # the fix each cause calls for (others: the other checkpointing)
    FROZEN: "Leave frozen layers out of swap_config",
    NOT_ENTERED: ("Call torch._dynamo.reset() after swapkit.apply, or drop the swap from swap_config if the module "
                  "is never called"),
    HF_CHECKPOINT: ("Recompute with swapkit instead: call model.gradient_checkpointing_disable() (or leave "
                    "gradient_checkpointing off in TrainingArguments) and set recompute_config.recompute: true for "
                    "the same layers, or drop the op swaps (a layer swap offloads the inputs HF's checkpoint saves)"),
}


def entry_cause(own_pack: Callable[[torch.Tensor], Any]) -> str | None:
    """Why tensors saved in a scope entered now would not reach the session (``None``: they would)."""
    if not torch.is_grad_enabled():
        return NO_GRAD
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is None or top[0] != own_pack:
        return OTHER_HOOKS
    return None


def scope_label(layer: int, path: str) -> str:
    """As :attr:`swapkit.runtime.scope.Frame.label`: ``"layer 1: self_attn"``, ``"layer 1"``."""
    return f"layer {layer}: {path}" if path else f"layer {layer}"


def shared_cause(positions: list[int]) -> str:
    """The cause of a swap at a shared module's position (Note [Swaps nobody reports]): every call saves
    under its last position's frame (``swapkit.runtime.scope`` Note [A shared module's swap scope])."""
    return (f"its layer is one module object with layers {', '.join(map(str, positions))} (a module at several "
            f"positions), so every call of it saves under the swap settings of layer {positions[-1]} "
            "(Note [One module at several layer positions] in swapkit.runtime.binding)")


SHARED_FIX = "Configure the same swap for every position of the shared module, or give each position a module of its own"


def unused_message(layers: list[int], path: str, cause: str | None, step: int, fix: str | None = None) -> str:
    """One warning for a swap scope that saw no saved tensor, for every layer (ascending) where it did not
    for the same cause: a 32-layer model says it once, not 32 times. ``fix``: what to do, if not the cause's."""
    where = f"layer {layers[0]}" if len(layers) == 1 else layer_ranges(layers)
    what = f"op swap at {where}: {path}" if path else f"layer swap at {where}"
    why = cause or ("nothing inside it saved a tensor through swapkit (the tensors are saved elsewhere, or "
                    "something else checkpoints the region)")
    fix = fix or FIXES.get(cause, "Drop the swap from swap_config, or stop the other checkpointing for this layer")
    if len(layers) > 1:
        fix = fix.replace("for this layer", "for these layers")
    return (f"swapkit: {what} saw no saved tensor in step {step}: {why}; the swap has no effect. {fix} "
            "(Note [Swaps nobody reports])")


# Note [Swaps that move nothing]
# A swap can be configured, reached by tensors, and still free nothing: every candidate was saved in
# the forward's last ``backward_prefetch`` ticks (a distance at least as long as the step: ticks count
# saved tensors, not layers or ops, so a MindFormers-sized ``backward_prefetch: 20`` on a small model
# keeps everything), or is under ``runtime.min_offload_bytes``, or ``runtime.max_host_bytes`` refused
# its host buffer. ``stats.skipped`` shows it, but the step runs exactly as without swap, so the
# session logs one WARNING per session, when backward begins in a step in which swap candidates were
# kept for these reasons and none was offloaded, naming the reasons by bytes and their fixes (those
# holding at least a tenth of the kept bytes). The tail is known at save time from the second step on
# (the first step offloads it and drops the copies when backward begins), so a too-long distance is
# reported in step 2. Offloaded storages whose copy had not finished when backward began (the thread
# engine behind on a loaded CPU) are not this case: their swap was configured right. A pipeline stage's
# session checks its micro-steps added up, when its ``with`` block (the optimizer step) ends.
# Under MindFormers' default strategy the distance is written as ``swap_config.default_prefetch``, so the
# tail reason names that key: the user wrote no backward_prefetch.
IDLE_REASONS = {
    "tail": ("saved in the forward's last {prefetch_key} ticks, which stay on the device (the step saved "
             "{ticks} tensors: {prefetch_key} counts saved tensors, not layers); lower {prefetch_key} "
             "well below {ticks}"),
    "small": "smaller than runtime.min_offload_bytes ({min_offload_bytes} bytes); lower it",
    "host_cap": "refused by runtime.max_host_bytes ({max_host_bytes} bytes); raise it",
    "not_on_device": "not on the model's device, so there is nothing to free",
}


def idle_message(step: int, ticks: int, offloaded: int, skipped: Mapping[str, int], runtime: Any,
                 prefetch_key: str = "backward_prefetch") -> str | None:
    """The warning for a step whose swaps freed nothing (Note [Swaps that move nothing]), or ``None``;
    ``prefetch_key``: the key that sets the distance (:func:`distance_key`)."""
    kept = {reason: n for reason, n in skipped.items() if reason in IDLE_REASONS and n}
    if offloaded or not kept:
        return None
    values = {"ticks": ticks, "min_offload_bytes": runtime.min_offload_bytes, "max_host_bytes": runtime.max_host_bytes,
              "prefetch_key": prefetch_key}
    total = sum(kept.values())
    reasons = "; ".join(f"{n:,} bytes {IDLE_REASONS[reason].format(**values)}"  # the reasons that matter
                        for reason, n in sorted(kept.items(), key=lambda item: -item[1]) if n * 10 >= total)
    return (f"swapkit: swap moved nothing off the device in step {step}: its swap candidates were kept, {reasons} "
            "(Note [Swaps that move nothing])")


# Note [Swaps whose tensors are all small]
# A swap scope can see tensors and still move nothing while the rest of the step's swaps do: every
# candidate saved in it is under ``runtime.min_offload_bytes`` (an op swap of a norm, whose output is one
# hidden vector per token, under a threshold written for attention outputs). The step-wide warning above
# does not fire, since other scopes offload. So the step records, per swap scope, why it kept each
# candidate it did not offload (``ScopesReached.kept_in``: only on the skip paths, never per offloaded storage),
# and when backward begins in a step that offloaded something, a scope whose kept candidates were all
# small and that offloaded nothing gets one WARNING per session, with its layers grouped as unused swaps
# are, naming the largest such tensor and the threshold to lower. A scope that also kept candidates for
# another reason (the tail, the host cap) is not named: lowering the threshold alone would not make it move
# anything (``stats.skipped`` has those reasons). Nor is one that saved again a storage another scope swaps
# (recorded as ``"moved"`` on that re-save path, only when the two scopes differ): it holds moved bytes.
# The scopes are the configured swaps: an op hooked inside one only for recompute saves under the distance
# of the innermost configured swap around it and counts for that one (``ScopesReached.swap_owner``), so it is never
# named as an op swap nobody wrote. The warning is its own kind: a scope named here can still be named as
# unused later, and the other way round. Parameters (a norm's weight and bias) and tensors on another device
# saved in the scope are no candidates: no threshold moves them, so they neither count nor silence it.
# In a pipeline stage "a step that offloaded something" is the optimizer step, any of its micro-steps
# (``StageSession._offloaded``), as the idle warning adds them up: a chunk whose swaps kept only small
# tensors is named while another chunk's swaps move bytes.
def small_message(layers: list[int], path: str, largest: int, min_offload_bytes: int, step: int) -> str:
    """The warning for a swap scope whose tensors were all under ``min_offload_bytes`` (Note [Swaps whose
    tensors are all small])."""
    where = f"layer {layers[0]}" if len(layers) == 1 else layer_ranges(layers)
    what = f"op swap at {where}: {path}" if path else f"layer swap at {where}"
    return (f"swapkit: {what} moved nothing in step {step}: every tensor it could have moved was smaller than "
            f"runtime.min_offload_bytes ({min_offload_bytes:,} bytes; the largest was {largest:,}), so all stayed "
            f"on the device and the swap has no effect. Lower runtime.min_offload_bytes to {largest} or less, or "
            "drop the swap from swap_config (Note [Swaps whose tensors are all small])")


def distance_key(origins: Iterable[Any]) -> str:
    """``swap_config.default_prefetch`` when the plan's op swap is MindFormers' default strategy (a
    defaulted op_swap origin, ``swapkit.plan.origins``), else ``backward_prefetch``."""
    default = any(o.kind == "op_swap" and o.default is not None for o in origins)
    return "swap_config.default_prefetch" if default else "backward_prefetch"
