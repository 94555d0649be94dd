"""pytest-benchmark of the exact decoder's passes, the layouts `variants/exact/cache.py`
chose between, against a read of the same bytes:

    python -m pytest tests/benchmarks/test_decode.py --benchmark-only

One query row, B H = 8, D = 64, float32, a cache of N = 2^18 tokens (512 MiB of keys and
as much of values), each pass over the whole cache:

- "scores": a sum over K (the read), q K^T by one batched matmul over K as it arrives
  (N, D), and over K stored transposed (D, N);
- "values": a sum over V (the read), p V over V as it arrives and V^T p over V stored
  transposed (D long dot products);
- "softmax": into a fresh tensor (its pages faulted in on every call) and in place in a
  kept buffer;
- "step": one whole step, SDPA over a cache against the exact decoder's.
"""

import pytest
import torch
import torch.nn.functional as F

import variants
from variants.core import softmax_

BH, N, D = 8, 1 << 18, 64
_g = torch.Generator().manual_seed(0)
K, V = torch.randn(BH, N, D, generator=_g), torch.randn(BH, N, D, generator=_g)
Q = torch.randn(BH, 1, D, generator=_g)


@pytest.mark.parametrize("form", ["read", "K as it arrives", "K transposed"])
def test_scores(benchmark, form):
    benchmark.group = "decode scores q K^T, 2^18 keys"
    s = torch.empty(BH, 1, N)
    if form == "read":
        benchmark(K.sum)
    elif form == "K as it arrives":
        benchmark(lambda: torch.bmm(Q, K.transpose(1, 2), out=s))
    else:
        kt = K.transpose(1, 2).contiguous()
        benchmark(lambda: torch.bmm(Q, kt, out=s))


@pytest.mark.parametrize("form", ["read", "V as it arrives", "V transposed"])
def test_values(benchmark, form):
    benchmark.group = "decode values p V, 2^18 keys"
    p = torch.softmax(torch.randn(BH, 1, N, generator=_g), dim=-1)
    if form == "read":
        benchmark(V.sum)
    elif form == "V as it arrives":
        benchmark(lambda: torch.bmm(p, V))
    else:
        vt = V.transpose(1, 2).contiguous()
        benchmark(lambda: torch.bmm(vt, p.transpose(1, 2)))


@pytest.mark.parametrize("form", ["fresh", "in place"])
def test_softmax(benchmark, form):
    benchmark.group = "decode softmax, 2^18 keys"
    s = torch.randn(BH, 1, N, generator=_g)
    if form == "fresh":
        benchmark(lambda: torch.softmax(s, dim=-1))
    else:
        benchmark(softmax_, s)  # softmax of a softmax: the same passes, finite values


@pytest.mark.parametrize("form", ["sdpa over the cache", "exact decoder"])
def test_step(benchmark, form):
    benchmark.group = "decode step, 2^18 keys"
    q, k, v = Q.view(1, BH, 1, D), K.view(1, BH, N, D), V.view(1, BH, N, D)
    if form == "sdpa over the cache":
        benchmark(lambda: F.scaled_dot_product_attention(q, k, v))
    else:
        state = variants.build("sdpa").prefill(k, v, max_len=N)
        benchmark(lambda: state.attend(q))
