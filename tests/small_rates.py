"""small_matmul, for conftest's session-wide fixture (a module of its own: `from conftest
import` would find tests/benchmarks/conftest.py when the whole suite is collected)."""

from __future__ import annotations

import pytest


def small_matmul(mp: pytest.MonkeyPatch) -> None:
    """The runner's matmul rate (harness.measure.store.matmul_gflops) timed on a 256 x 256
    matmul for 0.01 s instead of a 2048 x 2048 one for 0.2-0.5 s: the same code, a real
    rate, a hundredth of the time. A run in this process samples the rate at its start,
    before each later round and at its end, 1-2 s a sample on this machine, more than the
    tiny matrices of the tests take to measure. For tests that read no rate; jobs and
    subprocesses the test starts measure theirs as a run does."""
    from harness.measure import store

    real = store.matmul_gflops

    def small(device, dtype, threads, n=None, min_run_time=0.5):
        return real(device, dtype, threads, n=256, min_run_time=0.01)

    mp.setattr(store, "matmul_gflops", small)
