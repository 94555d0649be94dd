"""The conformance kit catches what it claims to: a variant with one planted bug per
property fails that property (and the correct variant they start from passes all of
them); `attnbench check` prints one line per property and exits 0, 1 or 2.
"""

import re
from pathlib import Path

import pytest

import run_bench
import variants
from harness.check import kit
from harness.check.properties import ALL, check
from harness.measure.worker import EXTRA_ENV
from variants.core import modules, registry

REPO = Path(__file__).resolve().parent.parent
FAKES = str(REPO / "tests" / "check_fakes.py")
variants.load_module(FAKES)
PROPS = {f.__name__: f for f in ALL}


def test_the_correct_variant_passes_every_property():
    results = check(["_check_good"])
    assert {r.prop for r in results} == set(PROPS)
    assert [r.line() for r in results if r.status not in ("pass", "n/a")] == []


@pytest.mark.parametrize("prop", sorted(PROPS))
def test_a_planted_bug_fails_its_property(prop):
    r = kit.run_property(PROPS[prop], f"_check_{prop}")
    assert r.status == "fail", r.line()
    assert r.detail and (prop == "spec" or re.search(r"\d", r.detail)), r.detail  # numbers


@pytest.fixture
def registry_snapshot(monkeypatch):
    """Registrations a test makes (check, --variant-module) are undone after it."""
    monkeypatch.delenv(EXTRA_ENV, raising=False)
    saved = (dict(registry._REGISTRY), dict(registry._ORIGIN), dict(modules._LOADED))
    yield
    for live, old in zip((registry._REGISTRY, registry._ORIGIN, modules._LOADED), saved):
        live.clear()
        live.update(old)


def readme_file() -> str:
    """The ~30-line variant file README.md's "Add a variant" shows."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Add a variant", 1)[1].split("\n## ", 1)[0]
    found = re.findall(r"```python\n(# my_attention\.py.*?\n.*?)```", section, re.S)
    assert len(found) == 1, "README's Add a variant shows one my_attention.py"
    return found[0]


def test_check_passes_the_readme_file(tmp_path, capsys, registry_snapshot):
    path = tmp_path / "my_attention.py"
    path.write_text(readme_file())
    assert 25 <= len(readme_file().splitlines()) <= 40
    assert run_bench.main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("  ")]
    assert len(lines) == len(PROPS)  # one line per property
    assert not [ln for ln in lines if "FAIL" in ln]
    assert re.search(r"PASS\s+cosine\s+causal\s+rows 0\.\.150 moved 0\.0e\+00", out)
    assert f"module {path}" in out  # its origin


def test_a_causal_bug_in_the_readme_file_fails_check_on_causal(tmp_path, capsys,
                                                               registry_snapshot):
    text = readme_file()
    assert "triu(1)" in text
    path = tmp_path / "leaky.py"
    path.write_text(text.replace("triu(1)", "triu(2)"))  # query i reads key i + 1
    assert run_bench.main(["check", str(path)]) == 1
    out = capsys.readouterr().out
    assert re.search(r"FAIL\s+cosine\s+causal\s+rows 0\.\.150 changed by \S+ when keys", out)
    assert "1 fail" in out or "2 fail" in out


def test_check_narrows_to_named_variants(capsys, registry_snapshot):
    assert run_bench.main(["check", FAKES, "--variants", "_check_good"]) == 0
    out = capsys.readouterr().out
    assert "_check_causal" not in out and "1 variant(s)" in out
    assert run_bench.main(["check", FAKES, "--variants", "_check_nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "_check_nope not registered by" in err


def test_check_of_a_module_of_this_package(capsys):
    assert run_bench.main(["check", "variants.exact", "--variants", "standard"]) == 0
    assert "standard (variants/exact)" in capsys.readouterr().out
