"""Timing in rounds (`rounds` / `--rounds R`): round 1 of every case, then round 2 of every
case, ... in the matrix's order; memory and error once; the row when the last round ends,
with time_ms over all rounds' samples, `rounds` and `time_ms_spread`; a run killed in
round 2 keeps round 1; a later round that fails makes the row that failure; shards do
their rounds over their own cases (tests/test_sharded.py: its matrix has rounds = 2)."""

from __future__ import annotations

import csv
import json
import re
import statistics
from pathlib import Path

import pytest

import run_bench
from harness.errors import UsageError
from harness.measure import matrix as mx
from harness.measure import loop
from harness.measure.store import RunStore
from harness.measure.worker import EXTRA_ENV, import_extra

REPO = Path(__file__).resolve().parent.parent
FAKES = str(REPO / "tests" / "harness_fakes.py")
import_extra(FAKES)

TINY = ('variants = ["sdpa", "linear", "xformers"]\nseq_lens = [64, 128]\nheads = 1\n'
        'head_dim = 16\npasses = ["forward"]\nmin_run_time_s = 0.03\nmin_repeats = 3\n')
_PART = re.compile(r"^--- \S+ (\w+) ([0-9a-f]{16}) ", re.M)


def _rows(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _parts(log: Path, start: int = 0) -> list[tuple[str, str]]:
    """(part, case id) of each request in a worker log, from byte `start` on."""
    return _PART.findall(log.read_text()[start:])


def _records(path: Path) -> list[dict]:
    data = path.read_bytes()
    return [json.loads(line) for line in data[:data.rfind(b"\n") + 1].splitlines()]


@pytest.fixture(scope="module")
def three_rounds(tmp_path_factory):
    d = tmp_path_factory.mktemp("rounds")
    cfg = d / "tiny.toml"
    cfg.write_text(TINY)
    assert run_bench.main(["run", "--config", str(cfg), "--results-dir", str(d), "--run-id",
                           "r", "--rounds", "3"]) == 0
    return d / "r", mx.load(str(cfg), {"rounds": 3})[1]


def test_rounds_go_over_every_case_in_matrix_order(three_rounds):
    folder, cases = three_rounds
    rows = _rows(folder / "results.csv")
    assert [r["case_id"] for r in rows] == [c.case_id for c in cases]
    ok = [r["case_id"] for r in rows if r["status"] == "ok"]
    assert len(ok) == 4  # xformers: declared skipped (no CPU kernel), no rounds
    parts = _parts(folder / "worker.log")
    # memory and error (the `time` part) once per case, then two rounds of time alone
    assert [c for p, c in parts if p == "memory"] == ok
    assert [c for p, c in parts if p == "time"] == ok
    assert [c for p, c in parts if p == "retime"] == ok + ok  # round 2 of all, then round 3
    first_retime = [p for p, _ in parts].index("retime")
    assert all(p != "time" for p, _ in parts[first_retime:])
    # the rounds file kept rounds 1 and 2 of each case; the 3rd went straight into the row
    recs = _records(folder / "rounds.jsonl")
    assert sorted((r["case_id"], r["round"]) for r in recs) == sorted(
        (c, k) for c in ok for k in (1, 2))
    assert all("peak_mem_mib" in r["row"] and "rel_err" in r["row"] for r in recs
               if r["round"] == 1)
    meta = json.loads((folder / "meta.json").read_text())
    assert [s["before_round"] for s in meta["busy"]] == [0, 2, 3]
    # the matmul rate the report sets GFLOP/s against: sampled as the busy check is, and
    # at the end; the median of the samples
    samples = meta["matmul_samples"]
    assert [s["at"] for s in samples] == ["start", "before round 2", "before round 3", "end"]
    assert all(s["rates"]["cpu float32"] > 0 for s in samples)
    assert meta["matmul_gflops"]["cpu float32"] == statistics.median(
        s["rates"]["cpu float32"] for s in samples)


def test_a_run_in_rounds_records_the_read_rate_beside_the_matmul_rate(three_rounds):
    """A reference run (timed in rounds) names the machine's memory speed, as a decode run
    does for its bound: folders from different machines can be told apart."""
    meta = json.loads((three_rounds[0] / "meta.json").read_text())
    assert meta["read_bandwidth_gbps"] > 0 and meta["matmul_gflops"]["cpu float32"] > 0


def test_row_pools_the_rounds(three_rounds):
    folder, _ = three_rounds
    recs = {(r["case_id"], r["round"]): r for r in _records(folder / "rounds.jsonl")}
    for row in _rows(folder / "results.csv"):
        if row["status"] != "ok":
            assert row["rounds"] == row["time_ms_spread"] == ""
            continue
        assert row["rounds"] == "3" and int(row["repeats"]) >= 3  # at least ceil(3 / 3) each
        one, two = (recs[(row["case_id"], k)]["samples_ms"] for k in (1, 2))
        m1, m2 = statistics.median(one), statistics.median(two)
        spread = float(row["time_ms_spread"])
        assert spread >= abs(m1 - m2) / min(m1, m2) - 1e-9  # the largest over all pairs
        # memory and error of round 1 are the row's: measured once
        assert float(row["peak_mem_mib"]) == recs[(row["case_id"], 1)]["row"]["peak_mem_mib"]
        assert float(row["gflops_per_s"]) == pytest.approx(
            float(row["flops"]) / (float(row["time_ms"]) * 1e6))


def test_pooled_row_is_the_median_over_all_samples_and_the_spread_of_round_medians():
    rounds = {1: {"samples_ms": [10.0, 11.0, 12.0], "row": {"case_id": "x", "rel_err": 0.1}},
              2: {"samples_ms": [20.0, 22.0]},
              3: {"samples_ms": [10.5]}}
    row = loop._pooled(rounds)
    assert row["time_ms"] == 11.5  # median of 10, 10.5, 11, 12, 20, 22
    assert row["repeats"] == 6 and row["rounds"] == 3 and row["rel_err"] == 0.1
    assert row["time_ms_spread"] == pytest.approx((21.0 - 10.5) / 10.5)
    assert loop._pooled({1: rounds[1]})["time_ms_spread"] is None


def test_a_later_round_that_fails_makes_the_row_that_failure(tmp_path, monkeypatch):
    monkeypatch.setenv(EXTRA_ENV, FAKES)
    flag = tmp_path / "flag"
    m = mx.normalise({"variants": {"_test_fails_if": [{"flag": str(flag)}], "sdpa": [{}]},
                      "seq_lens": [32], "heads": 1, "head_dim": 8, "rounds": 3,
                      "min_run_time_s": 0.01, "min_repeats": 3})
    cases = mx.expand(m)
    store = RunStore(tmp_path / "r")
    loop.measure(cases, store, set(), tmp_path / "worker.log",
                   between_rounds=lambda r: flag.touch())  # breaks before round 2
    bad, good = _rows(tmp_path / "r" / "results.csv")
    assert bad["status"] == "error" and bad["reason"].startswith("round 2 of 3: RuntimeError")
    assert bad["rounds"] == "1" and float(bad["time_ms"]) > 0  # round 1's time is kept
    assert good["status"] == "ok" and good["rounds"] == "3"


class _Killed(BaseException):
    """Stands for a kill: not an Exception, so nothing on the way catches it."""


def test_run_stopped_in_round_2_keeps_round_1(tmp_path):
    m = mx.normalise({"variants": ["sdpa", "linear"], "seq_lens": [64, 256], "heads": 1,
                      "head_dim": 16, "min_run_time_s": 0.03, "min_repeats": 3, "rounds": 3})
    cases = mx.expand(m)
    store, log = RunStore(tmp_path / "r"), tmp_path / "r" / "worker.log"
    seen = []

    def stop_in_round_2(case):  # asked before each case of each round: stop at round 2's 3rd
        seen.append(case.case_id)
        if len(seen) == len(cases) + 3:
            raise _Killed
        return False

    with pytest.raises(_Killed):
        loop.measure(cases, store, set(), log, skip=stop_in_round_2)
    with store.rounds_path.open("ab") as f:
        f.write(b'{"case_id": "deadbeef", "rou')  # a record cut off mid-write
    recs = _records(store.rounds_path)
    assert len(recs) == len(cases) + 2  # round 1 of every case, round 2 of two
    assert _rows(tmp_path / "r" / "results.csv") == []  # no row before a case's last round
    left = {c.case_id: 3 - sum(r["case_id"] == c.case_id for r in recs) for c in cases}
    start = log.stat().st_size
    counts = loop.measure(cases, store, set(), log)  # the resume
    assert counts == {"ok": len(cases)}
    parts = _parts(log, start)
    assert {p for p, _ in parts} == {"retime"}  # round 1 (memory, error, time) not again
    assert sorted(c for _, c in parts) == sorted(c for c, n in left.items() for _ in range(n))
    rows = _rows(tmp_path / "r" / "results.csv")
    assert [r["case_id"] for r in rows] == [c.case_id for c in cases]
    assert {(r["status"], r["rounds"]) for r in rows} == {("ok", "3")}
    assert len(_records(store.rounds_path)) == len(cases) * 2  # the partial line was cut


def test_rounds_key_and_flag():
    _, one = mx.load("quick")
    _, three = mx.load("quick", {"rounds": 3})
    assert [c.case_id for c in one] == [c.case_id for c in three]  # a run setting, not the case
    assert {c.rounds for c in one} == {1} and {c.rounds for c in three} == {3}
    assert {c.rounds for c in mx.load("cpu")[1]} == {c.rounds for c in mx.load("scaling")[1]} == {3}
    with pytest.raises(UsageError, match="'rounds' must be at least 1"):
        mx.normalise({"rounds": 0})


def test_report_flags_cases_whose_rounds_disagree(tmp_path):
    from harness.report.build import write_report
    from report_synth import META, row, write_run

    rows = [row("sdpa", n, rounds=3, time_ms_spread=s)
            for n, s in ((1024, 0.04), (4096, 0.25))]
    rows += [row("nystrom", 4096, rounds=3, time_ms_spread=0.02),
             row("performer", 4096, status="timeout", reason="round 2 of 3: exceeded")]
    busy = [{"at": "2026-01-01T00:00:00+00:00", "window_s": 1.0, "cores": 2,
             "other_cores": 0.1, "own_cores": 0.0, "load_average": [3.0, 2.0, 1.0],
             "warn": False, "before_round": 0},
            {"at": "2026-01-01T00:05:00+00:00", "window_s": 1.0, "cores": 2,
             "other_cores": 1.4, "own_cores": 0.0, "load_average": [1.0, 1.0, 1.0],
             "warn": True, "before_round": 2}]
    folder = write_run(tmp_path / "syn", rows, {**META, "busy": busy})
    md = write_report(folder).read_text()
    section = md[md.index("## Timing drift between rounds"):]
    section = section[:section.index("\n## ", 5)]
    assert "3 case(s) timed in 3 rounds" in section and "largest 25.0%" in section
    assert "1 case(s) exceed 10%" in section and "uncertain by that much" in section
    flagged = [ln for ln in section.splitlines() if ln.startswith("| sdpa")]
    assert len(flagged) == 1 and "4096" in flagged[0] and "±25%" in flagged[0]
    assert "nystrom" not in section  # 2%: not flagged
    assert "other work used 1.4 of 2 cores over 1 s before round 2" in section
    assert "0.1 of 2" not in section  # a quiet sample is no warning

    plain = write_run(tmp_path / "plain", [row("sdpa", 1024), row("nystrom", 1024)])
    md = write_report(plain).read_text()  # a run without rounds (or from before them)
    assert "No case was timed in more than one round" in md
