"""The report's layout: build.py holds the sections' order and the writers only, each
section is a module whose entry gives its blocks, and the order holds for every kind of
folder (a benchmark run, decode rows alone, with model drift and a training sweep)."""

import ast
import csv
import shutil
from pathlib import Path

from harness.drift.store import COLUMNS as MODEL_COLUMNS
from harness.report import build
from harness.report.build import write_report
from report_synth import DECODE_META, decode_rows, synthetic_rows, write_run

REPO = Path(__file__).resolve().parent.parent
WRITERS = {"to_markdown", "to_html", "_table_html", "write_report", "build_blocks"}


def test_build_holds_the_order_and_the_writers_only():
    tree = ast.parse((REPO / "harness" / "report" / "build.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                for a in n.names}
    # what computes a section (tables, the captured view, plots) is never build.py's
    assert not {"tables", "captured", "plots", "analysis"} & imported, imported
    defs = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    adapters = defs - WRITERS
    assert all(len(ast.unparse(n).splitlines()) <= 6 for n in tree.body
               if isinstance(n, ast.FunctionDef) and n.name in adapters), adapters


SECTION_MODULES = ("summary", "answers", "hybrid", "layers", "complexity", "crossover",
                   "by_length", "scaling", "budget", "pareto", "gflops", "unmeasured",
                   "settings", "environment")


def test_every_section_module_has_one_entry_for_a_run_and_build_orders_them():
    build_src = (REPO / "harness" / "report" / "build.py").read_text()
    for name in SECTION_MODULES:
        tree = ast.parse((REPO / "harness" / "report" / f"{name}.py").read_text())
        public = [n for n in tree.body if isinstance(n, ast.FunctionDef)
                  and not n.name.startswith("_")]
        entry = next(n for n in public if n.name == "blocks")
        assert [a.arg for a in entry.args.args] == ["run"], name
        assert f"{name}.blocks" in build_src, f"build.ORDER lacks {name}"


def _model_csv(folder: Path):
    folder.mkdir(parents=True, exist_ok=True)
    base = {"model": "minilm", "family": "exact", "device": "cpu", "dtype": "float32",
            "seq_len": 512, "windows": 2, "causal": False, "threads": 2, "seed": 0,
            "params": "{}", "status": "ok", "emb_cos": 1.0, "hidden_rel_err": 1e-7,
            "time_ms": 100.0, "peak_mem_mib": 20.0}
    with (folder / "model.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=MODEL_COLUMNS)
        w.writeheader()
        w.writerow({**base, "variant": "sdpa"})


def _train(folder: Path):
    for name in ("train.csv", "train_meta.json"):  # a committed sweep
        shutil.copy(REPO / "results" / "mad-cpu" / name, folder / name)


def _order(md: str) -> list[str]:
    return [line[3:] for line in md.splitlines() if line.startswith("## ")]


def test_sections_keep_their_order_in_every_kind_of_folder(tmp_path):
    bench = write_run(tmp_path / "bench", synthetic_rows((1024, 2048)))
    _model_csv(bench)
    _train(bench)
    got = _order(write_report(bench).read_text())
    assert got[:5] == ["Attention maps", "Answers", "Quality when trained", "Model drift",
                       "Timing drift between rounds"]
    assert got[-3:] == ["Cases not measured", "Variant settings", "Environment"]

    dec = write_run(tmp_path / "dec", decode_rows(), DECODE_META)
    _model_csv(dec)
    _train(dec)
    assert _order(write_report(dec).read_text()) == [
        "Answers", "Quality when trained", "Model drift", "Generation",
        "Cases not measured", "Variant settings", "Environment"]

    drift = tmp_path / "drift"
    _model_csv(drift)
    assert _order(write_report(drift).read_text()) == ["Model drift", "Environment"]
    _train(drift)
    assert _order(write_report(drift).read_text()) == [
        "Answers", "Quality when trained", "Model drift", "Environment",
        "Training environment"]
