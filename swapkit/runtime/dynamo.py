"""Keeping swapkit's hooks and finalizers out of Dynamo's traces.

Note [Saved-tensor hooks stay out of Dynamo]
``torch.compile`` of a whole model (or of a training step) runs the frames it cannot put in a graph
eagerly with Dynamo's frame callback still installed, and the pack and unpack hooks that their ops
call are Python frames too: Dynamo traced them like user code (the session's bookkeeping, weak
references and locks), which failed with ``InternalTorchDynamoError`` or replayed the hook's side
effects wrongly, so swaps moved nothing. On each ``__enter__`` the code objects of the hooks it
installs (the methods the session has then) are therefore marked for Dynamo to skip, together with
every frame they call (a code execution strategy of ``SKIP`` for the frame and recursively).
- The finalizers of what the hooks create (``KeptRecord``, ``SwapRecord`` and ``Recipe`` ``__del__``,
  ``RecomputableOutputs.forget``, ``PinnedMapping.__del__``) are not called by a hook: they run
  wherever the last reference dies, in a compiled step's backward say, so they are marked the same
  way (Dynamo was handed them before, and let them run only because their frames held no tensor;
  ``Batch._return_host``, which a dying ``SwapRecord`` calls, holds one).
- The module hooks swapkit registers are ``AttachedHook`` objects around functions that Dynamo
  must not trace (``eager``). Where Dynamo traces a module call and breaks the graph at such a hook
  (an op swap on ``nn.MultiheadAttention`` inside a compiled ``nn.TransformerEncoder``), it then
  compiled ``AttachedHook.__call__`` as a frame of its own, once per hook signature and object, and
  hit ``recompile_limit`` (8) with a warning after a few layers: frames with nothing to compile. Its
  code is marked too, so it always runs eagerly; where Dynamo inlines it, the graph break at the
  hook's ``eager`` function is as before.
- A mark does not stop Dynamo from inlining the function into a frame it traces (swapkit never calls
  these from user code), and a function that was itself ``torch.compile``d still compiles when a
  hook calls it (its wrapper installs its own frame callback): a recipe re-runs the region's eager
  ``forward``, as it would without Dynamo. ``torch._dynamo.reset()`` does not clear the marks; they
  are set again on every ``__enter__`` anyway (one call per code object).
- A mark costs nothing per call (``benchmarks/microbench.py``, keep-only session, main-thread CPU per
  saved tensor on the shared 2-core machine: 4.9-6.1 us with the marks, 5.1-6.1 us without,
  6.3-7.4 us with ``torch.compiler.disable`` wrappers, in two rounds of alternating runs).
- A torch without that (private) API gets the ``torch.compiler.disable`` wrappers instead, as the
  scope hooks have them (swapkit.runtime.scope Note [Bookkeeping stays out of compiled graphs]), and
  its finalizers stay unmarked; ``entry_cause`` and ``swapkit.runtime.session.active_session`` recognise both.
"""
from __future__ import annotations

from typing import Any

from swapkit.engine.pinned import PinnedMapping
from swapkit.runtime.recipes import Recipe, RecomputableOutputs
from swapkit.runtime.detach import AttachedHook
from swapkit.runtime.records import KeptRecord, SwapRecord
from swapkit.runtime.scope import eager

try:  # Note [Saved-tensor hooks stay out of Dynamo]
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy
    from torch._C._dynamo.eval_frame import set_code_exec_strategy as _set_code_exec_strategy

    _SKIP_ALL: Any = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)  # this frame and what it calls
except (ImportError, AttributeError):
    _SKIP_ALL = None


def out_of_dynamo(pack: Any, unpack: Any) -> tuple[Any, Any]:
    """The hooks to install, never traced by Dynamo (Note [Saved-tensor hooks stay out of Dynamo]).

    The finalizers that the death of a saved tensor's handle runs are marked too: they run wherever the
    garbage collector or autograd drops the last reference, not inside a hook.
    """
    if _SKIP_ALL is not None:
        for finalizer in (*_finalizers(), AttachedHook.__call__):
            _set_code_exec_strategy(finalizer.__code__, _SKIP_ALL)
    return kept_out_of_dynamo(pack), kept_out_of_dynamo(unpack)


def _finalizers() -> tuple[Any, ...]:
    """Code of swapkit's that runs when a handle or a storage dies (Note [Saved-tensor hooks stay out of Dynamo])."""
    return (KeptRecord.__del__, SwapRecord.__del__, Recipe.__del__, RecomputableOutputs.forget,
            PinnedMapping.__del__)


def kept_out_of_dynamo(function: Any) -> Any:
    """``function``, never traced by Dynamo: its code marked, or on an older torch a ``torch.compiler.disable``
    wrapper (Note [Saved-tensor hooks stay out of Dynamo]); the hooks, and what the C++ hooks call
    (swapkit.runtime.native Note [The native save path])."""
    code = getattr(getattr(function, "__func__", function), "__code__", None)
    if _SKIP_ALL is None or code is None:  # a torch without code execution strategies, or a callable object
        return eager(function)
    _set_code_exec_strategy(code, _SKIP_ALL)
    return function
