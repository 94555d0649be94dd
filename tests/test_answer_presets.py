"""The reference presets of issue 54: `answers` (the forward answer settings over every
family) and `decode-answers` (one served layer's decoders at 4K .. 1M against GQA-8) plan
what their headers say, within their time budgets.

The report answers a setting at the largest length every variant of it has a row at
(harness.report.tables.common_max_length), so every variant of a long setting must be
planned at 32K, run or declared skipped, for the Answers to reach 32K.
"""

import json
import re

import pytest

import variants
from harness.measure import estimate, layers
from harness.measure import matrix as mx
from harness.measure.memory import decode_bytes

FAMILIES = {"exact", "sliding_window", "sparse", "low_rank", "nystrom", "linear",
            "band_lowrank", "routed", "learned_sparse", "recurrent"}
RECURRENCES = {"gated_deltanet", "mamba2", "gla", "deltanet"}


@pytest.fixture(scope="module")
def answers():
    _, cases = mx.load("answers")
    return cases, estimate.plan_cases(cases, 150e9)


def _label(c) -> tuple[str, str]:
    return c.variant, c.params


def test_answers_covers_every_family_at_the_answer_settings(answers):
    cases, planned = answers
    assert {variants.build(c.variant).family for c in cases} >= FAMILIES
    assert {c.pass_ for c in cases} == {"forward"} and {c.dtype for c in cases} == {"float32"}
    assert {c.rounds for c in cases} == {3}
    long = [c for c in cases if c.input != "minilm"]
    assert {(c.input, c.causal, c.seq_len) for c in long} == {
        (i, causal, n) for i in ("local", "retrieval") for causal in (False, True)
        for n in (4096, 16384, 32768)}
    assert {(c.batch, c.heads, c.head_dim) for c in long} == {(1, 4, 64)}
    assert {(c.seq_len, c.causal) for c in cases if c.input == "minilm"} == {
        (512, False), (512, True)}
    ran = {c.variant for c, why, _ in planned if not why}
    assert ran == {c.variant for c in cases}  # each variant runs somewhere


def test_answers_plans_every_variant_at_every_length_of_a_setting(answers):
    cases, _ = answers
    by_setting: dict = {}
    for c in cases:
        by_setting.setdefault((c.input, c.causal), {}).setdefault(c.seq_len, set()).add(
            _label(c))
    for setting, at in by_setting.items():
        labels = list(at.values())
        assert all(s == labels[0] for s in labels), (setting, {
            n: sorted(v for v, _ in labels[0] ^ s) for n, s in at.items()})


def test_answers_skips_only_what_a_variant_declares_it_cannot_run(answers):
    """A skipped case is a causal-only variant without the mask, a non-causal one with it,
    or a captured input without the gates a variant needs; nothing else."""
    _, planned = answers
    for c, why, _ in planned:
        if why:
            words = " ".join(why)
            assert ("causal" in words or "captured input without" in words), (c, why)


def test_answers_plans_within_an_hour(answers):
    """Its compute-bound estimate at a fixed 150 GFLOP/s (the fixture's rate, of the order
    of the project's quiet 2-core machines): it counts sdpa high (a quarter of the matmul
    rate) and the sparse selectors (dsa, nsa) low; two thirds of the hour, the rest their
    margin."""
    _, planned = answers
    assert sum(s for *_, s in planned) / 60 <= 40


def test_decode_answers_runs_the_served_decoders_at_four_contexts():
    matrix, cases = mx.load("decode-answers")
    assert matrix["baseline"] == {"variant": "sdpa", "params": "{}", "kv_heads": 8,
                                  "value_heads": None, "value_dim": None}
    contexts = {4096, 32768, 131072, 1 << 20}
    got = {(c.variant, c.params, c.kv_heads, c.seq_len) for c in cases}
    at = lambda v, p, hk: {n for v2, p2, hk2, n in got if (v2, p2, hk2) == (v, p, hk)}
    assert at("sdpa", "{}", 8) == contexts  # the served baseline, GQA-8
    assert at("sdpa", "{}", None) == contexts  # the multi-head cache (the guard's at 1M)
    assert at("sdpa", '{"cache_dtype": "bfloat16"}', 8) == contexts
    assert at("sliding_window", '{"sink": true, "window": 127}', 8) == contexts
    assert {n for v, _, _, n in got if v in ("dsa", "mla")} == contexts
    for name in RECURRENCES:  # their prefill at 1M would outlast the rest of the run
        assert {n for v, _, _, n in got if v == name} == contexts - {1 << 20}, name
    assert {c.batch for c in cases} == {1} and {c.heads for c in cases} == {32}
    served = [c for c in cases if c.variant == "dsa"]  # as decode-served: MLA's MQA form
    assert {(c.head_dim, c.kv_heads, c.value_dim) for c in served} == {(576, 1, 512)}
    assert all('"lightning"' in c.params for c in served)
    assert {c.head_dim for c in cases if c.variant not in ("mla", "dsa")} == {128}
    assert {c.pass_ for c in cases} == {"decode"} and {c.dtype for c in cases} == {"float32"}
    assert all(json.loads(c.params).get("cache_dtype") != "float8_e4m3fn" for c in cases)


def test_decode_answers_plans_within_an_hour():
    """A decode case's estimate does not depend on the matmul rate: drawing the context and
    reading the state at assumed rates (close to decode-served's wall time, case by case).
    A state above the project's 24 GiB machines (the multi-head cache at 1M) is the memory
    guard's skip there, as in the dry run's estimate. dsa as served is a quarter of it (at
    1M it draws the context's 576-wide queries and 64 indexer queries a token, which its
    prefill does not read), so the limit is 55 minutes, not decode-served's 45."""
    _, cases = mx.load("decode-answers")
    planned = estimate.plan_cases(cases, 150e9)
    assert not [c for c, why, _ in planned if why]
    fits = [s for c, _, s in planned
            if decode_bytes(c, layers.build(c)) < 24 * 2**30]
    assert len(fits) == len(planned) - 1
    assert sum(fits) / 60 <= 55


def test_the_readme_and_docs_name_the_presets_that_exist():
    """The README's Presets sentence names `answers` and `decode-answers`, and every preset
    it names in backticks is a file of harness/presets/; docs/running.md shows the command."""
    root = mx.PRESET_DIR.parents[1]
    readme = (root / "README.md").read_text()
    start = readme.index("Presets (`harness/presets/*.toml`)")
    sentence = readme[start:readme.index("\n\n", start)]
    named = set(re.findall(r"`([a-z0-9-]+)`", sentence)) - {"train"}
    assert {"answers", "decode-answers"} <= named
    assert named <= {p.stem for p in mx.PRESET_DIR.glob("*.toml")}, named
    running = (root / "docs" / "running.md").read_text()
    for name in ("answers", "decode-answers"):
        assert f"attnbench run --preset {name} " in running, name
