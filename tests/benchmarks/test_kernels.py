"""pytest-benchmark of the single ops whose rates the variants' docstrings and docs quote:

    python -m pytest tests/benchmarks/test_kernels.py --benchmark-only

- "exp": torch.exp against torch.exp2 and `variants.core.exp_` (exp2 with its scaling
  pass) over 2^19 float32 elements (why the sparse backward passes and elu+1 use exp_).
- "exp of a log-decay": torch.exp and exp2 of inputs from -3 to -inf, and a chunk's
  decayed product Q K^T ⊙ Γ by an -inf mask against `chunked.decayed`, one thread.
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


# -- exp below float32's normal range -------------------------------------------------

@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("x", [-3.0, -86.0, -87.5, -88.0, -100.0, -130.0, -200.0, float("-inf")])
@pytest.mark.parametrize("op", ["torch.exp", "torch.exp2"])
def test_exp_of_a_decay(benchmark, op, x, one_thread):
    """exp of 2^18 equal inputs, one thread: exp's slow path for results below float32's
    smallest normal number (why the chunk forms clamp a decay's exponent at EXP_FLOOR)."""
    benchmark.group = "exp of a log-decay, 2^18 float32, one thread"
    xs, out = torch.full((1 << 18,), x), torch.empty(1 << 18)
    benchmark(torch.exp if op == "torch.exp" else torch.exp2, xs, out=out)


@pytest.mark.parametrize("form", ["-inf mask", "decayed"])
def test_decay_matrix(benchmark, form, one_thread):
    """Q K^T ⊙ Γ forward at a recall model's (32, 2, 64, 64), one thread: Γ by an additive
    -inf mask before exp (the earlier form) against `chunked.decayed` (clamp, exp, mask)."""
    from variants.recurrent.chunked import decayed, lower_mask
    benchmark.group = "decayed product (32, 2, 64, 64), one thread"
    gen = torch.Generator().manual_seed(2)
    b = (-0.1 * torch.rand(32, 2, 64, generator=gen)).cumsum(-1)
    qk = torch.randn(32, 2, 64, 64, generator=gen)
    lower = lower_mask(64, qk)
    off = torch.zeros_like(lower).masked_fill_(lower == 0, float("-inf"))
    if form == "decayed":
        benchmark(lambda: decayed(b, lower, qk))
    else:
        benchmark(lambda: qk * (b[..., :, None] - b[..., None, :] + off).exp())


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
