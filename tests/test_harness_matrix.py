"""The matrix: TOML checks (all problems at once), expansion by product, case ids, presets,
and the CLI's exit-2 path that writes nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import variants
from harness.measure import matrix as mx
from harness.errors import UsageError

REPO = Path(__file__).resolve().parent.parent


def test_expansion_is_a_product_with_defaults_filled_in():
    m = mx.normalise({"variants": {"sdpa": [{}], "standard": [{}]}, "seq_lens": [256, 128],
                      "inputs": ["gaussian", "sharp"], "passes": ["forward", "forward_backward"]})
    cases = mx.expand(m)
    assert len(cases) == 2 * 2 * 2 * 2
    assert [c.seq_len for c in cases[:2]] == [128, 256]  # ascending within a series
    assert len({c.case_id for c in cases}) == len(cases)


def test_params_are_full_sorted_json_and_ids_stable():
    m = mx.normalise({"variants": {"nystrom": [{"num_landmarks": 8}]}, "seq_lens": [64]})
    (case,) = mx.expand(m)
    full = json.loads(case.params)
    assert full["num_landmarks"] == 8 and set(full) == set(variants.spec("nystrom").defaults)
    assert list(full) == sorted(full)
    again = mx.expand(mx.normalise({"variants": {"nystrom": [{"num_landmarks": 8}]},
                                    "seq_lens": [64], "timeout_s": 5}))
    assert again[0].case_id == case.case_id  # run settings are not part of the key


def test_all_means_every_public_variant_and_groups_union():
    m = mx.normalise({"variants": "all", "seq_lens": [64],
                      "groups": [{"inputs": ["gaussian"]}, {"inputs": ["gaussian", "local"]}]})
    cases = mx.expand(m)
    public = variants.names()
    assert sorted({c.variant for c in cases}) == sorted(public)
    assert len(cases) == 2 * sum(len(s) for s in m["groups"][0]["variants"].values())


def test_every_problem_is_reported_at_once():
    raw = {"variants": {"no_such_variant": [{}], "sdpa": [{"bogus": 1}]}, "dtypes": ["float33"],
           "devices": ["tpu"], "inputs": ["uniform"], "passes": ["sideways"], "colour": "red",
           "seq_lens": [0]}
    with pytest.raises(UsageError) as e:
        mx.normalise(raw)
    msg = str(e.value)
    for part in ("no_such_variant", "bogus", "float33", "tpu", "uniform", "sideways", "colour",
                 "seq_lens", "registered: standard"):
        assert part in msg, part
    assert "\n" not in msg


def test_narrowing_overrides():
    m = mx.normalise({"variants": "all", "seq_lens": [64, 128]},
                     {"variants": ["sdpa"], "seq_lens": [32], "passes": ["forward_backward"]})
    cases = mx.expand(m)
    assert {(c.variant, c.seq_len, c.pass_) for c in cases} == {("sdpa", 32, "forward_backward")}
    with pytest.raises(UsageError, match="unknown variant 'nope'"):
        mx.normalise({"variants": "all"}, {"variants": ["nope"]})


# Benchmark matrices; the training matrices (train-*, mad-cpu: they set a task, rates, a
# model) are checked by tests/test_train_presets.py (and `run` refuses them by their keys).
TRAIN_KEYS = {"task", "lrs", "d_model", "max_steps"}
PRESETS = sorted(p.stem for p in mx.PRESET_DIR.glob("*.toml")
                 if not TRAIN_KEYS & set(mx.read_toml(str(p))))


def test_every_preset_is_tested():
    assert {"quick", "cpu", "gpu", "gpu-smoke", "scaling", "drift", "answers",
            "decode-answers"} <= set(PRESETS)


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_expand_and_every_case_is_planned(preset):
    """Each preset is checked (an unknown variant or parameter fails it), expanded, and
    each case built and planned as `--dry-run` would: FLOPs, exactness, declared skips."""
    from harness.measure import estimate

    _, cases = mx.load(preset)
    assert cases
    planned = estimate.plan_cases(cases, 1e11)
    assert len(planned) == len(cases)
    ran = [c for c, why, _ in planned if not why]
    assert ran, f"every case of {preset} is declared unsupported"
    raw = mx.read_toml(preset)
    named = set(raw.get("params", {})) | {n for g in raw.get("groups", [])
                                           for n in g.get("variants", []) if isinstance(n, str)}
    assert named <= {c.variant for c in cases}  # every variant it names is in its cases


def test_a_misspelt_variant_in_a_presets_params_fails_it(tmp_path):
    """An unknown name under [params] is an error, never a skip (issue 19: `nystorm`)."""
    planted = mx.read_toml("cpu")
    text = (mx.PRESET_DIR / "cpu.toml").read_text().replace(
        "nystrom = [{num_landmarks = 32}", "nystorm = [{num_landmarks = 32}")
    assert text != (mx.PRESET_DIR / "cpu.toml").read_text() and "params" in planted
    bad = tmp_path / "cpu.toml"
    bad.write_text(text)
    with pytest.raises(UsageError, match="params: unknown variant 'nystorm'"):
        mx.load(str(bad))


def _cli(tmp_path, *args):
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    r = subprocess.run([sys.executable, "run_bench.py", "run", "--results-dir", str(tmp_path / "res"),
                        "--run-id", "x", *args], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    after = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    return r, before, after


@pytest.mark.parametrize("toml, expect", [
    ("variants = [\"sdpa\"\nseq_lens = [", "malformed TOML"),
    ("variants = [\"no_such_variant\"]", "unknown variant 'no_such_variant'; registered: standard"),
    ("variants = {sdpa = [{window = 3}]}", "sdpa: unknown parameter(s) 'window'"),
])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, toml, expect):
    cfg = tmp_path / "m.toml"
    cfg.write_text(toml)
    r, before, after = _cli(tmp_path, "--config", str(cfg))
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and expect in r.stderr, r.stderr
    assert r.stdout == "" and before == after
