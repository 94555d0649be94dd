"""One pytest-benchmark case of a variant: seeded (1, H, N, 64) float32 inputs, the
variant's `prepare` (a compile, a mask) before the timed rounds, a forward (no autograd)
or a forward+backward per round, and the analytic GFLOP in `extra_info`."""

import pytest
import torch

import variants

D = 64


def run_case(benchmark, name: str, H: int, N: int, causal: bool, backward: bool, group: str,
             **params) -> None:
    m = variants.build(name, **params)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, N, D, generator=g).requires_grad_(backward) for _ in range(3))
    reasons = m.unsupported_reasons(device="cpu", dtype=q.dtype, causal=causal, seq_len=N,
                                    head_dim=D, backward=backward)
    if reasons:
        pytest.skip("; ".join(reasons))
    m.prepare(q, k, v, causal, backward=backward)  # one-time work: never in a timed round
    benchmark.group = group
    benchmark.extra_info["gflop"] = m.flops(1, H, N, D, causal) * (3 if backward else 1) / 1e9

    def step():
        if backward:
            q.grad = k.grad = v.grad = None
            m(q, k, v, causal=causal).sum().backward()
        else:
            with torch.no_grad():
                m(q, k, v, causal=causal)

    benchmark(step)
