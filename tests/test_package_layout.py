"""The package layout is a contract: pure config/plan packages, one-way dependencies, no import cycles."""
from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "swapkit"

# Which top-level parts of swapkit each part may import (besides itself). The pure side never
# reaches the torch side; the torch side never reaches the CLI or the training entry point.
ALLOWED = {
    "config": set(),
    "logs": set(),  # a logger held quieter for a block: the CLI's and the rank launcher's
    "plan": {"config"},
    "load": {"config", "plan"},
    "engine": {"config"},
    "runtime": {"config", "plan", "engine"},
    "api": {"config", "plan", "load", "runtime"},
    "train": {"__init__", "api", "config", "plan", "load", "runtime", "engine"},
    "integrations": {"__init__", "config", "plan", "load", "api", "runtime"},  # the edge: others never import it
    "distributed": {"__init__", "api", "config", "plan", "load", "runtime", "engine", "train", "logs"},
    # measures by training (the built-in model, or a user's model from integrations): at the edge too
    "planner": {"config", "plan", "load", "api", "runtime", "engine", "train", "integrations", "distributed"},
    "cli": {"__init__", "config", "plan", "load", "runtime", "train", "integrations", "distributed", "planner",
            "logs"},
    "__init__": {"config", "plan", "load", "api", "runtime"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imported(path: Path, modules: dict[str, Path]) -> set[str]:
    """Every swapkit module ``path`` imports anywhere (module level, functions, TYPE_CHECKING)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "swapkit"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "swapkit":
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
    return {name for name in found if name in modules}


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imported(path, modules) - {name} for name, path in modules.items()}


def part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_no_import_cycles():
    graph = import_graph()
    state: dict[str, int] = {}  # 1 visiting, 2 done
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_parts_depend_one_way():
    wrong = [f"{module} imports {target}" for module, targets in import_graph().items() for target in targets
             if part(target) != part(module) and part(target) not in ALLOWED[part(module)]]
    assert wrong == []


def test_every_part_is_known():
    assert {part(m) for m in all_modules()} <= set(ALLOWED)


def test_config_and_plan_work_without_torch():
    configs = sorted(str(p) for p in (ROOT / "configs").glob("*.yaml"))
    assert configs
    script = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        import swapkit.config, swapkit.plan
        from swapkit import build_plan, load_config
        for path in {configs!r}:
            plan = build_plan(load_config(path))
            assert plan.layers, path
            plan.to_json()
        assert "swapkit.runtime" not in sys.modules and "swapkit.engine" not in sys.modules
        print("ok", len({configs!r}))
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"ok {len(configs)}"


def test_the_process_that_starts_the_ranks_never_loads_pipelining_or_dynamo():
    """swapkit.distributed.pipeline Note [Pipelining loads where a stage runs]: 2 s of the start of every run. The
    op-pattern check builds the model on meta, whose embedding init and rotary tables imported Dynamo
    (swapkit.train.model Note [A meta model loads no Dynamo])."""
    script = textwrap.dedent(f"""
        import argparse, sys
        import torch
        from swapkit.cli import _check_builtin_patterns
        from swapkit.distributed.launch import check
        from swapkit.load import load_config
        config = load_config({str(ROOT / "configs" / "pp2.yaml")!r})
        check(config, torch.device("cpu"))
        _check_builtin_patterns(argparse.Namespace(overrides=[]), config)  # binds the built-in model on meta
        print(sorted(m for m in ("torch.distributed.pipelining", "torch._dynamo") if m in sys.modules))
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_swapkit_train_starts_the_rank_server_before_it_imports_torch():
    """swapkit.distributed.rank_start Note [The server starts first]: only a run with CPU ranks that swapkit train
    starts itself gets the server, and the parent has not imported torch when it does."""
    script = textwrap.dedent(f"""
        import argparse, os, sys
        from multiprocessing import forkserver
        from swapkit.cli import _start_rank_server
        from swapkit.load import load_config
        started = lambda: forkserver._forkserver._forkserver_pid is not None
        _start_rank_server(load_config({str(ROOT / "configs" / "tiny.yaml")!r}), argparse.Namespace(device=None))
        one = started()
        pipeline = load_config({str(ROOT / "configs" / "pp2.yaml")!r})
        _start_rank_server(pipeline, argparse.Namespace(device="cuda"))
        cuda = started()
        os.environ["RANK"] = "0"
        _start_rank_server(pipeline, argparse.Namespace(device=None))
        torchrun = started()
        del os.environ["RANK"]
        _start_rank_server(pipeline, argparse.Namespace(device=None))
        print(one, cuda, torchrun, started(), "torch" in sys.modules)
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False", "False", "True", "False"]


def test_torch_side_names_stay_public():
    import swapkit

    for name in swapkit.__all__:
        assert getattr(swapkit, name) is not None


def test_dir_lists_the_public_names_the_lazy_ones_too_and_no_helpers():
    """``dir(swapkit)`` (tab completion) listed ``Any``, ``TYPE_CHECKING`` and ``importlib`` but not ``apply``
    before its first use: the torch-side names are imported lazily (PEP 562)."""
    script = "import swapkit; print(' '.join(dir(swapkit)))"
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    listed = set(result.stdout.split())
    import swapkit

    assert set(swapkit.__all__) <= listed and "__version__" in listed and "config" in listed  # apply: not yet imported
    assert not {"Any", "TYPE_CHECKING", "importlib", "ModuleType"} & listed


def test_only_integrations_import_transformers():
    """Integrations live at the edge: the core (presets included) never imports transformers."""
    def imports_transformers(path: Path) -> bool:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(name.split(".")[0] in ("transformers", "accelerate") for name in names):
                return True
        return False

    users = sorted(name for name, path in all_modules().items() if imports_transformers(path))
    assert users == ["swapkit.integrations.transformers"]


def test_the_native_hooks_source_ships_in_the_package():
    """``runtime.native_save`` builds ``native_save.cpp`` and its other sources from the installed package
    (swapkit.runtime.native): a wheel without them would fail at the first apply. The package data must name them."""
    import fnmatch
    import tomllib

    from swapkit.runtime.native import SOURCES

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for source in SOURCES:
        assert source.is_file() and source.parent == PACKAGE / "runtime"
        assert any(fnmatch.fnmatch(source.name, pattern) for pattern in data["swapkit.runtime"])
