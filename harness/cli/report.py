"""The `report` and `compare` subcommands of run_bench.py: they read result folders, never measure."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from harness.errors import UsageError


def add_report_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a results folder, e.g. results/<run-id>")


def report_dir(path) -> int:
    """Write report.md, report.html and plots/ into a run folder and say where they are."""
    from harness.report.build import write_report

    start = time.perf_counter()
    md = write_report(Path(path))
    print(f"report: {md} and {md.with_suffix('.html')} "
          f"({time.perf_counter() - start:.1f} s)")
    return 0


def report_command(args) -> int:
    return report_dir(args.run_dir)


def _fraction(text: str) -> float:
    """A threshold as a fraction: `0.1`, `10%`."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise UsageError(f"--threshold must be a number or a percentage, got {text!r}") from None
    if value < 0:
        raise UsageError(f"--threshold must be >= 0, got {text!r}")
    return value


def add_compare_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_a", help="the baseline results folder")
    parser.add_argument("run_b", help="the results folder compared with it (ratios are b / a)")
    parser.add_argument("--threshold", default="10%", metavar="FRACTION",
                        help="smallest relative time change flagged, as 0.1 or 10%% "
                             "(default 10%%); it must also exceed the two runs' IQRs")
    parser.add_argument("--fail-on-regression", action="store_true",
                        help="exit 1 when any case regressed")
    parser.add_argument("--output", metavar="FILE.md", help="also write the table to this file")


def compare_command(args) -> int:
    from harness.report.compare import compare_runs, to_markdown
    from harness.report.folder import load_run

    threshold = _fraction(str(args.threshold))
    out = Path(args.output) if args.output else None
    if out is not None and not out.parent.is_dir():
        raise UsageError(f"--output: folder {out.parent} does not exist")
    (a, _), (b, _) = load_run(args.run_a), load_run(args.run_b)
    cmp = compare_runs(a, b, threshold)
    text = to_markdown(cmp, Path(args.run_a).name, Path(args.run_b).name)
    print(text, end="")
    if out is not None:
        out.write_text(text)
    return 1 if args.fail_on_regression and cmp.regressions else 0
