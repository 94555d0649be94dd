"""The CUDA path, checked as far as a machine without a GPU allows.

- Every registered variant runs on the `meta` device (shapes and dtypes, no data),
  causal and not, forward and backward where it supports them, and returns `meta`
  outputs and gradients: no tensor inside a variant is created on a fixed device.
- The harness's CUDA timing (events after a synchronisation) and memory
  (reset_peak_memory_stats, max_memory_allocated) paths: run on CUDA, skipped elsewhere.
- Asking for CUDA where there is none: one line, exit status 2, nothing written.
"""

import pytest
import torch

import run_bench
import variants
from test_conformance import lacks
from harness.measure import memory
from harness.measure import timing

NAMES = variants.names()
NO_CUDA = "CUDA is not available on this machine"


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_variant_runs_on_the_meta_device(name, causal, backward):
    m = variants.build(name)
    reasons = m.unsupported_reasons(device="meta", dtype=torch.float32, causal=causal,
                                    seq_len=300, head_dim=16, backward=backward)
    q, k, v = (torch.empty(2, 3, 300, 16, device="meta", requires_grad=backward)
               for _ in range(3))
    if reasons:  # declared: forward refuses with the reason, never computes something else
        with pytest.raises(ValueError) as e, torch.set_grad_enabled(backward):
            m(q, k, v, causal=causal)
        assert reasons[0] in str(e.value)
        if lacks(reasons):
            pytest.skip(f"this machine lacks what it needs: {'; '.join(reasons)}")
        return
    with torch.set_grad_enabled(backward):
        o = m(q, k, v, causal=causal)
    assert o.device.type == "meta" and o.shape == q.shape and o.dtype == q.dtype
    if backward:
        o.sum().backward()
        assert all(t.grad is not None and t.grad.device.type == "meta" for t in (q, k, v))


def test_a_cpu_tensor_inside_a_variant_fails_on_meta():
    """The meta check can fail: a tensor made on a fixed device does not mix with meta."""
    q = torch.empty(1, 1, 8, 4, device="meta")
    with pytest.raises((RuntimeError, NotImplementedError)):
        q + torch.ones(8, 4)  # what `torch.ones(N, D)` without device=q.device would do


def test_cpu_timing_does_not_take_the_event_path(monkeypatch):
    def no_events(*a, **k):
        raise AssertionError("CUDA events used for a CPU call")
    monkeypatch.setattr(timing, "time_cuda_events", no_events)
    t = timing.time_call(lambda: torch.ones(8) @ torch.ones(8), min_run_time=0.01,
                         min_repeats=3, device="cpu")
    assert t.repeats >= 3 and t.time_ms > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_events_time_the_gpu_work():
    dev = torch.device("cuda")
    a = torch.randn(2048, 2048, device=dev)
    small = timing.time_call(lambda: a @ a, min_run_time=0.05, min_repeats=5, device=dev)
    big = timing.time_call(lambda: [a @ a for _ in range(8)], min_run_time=0.05,
                           min_repeats=5, device=dev)
    assert small.repeats >= 5 and small.time_ms > 0
    # Eight matmuls queued take longer than one on the GPU's clock; without the
    # synchronisation and events the launch alone (microseconds) would be timed.
    assert big.time_ms > 4 * small.time_ms


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_peak_memory_counts_the_call_only():
    dev = torch.device("cuda")
    held = torch.empty(64 * 2**20, dtype=torch.uint8, device=dev)  # allocated before
    peak = memory.peak_mib(lambda: torch.empty(32 * 2**20, dtype=torch.uint8, device=dev), dev)
    assert 31 <= peak <= 40, peak
    del held


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
@pytest.mark.parametrize("argv", [["run", "--device", "cuda"], ["run", "--preset", "gpu"],
                                  ["run", "--preset", "gpu-smoke"]])
def test_asking_for_cuda_without_it_is_a_usage_error(argv, tmp_path, capsys):
    rc = run_bench.main(argv + ["--results-dir", str(tmp_path / "r"), "--run-id", "x"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "cuda" in err[0].lower(), err
    assert not (tmp_path / "r").exists()
