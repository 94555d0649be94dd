"""The README and docs/ say what the code does: links resolve, every command they show
parses with the real argument parser, every `python -m` module exists."""

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

import run_bench

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _code_lines(text: str) -> list[str]:
    """Lines of the fenced code blocks, with backslash continuations joined."""
    lines = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        lines += [line.strip() for line in joined.splitlines()]
    return lines


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300
    first = "\n".join(lines[:60])  # the first screen (issue 54)
    assert "pip install -e . && attnbench" in first  # the main job
    assert "pip install -e '.[test,xformers]' && python -m pytest" in first  # the tests


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    text = page.read_text()
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.name}: links to missing files {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_shown_command_parses(page):
    commands = [line for line in _code_lines(page.read_text())
                if line.startswith(("python run_bench.py", "attnbench"))]
    for line in commands:  # the console script `attnbench` is `python run_bench.py`
        argv = shlex.split(line, comments=True)[1 if line.startswith("attnbench") else 2:]
        try:
            run_bench._parser().parse_args(argv)
        except Exception as e:  # UsageError from the parser: an unknown flag or command
            raise AssertionError(f"{page.name}: `{line}` does not parse: {e}") from None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_python_m_module_exists(page):
    modules = re.findall(r"python -m ((?:harness|tests)[\w.]*)", page.read_text())
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    assert not missing, f"{page.name}: no such module {missing}"
