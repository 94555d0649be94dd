"""The runner end to end on real small cases: every status becomes a row and the run goes
on; memory and error columns mean what they say; a killed run resumes without loss or
duplication."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.measure import matrix as mx
from harness.measure import runner
from harness.measure.store import RunStore
from harness.measure.worker import EXTRA_ENV, import_extra

REPO = Path(__file__).resolve().parent.parent
PREPARE_CALL_S = 0.3  # one call of _test_prepares
FAKES = str(REPO / "tests" / "harness_fakes.py")
import_extra(FAKES)


def _rows(folder: Path) -> list[dict]:
    with (folder / "results.csv").open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory):
    """One run over groups that each force one outcome (sharing worker start-ups)."""
    base = {"batch": 1, "head_dim": 32, "min_run_time_s": 0.02, "min_repeats": 3,
            "timeout_s": 60, "inputs": ["gaussian"], "passes": ["forward"]}
    groups = [
        {"variants": ["standard", "sdpa"], "seq_lens": [2048], "heads": 2},
        {"variants": ["_test_raises", "_test_nan"], "seq_lens": [64]},
        {"variants": {"_test_sleeps": [{"seconds": 60.0}]}, "seq_lens": [64, 128], "timeout_s": 3},
        # out of memory at 2048 under a 48 MiB cap: 4096 is not tried
        {"variants": ["standard"], "seq_lens": [2048, 4096], "heads": 8, "mem_limit_mib": 48},
        {"variants": ["sdpa"], "seq_lens": [256], "inputs": ["sharp"]},
        {"variants": {"nystrom": [{"num_landmarks": 8}]}, "seq_lens": [256], "inputs": ["sharp"]},
        {"variants": ["nystrom"], "seq_lens": [256], "causal": [True]},
        # a causal case through the worker: its error is against the causal reference
        {"variants": ["sdpa", "sliding_window"], "seq_lens": [256], "causal": [True]},
        {"variants": {"_test_prepares": [{"seconds": PREPARE_CALL_S}]}, "seq_lens": [64]},
    ]
    m = mx.normalise({**base, "groups": groups})
    cases = mx.expand(m)
    store = RunStore(tmp_path_factory.mktemp("run") / "mixed")
    os.environ[EXTRA_ENV] = FAKES
    try:
        counts = runner.run(m, cases, store, resume=False)
    finally:
        del os.environ[EXTRA_ENV]
    rows = _rows(store.folder)
    assert len(rows) == len(cases) == sum(counts.values())
    return {(r["variant"], r["seq_len"], r["input"], r["heads"], r["causal"]): r for r in rows}


def test_failures_become_rows(mixed_run):
    err = mixed_run[("_test_raises", "64", "gaussian", "4", "False")]
    assert err["status"] == "error" and "deliberate failure in _test_raises" in err["reason"]
    nan = mixed_run[("_test_nan", "64", "gaussian", "4", "False")]
    assert nan["status"] == "nonfinite" and nan["time_ms"] == ""
    slow = mixed_run[("_test_sleeps", "64", "gaussian", "4", "False")]
    assert slow["status"] == "timeout" and "timeout_s=3" in slow["reason"]
    longer = mixed_run[("_test_sleeps", "128", "gaussian", "4", "False")]
    assert longer["status"] == "skipped" and "timed out at N=64" in longer["reason"]
    oom = mixed_run[("standard", "2048", "gaussian", "8", "False")]
    assert oom["status"] == "oom", oom["reason"]
    after_oom = mixed_run[("standard", "4096", "gaussian", "8", "False")]
    assert after_oom["status"] == "skipped", after_oom
    assert "ran out of memory at N=2048; longer skipped" in after_oom["reason"]
    # the run went on after each of them
    assert mixed_run[("sdpa", "256", "sharp", "4", "False")]["status"] == "ok"


def test_memory_of_standard_vs_sdpa(mixed_run):
    std = float(mixed_run[("standard", "2048", "gaussian", "2", "False")]["peak_mem_mib"])
    fused = float(mixed_run[("sdpa", "2048", "gaussian", "2", "False")]["peak_mem_mib"])
    # the N x N matrix is 16 MiB per head in float32; standard holds scores and probabilities
    assert std >= 2 * 16 * 1.5, std
    assert fused < std / 8, (fused, std)


def test_error_columns(mixed_run):
    sdpa = mixed_run[("sdpa", "256", "sharp", "4", "False")]
    assert float(sdpa["rel_err"]) < 1e-5 and int(sdpa["err_rows"]) == 256
    ny = mixed_run[("nystrom", "256", "sharp", "4", "False")]
    assert float(ny["rel_err"]) > 1e-2 > 100 * float(sdpa["rel_err"])
    causal = mixed_run[("nystrom", "256", "gaussian", "4", "True")]
    assert causal["status"] == "skipped" and "non-causal" in causal["reason"]


def test_causal_error_is_against_the_causal_reference(mixed_run):
    """Against a non-causal reference, a causal output's error is of order one."""
    for variant in ("sdpa", "sliding_window"):
        r = mixed_run[(variant, "256", "gaussian", "4", "True")]
        assert r["status"] == "ok", r
        assert float(r["rel_err"]) < 1e-5 and float(r["row_cos"]) > 1 - 1e-6, r
    # sliding_window(256) covers every pair at N = 256: the run records it as exact there
    assert mixed_run[("sliding_window", "256", "gaussian", "4", "True")]["exact"] == "True"
    assert mixed_run[("sdpa", "256", "gaussian", "4", "True")]["exact"] == "True"
    assert mixed_run[("nystrom", "256", "sharp", "4", "False")]["exact"] == "False"


