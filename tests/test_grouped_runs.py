"""kv_heads, value_heads and value_dim in the matrix, the command line and the results
(issue 51): a case at the default keeps its old id, a committed folder resumes measuring
nothing, bad groupings end in one line with exit 2 and nothing lost, grouped decode rows
count the state of the heads they keep, and the report labels only non-default rows.
"""

import csv
import hashlib
import json
import shutil
from pathlib import Path

import pytest

import run_bench
from harness.files.csvlog import CsvLog
from harness.files.columns import LATER_RESULT_COLUMNS, RESULT_COLUMNS
from harness.measure import matrix as mx
from harness.measure.store import RunStore
from harness.report.folder import read_results

REPO = Path(__file__).resolve().parent.parent
OLD = REPO / "results" / "decode-quiet"  # a folder written before the grouping axes


def _raw(matrix: dict) -> dict:
    """The TOML table that normalises to a stored (normalised) matrix."""
    groups = []
    for g in matrix["groups"]:
        g = dict(g)
        g["variants"] = {n: [json.loads(p) for p in ps] for n, ps in g["variants"].items()}
        groups.append(g)
    return {"groups": groups}


def _old_id(case: mx.Case) -> str:
    """The id formula before the grouping axes (issue 51), written out independently."""
    key = {f: getattr(case, f) for f in ("variant", "params", "device", "dtype", "batch",
                                         "heads", "head_dim", "seq_len", "causal", "pass_",
                                         "input", "seed")}
    if case.decode:
        key["decode_tokens"] = case.decode_tokens
    return hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


@pytest.mark.parametrize("folder", sorted(p.parent.name for p in
                                         (REPO / "results").glob("*/meta.json")
                                         if p.parent.name != "decode-hybrid"))
def test_every_committed_folder_keeps_its_case_ids(folder):
    """Each committed run's rows are cases its stored matrix still expands to, by id."""
    meta = json.loads((REPO / "results" / folder / "meta.json").read_text())
    ids = {c.case_id for c in mx.expand(mx.normalise(_raw(meta["matrix"])))}
    rows = csv.DictReader((REPO / "results" / folder / "results.csv").open())
    done = {r["case_id"] for r in rows}
    assert done and done <= ids


def test_a_committed_folder_keeps_its_matrix_ids_and_columns():
    meta = json.loads((OLD / "meta.json").read_text())
    matrix = mx.normalise(_raw(meta["matrix"]))
    assert matrix == meta["matrix"]  # no grouping keys at the default: it resumes
    done = {r["case_id"] for r in csv.DictReader((OLD / "results.csv").open())}
    assert {c.case_id for c in mx.expand(matrix)} == done
    header = next(csv.reader((OLD / "results.csv").open()))
    assert header == RESULT_COLUMNS[:len(header)] and header != RESULT_COLUMNS
    assert CsvLog(OLD / "results.csv", RESULT_COLUMNS, LATER_RESULT_COLUMNS).takes(header)
    assert not CsvLog(OLD / "results.csv", RESULT_COLUMNS).takes(header)


@pytest.fixture
def no_rates(monkeypatch):
    """The machine's rates and the run's attention maps, which take seconds and are not
    what these tests read."""
    from harness.measure import maps, runner
    for name in ("matmul_fp32_gflops", "read_bandwidth_gbps"):
        monkeypatch.setattr(runner, name, lambda threads: 1.0)
    monkeypatch.setattr(runner, "matmul_rates", lambda *a: {"cpu float32": 1.0})
    monkeypatch.setattr(maps, "write", lambda folder, cases: None)


def test_resuming_a_committed_folder_measures_nothing(tmp_path, monkeypatch, no_rates):
    from harness.measure import loop, runner
    measured = []
    real = loop.measure

    def counting(cases, store, done, *args):  # what the runner hands the loop
        measured.extend(c.case_id for c in cases if c.case_id not in done)
        return real(cases, store, done, *args)

    monkeypatch.setattr(runner, "measure", counting)
    folder = tmp_path / "old"
    shutil.copytree(OLD, folder)
    before = (folder / "results.csv").read_bytes()
    meta = json.loads((OLD / "meta.json").read_text())
    cfg = tmp_path / "m.toml"
    cfg.write_text(_toml(_raw(meta["matrix"])))
    assert RunStore(folder).check(mx.normalise(_raw(meta["matrix"]))) is True
    code = run_bench.main(["run", "--config", str(cfg), "--results-dir", str(tmp_path),
                           "--run-id", "old", "--no-report"])
    assert code == 0 and measured == []  # every case was done: nothing measured twice
    assert (folder / "results.csv").read_bytes() == before


