"""pytest-benchmark of the sparse variants at the roofline's size, and causal block_sparse
beside compiled flex attention on the same layout.

    python -m pytest tests/benchmarks/test_sparse_family.py --benchmark-only --benchmark-autosave
    python -m pytest tests/benchmarks/test_sparse_family.py --benchmark-only --benchmark-compare

B=1, float32 on CPU, default parameters. sliding_window and block_sparse at H=8, N=8192,
D=64, non-causal and causal, forward and forward+backward; then causal block_sparse and
block_sparse_flex forward at H=4, N=16384 (flex compiled in `prepare`, outside the timed
rounds), and a narrow sliding_window(window=64) forward at H=4, N=16384, causal and not.
Each case's analytic FLOPs (`flops()`, x3 with the backward) is in its `extra_info`;
`python -m harness.measure.roofline` sets the default-parameter cases against the
machine's matmul rate.
"""

import pytest

from bench_case import run_case


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward_backward"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", ["sliding_window", "block_sparse"])
def test_sparse_family(benchmark, name, causal, backward):
    run_case(benchmark, name, 8, 8192, causal, backward,
             f"{'forward_backward' if backward else 'forward'} N=8192")


@pytest.mark.parametrize("name", ["block_sparse", "block_sparse_flex"])
def test_causal_block_sparse_beside_flex(benchmark, name):
    run_case(benchmark, name, 4, 16384, True, False, "causal forward N=16384 H=4")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_narrow_window(benchmark, causal):
    """window=64 at H=4, N=16384 (the reference answers' setting): 512 chunks of 32 rows,
    taken in groups."""
    run_case(benchmark, "sliding_window", 4, 16384, causal, False,
             "sliding_window(window=64) forward N=16384 H=4", window=64)
