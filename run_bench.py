"""attnbench command line: run a benchmark matrix, report it, compare runs, list variants.

`attnbench` (the console script `pip install` gives) and `python run_bench.py` are the
same command:

    attnbench                                # the default job (below)
    attnbench run --preset cpu               # or gpu, or a TOML file of your own
    attnbench report results/<run-id>
    attnbench compare results/<a> results/<b>
    attnbench list                           # variants, families, parameters, origins
    attnbench model [--model minilm|PATH] [--text FILE]   # drift inside a real model
    attnbench maps [--layer L --head H --seq-len N --variants ...]  # attention maps
    attnbench train [--preset train-quick|train-cpu|train-gpu]   # trained recall
    attnbench check my_attention.py          # the conformance kit on variants of your own
    attnbench run --variant-module my_attention.py ...   # also train, model, maps, list

Bad input ends with a one-line error on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from harness.errors import UsageError

DEFAULT_JOB = ("with no command, attnbench runs the default job: the quick CPU matrix, the "
               "drift of MiniLM at N = 512 under each variant and their report, into "
               "results/<timestamp>/ (about a minute on 2 cores, docs/running.md; `attnbench run --preset quick "
               "--dry-run` prints its plan)")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own usage errors: one line, status 2
        raise UsageError(message)


def _prog() -> str:
    """The program the user typed: `run_bench.py` when run as that file, else `attnbench`
    (the console script, and the name errors use from anywhere else)."""
    return "run_bench.py" if os.path.basename(sys.argv[0] or "") == "run_bench.py" else "attnbench"


def version() -> str:
    """The installed package's version (pyproject.toml's, in a checkout that is not
    installed)."""
    from importlib import metadata

    try:
        return metadata.version("attnbench")
    except metadata.PackageNotFoundError:
        import re
        from pathlib import Path

        text = (Path(__file__).resolve().parent / "pyproject.toml").read_text()
        return re.search(r'^version = "([^"]+)"', text, re.M).group(1)


def _parser() -> argparse.ArgumentParser:
    from harness.cli import check as cli_check
    from harness.cli import maps as cli_maps
    from harness.cli import modules as cli_modules
    from harness.cli import model as cli_model
    from harness.cli import report as cli_report
    from harness.cli import run as cli_run
    from harness.cli import train as cli_train

    p = _Parser(prog=_prog(), description=__doc__.splitlines()[0], epilog=DEFAULT_JOB)
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    with_modules = [
        (cli_run.add_run_args, "run", "run a benchmark matrix"),
        (cli_run.add_list_args, "list",
         "list variants: what each supports, where it runs, its origin (--wide: more)"),
        (cli_model.add_model_args, "model",
         "drift of a pretrained model when a variant replaces its attention"),
        (cli_maps.add_maps_args, "maps",
         "draw the attention maps of one head: exact, each variant, differences"),
        (cli_train.add_train_args, "train",
         "train a small model per variant on a recall task (train.csv)")]
    for add, name, what in with_modules:
        q = sub.add_parser(name, help=what)
        add(q)
        cli_modules.add_args(q)
    cli_check.add_check_args(sub.add_parser(
        "check", help="the conformance kit on the variants a module registers"))
    cli_report.add_report_args(sub.add_parser("report", help="write the report of a run"))
    cli_report.add_compare_args(sub.add_parser("compare", help="compare two runs"))
    return p


def main(argv: list[str] | None = None) -> int:
    from harness.cli import check as cli_check
    from harness.cli import maps as cli_maps
    from harness.cli import modules as cli_modules
    from harness.cli import model as cli_model
    from harness.cli import report as cli_report
    from harness.cli import run as cli_run
    from harness.cli import train as cli_train

    try:
        args = _parser().parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)  # to print a rerun command
        args.prog = _prog()
        if args.command == "run":  # an unknown preset: the presets `run` takes
            cli_run.check_preset(args.config or args.preset or "quick")
        if args.command not in ("report", "compare", "check"):  # before anything is built
            cli_modules.use(args, getattr(args, "config", None) or getattr(args, "preset", None))
        if args.command is None:  # the default job: the quick CPU matrix, the model drift
            run_dir = cli_run.run_default()  # at N = 512 into the same folder, the report
            cli_model.run_model(cli_model.default_args(run_dir.parent, run_dir.name))
            return cli_report.report_dir(run_dir)
        return {"run": cli_run.run_command, "list": cli_run.list_command,
                "report": cli_report.report_command,
                "compare": cli_report.compare_command,
                "model": cli_model.model_command,
                "maps": cli_maps.maps_command,
                "train": cli_train.train_command,
                "check": cli_check.check_command}[args.command](args)
    except UsageError as e:
        print(f"{_prog()}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
