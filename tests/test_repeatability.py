"""`python -m harness.measure.repeatability`: the `drift` preset's dozen (here a tiny slice
of it) run twice with one round and once with rounds, through the real runner (its matmul
rate on a small matmul: tests/small_rates.py's small_matmul; nothing here reads the rate)."""

from __future__ import annotations

import csv
import re

from harness.measure import matrix as mx
from harness.measure import repeatability


def test_the_dozen_is_the_drift_preset_without_its_rounds():
    preset = mx.read_toml("drift")
    assert preset["rounds"] == 3 and "rounds" not in repeatability.MATRIX
    assert repeatability.MATRIX == {k: v for k, v in preset.items() if k != "rounds"}


def test_three_runs_and_a_line_per_case(tmp_path, capsys):
    assert repeatability.main(["--seq-len", "64", "--variants", "sdpa,linear",
                               "--min-run-time", "0.01", "--keep", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = {}
    for name in ("one-round-a", "one-round-b", "3-rounds"):
        with (tmp_path / name / "results.csv").open(newline="") as f:
            rows[name] = list(csv.DictReader(f))
    assert all(len(r) == 4 and all(x["status"] == "ok" for x in r) for r in rows.values())
    assert {x["rounds"] for x in rows["one-round-a"]} == {"1"}
    assert {x["rounds"] for x in rows["3-rounds"]} == {"3"}
    assert all(x["time_ms_spread"] != "" for x in rows["3-rounds"])
    # one printed line per case, its 3-round time and spread from the 3-round run's row
    for x in rows["3-rounds"]:
        line = next(ln for ln in out.splitlines()
                    if ln.startswith(x["variant"]) and f" {x['pass']} " in ln)
        numbers = [float(t) for t in re.findall(r"(?<![\d.%])\d+\.\d+(?![\d%])", line)]
        assert any(abs(n - float(x["time_ms"])) < 0.006 for n in numbers), line
        assert f"{float(x['time_ms_spread']):.1%}" in line
    assert "with 3 rounds: spread median" in out and "3-rounds: other work on the cores" in out
