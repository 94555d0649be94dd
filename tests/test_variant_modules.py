"""Variants of one's own: `--variant-module` (run, train, list, ...), a TOML's `modules`,
an `attnbench.variants` entry point; what a run records of them (meta.json), how they
reach workers and sharded jobs, and the bad inputs (exit 2, one line, nothing written).
"""

import csv
import hashlib
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import run_bench
import variants
from harness.cluster.executors import ShardJob
from harness.measure.worker import EXTRA_ENV
from variants.core import modules, registry

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from test_check import readme_file  # noqa: E402  (README's my_attention.py)

TINY = ('variants = ["cosine", "sdpa"]\nseq_lens = [32, 64]\nheads = 1\nhead_dim = 16\n'
        'passes = ["forward"]\nmin_run_time_s = 0.01\nmin_repeats = 2\nthreads = 1\n')


@pytest.fixture
def clean(monkeypatch):
    """Registrations and ATTNBENCH_EXTRA_MODULES a test makes are undone after it."""
    monkeypatch.delenv(EXTRA_ENV, raising=False)
    saved = (dict(registry._REGISTRY), dict(registry._ORIGIN), dict(modules._LOADED))
    yield monkeypatch
    for live, old in zip((registry._REGISTRY, registry._ORIGIN, modules._LOADED), saved):
        live.clear()
        live.update(old)


@pytest.fixture
def mine(tmp_path):
    path = tmp_path / "mine" / "my_attention.py"
    path.parent.mkdir()
    path.write_text(readme_file())
    return path


def _rows(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_run_with_a_variant_module_writes_its_rows_meta_and_report(tmp_path, mine, clean,
                                                                   capsys):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY)
    argv = ["run", "--variant-module", str(mine), "--config", str(cfg), "--results-dir",
            str(tmp_path / "res"), "--run-id", "serial"]
    assert run_bench.main(argv) == 0
    folder = tmp_path / "res" / "serial"
    rows = _rows(folder / "results.csv")
    assert {(r["variant"], r["status"]) for r in rows} == {("cosine", "ok"), ("sdpa", "ok")}
    assert all(float(r["rel_err"]) > 0 for r in rows if r["variant"] == "cosine")
    meta = json.loads((folder / "meta.json").read_text())
    [record] = [m for m in meta["variant_modules"] if m["path"] == str(mine)]
    assert record["path"] == str(mine) and record["variants"] == ["cosine"]
    assert record["sha256"] == hashlib.sha256(mine.read_bytes()).hexdigest()
    assert "cosine" in (folder / "report.md").read_text()
    # the same run sharded over two local submitit jobs: the same cases, the same errors
    assert run_bench.main([*argv[:-1], "local", "--executor", "local", "--shards", "2",
                           "--no-report"]) == 0
    sharded = _rows(tmp_path / "res" / "local" / "results.csv")
    assert [(r["case_id"], r["status"], r["rel_err"]) for r in sharded] == \
        [(r["case_id"], r["status"], r["rel_err"]) for r in rows]


def test_a_shard_job_carries_the_modules_into_a_fresh_process(tmp_path, mine, clean):
    """Whatever environment a job starts in (a Slurm node, a requeue), it loads the modules
    of the command that submitted it."""
    clean.setenv(EXTRA_ENV, str(mine))
    import variant_module_job

    job = ShardJob(variant_module_job.registered, str(tmp_path), 0, [], "local")
    blob = tmp_path / "job.pkl"
    blob.write_bytes(pickle.dumps(job))
    env = {k: v for k, v in os.environ.items() if k != EXTRA_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests")])
    code = ("import pickle, sys, json; job = pickle.load(open(sys.argv[1], 'rb')); "
            "print(json.dumps(job()))")
    out = subprocess.run([sys.executable, "-c", code, str(blob)], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1])["cosine"] == f"module {mine}"


def test_train_with_a_variant_module_writes_its_row(tmp_path, mine, clean):
    cfg = tmp_path / "train.toml"
    cfg.write_text('task = "mqar"\nvariants = ["sdpa"]\nseq_lens = [16]\nnum_kv_pairs = 2\n'
                   'vocab_size = 16\nd_model = 16\nheads = 1\nlrs = [1e-2]\nbatch = 16\n'
                   'max_steps = 20\neval_every = 10\ntrain_examples = 200\n'
                   'test_examples = 40\nthreads = 1\ncausal = [true]\n')
    assert run_bench.main(["train", "--variant-module", str(mine), "--config", str(cfg),
                           "--variants", "cosine", "--results-dir", str(tmp_path),
                           "--run-id", "t"]) == 0
    [row] = _rows(tmp_path / "t" / "train.csv")
    assert row["variant"] == "cosine" and row["status"] == "ok" and row["family"] == "mine"
    meta = json.loads((tmp_path / "t" / "train_meta.json").read_text())
    assert str(mine) in [m["path"] for m in meta["variant_modules"]]


