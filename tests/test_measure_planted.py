"""The measuring modules against references they do not share: float64 dense attention
written out here, hand-computed values, and variants whose memory is known by construction.

Each test names the planted bug it catches (issue 25, item 5: bugs planted one at a time
in a copy of main, the relevant test files run against each):
- the error's reference, or the comparison, in float32 (accuracy.py, reference.py);
- rel_err normalised by ||o|| or per row; max_abs_err as a mean; row_cos over the wrong
  axis; the sampled rows not applied to o; the causal flag dropped; layer_rel_err sliced
  layer-minor (accuracy.py);
- the median as mean or min, the IQR not the quartiles' distance, the warm-up timed or
  skipped, fewer repeats than asked (timing.py);
- the seed ignored, q, k, v from one draw, `sharp` not q scaled by 4, `local` not local
  (inputs.py);
- VmHWM not reset, the peak not above the resident size before the call, the worker's
  malloc settings dropped, the kept state added into the peak (memory.py, runner.py,
  worker.py);
- forward_backward FLOPs not three forwards, GFLOP/s in the wrong unit (runner.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import variants
from harness.measure import accuracy, timing
from harness.measure.inputs import make_inputs
from harness.measure.matrix import Case
from harness.measure.memory import MALLOC_ENV
from harness.measure.worker import EXTRA_ENV

REPO = Path(__file__).resolve().parent.parent
FAKES = str(REPO / "tests" / "measure_fakes.py")


def dense64(q, k, v, causal=False):
    """softmax(q k^T / sqrt(D)) v in float64, the N x N matrix materialised (small N only)."""
    q, k, v = q.double(), k.double(), v.double()
    N, D = q.shape[-2:]
    s = q @ k.transpose(-1, -2) / math.sqrt(D)
    if causal:
        s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def qkv32(N=200, B=1, H=2, D=16, dist="sharp", seed=0):
    return make_inputs(dist, B, H, N, D, seed=seed)  # float32


# -- error: the reference is float64 ----------------------------------------------------

def test_reference_of_float32_inputs_is_float64_arithmetic():
    """exact_reference on float32 q, k, v equals float64 attention on the same values to
    float64 rounding, not float32's (a reference computed in float32 is ~1e-7 off)."""
    q, k, v = qkv32()
    for causal in (False, True):
        ref = variants.exact_reference(q, k, v, causal)
        assert ref.dtype == torch.float64
        want = dense64(q, k, v, causal)
        assert float((ref - want).norm() / want.norm()) < 1e-13


def test_error_of_the_float64_answer_is_zero_to_float64_rounding():
    """An output that is the float64 answer has rel_err ~1e-16: every rel_err would
    otherwise carry the reference's (or the comparison's) float32 rounding."""
    q, k, v = qkv32()
    for causal in (False, True):
        err = accuracy.error(dense64(q, k, v, causal), q, k, v, causal)
        assert err.rel_err < 1e-13 and err.max_abs_err < 1e-13, err
        assert abs(err.row_cos - 1) < 1e-13, err


def test_error_of_the_answer_rounded_to_float32_is_that_rounding():
    """o = the float64 answer rounded to float32: rel_err is ||o - ref|| / ||ref|| in
    float64, ~2^-25, neither 0 (compared in float32) nor 1e-7 (a float32 reference)."""
    q, k, v = qkv32()
    ref = dense64(q, k, v)
    o = ref.float()
    want = float((o.double() - ref).norm() / ref.norm())
    assert 1e-9 < want < 1e-7
    err = accuracy.error(o, q, k, v, False)
    assert err.rel_err == pytest.approx(want, rel=1e-6)
    assert err.max_abs_err == pytest.approx(float((o.double() - ref).abs().max()), rel=1e-6)


# -- error: the definitions of the columns -----------------------------------------------

def test_rel_err_is_the_frobenius_norm_over_the_references():
    q, k, v = qkv32(N=64)
    ref = dense64(q, k, v)
    err = accuracy.error(2 * ref, q, k, v, False)  # ||2r - r|| / ||r|| = 1, not 1/2
    assert err.rel_err == pytest.approx(1.0, abs=1e-12)
    assert err.max_abs_err == pytest.approx(float(ref.abs().max()), abs=1e-12)
    # an error in one row only: the whole output's Frobenius norm, not a mean over rows
    o = ref.clone()
    o[0, 1, 5] += 0.5
    err = accuracy.error(o, q, k, v, False)
    assert err.rel_err == pytest.approx(0.5 * math.sqrt(16) / float(ref.norm()), rel=1e-9)
    assert err.max_abs_err == pytest.approx(0.5, abs=1e-12)  # the largest, not the mean


