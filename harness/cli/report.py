"""The `report` and `compare` subcommands of attnbench: they read result folders, never measure."""

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
    if not 0 <= value <= 1:
        raise UsageError(f"--threshold is a fraction from 0 to 1 (0.1 or 10%), got {text!r}")
    return value


def add_compare_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_a", help="the baseline results folder")
    parser.add_argument("run_b", help="the results folder compared with it (ratios are b / a)")
    parser.add_argument("--threshold", default="10%", metavar="FRACTION",
                        help="smallest relative time change flagged, a fraction from 0 to 1: "
                             "0.1 or 10%% (default 10%%); it must also exceed the two runs' "
                             "IQRs")
    parser.add_argument("--fail-on-regression", action="store_true",
                        help="exit 1 when any case regressed")
    parser.add_argument("--output", metavar="FILE.md", help="also write the table to this file")


def compare_command(args) -> int:
    """Benchmark runs (results.csv) case by case, training sweeps (train.csv) configuration by
    configuration: whichever both folders hold."""
    from harness.files import RESULTS, TRAIN_CSV
    from harness.report.compare import compare_runs, compare_trained, to_markdown, \
        trained_markdown
    from harness.report.folder import load_run
    from harness.report.trained import read_train

    threshold = _fraction(str(args.threshold))
    out = Path(args.output) if args.output else None
    if out is not None and not out.parent.is_dir():
        raise UsageError(f"--output: folder {out.parent} does not exist")
    a_dir, b_dir = Path(args.run_a), Path(args.run_b)
    names = (a_dir.name, b_dir.name)
    trained = (a_dir / TRAIN_CSV).is_file() and (b_dir / TRAIN_CSV).is_file()
    texts, regressions = [], 0
    if not trained or ((a_dir / RESULTS).is_file() and (b_dir / RESULTS).is_file()):
        (a, _), (b, _) = load_run(a_dir), load_run(b_dir)  # the usual error otherwise
        cmp = compare_runs(a, b, threshold)
        texts.append(to_markdown(cmp, *names))
        regressions += cmp.regressions
    if trained:
        tcmp = compare_trained(read_train(a_dir / TRAIN_CSV), read_train(b_dir / TRAIN_CSV))
        texts.append(trained_markdown(tcmp, *names))
        regressions += tcmp.regressions
    text = "\n".join(texts)
    print(text, end="")
    if out is not None:
        out.write_text(text)
    return 1 if args.fail_on_regression and regressions else 0
