"""Variants from outside this package: a module of one's own (a .py path or an importable
name) or an installed package's entry point in the group `attnbench.variants`.

    load_module("my_attention.py")        # -> the names it registered
    load_entry_points()                   # every installed `attnbench.variants` entry point
    loaded_modules()                      # [{"module", "path", "sha256", "variants"}, ...]

A module registers its variants with `@register` as it is imported (the way the package's
own families do). Loading refuses, with a `ModuleError` naming the module and the cause, a
module that does not import, one that registers no variant, and one that registers a name
already taken; whatever it registered before failing is unregistered. Loading the same
module again does nothing. The entry-point form follows pytest's and asv's plugins
(https://packaging.python.org/en/latest/specifications/entry-points/).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

from .registry import _REGISTRY, DuplicateName, loading

GROUP = "attnbench.variants"
_LOADED: dict[str, dict] = {}  # module key -> its record (loaded_modules)


class ModuleError(ValueError):
    """A variant module that cannot be used; the message names it and says why."""


def _is_path(spec: str) -> bool:
    return spec.endswith(".py") or "/" in spec or Path(spec).is_file()


def _sha256(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes())
    return h.hexdigest()


def _sources(module) -> list[Path]:
    """The files of a loaded module: the file, or every .py file of a package."""
    file = getattr(module, "__file__", None)
    if not file:
        return []
    file = Path(file)
    if file.name == "__init__.py":
        return sorted(file.parent.rglob("*.py"))
    return [file]


def load_module(spec: str, origin: str | None = None) -> list[str]:
    """Import a variant module (`spec`: a .py path, or a dotted name on sys.path) and return
    the names of the variants it registers. `origin`: what `variants.origin` says for them
    (default `module <absolute path or name>`)."""
    path = Path(spec).expanduser().resolve() if _is_path(spec) else None
    key = str(path) if path is not None else spec
    if key in _LOADED:
        return list(_LOADED[key]["variants"])
    label = key
    if path is not None and not path.is_file():
        raise ModuleError(f"variant module {spec}: does not import (no such file)")
    already = path is None and spec in sys.modules  # imported before (by a test, a package)
    try:
        with loading(origin or f"module {label}") as names:
            if path is not None:
                name = f"_attnbench_module_{path.stem}_{hashlib.sha1(key.encode()).hexdigest()[:8]}"
                mod_spec = importlib.util.spec_from_file_location(name, path)
                module = importlib.util.module_from_spec(mod_spec)
                sys.modules[name] = module
                try:
                    mod_spec.loader.exec_module(module)
                except BaseException:
                    sys.modules.pop(name, None)
                    raise
            else:
                module = importlib.import_module(spec)
    except DuplicateName as e:
        raise ModuleError(f"variant module {spec}: registers a name already taken: {e}") from None
    except ModuleError:
        raise
    except Exception as e:  # anything its import raised: the module does not import
        raise ModuleError(f"variant module {spec}: does not import: "
                          f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                          ) from None
    if already:  # its registrations happened earlier, outside `loading`: find them by module
        names = [n for n, cls in _REGISTRY.items()
                 if cls.__module__ == spec or cls.__module__.startswith(spec + ".")]
    if not names:
        raise ModuleError(f"variant module {spec}: registers no variant (a class decorated "
                          "with @variants.register)")
    sources = _sources(module)
    _LOADED[key] = {"module": spec, "path": str(sources[0]) if sources else None,
                    "sha256": _sha256(sources) if sources else None,
                    "origin": origin or f"module {label}", "variants": list(names)}
    return list(names)


def load_entry_points() -> list[str]:
    """Load every installed entry point of the group `attnbench.variants` (its value a
    module, `module` or `module:attr`); returns the names they registered."""
    out = []
    for ep in sorted(importlib.metadata.entry_points(group=GROUP), key=lambda e: e.name):
        dist = getattr(ep, "dist", None)
        where = f" ({dist.name} {dist.version})" if dist is not None else ""
        origin = f"entry point {ep.name} = {ep.value}{where}"
        try:
            out += load_module(ep.module, origin=origin)
        except ModuleError as e:
            raise ModuleError(f"entry point {ep.name!r} of {GROUP}{where}: {e}") from None
    return out


def loaded_modules() -> list[dict]:
    """What meta.json records of the modules loaded here: name, file, sha256 of the source
    (every .py file of a package), origin and the variants each registered."""
    return [dict(r) for r in _LOADED.values()]


__all__ = ["GROUP", "ModuleError", "load_entry_points", "load_module", "loaded_modules"]