def test_row_cos_is_the_mean_cosine_of_output_rows():
    """Rows scaled by different positive factors point the right way: row_cos = 1; one
    row of the 2 x 64 negated: (127 - 1) / 128. Over the wrong axis neither holds."""
    q, k, v = qkv32(N=64)
    ref = dense64(q, k, v)
    scale = torch.rand(1, 2, 64, 1, generator=torch.Generator().manual_seed(1)) * 3 + 0.1
    err = accuracy.error(ref * scale, q, k, v, False)
    assert err.row_cos == pytest.approx(1.0, abs=1e-12)
    o = ref.clone()
    o[0, 0, 7] *= -1
    assert accuracy.error(o, q, k, v, False).row_cos == pytest.approx(126 / 128, abs=1e-12)


def test_sampled_rows_compare_the_same_rows_of_o_and_the_reference():
    """N = 300 > max_rows = 64: an error in a row outside the sample is not seen, one in a
    sampled row is, and an exact output reads 0 (o's rows taken at the sampled indices)."""
    q, k, v = qkv32(N=300)
    ref = dense64(q, k, v)
    rows = accuracy.sample_rows(300, 64, seed=3)
    assert len(rows) == 64 and len(set(rows.tolist())) == 64
    assert rows.tolist() == sorted(rows.tolist()) and 0 <= int(rows.min()) < int(rows.max()) < 300
    assert not torch.equal(rows, accuracy.sample_rows(300, 64, seed=4))
    assert accuracy.sample_rows(64, 64, seed=3) is None  # all rows when N <= max_rows
    exact = accuracy.error(ref, q, k, v, False, max_rows=64, seed=3)
    assert exact.err_rows == 64 and exact.rel_err < 1e-13
    outside = int(next(i for i in range(300) if i not in set(rows.tolist())))
    o = ref.clone()
    o[:, :, outside] += 1.0
    assert accuracy.error(o, q, k, v, False, max_rows=64, seed=3).rel_err < 1e-13
    o = ref.clone()
    o[:, :, int(rows[5])] += 1.0
    want = math.sqrt(2 * 16) / float(ref[:, :, rows].norm())
    assert accuracy.error(o, q, k, v, False, max_rows=64, seed=3).rel_err == pytest.approx(
        want, rel=1e-9)


def test_causal_error_is_against_the_causal_answer():
    q, k, v = qkv32(N=64)
    o = dense64(q, k, v, causal=True)
    assert accuracy.error(o, q, k, v, True).rel_err < 1e-13
    assert accuracy.error(o, q, k, v, False).rel_err > 0.1


def test_layer_rel_err_is_per_layer_of_a_layer_major_batch():
    """batch = 2 layers x 3 windows, layer-major: an error in layer 1's windows only."""
    q, k, v = qkv32(N=32, B=6)
    ref = dense64(q, k, v)
    o = ref.clone()
    o[3:] *= 1.5
    err = accuracy.error(o, q, k, v, False, layers=2)
    assert err.layer_rel_err[0] < 1e-13
    assert err.layer_rel_err[1] == pytest.approx(0.5, abs=1e-12)


# -- timing: median and IQR of per-call times, warm-up untimed -----------------------------

def test_summarise_is_the_median_and_interquartile_range():
    """Against numpy's percentiles (linear interpolation between order statistics)."""
    for times_ms in ([5.0, 1.0, 4.0, 2.0, 100.0], [3.0, 1.0, 2.0, 10.0, 7.0, 4.0],
                     [2.0, 2.0], [7.0]):
        t = timing.summarise([x / 1e3 for x in times_ms])
        p25, p50, p75 = np.percentile(times_ms, [25, 50, 75])
        assert t.time_ms == pytest.approx(p50) and t.time_ms_iqr == pytest.approx(p75 - p25)
        assert t.repeats == len(times_ms) and t.samples_ms == pytest.approx(sorted(times_ms))
    t = timing.summarise([x / 1e3 for x in (5.0, 1.0, 4.0, 2.0, 100.0)])
    assert (t.time_ms, t.time_ms_iqr) == pytest.approx((4.0, 3.0))  # not mean 22.4, not min 1


