"""A tensor passed to a recomputed region more than once stays one object in every re-run
(swapkit.runtime.region_inputs Note [A tensor passed to a region more than once], recipes Note [One object
per input]): ``nn.MultiheadAttention(x, x, x)`` under select recompute failed inside a session."""
from __future__ import annotations

import copy
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import Callable, NamedTuple

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointError

import swapkit
from swapkit.runtime.region_inputs import aliased_elements, substituted
from tests.toys import assert_grads_equal, grads

MEGATRON_CORE_ATTN = {"recompute_granularity": "selective", "module_scopes": {"core_attn": "self_attn"}}
SELECT = {"mindformers": {"select_recompute": ["probe"]},
          "megatron": {"recompute_granularity": "selective", "module_scopes": {"core_attn": "probe"}}}


def backward_both(model: nn.Module, plain: nn.Module, recompute: dict) -> tuple[dict, dict]:
    """One step of ``model`` under swapkit's ``recompute`` and of ``plain`` without it: their gradients."""
    x = torch.randn(4, 16, requires_grad=True)
    session = swapkit.apply(model, {"recompute_config": recompute})
    with session:
        model(x).square().mean().backward()
    session.remove()
    plain(x.detach().requires_grad_()).square().mean().backward()
    return grads(model), grads(plain)


def encoder() -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


@pytest.mark.parametrize("recompute", [{"select_recompute": ["self_attn"]}, MEGATRON_CORE_ATTN],
                         ids=["mindformers", "megatron"])
def test_select_recompute_of_multihead_attention_inside_a_session(recompute):
    model, plain = encoder(), encoder()
    x = torch.randn(2, 8, 32)
    session = swapkit.apply(model, {"recompute_config": recompute})
    with session:  # raised CheckpointError: the re-run saw query, key, value as three objects
        model(x).square().mean().backward()
    plain(x).square().mean().backward()
    assert_grads_equal(grads(model), grads(plain))
    assert session.stats.recomputed_by_scope == {"layer 0: self_attn": 1, "layer 1: self_attn": 1}
    session.remove()


class Probe(nn.Module):
    """Records, on every call, whether its inputs are one object (as ``query is key`` in attention)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.same: list[bool] = []

    def forward(self, q, k=None, v=None):
        k = q if k is None else k
        self.same.append(q is k and (v is None or v is q))
        return self.lin(q).sigmoid() * k  # the mul saves both: the region is re-run in backward


class Block(nn.Module):
    def __init__(self, keywords: bool) -> None:
        super().__init__()
        self.probe, self.out, self.keywords = Probe(), nn.Linear(16, 16), keywords

    def forward(self, x):
        y = self.probe(x, k=x, v=x) if self.keywords else self.probe(x, x)
        return x + self.out(y)  # the linear saves y: MindFormers' recipe rebuilds it in backward


class Net(nn.Module):
    def __init__(self, keywords: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(keywords) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("keywords, recompute, calls", [
    (False, {"select_recompute": ["probe"]}, 3),  # forward, checkpoint re-run, output recipe
    (True, {"select_recompute": ["probe"]}, 3),
    (True, {"recompute_granularity": "selective", "module_scopes": {"core_attn": "probe"}}, 2),
    (False, {"recompute": True}, 2),  # the whole layer: its input x reaches the probe twice
])
def test_every_rerun_of_a_region_gets_one_object_where_forward_did(keywords, recompute, calls):
    torch.manual_seed(0)
    model = Net(keywords)
    plain = copy.deepcopy(model)
    x = torch.randn(4, 16, requires_grad=True)
    session = swapkit.apply(model, {"recompute_config": recompute})
    with session:
        model(x).square().mean().backward()
    plain(x.detach().requires_grad_()).square().mean().backward()
    assert [layer.probe.same for layer in model.layers] == [[True] * calls] * 2
    assert_grads_equal(grads(model), grads(plain))
    session.remove()


def test_reentrant_recompute_passes_a_repeated_tensor_once():
    """Reentrant checkpointing detaches each input on its own (with or without a session); its gradients
    are summed in another order than plain autograd's, so they are compared with ``assert_close``."""
    torch.manual_seed(0)
    model = Net(keywords=False)
    plain = copy.deepcopy(model)
    x = torch.randn(4, 16, requires_grad=True)
    session = swapkit.apply(model, {"recompute_config": {"select_recompute": ["probe"], "use_reentrant": True}})
    with session:
        model(x).square().mean().backward()
    plain(x.detach().requires_grad_()).square().mean().backward()
    assert [layer.probe.same for layer in model.layers] == [[True] * 3] * 2
    ours, theirs = grads(model), grads(plain)
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-7)
    session.remove()


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, a: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        return self.lin(a * scale).sigmoid()


