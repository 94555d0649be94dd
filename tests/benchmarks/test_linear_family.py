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
import torch

import variants

N, H, D = 8192, 8, 64
CASES = [("linear", False), ("linear", True), ("performer", False), ("performer", True),
         ("linformer", False), ("nystrom", False)]


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward_backward"])
@pytest.mark.parametrize("name,causal", CASES, ids=[f"{n}-{'causal' if c else 'full'}"
                                                    for n, c in CASES])
def test_linear_family(benchmark, name, causal, backward):
    m = variants.build(name)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, N, D, generator=g).requires_grad_(backward) for _ in range(3))
    benchmark.group = f"{'forward_backward' if backward else 'forward'} N={N}"
    benchmark.extra_info["gflop"] = m.flops(1, H, N, D, causal) * (3 if backward else 1) / 1e9

    def step():
        if backward:
            q.grad = k.grad = v.grad = None
            m(q, k, v, causal=causal).sum().backward()
        else:
            with torch.no_grad():
                m(q, k, v, causal=causal)

    benchmark(step)