class _Clock:
    """A fake perf_counter; each call of `fn` advances it by the next scripted duration."""

    def __init__(self, durations_s):
        self.now, self.durations, self.calls = 100.0, list(durations_s), 0

    def perf_counter(self):
        return self.now

    def fn(self):
        self.now += self.durations[self.calls]
        self.calls += 1


def test_time_call_times_calls_after_the_warm_up_only(monkeypatch):
    """A slow case (call_s known) is timed call by call: with warmup = 1 the first call
    (1 s here, a lazy initialisation) is run and left out; the next min_repeats calls are
    the samples, exactly."""
    clock = _Clock([1.0, 0.001, 0.005, 0.002, 0.004, 0.003, 9.0])
    monkeypatch.setattr(timing, "time", clock)
    t = timing.time_call(clock.fn, min_run_time=0.1, min_repeats=5, warmup=1, call_s=1.0)
    assert clock.calls == 6
    assert t.samples_ms == pytest.approx((1.0, 2.0, 3.0, 4.0, 5.0))
    assert (t.time_ms, t.time_ms_iqr, t.repeats) == pytest.approx((3.0, 2.0, 5))


def test_time_call_by_autorange_gives_per_call_times_and_enough_of_them():
    """Timer's path: each sample is one call's time (a call that sleeps 2 ms gives no
    sample below that), at least min_repeats of them, after the warm-up."""
    import time as real_time

    calls = []

    def fn():
        calls.append(1)
        real_time.sleep(0.002)

    t = timing.time_call(fn, min_run_time=0.03, min_repeats=7, warmup=2)
    assert t.repeats == len(t.samples_ms) >= 7
    assert min(t.samples_ms) >= 2.0 and t.time_ms >= 2.0
    assert len(calls) >= 2 + 7
    # A microsecond call: Timer runs it in blocks of hundreds; a sample is a block's time
    # over its calls. Calls made x the median per-call time cannot exceed the wall time
    # spent (a block's total taken as one call's would, by the block size).
    xs = list(range(200))
    calls.clear()

    def fast():
        calls.append(1)
        sum(xs)

    start = real_time.perf_counter()
    t = timing.time_call(fast, min_run_time=0.1, min_repeats=1, warmup=1)  # Timer's blocks only
    wall_ms = (real_time.perf_counter() - start) * 1e3
    assert len(calls) > 100 and len(calls) * t.time_ms <= 2 * wall_ms, (len(calls), t, wall_ms)


# -- inputs: seeded, distinct, each distribution what it says -------------------------------

@pytest.mark.parametrize("dist", ["gaussian", "sharp", "local"])
def test_inputs_are_seeded_and_q_k_v_are_distinct_draws(dist):
    a = make_inputs(dist, 2, 2, 64, 16, seed=5)
    b = make_inputs(dist, 2, 2, 64, 16, seed=5)
    c = make_inputs(dist, 2, 2, 64, 16, seed=6)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(not torch.equal(x, y) for x, y in zip(a, c))
    q, k, v = a
    assert not torch.equal(q, k) and not torch.equal(k, v) and not torch.equal(q, v)
    assert not torch.equal(v[0], v[1]) and not torch.equal(v[:, 0], v[:, 1])  # per batch, head
    # the noise of v is independent of q's and k's: correlation near 0
    corr = torch.corrcoef(torch.stack([q.flatten(), k.flatten(), v.flatten()]))
    assert float(corr[0, 2].abs()) < 0.1 and float(corr[1, 2].abs()) < 0.1


def test_gaussian_is_standard_normal_and_sharp_scales_its_q_by_4():
    g = make_inputs("gaussian", 1, 4, 1024, 64, seed=2)
    s = make_inputs("sharp", 1, 4, 1024, 64, seed=2)
    for t in g:
        assert abs(float(t.mean())) < 0.02 and abs(float(t.std()) - 1) < 0.02
    assert torch.equal(s[0], 4 * g[0]) and torch.equal(s[1], g[1]) and torch.equal(s[2], g[2])
    scores = (s[0].double() @ s[1].double().mT / 8).flatten()  # q.k / sqrt(D) ~ N(0, 16)
    assert abs(float(scores.std()) - 4) < 0.2