def _toml(raw: dict) -> str:
    lines = []
    for g in raw["groups"]:
        lines.append("[[groups]]")
        for k, v in g.items():
            if k == "variants":
                items = ", ".join(f"{n} = [{', '.join(_inline(p) for p in ps)}]"
                                  for n, ps in v.items())
                lines.append(f"variants = {{{items}}}")
            else:
                lines.append(f"{k} = {json.dumps(v)}")
    return "\n".join(lines) + "\n"


def _inline(d: dict) -> str:
    return "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in d.items()) + "}"


def test_the_default_keeps_old_ids_and_another_grouping_gets_its_own():
    m = mx.normalise({"variants": ["sdpa", "gated_deltanet", "standard"], "heads": 8,
                      "head_dim": 16, "seq_lens": [64], "kv_heads": [8, 2],
                      "value_heads": [8, 16], "inputs": ["gaussian"]})
    m["groups"].append({**m["groups"][0], "variants": {"standard": ['{}']},
                        "value_dim": [16, 24]})  # standard declares it; the others do not
    cases = mx.expand(m)
    got = {(c.variant, c.kv_heads, c.value_heads, c.value_dim) for c in cases}
    assert got == {("sdpa", None, None, None), ("sdpa", 2, None, None),
                   ("standard", None, None, None), ("standard", 2, None, None),
                   ("standard", None, None, 24), ("standard", 2, None, 24),
                   ("gated_deltanet", None, None, None), ("gated_deltanet", None, 16, None)}
    for c in cases:
        grouped = (c.kv_heads, c.value_heads, c.value_dim) != (None, None, None)
        assert (c.case_id == _old_id(c)) != grouped


@pytest.mark.parametrize("flags,words", [
    (["--kv-heads", "0"], "'kv_heads' must be positive"),
    (["--kv-heads", "3", "--heads", "8"], "kv_heads 3 does not divide heads 8"),
    (["--value-heads", "12", "--heads", "8", "--variants", "gated_deltanet"],
     "value_heads 12 is not a multiple of heads 8"),
    (["--value-dim", "32", "--variants", "sdpa"], "sdpa does not declare values of their own"),
    (["--kv-heads", "4", "--inputs", "minilm"], "kv_heads 4 with the captured input 'minilm'"),
])
def test_a_bad_grouping_exits_2_with_one_line_and_loses_nothing(tmp_path, capsys, flags, words):
    folder = tmp_path / "old"
    shutil.copytree(OLD, folder)
    files = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    args = ["run", "--preset", "quick", "--results-dir", str(tmp_path), "--run-id", "old",
            "--seq-lens", "64"]
    if "--inputs" not in flags:
        args += ["--inputs", "gaussian"]
    assert run_bench.main(args + flags) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == files


def test_grouped_decode_rows_count_the_heads_they_keep(tmp_path):
    """Decode at B = 1, H = 4 (in this process: the worker's own measure): sdpa at kv_heads
    1 keeps and reads a quarter of kv_heads 4's cache, gated_deltanet at value_heads 8 keeps
    twice the state of value_heads 4; each against its float64 reference; the report
    labels the grouped rows only."""
    import torch

    from harness.measure import decode, layers
    from harness.measure.rows import case_row
    overrides = {"variants": ["sdpa", "gated_deltanet"], "heads": [4], "head_dim": [16],
                 "kv_heads": [4, 1], "value_heads": [4, 8], "seq_lens": [256], "batch": [1],
                 "decode_tokens": 4, "min_run_time_s": 0.01, "min_repeats": 1}
    _, cases = mx.load("decode", overrides)
    assert len(cases) == 4
    log = CsvLog(tmp_path / "results.csv", RESULT_COLUMNS)
    log.open()
    rows = {}
    for case in cases:
        module = layers.build(case)
        row = {**case_row(case, module), **decode.measure(case, module, torch.device("cpu"),
                                                          "time")}
        log.append(row)
        rows[(case.variant, case.kv_heads, case.value_heads)] = row
    log.close()
    assert all(r["status"] == "ok" and r["rel_err"] < 1e-5 for r in rows.values())
    full, one = rows[("sdpa", None, None)], rows[("sdpa", 1, None)]
    for col in ("decode_state_mib", "decode_read_mib", "state_size"):
        assert one[col] * 4 == pytest.approx(full[col]), col
    s4, s8 = rows[("gated_deltanet", None, None)], rows[("gated_deltanet", None, 8)]
    for col in ("decode_state_mib", "state_size"):
        assert s8[col] == pytest.approx(2 * s4[col]), col
    df = read_results(tmp_path / "results.csv")
    assert set(df["label"]) == {"sdpa", "sdpa [kv_heads=1]", "gated_deltanet(chunk=64)",
                                "gated_deltanet(chunk=64) [value_heads=8]"}
