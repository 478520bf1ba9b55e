"""The README is a contract: its Python example runs, and CI runs its test command verbatim."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, re.S)


def have_hf() -> bool:
    try:
        import accelerate  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def test_python_examples_run(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # the Trainer example writes its output_dir
    hf = have_hf()
    for code in blocks("python"):
        if "transformers" in code and not hf:
            continue  # the Hugging Face sections need the hf extra; the rest runs anyway
        exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    printed = out.split()
    assert printed and int(printed[0]) > 0  # the example really swapped bytes
    # "With your own model": the stats table; "With Hugging Face models": the Llama's real scopes;
    # "With a Trainer": swapkit's bytes in the Trainer's log history
    assert "swapkit step 1: session accounting, not RSS or the allocator's totals" in out
    if hf:
        assert "['layer 0: mlp', 'layer 0: self_attn', 'layer 1: mlp', 'layer 1: self_attn']" in out
        assert float(out.strip().splitlines()[-1]) > 0


def test_every_stats_field_is_documented():
    from dataclasses import fields

    from swapkit.runtime.stats import SwapStats

    section = README.split("### Reading the stats")[1].split("\n## ")[0]
    names = [f.name for f in fields(SwapStats)] + ["mean_prefetch_lead", "memory_saved_bytes"]
    assert [name for name in names if f"`{name}`" not in section] == []


def test_new_user_sections_exist():
    for heading in ("With your own model", "With Hugging Face models", "With a Trainer"):
        assert f"\n## {heading}\n" in README
    own = README.split("## With your own model")[1].split("\n## ")[0]
    assert "logging.basicConfig" in own


def test_ci_runs_the_readme_test_command():
    main_job, tests = blocks("bash")[:2]
    assert "swapkit train configs/" in main_job
    assert tests.strip() in (ROOT / ".ci" / "run").read_text()


def test_configs_cite_only_sections_that_exist():
    """A comment pointing at a document section must point at one this repository has."""
    headings = set(re.findall(r"^#+ (.+)$", README, re.M))
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        text = path.read_text()
        assert "DESIGN" not in text and "§" not in text, path.name  # DESIGN.md is not shipped
        for cited in re.findall(r'README "([^"]+)"', text):
            assert cited in headings, (path.name, cited)
