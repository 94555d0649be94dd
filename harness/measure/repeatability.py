"""Repeatability: the same cases measured twice in one run (one worker pair), as ratios.

    python -m harness.measure.repeatability            # 6 variants x 2 passes at N=4096, H=4

Times are measured in two passes over the cases, a pass apart; a ratio far from 1 with
small IQRs means the machine's speed drifted between passes, not timer noise.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from harness.measure import matrix as mx
from harness.measure.runner import WorkerPair

MATRIX = {"variants": ["sdpa", "sliding_window", "block_sparse", "nystrom", "linear",
                       "performer"],
          "seq_lens": [4096], "heads": 4, "passes": ["forward", "forward_backward"],
          "min_run_time_s": 0.2, "min_repeats": 3}


def main() -> None:
    cases = mx.expand(mx.normalise(MATRIX))
    workers = WorkerPair(Path(tempfile.mkdtemp()) / "worker.log")
    try:
        passes = [[workers.measure(c) for c in cases] for _ in range(2)]
    finally:
        workers.close()
    ratios = []
    for c, a, b in zip(cases, *passes):
        r = b["time_ms"] / a["time_ms"]
        ratios.append(r)
        print(f"{c.variant:15s} {c.pass_:17s} {a['time_ms']:9.2f} {b['time_ms']:9.2f} ms "
              f"(IQR {a['time_ms_iqr']:.2f}, {b['time_ms_iqr']:.2f})  ratio {r:.3f}  "
              f"peak {a['peak_mem_mib']:.1f} / {b['peak_mem_mib']:.1f} MiB")
    print(f"time ratio second/first: median {statistics.median(ratios):.3f}, "
          f"range {min(ratios):.3f}-{max(ratios):.3f}")


if __name__ == "__main__":
    main()
