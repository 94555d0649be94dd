"""pytest-benchmark of the linear-family and low-rank variants at the roofline's size, causal too.

    python -m pytest tests/benchmarks/test_linear_family.py --benchmark-only --benchmark-autosave
    python -m pytest tests/benchmarks/test_linear_family.py --benchmark-only --benchmark-compare

B=1, H=8, N=8192, D=64, float32 on CPU, default parameters: linear and performer non-causal
and causal (their chunked prefix sums), linformer and nystrom non-causal. Each case's
analytic forward FLOPs (`flops()`, x3 with the backward) is in its `extra_info`, so a
saved run gives GFLOP/s; `python -m harness.measure.roofline` sets the same cases against
the machine's matmul rate.
"""

import pytest

from bench_case import run_case

N, H = 8192, 8
CASES = [("linear", False), ("linear", True), ("performer", False), ("performer", True),
         ("linformer", False), ("nystrom", False)]


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward_backward"])
@pytest.mark.parametrize("name,causal", CASES, ids=[f"{n}-{'causal' if c else 'full'}"
                                                    for n, c in CASES])
def test_linear_family(benchmark, name, causal, backward):
    run_case(benchmark, name, H, N, causal, backward,
             f"{'forward_backward' if backward else 'forward'} N={N}")
