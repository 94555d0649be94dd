"""How far each trained cell's held-out accuracy moved between two runs of the same preset,
split by whether the cell settled in both: the reading behind docs/training.md's comparison
of train-cpu-v5 (Intel Xeon) and train-cpu-v6 (AMD EPYC).

    python tools/trained_moves.py results/train-cpu-v5 results/train-cpu-v6

A cell is the report's (harness.report.cells: a configuration over its seeds, its accuracy
the median). `attnbench compare A B` lists the same move configuration by configuration;
this groups by cell and by the settling rule, which is what the answers depend on.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pathlib import Path  # noqa: E402

from harness.report.cells import CELL, cells  # noqa: E402
from harness.report.trained import read_train  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path, help="the first run's folder (holds train.csv)")
    ap.add_argument("b", type=Path, help="the second run's folder")
    ap.add_argument("--top", type=int, default=8, help="the largest moves to list")
    args = ap.parse_args(argv)
    keep = [*CELL, "accuracy", "acc_min", "acc_max", "settled"]
    a, b = (cells(read_train(d / "train.csv"))[keep] for d in (args.a, args.b))
    both = a.merge(b, on=CELL, suffixes=("_a", "_b"), how="inner")
    both["move"] = (both["accuracy_b"] - both["accuracy_a"]).abs()
    settled = (both["settled_a"] == True) & (both["settled_b"] == True)  # noqa: E712
    print(f"{len(both)} cells in both ({len(a)} in {args.a.name}, {len(b)} in {args.b.name})")
    for name, part in (("settled in both", both[settled]), ("not", both[~settled])):
        if len(part):
            print(f"{name}: {len(part)} cells, median move {part['move'].median():.4f}, "
                  f"largest {part['move'].max():.4f}")
    cols = ["variant", "params", "seq_len", "heads", "accuracy_a", "accuracy_b", "move"]
    print(both.assign(settled_both=settled).sort_values("move", ascending=False)
          [cols + ["settled_both"]].head(args.top).round(4).to_string(index=False))


if __name__ == "__main__":
    main()
