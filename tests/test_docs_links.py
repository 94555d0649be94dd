"""Code points readers at files in this repository: no docstring or comment names a design
note outside it (DESIGN.md, shared/), and each docs/*.md it names exists."""

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = {p.stem for p in (REPO / "docs").glob("*.md")}


def _tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout.split()
    return [REPO / p for p in out if p != "tests/test_docs_links.py"]


def test_no_pointer_outside_the_repository():
    files = _tracked("*.py", "*.toml", "*.sh", ".ci/*")
    assert files
    bad = [f"{p.relative_to(REPO)}: {word}" for p in files for word in ("DESIGN.md", "shared/")
           if word in p.read_text()]
    assert not bad, bad


def test_docs_named_in_code_are_the_repositorys():
    named = {(p.relative_to(REPO), m) for p in _tracked("*.py", "*.toml", "*.sh")
             for m in re.findall(r"docs/([\w-]+)\.md", p.read_text())}
    assert named  # the docstrings do point at docs/
    assert {m for _, m in named} <= DOCS, sorted(named)
