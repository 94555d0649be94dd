"""The shape of harness/ and variants/: one folder per subsystem or family, imports
flowing one way.

Read from the source with `ast` (nothing is imported), so a new import that runs against
the flow fails here before it can make a circle at run time.
"""

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HARNESS = ROOT / "harness"
VARIANTS = ROOT / "variants"
# What each subpackage may import from the others: the documented arrows (docs/architecture.md).
ALLOWED = {
    "cli": {"check", "cluster", "report", "drift", "train", "measure", "models", "files"},
    "check": set(),
    "cluster": {"train", "measure", "models", "files"},
    "report": {"files"},
    "drift": {"measure", "models", "files"},
    "train": {"measure", "models", "files"},
    "measure": {"models", "files"},
    "models": {"files"},
    "files": set(),
}
# What each family of variants/ may import (docs/architecture.md): the core, and the public
# names of the families it builds on. The core imports no family.
FAMILIES = {
    "core": set(),
    "exact": {"core"},
    "sliding_window": {"core"},
    "sparse": {"core"},
    "low_rank": {"core"},
    "nystrom": {"core", "low_rank"},
    "linear": {"core"},
    "band_lowrank": {"core", "sliding_window", "linear", "low_rank"},
    "recurrent": {"core"},
    "library": {"core", "exact", "sliding_window", "sparse", "recurrent"},
    "routed": {"core"},
    "learned_sparse": {"core"},
    "latent": {"core"},
    "floor": {"core"},
}


def _modules(*trees: Path) -> dict[str, Path]:
    out = {}
    for path in (p for tree in (trees or (HARNESS,)) for p in tree.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, top_level_only: bool,
             mods: dict[str, Path] | None = None) -> set[str]:
    """Modules of the project that `name` imports (function-level imports too unless
    asked); `mods` defaults to harness's."""
    return {m for m, _ in _import_names(name, path, top_level_only, mods)}


def _import_names(name: str, path: Path, top_level_only: bool,
                  mods: dict[str, Path] | None = None) -> set[tuple[str, str | None]]:
    """(module, imported name or None) for each project module `name` imports: `from m
    import x` gives (m, "x"), or (m.x, None) when x is itself a module."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    mods = _modules() if mods is None else mods
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {(a.name, None) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            for a in node.names:
                found.add((f"{base}.{a.name}", None) if f"{base}.{a.name}" in mods
                          else (base, a.name))
    return {(m, x) for m, x in found if m in mods and m != name}


def _subpackage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (HARNESS / parts[1]).is_dir()) \
        else None


def test_every_module_lives_in_a_subpackage_with_a_docstring():
    loose = sorted(p.name for p in HARNESS.glob("*.py") if p.name not in ("__init__.py",
                                                                             "errors.py"))
    assert not loose, f"modules outside a subpackage: {loose}"
    for pkg in (p for p in HARNESS.iterdir() if (p / "__init__.py").exists()):
        doc = ast.get_docstring(ast.parse((pkg / "__init__.py").read_text()))
        assert doc and len(doc.splitlines()) >= 3, f"{pkg.name}/__init__.py needs a docstring"
    assert set(ALLOWED) >= {p.name for p in HARNESS.iterdir() if (p / "__init__.py").exists()}


def test_subpackages_import_only_down_the_documented_arrows():
    wrong = []
    for name, path in _modules().items():
        src = _subpackage(name)
        if src is None:
            continue
        for dep in _imports(name, path, top_level_only=False):
            dst = _subpackage(dep)
            if dst is not None and dst != src and dst not in ALLOWED[src]:
                wrong.append(f"{name} imports {dep}")
    assert not wrong, "imports against the flow:\n" + "\n".join(wrong)


def test_allowed_arrows_form_no_circle():
    seen, stack = set(), set()

    def visit(p):
        assert p not in stack, f"circle through {p}"
        if p in seen:
            return
        stack.add(p)
        for q in ALLOWED[p]:
            visit(q)
        stack.remove(p)
        seen.add(p)

    for p in ALLOWED:
        visit(p)


@pytest.mark.parametrize("top_level_only", [True, False], ids=["module-level", "any-level"])
def test_no_import_circle_between_modules(top_level_only):
    """Anywhere in the project: harness, variants and the entry point, call-time imports
    included."""
    mods = _modules(HARNESS, VARIANTS)
    mods["run_bench"] = ROOT / "run_bench.py"
    graph = defaultdict(set)
    for name, path in mods.items():
        graph[name] = _imports(name, path, top_level_only, mods)
        # a package's __init__ runs before its modules: importing a.b imports a
    state: dict[str, int] = {}

    def visit(m, trail):
        if state.get(m) == 1:
            raise AssertionError("import circle: " + " -> ".join(trail[trail.index(m):] + [m]))
        if state.get(m) == 2:
            return
        state[m] = 1
        for d in sorted(graph[m]):
            visit(d, trail + [m])
        state[m] = 2

    for m in sorted(graph):
        visit(m, [])


def _family(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "variants" and len(parts) > 1 else None


def test_variants_is_a_package_per_family_with_a_docstring():
    loose = sorted(p.name for p in VARIANTS.glob("*.py") if p.name != "__init__.py")
    assert not loose, f"modules of variants/ outside a family's folder: {loose}"
    folders = {p.name for p in VARIANTS.iterdir() if (p / "__init__.py").exists()}
    assert folders == set(FAMILIES), "FAMILIES and docs/architecture.md list every folder"
    for name in folders:
        doc = ast.get_docstring(ast.parse((VARIANTS / name / "__init__.py").read_text()))
        assert doc and len(doc.splitlines()) >= 3, f"variants/{name}/__init__.py needs a docstring"
        assert "Imports:" in doc, f"variants/{name}/__init__.py must say what it may import"


def _public(package: str) -> set[str]:
    """The names a family's __init__ lists in __all__."""
    tree = ast.parse((VARIANTS / package.split(".")[1] / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__"
                                                for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def test_families_import_down_to_the_core_and_only_public_names_of_each_other():
    """A family imports the core and, of the families it builds on, only the names their
    __init__ exports (never a module inside them, never a private name); the core imports
    no family; harness sees only `variants` itself."""
    mods = _modules(HARNESS, VARIANTS)
    wrong = []
    for name, path in mods.items():
        src = _family(name)
        for dep, what in _import_names(name, path, top_level_only=False, mods=mods):
            dst = _family(dep)
            if name.startswith("harness.") and dep.startswith("variants."):
                wrong.append(f"{name} imports {dep} (harness uses the `variants` package only)")
            if src is None or dst is None or dst == src:
                continue
            if dst not in FAMILIES[src]:
                wrong.append(f"{name} imports {dep}: {src} may not import {dst}")
            elif dst != "core" and (dep != f"variants.{dst}" or what is None
                                    or what.startswith("_") or what not in _public(dep)):
                wrong.append(f"{name} imports {dep}.{what}: not a public name of {dst}")
    assert not wrong, "imports against the flow of variants/:\n" + "\n".join(wrong)


def test_family_arrows_form_no_circle():
    done = set()

    def visit(f, trail):
        assert f not in trail, "circle: " + " -> ".join(trail + [f])
        if f not in done:
            for g in FAMILIES[f]:
                visit(g, trail + [f])
            done.add(f)

    for f in FAMILIES:
        visit(f, [])
