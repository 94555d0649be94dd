"""pytest-benchmark micro benchmarks over the registry: forward and forward+backward.

    python -m pytest tests/benchmarks --benchmark-only --benchmark-autosave
    python -m pytest tests/benchmarks --benchmark-only --benchmark-compare   # vs the last save

B=1, H=8, D=64, float32 on CPU. A case a variant declares unsupported is skipped with its
reason. Each variant's `prepare` (a library kernel's compile, a mask) runs before the
benchmark, outside its timed rounds, as the harness does. For the full measurement
(memory, error, many lengths) use `run_bench.py run`.
"""

import pytest
import torch

import variants

LENGTHS = (1024, 4096)


def _case(name, N, backward):
    m = variants.build(name)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, N, 64, generator=g).requires_grad_(backward) for _ in range(3))
    reasons = m.unsupported_reasons(device="cpu", dtype=q.dtype, causal=False, seq_len=N,
                                    head_dim=64, backward=backward)
    if reasons:
        pytest.skip("; ".join(reasons))
    m.prepare(q, k, v, False, backward=backward)  # one-time work: never in a timed round
    q.grad = k.grad = v.grad = None
    return m, q, k, v


@pytest.mark.parametrize("N", LENGTHS)
@pytest.mark.parametrize("name", variants.names())
def test_forward(benchmark, name, N):
    m, q, k, v = _case(name, N, backward=False)
    benchmark.group = f"forward N={N}"
    with torch.no_grad():
        benchmark(m, q, k, v)


@pytest.mark.parametrize("N", LENGTHS)
@pytest.mark.parametrize("name", variants.names())
def test_forward_backward(benchmark, name, N):
    m, q, k, v = _case(name, N, backward=True)
    benchmark.group = f"forward_backward N={N}"

    def step():
        q.grad = k.grad = v.grad = None
        m(q, k, v).sum().backward()

    benchmark(step)
