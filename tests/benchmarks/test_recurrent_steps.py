"""pytest-benchmark of the recurrences (and the routed variants) where their cost is not
their arithmetic: one training step of the recall model at short N, and the per-channel
kernel's forward over gates drawn from several seeds.

    python -m pytest tests/benchmarks/test_recurrent_steps.py --benchmark-only

- "train step N=64 / N=128": forward, backward and AdamW step of harness.train.model's
  RecallModel at train-cpu's shape (d_model 64, two layers, two heads, batch 32, MQAR with
  8 / 16 pairs), one thread; compare each variant's median with sdpa's in the same run.
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
