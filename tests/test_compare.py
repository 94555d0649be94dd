"""compare: planted slowdowns are flagged, noise and small changes are not, unmatched cases listed."""

from pathlib import Path

import pytest

from harness.cli.report import add_compare_args, compare_command
from harness.report.compare import compare_runs, to_markdown
from harness.errors import UsageError
from harness.report.folder import load_run
from report_synth import row, write_run

REPO = Path(__file__).resolve().parent.parent
LENGTHS = (1024, 2048)


def _base():
    return [row(v, n) for v in ("sdpa", "nystrom", "performer") for n in LENGTHS]


def _runs(tmp_path, rows_b, rows_a=None):
    a = write_run(tmp_path / "a", _base() if rows_a is None else rows_a)
    b = write_run(tmp_path / "b", rows_b)
    return a, b


def _args(*argv):
    import argparse

    p = argparse.ArgumentParser()
    add_compare_args(p)
    return p.parse_args([str(x) for x in argv])


def _flag(cmp, variant, n):
    j = cmp.joined
    return j[(j["variant"] == variant) & (j["seq_len"] == n)]["change"].item()


def test_planted_slowdown_is_flagged_noise_and_small_changes_are_not(tmp_path):
    base = {(r["variant"], r["seq_len"]): r for r in _base()}
    b = [row("sdpa", 1024, time_ms=2 * base["sdpa", 1024]["time_ms"]),          # 2x slower
         row("sdpa", 2048, time_ms=1.3 * base["sdpa", 2048]["time_ms"], iqr_frac=0.5),  # noisy
         row("nystrom", 1024, time_ms=1.05 * base["nystrom", 1024]["time_ms"], iqr_frac=0.001),
         row("nystrom", 2048, time_ms=0.4 * base["nystrom", 2048]["time_ms"]),   # 2.5x faster
         row("performer", 1024, status="oom", reason="out of memory"),          # stopped running
         row("performer", 2048)]
    a, bdir = _runs(tmp_path, b)
    cmp = compare_runs(load_run(a)[0], load_run(bdir)[0], 0.10)
    assert _flag(cmp, "sdpa", 1024) == "regression"
    assert _flag(cmp, "sdpa", 2048) == ""            # 30% slower but inside the IQRs
    assert _flag(cmp, "nystrom", 1024) == ""         # beyond the noise, under 10%
    assert _flag(cmp, "nystrom", 2048) == "improvement"
    assert _flag(cmp, "performer", 1024) == "regression (now oom)"
    assert _flag(cmp, "performer", 2048) == ""
    assert (cmp.regressions, cmp.improvements) == (2, 1)
    j = cmp.joined
    assert j[(j["variant"] == "sdpa") & (j["seq_len"] == 1024)]["time_ms b/a"].item() == \
        pytest.approx(2.0)
    md = to_markdown(cmp, "a", "b")
    assert "6 common cases; 2 regression(s), 1 improvement(s)" in md


def test_threshold_option(tmp_path):
    b = [row(v, n, time_ms=1.05 * row(v, n)["time_ms"], iqr_frac=0.001)
         for v in ("sdpa", "nystrom", "performer") for n in LENGTHS]
    quiet = [row(r["variant"], r["seq_len"], iqr_frac=0.001) for r in _base()]
    a, bdir = _runs(tmp_path, b, quiet)
    assert compare_command(_args(a, bdir, "--fail-on-regression")) == 0
    assert compare_command(_args(a, bdir, "--threshold", "2%", "--fail-on-regression")) == 1
    assert compare_command(_args(a, bdir, "--threshold", "0.02")) == 0  # no flag: exit 0
    with pytest.raises(UsageError, match="threshold"):
        compare_command(_args(a, bdir, "--threshold", "ten"))


def test_cases_in_one_run_only_are_listed(tmp_path, capsys):
    b = [r for r in _base() if r["variant"] != "performer"] + [row("sdpa", 4096)]
    a, bdir = _runs(tmp_path, b)
    out_file = tmp_path / "cmp.md"
    assert compare_command(_args(a, bdir, "--output", out_file)) == 0
    out = capsys.readouterr().out
    assert out == out_file.read_text()
    only_a = out[out.index("## Only in a"):out.index("## Only in b")]
    only_b = out[out.index("## Only in b"):]
    assert only_a.count("performer(features=128, redraw=false)") == 2
    assert "4096" in only_b and "sdpa" in only_b


def test_params_distinguish_cases(tmp_path):
    b = [r | {"params": '{"landmarks": 32}'} if r["variant"] == "nystrom" else r
         for r in _base()]
    a, bdir = _runs(tmp_path, b)
    cmp = compare_runs(load_run(a)[0], load_run(bdir)[0])
    assert len(cmp.joined) == 4 and len(cmp.only_a) == 2 and len(cmp.only_b) == 2


def test_no_common_case_is_a_usage_error(tmp_path):
    a, bdir = _runs(tmp_path, [row("sdpa", 8192)])
    with pytest.raises(UsageError, match="no case in common"):
        compare_command(_args(a, bdir))


def test_cli_exit_codes(tmp_path, capsys):
    """Through run_bench.main, the path `python run_bench.py compare` takes."""
    import run_bench

    slow = [row(r["variant"], r["seq_len"], time_ms=3 * r["time_ms"]) for r in _base()]
    a, bdir = (str(p) for p in _runs(tmp_path, slow))
    assert run_bench.main(["compare", a, bdir, "--fail-on-regression"]) == 1
    assert "6 regression(s)" in capsys.readouterr().out
    assert run_bench.main(["compare", a, bdir]) == 0
    assert run_bench.main(["compare", bdir, a, "--fail-on-regression"]) == 0  # improvements
    assert run_bench.main(["compare", a, bdir, "--threshold", "-5"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