def test_compile_ms_leaves_out_the_call_prepare_makes(mixed_run):
    """_test_prepares' prepare is one call and nothing else: its one-time cost is ~0, not
    the call's PREPARE_CALL_S."""
    r = mixed_run[("_test_prepares", "64", "gaussian", "4", "False")]
    assert r["status"] == "ok", r
    assert float(r["time_ms"]) >= PREPARE_CALL_S * 1e3
    assert float(r["compile_ms"]) < 0.5 * PREPARE_CALL_S * 1e3, r


def test_state_is_measured_apart_from_the_call(mixed_run):
    """sdpa keeps nothing between calls; its state reads ~0 (allocator noise)."""
    for key in (("sdpa", "2048", "gaussian", "2", "False"), ("sdpa", "256", "sharp", "4", "False")):
        assert 0 <= float(mixed_run[key]["state_mib"]) < 2, mixed_run[key]


def test_killed_run_resumes_without_loss_or_duplication(tmp_path):
    cfg = tmp_path / "m.toml"
    cfg.write_text('variants = ["sdpa"]\nseq_lens = [64, 256]\nheads = 1\n'
                   'inputs = ["gaussian", "sharp", "local"]\npasses = ["forward", "forward_backward"]\n'
                   "min_run_time_s = 0.02\nmin_repeats = 3\n")
    # --no-report: the rerun's report (plots: seconds) is not what this test reads
    cmd = [sys.executable, "run_bench.py", "run", "--config", str(cfg), "--results-dir",
           str(tmp_path), "--run-id", "r", "--no-report"]
    folder = tmp_path / "r"
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if (folder / "results.csv").exists() and len(_rows(folder)) >= 3:
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = _rows(folder)
    assert 3 <= len(before) < 12
    with (folder / "results.csv").open("a") as f:
        f.write("deadbeef,sdpa,exa")  # a row cut off mid-write
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "done earlier" in r.stdout
    after = _rows(folder)
    ids = [row["case_id"] for row in after]
    assert len(after) == 12 and len(set(ids)) == 12
    assert after[:len(before)] == before


def test_resume_refuses_another_matrix_and_a_foreign_folder(tmp_path):
    from harness.errors import UsageError
    a = mx.normalise({"variants": ["sdpa"], "seq_lens": [64]})
    b = mx.normalise({"variants": ["sdpa"], "seq_lens": [128]})
    store = RunStore(tmp_path / "run")
    store.write_meta({"matrix": a})
    assert store.check(a) is True
    with pytest.raises(UsageError, match="different matrix"):
        store.check(b)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="not an attnbench run"):
        RunStore(tmp_path / "other").check(a)


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="CUDA is not available")
def test_cuda_cases_measure_time_memory_and_error(tmp_path):
    m = mx.normalise({"variants": ["standard", "sdpa"], "seq_lens": [1024], "devices": ["cuda"],
                      "dtypes": ["float16", "float32"], "passes": ["forward", "forward_backward"],
                      "min_run_time_s": 0.05, "min_repeats": 3})
    cases = mx.expand(m)
    store = RunStore(tmp_path / "gpu")
    counts = runner.run(m, cases, store, resume=False)
    assert counts["ok"] == len(cases), _rows(store.folder)
    for r in _rows(store.folder):
        assert float(r["peak_mem_mib"]) > 0 and float(r["time_ms"]) > 0
        assert float(r["rel_err"]) < (1e-2 if r["dtype"] == "float16" else 1e-4)


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="CUDA is not available")
def test_cuda_run_keeps_state_stops_after_oom_and_rates_each_dtype(tmp_path):
    m = mx.normalise({"variants": {"sliding_window_sdpa_mask": [{}], "sdpa": [{}],
                                   "_test_hogs": [{}]},
                      "seq_lens": [4096, 8192], "devices": ["cuda"], "heads": 2,
                      "dtypes": ["float32", "bfloat16"], "min_run_time_s": 0.02,
                      "min_repeats": 3})
    store = RunStore(tmp_path / "gpu")
    os.environ[EXTRA_ENV] = FAKES
    try:
        runner.run(m, mx.expand(m), store, resume=False)
    finally:
        del os.environ[EXTRA_ENV]
    rows = {(r["variant"], r["seq_len"], r["dtype"]): r for r in _rows(store.folder)}
    for dtype in ("float32", "bfloat16"):
        assert rows[("_test_hogs", "4096", dtype)]["status"] == "oom"
        later = rows[("_test_hogs", "8192", dtype)]
        assert later["status"] == "skipped" and "ran out of memory at N=4096" in later["reason"]
        for n in (4096, 8192):
            mask = rows[("sliding_window_sdpa_mask", str(n), dtype)]
            assert mask["status"] == "ok", mask
            assert abs(float(mask["state_mib"]) - n * n / 2**20) < 2, mask  # the bool mask
            sdpa = rows[("sdpa", str(n), dtype)]
            assert sdpa["status"] == "ok" and float(sdpa["state_mib"]) < 2, sdpa
            assert sdpa["exact"] == "True" and mask["exact"] == "False"
    rates = store.read_meta()["matmul_gflops"]
    assert rates["cuda float32"] > 0 and rates["cuda bfloat16"] > 0
