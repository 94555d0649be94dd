"""The registry: names, specs, parameter validation, and the one-file drop-in of a variant."""

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import variants
from variants import Variant, param, register

ROOT = Path(__file__).resolve().parents[1]


def test_the_exact_variants_are_registered():
    assert {"standard", "sdpa", "xformers"} <= set(variants.names())


def test_unknown_name_lists_the_registered_ones():
    with pytest.raises(ValueError, match="unknown variant 'nope'.*standard.*sdpa"):
        variants.build("nope")
    with pytest.raises(ValueError, match="unknown variant"):
        variants.spec("nope")


def test_misspelt_parameter_names_what_is_allowed():
    with pytest.raises(ValueError, match=r"sdpa: unknown parameter\(s\) 'typo'; allowed: sink"):
        variants.build("sdpa", typo=1)


@dataclasses.dataclass(frozen=True)
class _ToyParams:
    width: int = param(4, min=1, max=64)
    mode: str = param("a", choices=("a", "b"))
    scale: float = param(1.0, min=0.0)

    def __post_init__(self):
        if self.mode == "b" and self.width % 2:
            raise ValueError("mode 'b' needs an even width")


class _Toy(Variant):
    """A throwaway variant used to test validation."""
    name = "_registry_toy"
    family = "test"
    Params = _ToyParams


def test_parameters_are_checked_for_type_range_and_choice():
    register(_Toy)
    try:
        assert variants.build("_registry_toy", width=8).params.width == 8
        assert variants.build("_registry_toy", scale=2).params.scale == 2.0  # int -> float
        for kwargs, msg in [({"width": "8"}, "'width' must be of type int"),
                            ({"width": True}, "'width' must be of type int"),
                            ({"width": 0}, "'width' must be >= 1"),
                            ({"width": 65}, "'width' must be <= 64"),
                            ({"mode": "c"}, r"'mode' must be one of \['a', 'b'\]"),
                            ({"scale": -1.0}, "'scale' must be >= 0.0"),
                            ({"mode": "b", "width": 3}, "needs an even width")]:
            with pytest.raises(ValueError, match="_registry_toy: .*" + msg):
                variants.build("_registry_toy", **kwargs)
        assert "_registry_toy" not in variants.names()  # private: a test fixture
        assert "_registry_toy" in variants.names(private=True)
        spec = variants.spec("_registry_toy")
        assert spec.defaults == {"width": 4, "mode": "a", "scale": 1.0}
        assert [p.choices for p in spec.params] == [None, ("a", "b"), None]
        with pytest.raises(ValueError, match="already registered"):
            register(_Toy)
    finally:
        variants.core.registry._REGISTRY.pop("_registry_toy", None)


def readme_example() -> str:
    """The complete add-a-variant example of the docs (docs/variants.md, the README links it):
    its first block that registers."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "variants.md").read_text(), re.S)
    return next(b for b in blocks if "@register" in b)


def test_readme_lists_every_registered_variant():
    table = (ROOT / "README.md").read_text()
    missing = [n for n in variants.names() if f"| `{n}` |" not in table]
    assert not missing, f"README's variant table lacks {missing}"


def test_a_dropped_in_variant_runs_through_the_whole_kit(tmp_path):
    """One new file in a family's folder and one import line in its __init__: listed by
    names() and conformance-tested."""
    shutil.copytree(ROOT / "variants", tmp_path / "variants",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "harness", tmp_path / "harness",  # the kit: harness.check
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "tests", tmp_path / "tests",
                    ignore=shutil.ignore_patterns("__pycache__", "benchmarks"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    (tmp_path / "variants" / "exact" / "toy.py").write_text(readme_example())
    with open(tmp_path / "variants" / "exact" / "__init__.py", "a") as f:
        f.write("from . import toy  # noqa: F401\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    listed = subprocess.run([sys.executable, "-c", "import variants; print(variants.names())"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    assert "'toy'" in listed.stdout
    kit = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/test_conformance.py", "-k", "toy"],
                         cwd=tmp_path, env=env, capture_output=True, text=True)
    assert kit.returncode == 0, kit.stdout[-3000:] + kit.stderr[-2000:]
    assert " passed" in kit.stdout and "failed" not in kit.stdout
