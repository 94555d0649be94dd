"""The shape of harness/: one folder per subsystem, imports flowing one way.

Read from the source with `ast` (nothing is imported), so a new import that runs against
the flow fails here before it can make a circle at run time.
"""

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HARNESS = ROOT / "harness"
# What each subpackage may import from the others: the documented arrows (docs/architecture.md).
ALLOWED = {
    "cli": {"cluster", "report", "drift", "train", "measure", "models", "files"},
    "cluster": {"train", "measure", "models", "files"},
    "report": {"files"},
    "drift": {"measure", "models", "files"},
    "train": {"measure", "models", "files"},
    "measure": {"models", "files"},
    "models": {"files"},
    "files": set(),
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in HARNESS.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, top_level_only: bool) -> set[str]:
    """Modules of harness that `name` imports (function-level imports too unless asked)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    mods = _modules()
    return {m for m in found if m in mods and m != name}


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
    graph = defaultdict(set)
    for name, path in _modules().items():
        graph[name] = _imports(name, path, top_level_only)
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
