"""The CUDA path, checked as far as a machine without a GPU allows, and on the GPU itself.

- Every registered variant runs on the `meta` device (shapes and dtypes, no data),
  causal and not, forward and backward where it supports them, and returns `meta`
  outputs and gradients: no tensor inside a variant is created on a fixed device.
- Asking for CUDA where there is none: one line, exit status 2, nothing written.
- Marked `cuda` (`python -m pytest -m cuda`; tools/gpu_check.sh runs them), skipped where
  CUDA is not available: every variant's own code on the device (the CUDA-only ones:
  xformers, FlexAttention on CUDA) against the float64 reference or its CPU self, forward
  and backward, causal and not, at a ragged length; the harness's CUDA timing (events
  after a synchronisation), memory (reset_peak_memory_stats, max_memory_allocated), the
  memory guard (mem_get_info), the caching allocator's release, and the matmul rate per
  dtype. tests/test_harness_memory.py covers the same logic on CPU with torch.cuda stubbed.
"""

import dataclasses
import sys

import pytest
import torch

import run_bench
import variants
from harness.check.kit import lacks
from harness.measure import memory
from harness.measure import timing
from harness.measure.matrix import Case
from variants import exact_reference, naive_attention

NAMES = variants.names()
NO_CUDA = "CUDA is not available on this machine"


