"""What the decode profiles in tools/ share: a median of timed calls by the harness's own
timer, and this machine's read and matmul rates as the harness measures them (the rates
its roofline bounds use)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness.measure.store import matmul_gflops, read_bandwidth_gbps  # noqa: E402
from harness.measure.timing import time_call  # noqa: E402

REPS = 7  # timed calls at least, each profile's median


def median_ms(f) -> float:
    """The median of at least REPS timed calls of f(), by the harness's own timer."""
    return time_call(f, min_repeats=REPS).time_ms


def matmul_rate(threads: int) -> float:
    """The square float32 matmul rate on CPU (GFLOP/s), as the harness's compute bound."""
    return matmul_gflops("cpu", "float32", threads)


def rates(threads: int) -> tuple[float, float]:
    """(read GB/s, matmul GFLOP/s) on CPU, as the harness's roofline measures them."""
    return read_bandwidth_gbps(threads), matmul_rate(threads)
