"""attnbench command line: run a benchmark matrix, report it, compare runs, list variants.

    python run_bench.py                      # quick CPU matrix, model drift at N=512, report
    python run_bench.py run --preset cpu     # or gpu, or a TOML file of your own
    python run_bench.py report results/<run-id>
    python run_bench.py compare results/<a> results/<b>
    python run_bench.py list                 # variants, families, parameters
    python run_bench.py model [--model minilm|PATH] [--text FILE]   # drift inside a real model
    python run_bench.py maps [--layer L --head H --seq-len N --variants ...]  # attention maps
    python run_bench.py train [--preset train-quick|train-cpu|train-gpu]   # trained recall

Bad input ends with a one-line error on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys

from harness.errors import UsageError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own usage errors: one line, status 2
        raise UsageError(message)


def _parser() -> argparse.ArgumentParser:
    from harness.cli import maps as cli_maps
    from harness.cli import model as cli_model
    from harness.cli import report as cli_report
    from harness.cli import run as cli_run
    from harness.cli import train as cli_train

    p = _Parser(prog="run_bench.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    cli_run.add_run_args(sub.add_parser("run", help="run a benchmark matrix"))
    cli_run.add_list_args(sub.add_parser("list", help="list variants and their parameters"))
    cli_report.add_report_args(sub.add_parser("report", help="write the report of a run"))
    cli_report.add_compare_args(sub.add_parser("compare", help="compare two runs"))
    cli_model.add_model_args(sub.add_parser(
        "model", help="drift of a pretrained model when a variant replaces its attention"))
    cli_maps.add_maps_args(sub.add_parser(
        "maps", help="draw the attention maps of one head: exact, each variant, differences"))
    cli_train.add_train_args(sub.add_parser(
        "train", help="train a small model per variant on a recall task (train.csv)"))
    return p


def main(argv: list[str] | None = None) -> int:
    from harness.cli import maps as cli_maps
    from harness.cli import model as cli_model
    from harness.cli import report as cli_report
    from harness.cli import run as cli_run
    from harness.cli import train as cli_train

    try:
        args = _parser().parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)  # to print a rerun command
        if args.command is None:  # the default job: the quick CPU matrix, the model drift
            run_dir = cli_run.run_default()  # at N = 512 into the same folder, the report
            cli_model.run_model(cli_model.default_args(run_dir.parent, run_dir.name))
            return cli_report.report_dir(run_dir)
        return {"run": cli_run.run_command, "list": cli_run.list_command,
                "report": cli_report.report_command,
                "compare": cli_report.compare_command,
                "model": cli_model.model_command,
                "maps": cli_maps.maps_command,
                "train": cli_train.train_command}[args.command](args)
    except UsageError as e:
        print(f"run_bench.py: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