class WritesItsKeywordAfter(nn.Module):
    """Calls ``probe(x, scale=scale)``, then writes ``scale`` in place before backward."""

    def __init__(self, write: bool) -> None:
        super().__init__()
        self.probe, self.out, self.write = Scaled(), nn.Linear(16, 16), write

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.full_like(x, 2.0)
        y = self.probe(x, scale=scale)
        if self.write:
            scale.add_(1.0)
        return x + self.out(y)


class Stack(nn.Module):
    """Two blocks in a row under ``layers``, seeded: two of them start with the same weights."""

    def __init__(self, block: Callable[[], nn.Module]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("recompute", SELECT.values(), ids=SELECT.keys())
def test_a_keyword_tensor_written_after_its_region_ran_fails_backward_instead_of_changing_gradients(recompute):
    """Note [Keyword tensors written after the region]: the keyword tensor travels by reference, so the re-run
    would read the new values; it raises, naming the keyword and the region (the plain model's autograd raises
    too). Without the write the gradients are the plain model's."""
    x = torch.randn(4, 16, requires_grad=True)
    model = Stack(lambda: WritesItsKeywordAfter(write=True))
    session = swapkit.apply(model, {"recompute_config": recompute})
    with pytest.raises(RuntimeError, match=r"keyword argument 'scale' of the recomputed region layer \d: probe was "
                                           r"modified by an in-place operation after the region ran"):
        with session:
            model(x).square().mean().backward()
    session.remove()
    assert_grads_equal(*backward_both(*(Stack(lambda: WritesItsKeywordAfter(write=False)) for _ in range(2)),
                                      recompute))


class Pair(NamedTuple):
    k: torch.Tensor
    n: int


@dataclass
class Holder:
    """An object that holds a tensor and is none of the containers swapkit walks (README limitations)."""

    k: torch.Tensor


class NestedProbe(nn.Module):
    """Gets its key inside a container (``f(x, [x])``, ``f(x, (x,))``, ``f(x, extra={"k": x})``, or deeper:
    ``f(x, [([x], 1)])``, ``f(x, extra={"k": [{"k": x}]})``, ``f(x, [Pair(x, 1)])``) and branches
    on whether it is the query object, as attention branches on ``query is key``."""

    def __init__(self) -> None:
        super().__init__()
        self.packed, self.single = nn.Linear(16, 32), nn.Linear(16, 16)
        self.same: list[bool] = []

    def forward(self, q, ks=None, extra=None):
        k = ks if ks is not None else extra
        while not isinstance(k, torch.Tensor):  # down the nesting: the first element, key "k" or field k
            k = k["k"] if isinstance(k, dict) else k.k if isinstance(k, Holder) else k[0]
        self.same.append(q is k)
        if q is k:
            return self.packed(q).sigmoid()[:, :16] * k
        return self.single(q).sigmoid() * k


class TwoPathsProbe(NestedProbe):
    """Gets one list at two paths (``f(x, states, [states])``) and branches on ``query is key`` only where they
    are one list, as a module that reads through one path what it put in through the other would."""

    def forward(self, q, states, nested):
        return super().forward(q, states if nested[0] is states else [q.detach()])


class NestedBlock(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.probe = TwoPathsProbe() if how == "one list at two paths" else NestedProbe()
        self.out, self.how = nn.Linear(16, 16), how

    def forward(self, x):
        if self.how == "list":
            y = self.probe(x, [x])
        elif self.how == "one list at two paths":
            states = [x]
            y = self.probe(x, states, [states])
        elif self.how == "tuple":
            y = self.probe(x, (x,))
        elif self.how == "nested list":
            y = self.probe(x, [([x], 1)])
        elif self.how == "nested dict keyword":
            y = self.probe(x, extra={"k": [{"k": x}], "unused": 3})
        elif self.how == "named tuple in a list":
            y = self.probe(x, [Pair(x, 1)])
        elif self.how == "ordered dict keyword":
            y = self.probe(x, extra=OrderedDict(k=[x], unused=3))
        elif self.how == "defaultdict keyword":
            y = self.probe(x, extra=defaultdict(int, k=(x,)))
        elif self.how == "dataclass in a list":
            y = self.probe(x, [Holder(x)])
        else:
            y = self.probe(x, extra={"k": x, "unused": 3})
        return x + self.out(y)


NESTED_RECOMPUTE = {
    "mindformers": (SELECT["mindformers"], 3),  # forward, checkpoint re-run, output recipe
    "megatron": (SELECT["megatron"], 2),
    "reentrant": ({**SELECT["mindformers"], "use_reentrant": True}, 3),
}


NESTED_CASES = [(how, kind) for how in ("list", "tuple", "dict keyword", "nested list", "nested dict keyword",
                                        "named tuple in a list", "ordered dict keyword", "defaultdict keyword",
                                        "one list at two paths")
                for kind in NESTED_RECOMPUTE
                if not (kind == "reentrant" and "keyword" in how)]  # reentrant recompute takes no keywords


@pytest.mark.parametrize("how, kind", NESTED_CASES)
def test_a_top_level_tensor_repeated_inside_a_container_argument_is_one_object_in_every_rerun(how, kind):
    """region_inputs Note [A tensor passed to a region more than once]: the checkpoint re-run and the output
    recipe put the top-level re-run object into the container; each failed before (torch's CheckpointError),
    and with only the checkpoint fixed the recipe took the other branch: silently other gradients."""
    recompute, calls = NESTED_RECOMPUTE[kind]
    model, plain = (Stack(lambda: NestedBlock(how)) for _ in range(2))
    ours, theirs = backward_both(model, plain, recompute)
    assert [layer.probe.same for layer in model.layers] == [[True] * calls] * 2
    if recompute.get("use_reentrant"):  # gradients summed in another order (see the reentrant test above)
        for name in ours:
            torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-7)
    else:
        assert_grads_equal(ours, theirs)


def test_a_rerun_gets_copies_of_the_containers_on_the_way_to_a_repeated_tensor_of_their_own_types():
    """region_inputs Note [A tensor passed to a region more than once]: the forward call (each element its own
    already) gets the caller's objects; the re-run copies only the containers on the paths, of their types."""
    x, rerun = torch.ones(1), torch.zeros(1)
    untouched = [1]
    value = [OrderedDict(a=Pair(x, 2), b=untouched), defaultdict(list, c=(untouched, {"d": x}))]
    paths = aliased_elements(value, lambda tensor: 0 if tensor is x else None)
    assert paths == {(0, "a", 0): 0, (1, "c", 1, "d"): 0}
    assert substituted(value, {path: x for path in paths}) is value
    copied = substituted(value, {path: rerun for path in paths})
    assert copied[0]["a"].k is rerun and type(copied[0]["a"]) is Pair and type(copied[0]) is OrderedDict
    assert copied[1]["c"][1]["d"] is rerun and copied[1].default_factory is list and copied[1]["c"][0] is untouched
    assert copied[0]["b"] is untouched and value[0]["a"].k is x and value[1]["c"][1]["d"] is x
    states = [x]
    twice = substituted([states, (states,)], {(0, 0): rerun, (1, 0, 0): rerun})
    assert twice[0] is twice[1][0] and twice[0] == [rerun]  # one container, one copy


@pytest.mark.parametrize("recompute", SELECT.values(), ids=SELECT.keys())
def test_a_tensor_repeated_inside_another_object_fails_backward_where_the_branches_save_other_shapes(recompute):
    """README limitations: the re-run gets the top-level tensor's re-run object and, inside an object swapkit
    does not walk (a dataclass), the forward's; NestedProbe's branches save tensors of other shapes, so
    torch's check raises (branches that save the same shapes would give other gradients, silently)."""
    model = Stack(lambda: NestedBlock("dataclass in a list"))
    session = swapkit.apply(model, {"recompute_config": recompute})
    with pytest.raises(CheckpointError, match="different metadata"):
        with session:
            model(torch.randn(4, 16, requires_grad=True)).square().mean().backward()
    session.remove()
    same = model.layers[1].probe.same  # the last layer's backward raised
    assert same[0] and not all(same[1:])  # forward took the packed branch, a re-run the other


class FillsItsList(nn.Module):
    """Appends its output to the list it is given (a caller collecting hidden states)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, q, states):
        out = self.lin(states[0]).sigmoid() * q
        states.append(out)
        return out


class CollectingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.ModuleDict({"probe": FillsItsList()}) for _ in range(2))

    def forward(self, x):
        collected = []
        for layer in self.layers:
            states = [x]
            layer["probe"](x, states)
            collected.append(states[-1])  # the caller reads what the module put in its list
            x = x + states[-1]
        return x + sum(collected)


@pytest.mark.parametrize("recompute", SELECT.values(), ids=SELECT.keys())
def test_the_forward_call_gets_the_callers_own_container(recompute):
    """A repeated tensor inside a container (region_inputs Note [A tensor passed to a region more than once]):
    the forward call must get the caller's list, not a copy, or what the module appends to it is lost (and
    with it the gradients of the module's weights; review of the container change)."""
    assert_grads_equal(*backward_both(CollectingNet(), CollectingNet(), recompute))