def test_list_shows_each_origin(mine, clean, capsys):
    assert run_bench.main(["list", "--variant-module", str(mine)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "origin" in lines[0]
    [cosine] = [ln for ln in lines if ln.startswith("cosine ")]
    assert f"module {mine}" in cosine
    [sdpa] = [ln for ln in lines if ln.startswith("sdpa ")]
    assert "variants/exact" in sdpa


def test_toml_modules_are_relative_to_the_toml(tmp_path, mine, clean, capsys, monkeypatch):
    cfg = mine.parent / "m.toml"
    cfg.write_text('modules = ["my_attention.py"]\n' + TINY)
    monkeypatch.chdir(tmp_path)  # elsewhere: the path is the TOML's, not the cwd's
    assert run_bench.main(["run", "--config", str(cfg), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "4 cases" in out and f"cosine: from module {mine}" in out


def _fake_distribution(site: Path, name: str) -> None:
    """A package `mypkg` installed with the entry point, as importlib.metadata reads one."""
    (site / "mypkg").mkdir(parents=True)
    (site / "mypkg" / "__init__.py").write_text("")
    (site / "mypkg" / "attention.py").write_text(
        readme_file().replace('name = "cosine"', f'name = "{name}"'))
    info = site / "mypkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mypkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[attnbench.variants]\nmine = mypkg.attention\n")


def test_an_entry_point_is_listed_and_runs_with_no_flag(tmp_path, clean, capsys):
    site = tmp_path / "site"
    _fake_distribution(site, "cosine_ep")
    clean.syspath_prepend(str(site))
    clean.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site),
                                                             os.environ.get("PYTHONPATH")])))
    assert run_bench.main(["list"]) == 0
    [line] = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("cosine_ep")]
    assert "entry point mine = mypkg.attention (mypkg 0.1)" in line
    cfg = tmp_path / "ep.toml"
    cfg.write_text(TINY.replace('["cosine", "sdpa"]', '["cosine_ep"]').replace("32, 64", "32"))
    assert run_bench.main(["run", "--config", str(cfg), "--results-dir", str(tmp_path),
                           "--run-id", "ep", "--no-report"]) == 0
    [row] = _rows(tmp_path / "ep" / "results.csv")  # measured in the workers: they found it
    assert row["variant"] == "cosine_ep" and row["status"] == "ok"


BAD = {"broken.py": ("import no_such_package_xyz\n", "does not import: ModuleNotFoundError"),
       "empty.py": ("import torch\n", "registers no variant"),
       "taken.py": (None, "registers a name already taken: variant 'sdpa'")}


@pytest.mark.parametrize("command", ["run", "train", "list", "check", "model", "maps"])
@pytest.mark.parametrize("bad", sorted(BAD))
def test_a_bad_module_is_one_line_exit_2_and_nothing_written(tmp_path, clean, capsys,
                                                             command, bad):
    text, words = BAD[bad]
    path = tmp_path / bad
    path.write_text(text or readme_file().replace('name = "cosine"', 'name = "sdpa"'))
    res = tmp_path / "res"
    argv = {"check": ["check", str(path)], "list": ["list", "--variant-module", str(path)],
            "maps": ["maps", "--variant-module", str(path), "--output", str(res / "m.png")]
            }.get(command, [command, "--variant-module", str(path), "--results-dir", str(res)])
    assert run_bench.main(argv) == 2
    out = capsys.readouterr()
    assert out.err.count("\n") == 1 and "Traceback" not in out.err, out.err
    assert out.err.startswith(f"attnbench: error: variant module {path}: {words}"), out.err
    assert not res.exists()
    assert bad[:-3] not in variants.names() and "cosine" not in variants.names()


def test_attnbench_is_the_console_script_of_run_bench_main(monkeypatch, capsys):
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"attnbench": "run_bench:main"}
    monkeypatch.setattr(sys, "argv", ["/venv/bin/attnbench", "run", "--variants"])
    assert run_bench.main() == 2  # argparse's own error, under the script's name
    err = capsys.readouterr().err
    assert err.startswith("attnbench: error:") and err.count("\n") == 1


def test_a_resumed_run_warns_when_a_module_changed_since_it_started(mine, clean, capsys):
    from harness.cli.modules import warn_changed

    variants.load_module(str(mine))
    [rec] = [m for m in variants.loaded_modules() if m["path"] == str(mine)]
    assert warn_changed({"variant_modules": [rec]}) == []
    assert warn_changed({}) == []  # a run from before variant modules were recorded
    [line] = warn_changed({"variant_modules": [dict(rec, sha256="0" * 64)]})
    assert f"variant module {mine} changed since this run started" in line
    assert capsys.readouterr().err == line + "\n"
