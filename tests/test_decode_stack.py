"""The decode pass of a layer pattern (harness.measure.layers.Stack, decode.py): each layer
prefilled from its own context and stepped in turn, the stack's state and traffic the sums
of its layers', no single reference (errors empty, the reason in the row), its forward
passes skipped, a pattern with an unknown mixer bad input.

Planted and seen failing (then reverted): decode_state_mib and decode_read_mib of the
first layer only (`mods[:1]`); Stack.state_size the first layer's; every layer drawing
layer 0's seeds (LAYER_SEED = 0); a stack's row measured against layer 0's reference; the
forward skip of a pattern removed from rows.skip_reasons; matrix._resolve_pattern raising
the pattern's ValueError instead of collecting it (a traceback, exit 1); the report reading
a stack's empty err_ref as softmax (its empty row_cos in the table against exact attention)
or as its own reference (tables.against_own: a table of nan); maps.settings_of asking the
registry for a pattern's name; the plan drawing one layer's context for a stack.
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch

import run_bench
import variants
from harness.measure import decode, estimate, layers, maps, matrix, memory, rows, timing

STACK = "gated_deltanet*3+sdpa"


def _case(variant, N=300, T=4, pass_="decode", **kw):
    raw = {"variants": [variant], "seq_lens": [N], "passes": [pass_], "causal": [True],
           "decode_tokens": T, "heads": 2, "head_dim": 8, "min_run_time_s": 0.01,
           "min_repeats": 2, **kw}
    (case,) = matrix.expand(matrix.normalise(raw))
    return case


@pytest.fixture
def untimed(monkeypatch):
    """time_call replaced by one rewind and one call of the timed callable."""
    monkeypatch.setattr(timing, "time_call", lambda fn, setup=None, **kw: (
        setup(), fn(), timing.Timing(1.0, 0.0, 1, (1.0,)))[-1])


def _state_nbytes(name, N, T, B=1, H=2, D=8):
    """A layer's own state at context N, prefilled by hand (not by the harness)."""
    m = variants.build(name)
    k = v = torch.randn(B, H, N, D)
    return m.state_nbytes(m.prefill(k, v, max_len=N + T, **m.draw_inputs(B, H, N, D)))


def test_a_stacks_decode_state_and_traffic_are_the_sums_of_its_layers(untimed):
    N, T = 300, 4
    got = decode.measure(_case(STACK, N, T), layers.build(_case(STACK, N, T)),
                         torch.device("cpu"), "time")
    assert got["status"] == "ok"
    want = 3 * _state_nbytes("gated_deltanet", N, T) + _state_nbytes("sdpa", N, T)
    assert got["decode_state_mib"] == pytest.approx(want / memory.MIB, rel=1e-12)
    plain = {n: decode.measure(_case(n, N, T), variants.build(n), torch.device("cpu"), "time")
             for n in ("gated_deltanet", "sdpa")}
    assert got["decode_read_mib"] == pytest.approx(
        3 * plain["gated_deltanet"]["decode_read_mib"] + plain["sdpa"]["decode_read_mib"])
    assert got["prefill_ms"] > 0


def test_a_stacks_state_size_column_and_guard_see_every_layer():
    N, T, D = 300, 4, 8
    case = _case(STACK, N, T)
    stack = layers.build(case)
    gdn, sdpa = variants.build("gated_deltanet"), variants.build("sdpa")
    row = rows.case_row(case, stack)
    assert row["state_size"] == 1 * 2 * (3 * gdn.state_size(N, D) + sdpa.state_size(N, D))
    assert row["family"] == "hybrid" and row["err_ref"] is None and row["exact"] is False
    per_head = 3 * gdn.state_size(N + T, D) + sdpa.state_size(N + T, D)
    assert memory.decode_bytes(case, stack) == (2 * per_head + 3 * 2 * N * D) * 4
    pred, _ = memory.MemoryGuard().predict_mib(case, stack)
    assert pred == memory.decode_bytes(case, stack) / memory.MIB


def test_each_layer_draws_its_own_context_and_tokens(untimed, monkeypatch):
    """sdpa*2: the two caches and the two layers' new tokens differ; layer 0 draws what the
    plain sdpa case draws."""
    case = _case("sdpa*2", N=40, T=3)
    stack = layers.build(case)
    seen = {0: [], 1: []}
    states = {}
    for i, m in enumerate(stack.layers):
        real = m.decode_step

        def spy(state, q, k, v, _real=real, _i=i, **kw):
            seen[_i].append(q.clone())
            states[_i] = state
            return _real(state, q, k, v, **kw)

        m.decode_step = spy
    decode.measure(case, stack, torch.device("cpu"), "retime")
    assert len(seen[0]) == len(seen[1]) > 0
    assert not any(torch.equal(a, b) for a, b in zip(seen[0], seen[1]))
    assert not torch.equal(states[0].k[:, :, :40], states[1].k[:, :, :40])
    q0 = decode.new_tokens(case, variants.build("sdpa"), torch.float32, "cpu")[0]
    assert torch.equal(seen[0][0], q0[:, :, :1])  # layer 0: the plain case's first token
    plain = next(decode.context_chunks(_case("sdpa", N=40, T=3), variants.build("sdpa"),
                                       torch.float32, "cpu"))[1]
    assert torch.equal(states[0].k[:, :, :40], plain)


