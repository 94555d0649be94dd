"""pytest-benchmark of the recurrences (and the routed variants) where their cost is not
their arithmetic: one training step of the recall model at short N, and the per-channel
kernel's forward over gates drawn from several seeds.

    python -m pytest tests/benchmarks/test_recurrent_steps.py --benchmark-only

- "train step N=64 / N=128": forward, backward and AdamW step of harness.train.model's
  RecallModel at train-cpu's shape (d_model 64, two layers, two heads, batch 32, MQAR with
  8 / 16 pairs), one thread; compare each variant's median with sdpa's in the same run.
- "routed forms at N=64 / 128": moba (8-token blocks, top 3) forward and backward at the
  recall model's mixer shape (B 32, H 2, D 32, causal), its dense masked form against the
  routed kernel (variants/routed/blocks.py's DENSE_MAX), sdpa beside them.
- "solve backward": the triangular solve's backward solve, a left solve by the transposed
  view of A against the right-hand solve on A as stored (chunked._UnitLowerSolve).
- "per-channel forward by seed": kda and gla at B = 1, H = 8, N = 4096, D = 64 over the
  harness's draws from seeds 0..3 (a kernel whose path hung on the decays drawn read
  153-349 ms across seeds here), and gated_deltanet at the same shape.
"""

import pytest
import torch

import variants
from tools.step_ratios import step_fn

STEP_VARIANTS = [("sdpa", {}), ("retention", {}), ("gla", {}), ("mamba2", {}),
                 ("deltanet", {}), ("gated_deltanet", {}), ("kda", {}),
                 ("moba", {"block_size": 8, "top_k": 3}), ("moba", {"block_size": 16, "top_k": 2})]


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("N", [64, 128])
@pytest.mark.parametrize("name,params", STEP_VARIANTS,
                         ids=[f"{n}-{'-'.join(f'{k}{v}' for k, v in p.items())}".rstrip("-")
                              for n, p in STEP_VARIANTS])
def test_train_step(benchmark, one_thread, name, params, N):
    """tools/step_ratios.py's step (train-cpu's shape), one variant after another."""
    step = step_fn(name, params, N)
    benchmark.group = f"train step N={N}"
    benchmark.pedantic(step, rounds=20, warmup_rounds=3)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("name", ["kda", "gla", "gated_deltanet"])
def test_per_channel_forward_by_seed(benchmark, name, seed):
    B, H, N, D = 1, 8, 4096, 64
    if name == "gated_deltanet" and seed:
        pytest.skip("one seed: its kernel has no per-channel scores")
    m = variants.build(name)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, D, generator=g) for _ in range(3))
    inputs = m.draw_inputs(B, H, N, D, seed=seed)
    benchmark.group = "per-channel forward by seed"
    with torch.no_grad():
        benchmark(lambda: m(q, k, v, causal=True, **inputs))


@pytest.mark.parametrize("N", [64, 128])
@pytest.mark.parametrize("form", ["sdpa", "moba dense", "moba routed"])
def test_routed_forms_at_short_n(benchmark, one_thread, monkeypatch, form, N):
    from variants.routed import blocks
    if form == "moba routed":
        monkeypatch.setattr(blocks, "DENSE_MAX", 0)
    m = variants.build("sdpa") if form == "sdpa" else variants.build("moba", block_size=8,
                                                                      top_k=3)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(32, 2, N, 32, generator=g, requires_grad=True) for _ in range(3))
    go = torch.randn(32, 2, N, 32, generator=g)
    benchmark.group = f"routed forms at N={N}"
    benchmark(lambda: m.unchecked(q, k, v, True).backward(go))


@pytest.mark.parametrize("C,rhs", [(64, 32), (64, 64)], ids=["one-chunk", "chunk form"])
@pytest.mark.parametrize("form", ["left by A^T view", "right on A"])
def test_solve_backward(benchmark, one_thread, form, C, rhs):
    lead = (32, 2) if rhs == 32 else (32, 2, 2)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(*lead, C, C, generator=g).tril(-1) * 0.1
    dx = torch.randn(*lead, C, rhs, generator=g)
    solve = torch.linalg.solve_triangular
    benchmark.group = f"solve backward {lead + (C, C)}, {rhs} right-hand sides"
    if form == "right on A":
        benchmark(lambda: solve(a, dx.transpose(-1, -2), upper=False, left=False,
                                unitriangular=True))
    else:
        benchmark(lambda: solve(a.transpose(-1, -2), dx, upper=True, unitriangular=True))