def cuda_only(f):
    """Marked `cuda`; skipped, naming what is missing, where CUDA is not available."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)(f))


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_variant_runs_on_the_meta_device(name, causal, backward):
    m = variants.build(name)
    reasons = m.unsupported_reasons(device="meta", dtype=torch.float32, causal=causal,
                                    seq_len=300, head_dim=16, backward=backward)
    q, k, v = (torch.empty(2, 3, 300, 16, device="meta", requires_grad=backward)
               for _ in range(3))
    inputs = m.draw_inputs(2, 3, 300, 16, seed=0, device="meta")  # a recurrence's gates
    if reasons:  # declared: forward refuses with the reason, never computes something else
        with pytest.raises(ValueError) as e, torch.set_grad_enabled(backward):
            m(q, k, v, causal=causal, **inputs)
        assert reasons[0] in str(e.value)
        if lacks(reasons):
            pytest.skip(f"this machine lacks what it needs: {'; '.join(reasons)}")
        return
    with torch.set_grad_enabled(backward):
        o = m(q, k, v, causal=causal, **inputs)
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


@cuda_only
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


@cuda_only
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


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm())


@cuda_only
@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_variant_on_cuda_matches_the_reference_or_its_cpu_self(name, causal, backward):
    """Each variant's own code on the device at N = 300 (a multiple of no block size: the
    ragged-tail branches run). Exact and pattern-exact variants (xformers, FlexAttention
    and SDPA-with-mask included) against float64 attention on their pattern, outputs and
    gradients; a recurrence against its own float64 sequential form (`reference`), with
    its declared gates drawn; other approximate ones against the same module on CPU (their
    random state is drawn on CPU from the seed, so both hold the same projections and
    features)."""
    check_against_reference(torch.device("cuda"), name, causal, backward)


def check_against_reference(dev: torch.device, name: str, causal: bool, backward: bool) -> None:
    N = 300
    m = variants.build(name)
    reasons = m.unsupported_reasons(device=dev, dtype=torch.float32, causal=causal, seq_len=N,
                                    head_dim=64, backward=backward)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, N, 64, generator=g) for _ in range(3))
    qc, kc, vc = (t.detach().clone().to(dev).requires_grad_(backward) for t in (q, k, v))
    inputs = m.draw_inputs(1, 4, N, 64, seed=0)  # a recurrence's gates, drawn on CPU
    ic = {n: t.to(dev) for n, t in inputs.items()}
    if reasons:
        with pytest.raises(ValueError) as e, torch.set_grad_enabled(backward):
            m(qc, kc, vc, causal=causal, **ic)
        assert reasons[0] in str(e.value)
        if lacks(reasons):
            pytest.skip(f"this machine lacks what it needs: {'; '.join(reasons)}")
        return
    m.prepare(qc, kc, vc, causal, backward=backward)
    with torch.set_grad_enabled(backward):
        o = m(qc, kc, vc, causal=causal, **ic)
    assert o.device == qc.device and o.shape == q.shape and torch.isfinite(o).all()
    spec = variants.spec(name)
    qr, kr, vr = (t.detach().double().requires_grad_(backward) for t in (q, k, v))
    if spec.exact or spec.pattern_exact:
        mask = m.key_mask(N)
        with torch.set_grad_enabled(backward):
            ref = naive_attention(qr, kr, vr, causal, key_mask=mask)
        assert _rel(o, exact_reference(q, k, v, causal, key_mask=mask)) < 1e-4
    elif spec.err_ref != "softmax":  # a recurrence: its own float64 sequential form
        with torch.set_grad_enabled(backward):
            ref = m.reference(qr, kr, vr, causal, **{n: t.double() for n, t in inputs.items()})
    else:
        with torch.set_grad_enabled(backward):
            ref = variants.build(name)(qr.float(), kr.float(), vr.float(), causal=causal)
    assert _rel(o, ref) < 1e-3, _rel(o, ref)
    if backward:
        o.sum().backward()
        ref.sum().backward()
        for got, want in ((qc, qr), (kc, kr), (vc, vr)):
            assert _rel(got.grad, want.grad) < 1e-3, (_rel(got.grad, want.grad))


def _cuda_case(variant: str, N: int) -> Case:
    return Case(variant, "{}", "cuda", "float32", 1, 8, 64, N, False, "forward", "gaussian",
                0, 0.05, 3, 60.0, 1, 256, 0)


@cuda_only
def test_cuda_guard_reads_the_devices_free_memory():
    std = variants.build("standard")
    free_mib = memory.cuda_free_bytes() / 2**20
    huge = _cuda_case("standard", 2**20)  # scores alone: 8 heads x 4 TiB
    reason = memory.MemoryGuard().refuse_reason(huge, std)
    assert reason and "free CUDA memory" in reason, reason
    assert memory.MemoryGuard().refuse_reason(_cuda_case("standard", 1024), std) is None
    assert free_mib > 0


@cuda_only
def test_release_hands_cached_blocks_back():
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    del x
    held = torch.cuda.memory_reserved()
    assert held >= 256 * 2**20
    memory.release("cuda")
    assert torch.cuda.memory_reserved() <= held - 256 * 2**20


@cuda_only
def test_cuda_matmul_rate_in_each_dtype():
    from harness.measure import store

    cases = [_cuda_case("sdpa", 64), dataclasses.replace(_cuda_case("sdpa", 64), dtype="bfloat16")]
    rates = store.matmul_rates(cases, 1, {"cpu float32": 1.0})
    assert set(rates) == {"cpu float32", "cuda float32", "cuda bfloat16"}
    assert all(r > 0 for r in rates.values())
    # the 8192 x 8192 operands (256 MiB each in float32) were freed and handed back
    assert torch.cuda.memory_reserved() < 512 * 2**20


def _fake_xformers(monkeypatch, raises: bool) -> None:
    """A stand-in xformers package whose kernel call raises as a wheel built for another
    torch does (no CUDA operators), or runs."""
    import types

    def memory_efficient_attention(q, k, v, attn_bias=None):
        if raises:
            raise NotImplementedError("No operator found for `memory_efficient_attention_"
                                      "forward` with inputs:\n     query : shape=(1, 8, 1, 8)")
        return q

    import importlib.machinery

    pkg, ops = types.ModuleType("xformers"), types.ModuleType("xformers.ops")
    pkg.__spec__ = importlib.machinery.ModuleSpec("xformers", None)
    pkg.__version__, ops.memory_efficient_attention, pkg.ops = "0.0.0", memory_efficient_attention, ops
    monkeypatch.setitem(sys.modules, "xformers", pkg)
    monkeypatch.setitem(sys.modules, "xformers.ops", ops)


@pytest.mark.parametrize("raises", [True, False])
def test_xformers_without_kernels_for_this_torch_is_a_reason_not_an_error(monkeypatch, raises):
    """The H200 run's xformers wheel imported but had no CUDA operators: every xformers
    case was an error row. The probe turns that into the reason the case is skipped."""
    from variants.exact import exact

    _fake_xformers(monkeypatch, raises)
    why = exact.kernel_missing.__wrapped__("cpu", torch.float32)  # uncached
    if raises:
        assert why.startswith("xformers 0.0.0 failed its probe call on cpu torch.float32")
        assert "NotImplementedError: No operator found" in why and "\n" not in why
    else:
        assert why == ""


def test_any_failure_of_the_xformers_probe_is_a_reason(monkeypatch):
    """Planning a GPU run on a CPU machine with xformers installed ended in "AssertionError:
    Torch not compiled with CUDA enabled" from the probe's CUDA tensor: whatever the probe
    raises is the reason, one line, naming the exception."""
    from variants.exact import exact

    _fake_xformers(monkeypatch, raises=False)

    def no_cuda(*args, **kwargs):
        raise AssertionError("Torch not compiled with CUDA enabled")

    monkeypatch.setattr(sys.modules["xformers.ops"], "memory_efficient_attention", no_cuda)
    why = exact.kernel_missing.__wrapped__("cuda", torch.float16)
    assert "AssertionError: Torch not compiled with CUDA enabled" in why and "\n" not in why


def test_xformers_probe_runs_only_where_cuda_exists(monkeypatch):
    from variants.exact import exact

    _fake_xformers(monkeypatch, raises=True)

    def probe(device, dtype):
        raise AssertionError("the probe ran without a CUDA device")

    monkeypatch.setattr(exact, "kernel_missing", probe)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    why = exact.xformers_reasons(torch.device("cuda"), torch.float16)
    assert len(why) == 1 and why[0].startswith("no CUDA device here")


def test_xformers_reasons_ask_the_kernel_probe_on_cuda(monkeypatch):
    from variants.exact import exact

    _fake_xformers(monkeypatch, raises=True)
    monkeypatch.setattr(exact, "kernel_missing", lambda device, dtype: f"none on {device}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert exact.xformers_reasons(torch.device("cuda"), torch.float16) == ["none on cuda"]
    assert variants.build("sliding_window_xformers").unsupported_reasons(
        device="cuda", dtype=torch.float16, causal=False, seq_len=64, head_dim=8,
        backward=False) == ["none on cuda"]
