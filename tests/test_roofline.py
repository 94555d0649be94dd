"""harness.measure.roofline: the achieved rate is the analytic FLOPs (3x for forward+backward)
over the measured time, set against the matmul rate; declared skips are reported, not run."""

import pytest

import variants
from harness.measure import roofline


def test_rate_is_analytic_flops_over_time_against_matmul():
    r = roofline.measure("linear", 1, 2, 128, 16, causal=True, backward=True,
                         min_run_time=0.01)
    flops = variants.build("linear").flops(1, 2, 128, 16, True)
    assert r["gflops"] * r["time_ms"] * 1e6 == pytest.approx(3 * flops)
    assert r["fraction"] == pytest.approx(r["gflops"] / r["matmul_gflops"])
    assert r["matmul_gflops"] > 0


def test_declared_unsupported_case_is_skipped_with_its_reason():
    r = roofline.measure("linformer", 1, 2, 128, 16, causal=True, backward=False,
                         min_run_time=0.01)
    assert "non-causal only" in r["skipped"] and "time_ms" not in r


def test_cli_rejects_an_unknown_variant(capsys):
    with pytest.raises(SystemExit) as e:
        roofline.main(["--variants", "nystorm"])
    assert e.value.code == 2 and "nystorm" in capsys.readouterr().err