def _weight_within(q, k, width):
    """Mean exact-attention weight on keys within `width` of the query (float64, dense)."""
    N, D = q.shape[-2:]
    p = torch.softmax(q.double() @ k.double().mT / math.sqrt(D), dim=-1)
    near = (torch.arange(N)[:, None] - torch.arange(N)[None, :]).abs() <= width
    return float((p * near).sum(-1).mean())


def test_local_attention_is_local_and_gaussian_is_not():
    """The docstring's figure (weight within 64 tokens 0.9999 at N = 4096, D = 64), here
    at N = 2048; N(0, 1) inputs put about 129 / N of the weight there."""
    q, k, _ = make_inputs("local", 1, 2, 2048, 64, seed=0)
    assert _weight_within(q, k, 64) > 0.999
    q, k, _ = make_inputs("gaussian", 1, 2, 2048, 64, seed=0)
    assert _weight_within(q, k, 64) < 0.15


def test_inputs_in_another_dtype_are_the_float32_draw_cast():
    f32 = make_inputs("local", 1, 2, 64, 16, seed=1)
    bf = make_inputs("local", 1, 2, 64, 16, dtype=torch.bfloat16, seed=1)
    assert all(b.dtype == torch.bfloat16 and torch.equal(b, a.bfloat16()) for a, b in zip(f32, bf))


# -- memory: the probe, and the memory worker on a variant of known memory -----------------

_PROBE = r"""
import json, torch
from harness.measure.memory import peak_cpu_mib
MIB = 2**18  # float32 elements
def big():  # 200 MiB, freed: the high-water mark must not carry over to the next reading
    t = torch.ones(200 * MIB)
    del t
def small():
    t = torch.ones(20 * MIB)
    del t
def returns():  # 50 MiB alive when the call returns: part of its peak
    return torch.ones(50 * MIB)
print(json.dumps([peak_cpu_mib(big), peak_cpu_mib(small), peak_cpu_mib(returns)]))
"""


def test_probe_resets_the_high_water_mark_and_counts_from_before_the_call():
    env = {**os.environ, **MALLOC_ENV, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", _PROBE], env=env, cwd=REPO, capture_output=True,
                       text=True, timeout=120, check=True)
    big, small, returns = json.loads(r.stdout.strip().splitlines()[-1])
    assert abs(big - 200) < 8, big
    assert abs(small - 20) < 4, small  # not ~200: VmHWM was reset before the call
    assert abs(returns - 50) < 4, returns  # above VmRSS before the call, not after it
    # MiB of 2^20 bytes (VmHWM is in KiB): measured 50.004; KiB / 1000 would read 51.2
    assert abs(returns - 50) < 0.6, returns


def _known(state_mib=0, temp_mib=16, how="one"):
    params = json.dumps({"how": how, "state_mib": state_mib, "temp_mib": temp_mib},
                        sort_keys=True)
    return Case("_known_memory", params, "cpu", "float32", 1, 1, 64, 64, False, "forward",
                "gaussian", 0, 0.02, 3, 120.0, 1, 64, 0)


@pytest.fixture(scope="module")
def known_memory(tmp_path_factory):
    """The memory worker (as the runner starts it) on cases whose answers are their
    parameters, one after the other in the same process, the largest first."""
    from harness.measure.processes import Worker

    cases = {"big": _known(temp_mib=256), "state": _known(state_mib=48, temp_mib=16),
             "sequential": _known(temp_mib=20, how="sequential"),
             "pieces": _known(temp_mib=100, how="pieces")}
    old = os.environ.get(EXTRA_ENV)
    os.environ[EXTRA_ENV] = FAKES
    try:
        worker = Worker("memory", tmp_path_factory.mktemp("mem") / "worker.log", threads=1)
    finally:
        if old is None:
            del os.environ[EXTRA_ENV]
        else:
            os.environ[EXTRA_ENV] = old
    try:
        got = {name: worker.run(case, timeout_s=120) for name, case in cases.items()}
    finally:
        worker.close()
    for r in got.values():
        assert r["status"] == "ok", r
    return got


def test_kept_state_is_state_not_peak(known_memory):
    """48 MiB kept from the first call on, 16 MiB per call: state_mib 48, peak_mem_mib 16
    (the state is not the call's: it was resident before the call began)."""
    r = known_memory["state"]
    assert abs(r["state_mib"] - 48) < 4, r
    assert abs(r["peak_mem_mib"] - 16) < 4, r


