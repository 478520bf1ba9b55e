"""The README is a contract: its Python example runs, and CI runs its test command verbatim."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, re.S)


def test_python_examples_run(capsys):
    for code in blocks("python"):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    printed = capsys.readouterr().out.split()
    assert printed and int(printed[0]) > 0  # the example really swapped bytes


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
