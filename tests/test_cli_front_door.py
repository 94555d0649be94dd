"""The command line as a new user meets it (issue 54 items 4 and 5): one name, `attnbench`,
in the README and in errors; --version; help for every flag; each subcommand's presets;
`run --variants 'name(param=value)'`; `compare --threshold` as a fraction; `list` within
100 columns; errors said once; the README's examples plan cases that run."""

import argparse
import re
import shlex
import sys
from pathlib import Path

import pytest

import run_bench
from harness.cli import report as cli_report
from harness.cli import run as cli_run
from harness.measure import matrix as mx
from harness.measure.worker import EXTRA_ENV
from variants.core import modules, registry

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    p = run_bench._parser()
    [sub] = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _main(argv, capsys) -> tuple[int, str, str]:
    rc = run_bench.main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as e:
        run_bench._parser().parse_args(["--version"])
    assert e.value.code == 0
    want = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)[1]
    assert capsys.readouterr().out.strip() == f"attnbench {want}"


def test_help_says_what_bare_attnbench_runs():
    text = run_bench._parser().format_help()
    assert "--version" in text
    assert "with no command" in text and "quick" in text and "about a minute" in text


@pytest.mark.parametrize("argv0, prog", [("/venv/bin/attnbench", "attnbench"),
                                         ("run_bench.py", "run_bench.py"),
                                         ("/x/__main__.py", "attnbench")])
def test_errors_name_the_program_typed(monkeypatch, capsys, argv0, prog):
    monkeypatch.setattr(sys, "argv", [argv0])
    rc, _, err = _main(["run", "--preset", "no-such-preset", "--dry-run"], capsys)
    assert rc == 2 and err.startswith(f"{prog}: error:") and err.count("\n") == 1, err


def test_every_flag_has_help_and_a_readable_metavar():
    for name, sub in _subparsers().items():
        for action in sub._actions:
            assert action.help, f"{name} {action.option_strings} has no help"
            if action.option_strings and action.nargs != 0:
                metavar = action.metavar or action.dest.upper()
                assert not metavar.endswith("_"), f"{name} {action.option_strings}: {metavar}"


def test_run_flags_name_their_toml_key():
    run = _subparsers()["run"]
    helps = {a.dest: a.help for a in run._actions}
    for dest, (key, _) in {**cli_run._OVERRIDES, **cli_run._SCALARS}.items():
        assert f"[{key}]" in helps[dest], (dest, key)
    assert "retrieval" in helps["inputs"]


def test_each_subcommand_lists_only_the_presets_it_takes():
    presets = sorted(p.stem for p in mx.PRESET_DIR.glob("*.toml"))
    train = {p for p in presets if mx.is_training(mx.read_toml(p))}
    assert train and "train-quick" in train and "quick" not in train
    subs = _subparsers()
    run_help = {a.dest: a.help for a in subs["run"]._actions}["preset"]
    listed = set(re.findall(r"[\w-]+", run_help))
    assert not train & listed, train & listed
    assert set(presets) - train <= listed
    train_help = {a.dest: a.help for a in subs["train"]._actions}["preset"]
    assert train <= set(re.findall(r"[\w-]+", train_help))


def test_an_unknown_run_preset_names_only_the_run_presets(capsys):
    rc, _, err = _main(["run", "--preset", "no-such-preset", "--dry-run"], capsys)
    assert rc == 2 and "quick" in err and "train-quick" not in err, err


@pytest.mark.parametrize("argv, causal", [([], "false"), (["--causal"], "true"),
                                          (["--causal", "true"], "true"),
                                          (["--causal", "false"], "false")])
def test_maps_causal_takes_a_value_as_run_does(argv, causal):
    assert run_bench._parser().parse_args(["maps", *argv]).causal == causal


def test_list_fits_100_columns_with_decode_and_devices(capsys):
    rc, out, _ = _main(["list"], capsys)
    lines = out.splitlines()
    assert rc == 0 and max(map(len, lines)) <= 100, max(lines, key=len)
    header = lines[0].split()
    assert {"decode", "devices", "origin"} <= set(header)
    [sdpa] = [ln.split() for ln in lines if ln.startswith("sdpa ")]
    assert sdpa[header.index("decode")] == "yes" and sdpa[header.index("devices")] == "cpu,cuda"
    [nystrom] = [ln.split() for ln in lines if ln.startswith("nystrom ")]
    assert nystrom[header.index("decode")] == "no"
    [xf] = [ln.split() for ln in lines if ln.startswith("xformers ")]
    assert xf[header.index("devices")] == "cuda"
    rc, wide, _ = _main(["list", "--wide"], capsys)
    assert rc == 0 and "parameters (defaults)" in wide.splitlines()[0]
    assert "num_landmarks=" in wide


def test_list_spec_prints_the_declared_contract(capsys):
    """`list --spec NAME` prints one variant's contract (it raised NameError once: the
    table's formatter was never imported)."""
    rc, out, _ = _main(["list", "--spec", "sdpa"], capsys)
    assert rc == 0 and out.startswith("sdpa (exact")
    rows = {ln.split()[0]: ln.split()[1:] for ln in out.splitlines()[2:] if ln.split()}
    assert rows["exactness"] == ["exact"] and rows["err_ref"] == ["softmax"]
    assert rows["own_reference"] == ["-"]  # an exact variant has no own reference
    rc, out, _ = _main(["list", "--spec", "gla"], capsys)
    rows = {ln.split()[0]: ln.split()[1:] for ln in out.splitlines()[2:] if ln.split()}
    assert rows["own_reference"] == rows["err_ref"] == ["recurrence"]
    rc, _, err = _main(["list", "--spec", "no_such_variant"], capsys)
    assert rc == 2 and err.count("\n") == 1


