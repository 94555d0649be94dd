"""The README's first screen (issue 54): within its first 60 lines, the answers at a glance
and the two set-up commands; every figure of an answer is in the committed report of the
run its row names, and that run was made from code that holds every other issue's last
landing (its meta.json commit descends from LANDING)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIRST_SCREEN = 60
# The last change to the code of issues 49-53 (the served decoders' tables, 5e3c113; stop
# 66 landed the rest): a reference run quoted on the first screen is of code at or after it.
LANDING = "5e3c113"
FIGURE = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?![\w])")


def _first_screen() -> list[str]:
    return (ROOT / "README.md").read_text().splitlines()[:FIRST_SCREEN]


def _glance() -> list[tuple[str, str, Path]]:
    """(question, answer, run folder) for each row of the glance table."""
    lines = _first_screen()
    start = next(i for i, s in enumerate(lines) if s.startswith("## Answers at a glance"))
    rows = []
    for s in lines[start:]:
        if not s.startswith("| ") or s.startswith("| question") or s.startswith("|---"):
            continue
        cells = [c.strip() for c in s.strip().strip("|").split("|")]
        run = re.search(r"\(?(results/[\w.-]+)/", cells[-1])
        rows.append((cells[0], cells[1], ROOT / run.group(1) if run else None))
    return rows


def _figures(text: str) -> list[str]:
    """The numbers of an answer cell, outside code spans and link targets."""
    text = re.sub(r"`[^`]*`|\]\([^)]*\)", " ", text)
    return FIGURE.findall(text)


def _report_figures(folder: Path) -> set[str]:
    return set(FIGURE.findall((folder / "report.md").read_text()))


def _meta(folder: Path) -> dict:
    for name in ("meta.json", "train_meta.json"):
        if (folder / name).exists():
            return json.loads((folder / name).read_text())
    raise AssertionError(f"{folder} has no meta.json")


def test_the_first_screen_answers_and_sets_up():
    screen = "\n".join(_first_screen())
    rows = _glance()
    assert len(rows) >= 4, "one row per question a user brings"
    asked = " ".join(q for q, _, _ in rows).lower()
    for words in ("fastest", "decod", "equal state", "my own"):
        assert words in asked, words
    # the two set-up commands: the main job, and the tests
    assert "pip install -e . && attnbench\n" in screen
    assert "pip install -e '.[test,xformers]' && python -m pytest" in screen
    # the accuracy criterion in plain words before the table uses it
    assert screen.index("0.995") < screen.index("| question")


def test_every_figure_on_the_first_screen_is_in_its_runs_report():
    checked = 0
    for question, answer, folder in _glance():
        figures = _figures(answer)
        if not figures:
            continue
        assert folder is not None, f"{question}: figures with no run named"
        missing = set(figures) - _report_figures(folder)
        assert not missing, f"{question}: {sorted(missing)} not in {folder}/report.md"
        checked += len(figures)
    assert checked >= 6


def test_a_figure_missing_from_its_report_is_caught(tmp_path):
    (tmp_path / "report.md").write_text("| sdpa | 4.11 | 1,024 |\n")
    assert set(_figures("sdpa 4.11 ms, 1,024 MiB")) <= _report_figures(tmp_path)
    assert set(_figures("sdpa 4.12 ms")) - _report_figures(tmp_path) == {"4.12"}
    assert _figures("`pip install torch==2.13.0` [a](results/x-1/report.md)") == []


def test_the_runs_on_the_first_screen_are_of_todays_code():
    folders = {f for _, _, f in _glance() if f is not None}
    assert folders
    for folder in sorted(folders):
        commit = _meta(folder)["git_commit"]
        r = subprocess.run(["git", "merge-base", "--is-ancestor", LANDING, commit],
                           cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 0, (f"{folder.name} was made at {commit[:7]}, not after "
                                   f"{LANDING}: {r.stderr.strip()}")
