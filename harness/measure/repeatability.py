"""Repeatability: how far a case's time moves between minutes, with and without rounds.

    python -m harness.measure.repeatability            # the `drift` preset's dozen, N=4096
    python -m harness.measure.repeatability --rounds 5 --seq-len 2048 --keep results/rep

The same dozen cases are run three times through the real runner, one run after the
other: twice with one round (what a run without `rounds` reports), then once with R
rounds. For each case it prints the IQR of the first one-round run as a share of its
median (the precision a one-round row claims), the drift between the two one-round runs
(|b - a| / min(a, b): how far the same case moved a few minutes later, which a one-round
row cannot show), and the R-round run's `time_ms_spread` (the same drift, seen inside
one run and written beside the time). Where the drift exceeds the IQR, the machine's
speed changed between minutes and a one-round run hides it. Other work on the cores is
sampled before each run and before each round (harness.measure.busy) and printed.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import tempfile
from pathlib import Path

from tabulate import tabulate

from harness.files import SPREAD_FLAG
from harness.measure import matrix as mx
from harness.measure import runner
from harness.measure.store import RunStore

# The dozen: the `drift` preset (its own rounds aside: each run here sets them).
MATRIX = {k: v for k, v in mx.read_toml("drift").items() if k != "rounds"}


def _run(folder: Path, table: dict) -> tuple[dict[str, dict], list[dict]]:
    """One run of the matrix into folder: (case id -> row, its busy samples)."""
    m = mx.normalise(table)
    store = RunStore(folder)
    runner.run(m, mx.expand(m), store, resume=False)
    with (folder / "results.csv").open(newline="") as f:
        rows = {r["case_id"]: r for r in csv.DictReader(f)}
    return rows, store.read_meta().get("busy", [])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.measure.repeatability",
                                description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds of the third run (default 3)")
    p.add_argument("--seq-len", type=int, default=MATRIX["seq_lens"][0])
    p.add_argument("--variants", default=",".join(MATRIX["variants"]))
    p.add_argument("--min-run-time", type=float, default=MATRIX["min_run_time_s"],
                   help="timing budget per case, s (each round takes its 1/R share)")
    p.add_argument("--keep", type=Path, default=None,
                   help="write the three runs into this folder (default: a temporary one)")
    args = p.parse_args(argv)
    if args.rounds < 2:
        p.error("--rounds must be at least 2")
    base = {**MATRIX, "seq_lens": [args.seq_len], "min_run_time_s": args.min_run_time,
            "variants": [v.strip() for v in args.variants.split(",") if v.strip()]}
    out = args.keep or Path(tempfile.mkdtemp(prefix="attnbench-repeatability-"))
    names = ("one-round-a", "one-round-b", f"{args.rounds}-rounds")
    runs = [_run(out / name, {**base, "rounds": r})
            for name, r in zip(names, (1, 1, args.rounds))]
    (a, _), (b, _), (c, _) = runs
    lines, iqrs, drifts, spreads = [], [], [], []
    for cid, ra in a.items():
        rb, rc = b.get(cid), c.get(cid)
        if ra["status"] != "ok" or not rb or rb["status"] != "ok" or not rc or rc["status"] != "ok":
            lines.append([ra["variant"], ra["pass"], ra["status"], "", "", "", ""])
            continue
        ta, tb = float(ra["time_ms"]), float(rb["time_ms"])
        iqr = float(ra["time_ms_iqr"]) / ta
        drift = abs(tb - ta) / min(ta, tb)
        spread = float(rc["time_ms_spread"])
        iqrs.append(iqr)
        drifts.append(drift)
        spreads.append(spread)
        lines.append([ra["variant"], ra["pass"], f"{ta:.2f} / {tb:.2f}", f"{iqr:.1%}",
                      f"{drift:.1%}", f"{float(rc['time_ms']):.2f}", f"{spread:.1%}"])
    print(f"{len(a)} cases at N={args.seq_len}; runs in {out}")
    print(tabulate(lines, headers=["variant", "pass", "1 round: a / b ms", "IQR / median (a)",
                                   "drift a -> b", f"{args.rounds} rounds: ms",
                                   "spread between rounds"],
                   disable_numparse=True))  # "1.00" stays "1.00", not 1
    if drifts:
        hidden = sum(d > i for d, i in zip(drifts, iqrs))
        print(f"without rounds: IQR median {statistics.median(iqrs):.1%}; the same case a run "
              f"later moved by median {statistics.median(drifts):.1%}, at most "
              f"{max(drifts):.1%}; more than its IQR in {hidden} of {len(drifts)} cases")
        print(f"with {args.rounds} rounds: spread median {statistics.median(spreads):.1%}, at "
              f"most {max(spreads):.1%}; above {SPREAD_FLAG:.0%} (flagged) in "
              f"{sum(s > SPREAD_FLAG for s in spreads)} of {len(spreads)} cases")
    for name, (_, busy) in zip(names, runs):
        print(f"{name}: other work on the cores " + ", ".join(
            f"{s['other_cores']:.2f}" + (f" (round {s['before_round']})" if s["before_round"]
                                         else " (start)") for s in busy)
              + f" of {busy[0]['cores'] if busy else '?'}; load average at its start "
              f"{busy[0]['load_average'] if busy else '?'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
