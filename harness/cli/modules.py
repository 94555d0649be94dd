"""`--variant-module PATH_OR_MODULE` and a matrix TOML's `modules = [...]`: variants of
one's own, from a file or an importable module, for every command that builds variants.

One mechanism carries them everywhere: the modules are named in ATTNBENCH_EXTRA_MODULES
(paths made absolute), which this process loads (harness.measure.worker.import_extra),
which the worker processes inherit, and which a sharded run's jobs carry with them
(harness.cluster.executors.ShardJob). Entry points of the group `attnbench.variants` are
loaded with them. A module that does not import, registers no variant or registers a name
already taken is a UsageError naming it, before anything is measured or written.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import variants
from harness.errors import UsageError
from harness.measure import matrix as mx
from harness.measure.worker import EXTRA_ENV, import_extra


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--variant-module", dest="variant_modules", action="append", default=[],
                   metavar="PATH_OR_MODULE",
                   help="a .py file or an importable module that registers variants with "
                        "@variants.register (repeatable; also `modules = [...]` in a matrix "
                        f"TOML, or {EXTRA_ENV})")


def resolve(spec: str, base: Path | None = None) -> str:
    """A path made absolute (relative to `base`, the TOML's folder, when given); a dotted
    module name as it is."""
    if spec.endswith(".py") or "/" in spec or os.sep in spec:
        path = Path(spec).expanduser()
        if base is not None and not path.is_absolute():
            path = base / path
        return str(path.resolve())
    return spec


def toml_modules(source: str | None) -> list[str]:
    """The `modules` list of a matrix TOML (a path; presets have none), resolved against
    the TOML's folder."""
    if not source:
        return []
    raw = mx.read_toml(source)
    found = raw.get("modules", [])
    if not isinstance(found, list) or not all(isinstance(m, str) and m for m in found):
        raise UsageError(f"{source}: 'modules' must be a list of module paths or names, "
                         f"got {found!r}")
    path = Path(source)
    base = path.resolve().parent if path.is_file() else mx.PRESET_DIR
    return [resolve(m, base) for m in found]


def use(args, source: str | None = None) -> list[str]:
    """Load the command's variant modules (flags, then the TOML's) and the entry points;
    returns the module specs now in ATTNBENCH_EXTRA_MODULES. UsageError on a bad module."""
    specs = [resolve(s) for s in getattr(args, "variant_modules", None) or []]
    specs += toml_modules(source)
    known = [s for s in os.environ.get(EXTRA_ENV, "").split(os.pathsep) if s]
    merged = list(dict.fromkeys(known + specs))
    if merged:
        os.environ[EXTRA_ENV] = os.pathsep.join(merged)
    try:
        import_extra()
    except variants.ModuleError as e:
        if merged != known:  # a failed module is not handed on to anything started later
            os.environ[EXTRA_ENV] = os.pathsep.join(known)
        raise UsageError(str(e)) from None
    return merged


def warn_changed(meta: dict) -> list[str]:
    """On a resumed run: warn (stderr) for each variant module whose source differs from the
    one the run's meta.json recorded, since the rows measured before came from that code.
    Returns the warnings."""
    before = {m["path"]: m["sha256"] for m in meta.get("variant_modules") or [] if m.get("path")}
    out = []
    for m in variants.loaded_modules():
        old = before.get(m["path"])
        if old is not None and old != m["sha256"]:
            out.append(f"warning: variant module {m['path']} changed since this run started "
                       f"(sha256 {old[:12]} -> {m['sha256'][:12]}): the rows measured before "
                       "came from the earlier code; a new --run-id keeps them apart")
            print(out[-1], file=sys.stderr)
    return out