def test_each_case_peak_is_its_own_after_a_larger_one(known_memory):
    assert abs(known_memory["big"]["peak_mem_mib"] - 256) < 10, known_memory["big"]
    assert known_memory["big"]["state_mib"] < 4, known_memory["big"]
    assert abs(known_memory["state"]["peak_mem_mib"] - 16) < 4  # not the 256 MiB before it


def test_the_memory_worker_reads_chunked_code(known_memory):
    """docs/measurement.md's two cases, through the worker the runner starts: without its
    malloc settings ten sequential 20 MiB temporaries read ~0 and 100 MiB in 0.5 MiB
    pieces 3-8 MiB."""
    assert abs(known_memory["sequential"]["peak_mem_mib"] - 20) < 4, known_memory["sequential"]
    assert abs(known_memory["pieces"]["peak_mem_mib"] - 100) < 6, known_memory["pieces"]


# -- the row's descriptive columns --------------------------------------------------------

def test_forward_backward_flops_are_three_forwards():
    """docs/results.md: `forward_backward` rows count 3x the forward's FLOPs (the
    backward as two matmuls per forward matmul); the forward is the analytic count, for
    `standard` 2 x 2 N^2 D per head (q k^T, then p v)."""
    from harness.measure.rows import case_row

    base = dataclasses.replace(_known(), variant="standard", params="{}", seq_len=128)
    module = variants.build("standard")
    fwd = case_row(base, module)["flops"]
    assert fwd == module.flops(1, 1, 128, 64, False) == 2 * (2 * 128 * 128 * 64)
    bwd = case_row(dataclasses.replace(base, pass_="forward_backward"), module)["flops"]
    assert bwd == 3 * fwd


# -- the time worker: the error of the case's own inputs ---------------------------------

def test_the_time_worker_measures_the_error_of_the_cases_own_inputs(tmp_path):
    """The time worker's rel_err, max_abs_err and row_cos for nystrom (float32) equal those
    computed here from the case's distribution, seed and causal flag against dense float64
    attention; two seeds give two errors (the case's inputs, not one fixed draw)."""
    from harness.measure.processes import Worker

    base = Case("nystrom", json.dumps({"num_landmarks": 8, "pinv_iterations": 6}),
                "cpu", "float32", 1, 2, 16, 96, False, "forward", "sharp", 1, 0.02, 3,
                120.0, 1, 96, 0)
    cases = [base, dataclasses.replace(base, seed=2), dataclasses.replace(base, input="local")]
    worker = Worker("time", tmp_path / "worker.log", threads=1)
    try:
        got = [worker.run(c, timeout_s=120) for c in cases]
    finally:
        worker.close()
    for case, r in zip(cases, got):
        assert r["status"] == "ok", r
        q, k, v = make_inputs(case.input, 1, 2, 96, 16, seed=case.seed)
        o = variants.build("nystrom", num_landmarks=8)(q, k, v).double()
        ref = dense64(q, k, v)
        assert r["rel_err"] == pytest.approx(float((o - ref).norm() / ref.norm()), rel=1e-5)
        assert r["max_abs_err"] == pytest.approx(float((o - ref).abs().max()), rel=1e-5)
        cos = torch.nn.functional.cosine_similarity(o, ref, dim=-1).mean()
        assert r["row_cos"] == pytest.approx(float(cos), abs=1e-6)
        assert r["err_rows"] == 96 and r["time_ms"] > 0 and r["repeats"] >= 3
    assert len({r["rel_err"] for r in got}) == 3


# -- the store: what counts as done --------------------------------------------------------

def test_every_row_counts_as_done_whatever_its_status_and_a_cut_row_does_not(tmp_path):
    """docs/results.md's resume rule: a case with a row (ok, skipped, oom, error, ...) is
    not measured again; a row cut off mid-write is not a row."""
    from harness.measure.store import RunStore

    store = RunStore(tmp_path / "run")
    store.folder.mkdir()
    store.open()
    for i, status in enumerate(("ok", "skipped", "oom", "timeout", "error", "nonfinite")):
        store.append({"case_id": f"c{i}", "variant": "sdpa", "status": status})
    store.close()
    with store.csv_path.open("a") as f:
        f.write("c9,sdpa,o")  # a partial last line
    assert store.done_ids() == {f"c{i}" for i in range(6)}
