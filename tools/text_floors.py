"""The lm corpora's splits and floors, measured: sizes, sha256, unigram and bigram bits per
byte on the test split, and the share of recall hits at several window lengths.

    python tools/text_floors.py                          # python-docs and python-source
    python tools/text_floors.py --corpora path:notes/ --seq-lens 128,256

docs/text-and-state.md quotes its output. The seconds are this process's (reading, the
train split's 7-gram counts, the hit masks), so they include the machine's load.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness.train import corpus as corpora  # noqa: E402
from harness.train import text_metrics as tm  # noqa: E402
from harness.train import text_windows as tw  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpora", default="python-docs,python-source")
    ap.add_argument("--seq-lens", default="256,512,1024")
    args = ap.parse_args(argv)
    for name in args.corpora.split(","):
        t0 = time.perf_counter()
        meta = corpora.describe(name)
        read_s = time.perf_counter() - t0
        train, test = tw.split_tensor(name, "train"), tw.split_tensor(name, "test")
        t0 = time.perf_counter()
        counts = tm.train_gram_counts(train)
        counts_s = time.perf_counter() - t0
        print(f"{name}: read and split in {read_s:.1f} s; 7-gram counts of train in "
              f"{counts_s:.1f} s ({len(counts[0]):,} distinct)")
        for s, m in meta["splits"].items():
            print(f"  {s:<10} {m['documents']:>5} documents {m['bytes']:>11,} bytes  "
                  f"sha256 {m['sha256'][:16]}")
        for N in (int(n) for n in args.seq_lens.split(",")):
            x, y = tw.eval_windows(test, N)
            t0 = time.perf_counter()
            hits = tm.recall_hits(x, y, counts)
            hits_s = time.perf_counter() - t0
            share = float(hits[y != tw.IGNORE].float().mean())
            print(f"  N={N:<5} unigram_bpb {tm.unigram_bpb(train, y):.3f}  bigram_bpb "
                  f"{tm.bigram_bpb(train, x, y):.3f}  hit share {share:.3f} "
                  f"(mask in {hits_s:.2f} s)")


if __name__ == "__main__":
    main()