def test_a_stacks_row_has_no_error_and_says_why(untimed):
    got = decode.measure(_case(STACK), layers.build(_case(STACK)), torch.device("cpu"), "time")
    assert got["status"] == "ok" and got["reason"] == layers.NO_REFERENCE
    assert not {"rel_err", "max_abs_err", "row_cos", "err_rows"} & set(got)
    plain = decode.measure(_case("sdpa"), variants.build("sdpa"), torch.device("cpu"), "time")
    assert plain["reason"] == "" and plain["rel_err"] < 1e-5  # a plain variant keeps its own


@pytest.mark.parametrize("pass_", ["forward", "forward_backward"])
def test_a_patterns_forward_passes_are_skipped_with_the_reason(pass_):
    case = _case(STACK, pass_=pass_)
    assert rows.skip_reasons(case, layers.build(case)) == [layers.FORWARD_REASON]
    ((_, why, _),) = estimate.plan_cases([case], 1e11)
    assert why == [layers.FORWARD_REASON]
    assert not rows.skip_reasons(_case(STACK), layers.build(_case(STACK)))


def test_a_plan_draws_and_steps_every_layer():
    one, four = _case("gated_deltanet", N=65536), _case("gated_deltanet*4", N=65536)
    (_, _, a), (_, _, b) = estimate.plan_cases([one, four], 1e11)
    assert 3.5 < (b - 0.5) / (a - 0.5) < 4.5  # the context's draws dominate, one per layer


def test_a_pattern_with_an_unknown_mixer_is_exit_2(tmp_path, capsys):
    (tmp_path / "m.toml").write_text('variants = ["glaa*3+sdpa"]\npasses = ["decode"]\n'
                                     'causal = [true]\nseq_lens = [64]\n')
    for extra in (["--dry-run"], ["--results-dir", str(tmp_path), "--run-id", "r"]):
        assert run_bench.main(["run", "--config", str(tmp_path / "m.toml"), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "unknown variant 'glaa'" in err
    assert not (tmp_path / "r").exists()


def test_the_plan_of_a_pattern_prints_and_names_the_origin_of_its_mixers(tmp_path, capsys,
                                                                          monkeypatch):
    """--dry-run lists where each variant from outside the package comes from: a pattern's
    own mixers, never the pattern as a name (which is no variant)."""
    mod = tmp_path / "mine.py"
    mod.write_text("from variants.recurrent.recurrent import GatedDeltaNet\n"
                   "from variants import register\n\n"
                   "@register\nclass Mine(GatedDeltaNet):\n    name = 'mine_gdn'\n")
    (tmp_path / "m.toml").write_text('variants = ["mine_gdn*3+sdpa"]\npasses = ["decode"]\n'
                                     'causal = [true]\nseq_lens = [64]\n')
    assert run_bench.main(["run", "--config", str(tmp_path / "m.toml"), "--dry-run",
                           "--variant-module", str(mod)]) == 0
    out = capsys.readouterr().out
    assert "mine_gdn: from module" in out and "mine_gdn*3+sdpa: from" not in out


def test_the_maps_of_a_run_with_a_pattern_draw_its_mixers():
    cases = [_case(STACK), _case("gated_deltanet"), _case("sdpa*4")]
    got = maps.settings_of(cases)
    assert [n for n, _ in got] == ["gated_deltanet"]  # once; sdpa is exact: no map of its own
    assert got[0][1] == cases[1].param_dict


@pytest.mark.slow  # three decode cases in worker processes, then the report
def test_a_decode_run_with_stacks_writes_rows_and_a_report(tmp_path):
    (tmp_path / "m.toml").write_text(f"""
variants = ["{STACK}", "sdpa*2", "sdpa"]
seq_lens = [200]
heads = 2
head_dim = 16
passes = ["decode", "forward"]
causal = [true]
decode_tokens = 2
min_run_time_s = 0.01
min_repeats = 2
""")
    assert run_bench.main(["run", "--config", str(tmp_path / "m.toml"), "--results-dir",
                           str(tmp_path), "--run-id", "d"]) == 0
    df = pd.read_csv(tmp_path / "d" / "results.csv")
    dec = df[df["pass"] == "decode"].set_index("variant")
    for name in (STACK, "sdpa*2"):
        row = dec.loc[name]
        assert row["status"] == "ok" and row["family"] == "hybrid"
        assert row["reason"] == layers.NO_REFERENCE
        assert all(pd.isna(row[c]) for c in ("rel_err", "max_abs_err", "row_cos", "err_ref"))
        assert row["time_ms"] > 0 and row["decode_state_mib"] > 0
    assert dec.loc["sdpa*2", "decode_state_mib"] == pytest.approx(
        2 * dec.loc["sdpa", "decode_state_mib"])
    fwd = df[df["pass"] == "forward"].set_index("variant")
    assert set(fwd.loc[[STACK, "sdpa*2"], "status"]) == {"skipped"}
    assert set(fwd.loc[[STACK, "sdpa*2"], "reason"]) == {layers.FORWARD_REASON}
    md = (tmp_path / "d" / "report.md").read_text()
    gen = md.split("## Generation", 1)[1].split("\n## ", 1)[0]  # that section alone
    assert STACK in gen.split("ms per generated token", 1)[1].split("decoding state", 1)[0]
    soft = gen.split("causal attention (err_ref softmax)", 1)[1].split("Decodes faster", 1)[0]
    assert "sdpa " in soft and STACK not in soft and "sdpa*2" not in soft
    assert "nan" not in gen and "own float64 reference (err_ref recurrence)" not in gen
    fastest = md.split("### Fastest decoder at each context", 1)[1].split("\n## ", 1)[0]
    assert "| sdpa " in fastest and "sdpa*2" not in fastest and STACK not in fastest
