"""pytest-benchmark of the single ops whose rates the variants' docstrings and docs quote:

    python -m pytest tests/benchmarks/test_kernels.py --benchmark-only

- "exp": torch.exp against torch.exp2 and `variants.core.exp_` (exp2 with its scaling
  pass) over 2^19 float32 elements (why the sparse backward passes and elu+1 use exp_).
- "block products": one 1024-row block of the linear core at B H = 8, M = D = 64: the
  key product with 64 and with 65 (= D + 1) columns, and the normaliser as a one-column
  batched matmul against a row vector times the block (why S and z are kept apart).
- "first touch": filling a fresh tensor against refilling a kept one, 16 MiB (glibc
  reuses it, under its 32 MiB mmap ceiling) and 64 MiB (a fresh mapping every time).
"""

import pytest
import torch

from variants.core import exp_

# -- exp ------------------------------------------------------------------------------

X = torch.randn(1 << 19, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("op", ["torch.exp", "torch.exp2", "exp_"])
def test_exp(benchmark, op):
    benchmark.group = "exp 2^19 float32"
    out = torch.empty_like(X)
    if op == "exp_":
        benchmark(lambda: exp_(out.copy_(X)))  # the copy restores the input: ~25 us of it
    else:
        fn = torch.exp if op == "torch.exp" else torch.exp2
        benchmark(fn, X, out=out)


# -- block products -------------------------------------------------------------------

def _block(*shape):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("cols", [64, 65])
def test_key_product(benchmark, cols):
    """phi(K)^T [V] (M x D) or phi(K)^T [V | 1] (M x (D + 1)) over one block of keys."""
    benchmark.group = "block products: phi(K)^T V, M = 64"
    fk, vw = _block(1, 8, 1024, 64), _block(1, 8, 1024, cols)
    benchmark(lambda: fk.transpose(-1, -2) @ vw)


@pytest.mark.parametrize("form", ["one-column matmul", "row vector times block"])
def test_normaliser(benchmark, form):
    """phi(Q) z for one block of queries, as (r x M)(M x 1) or as z^T phi(Q)^T."""
    benchmark.group = "block products: normaliser, M = 64"
    fq, z = _block(1, 8, 1024, 64), _block(1, 8, 64, 1)
    if form == "one-column matmul":
        benchmark(lambda: fq @ z)
    else:
        zt = z.transpose(-1, -2).contiguous()
        benchmark(lambda: zt @ fq.transpose(-1, -2))


# -- first touch ----------------------------------------------------------------------

@pytest.mark.parametrize("mib", [16, 64])
@pytest.mark.parametrize("memory", ["fresh", "kept"])
def test_first_touch(benchmark, mib, memory):
    benchmark.group = "first touch: fill"
    n = mib << 18  # float32 elements
    if memory == "fresh":
        benchmark(lambda: torch.empty(n).fill_(1.0))
    else:
        kept = torch.empty(n)
        benchmark(lambda: kept.fill_(1.0))