@pytest.mark.parametrize("value", ["10", "1.5", "150%", "-0.1"])
def test_compare_threshold_above_one_is_exit_2_one_line(tmp_path, capsys, value):
    rc, out, err = _main(["compare", str(tmp_path), str(tmp_path), "--threshold", value],
                         capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1 and "--threshold" in err, err


def test_compare_threshold_takes_a_fraction_or_percent():
    assert cli_report._fraction("0.1") == cli_report._fraction("10%") == pytest.approx(0.1)
    assert cli_report._fraction("1") == 1.0


def _overrides(*argv) -> dict:
    args = run_bench._parser().parse_args(["run", *argv])
    return cli_run.overrides_from(args)


def test_run_variants_takes_a_setting(capsys):
    _, cases = mx.load("quick", _overrides("--variants", "sdpa,sliding_window(window=64)",
                                           "--seq-lens", "512"))
    settings = {(c.variant, c.params) for c in cases}
    assert settings == {("sdpa", "{}"), ("sliding_window", '{"window": 64}')}
    rc, out, err = _main(["run", "--variants", "sliding_window(window=64)", "--dry-run"],
                         capsys)
    assert rc == 0 and re.match(r"[1-9]\d* cases;", out), (out, err)
    rc, _, err = _main(["run", "--variants", "sliding_window(windo=64)", "--dry-run"], capsys)
    assert rc == 2 and "windo" in err and err.count("\n") == 1


def test_run_variants_settings_of_one_variant_join(capsys):
    _, cases = mx.load("quick", _overrides(
        "--variants", "sliding_window(window=32),sliding_window(window=64)", "--seq-lens", "512"))
    assert {c.params for c in cases} == {'{"window": 32}', '{"window": 64}'}


def test_unknown_key_lists_every_accepted_top_level_key(tmp_path, capsys):
    cfg = tmp_path / "m.toml"
    cfg.write_text('variants = ["sdpa"]\nseq_lenz = [64]\n')
    rc, _, err = _main(["run", "--config", str(cfg), "--dry-run"], capsys)
    assert rc == 2 and "seq_lenz" in err
    for key in ("modules", "executor", "captures", "groups", "seq_lens"):
        assert key in err, (key, err)


def test_decode_without_causal_is_one_error(tmp_path, capsys):
    rc, _, err = _main(["run", "--preset", "decode", "--causal", "false", "--dry-run"], capsys)
    assert rc == 2 and err.count("generates tokens causally") == 1, err
    cfg = tmp_path / "m.toml"
    cfg.write_text('variants = ["sdpa"]\npasses = ["decode"]\nseq_lens = [64]\n'
                   '[[groups]]\nheads = [1]\n[[groups]]\nheads = [2]\n')
    rc, _, err = _main(["run", "--config", str(cfg), "--dry-run"], capsys)
    assert rc == 2 and err.count("generates tokens causally") == 1 and "groups[0, 1]" in err


def test_readme_names_one_command():
    assert README.count("run_bench.py") <= 2


def test_readme_example_matrix_mostly_runs(tmp_path, capsys):
    [toml] = re.findall(r"```toml\n(.*?)```", README, re.S)[:1]
    cfg = tmp_path / "example.toml"
    cfg.write_text(toml)
    rc, out, err = _main(["run", "--config", str(cfg), "--dry-run"], capsys)
    assert rc == 0, err
    total, skipped = map(int, re.match(r"(\d+) cases; (\d+) skipped", out).groups())
    assert total and skipped <= total / 4, out


def test_readme_narrowed_run_examples_mostly_run(tmp_path, capsys, monkeypatch):
    """Each `attnbench run ... --variants` line of the README, its own variant module the
    README's my_attention.py: at most a quarter of its cases skipped."""
    [module] = re.findall(r"```python\n(.*?)```", README, re.S)[:1]
    (tmp_path / "my_attention.py").write_text(module)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(EXTRA_ENV, raising=False)
    saved = (dict(registry._REGISTRY), dict(registry._ORIGIN), dict(modules._LOADED))
    try:
        _check_narrowed(capsys)
    finally:  # the module's variants leave the registry with the test
        for live, old in zip((registry._REGISTRY, registry._ORIGIN, modules._LOADED), saved):
            live.clear()
            live.update(old)


def _check_narrowed(capsys) -> None:
    lines = [ln for block in re.findall(r"```bash\n(.*?)```", README, re.S)
             for ln in block.splitlines() if ln.startswith("attnbench run") and "--variants" in ln]
    assert len(lines) >= 2
    for line in lines:
        argv = [a for a in shlex.split(line, comments=True)[1:] if a != "--dry-run"]
        rc, out, err = _main([*argv, "--dry-run"], capsys)
        assert rc == 0, (line, err)
        total, skipped = map(int, re.match(r"(\d+) cases; (\d+) skipped", out).groups())
        assert total and skipped <= total / 4, (line, out)


def test_readme_train_example_has_a_baseline():
    lines = [ln for block in re.findall(r"```bash\n(.*?)```", README, re.S)
             for ln in block.splitlines() if ln.startswith("attnbench train")]
    assert lines
    for line in lines:
        argv = shlex.split(line, comments=True)
        if "--variants" in argv:
            names = argv[argv.index("--variants") + 1].split(",")
            assert "sdpa" in names, line
