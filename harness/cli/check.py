"""The `check` command: the conformance kit (harness.check) on the variants a module
registers, one line per property with its numbers; exit 0 when every property holds, 1
when one fails, 2 when the module cannot be used (harness.cli.modules).

    attnbench check my_attention.py [--variants NAME,...]
    attnbench check variants.exact          # a module of this package works too
"""

from __future__ import annotations

import argparse

import variants
from harness.check import kit
from harness.check.properties import ALL
from harness.cli import modules
from harness.errors import UsageError


def add_check_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("module", help="a .py file or an importable module that registers "
                                  "variants with @variants.register")
    p.add_argument("--variants", help="comma-separated names to check (default: every "
                                      "variant the module registers)")
    p.add_argument("--properties", help="comma-separated properties to run (default: all: "
                                        + ", ".join(f.__name__ for f in ALL) + ")")
    modules.add_args(p)


def check_command(args) -> int:
    import torch

    modules.use(args)  # the modules it needs (--variant-module), the entry points
    try:
        names = variants.load_module(modules.resolve(args.module))
    except variants.ModuleError as e:
        raise UsageError(str(e)) from None
    if args.variants is not None:
        wanted = [t.strip() for t in args.variants.split(",") if t.strip()]
        unknown = [n for n in wanted if n not in names]
        if unknown or not wanted:
            raise UsageError(f"--variants: {', '.join(unknown) or '(none)'} not registered by "
                             f"{args.module}; it registers {', '.join(names)}")
        names = wanted
    props = ALL
    if getattr(args, "properties", None) is not None:
        by_name = {f.__name__: f for f in ALL}
        wanted = [t.strip() for t in args.properties.split(",") if t.strip()]
        unknown = [n for n in wanted if n not in by_name]
        if unknown or not wanted:
            raise UsageError(f"--properties: unknown {', '.join(unknown) or '(none)'}; the "
                             f"kit's properties: {', '.join(by_name)}")
        props = tuple(by_name[n] for n in wanted)
    torch.manual_seed(0)
    results = []
    for name in names:
        print(f"{name} ({variants.origin(name)})", flush=True)
        for fn in props:
            r = kit.run_property(fn, name)
            results.append(r)
            print("  " + r.line(len(name)), flush=True)
    text, status = kit.report(results)
    print(text.splitlines()[-1])
    return status
