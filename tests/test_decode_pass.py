"""The `decode` pass of the matrix: per-token time after a context, the state it keeps,
the error of the generated tokens, and the report's Generation section."""

import dataclasses

import pandas as pd
import pytest
import torch

import run_bench
import variants
from harness.errors import UsageError
from harness.measure import accuracy, decode, matrix, memory, timing
from harness.measure.inputs import make_inputs

# Four variants with a decoding form and one without, at one short context.
TINY_TOML = """
variants = ["sdpa", "linear", "sliding_window", "linformer", "gated_deltanet"]
seq_lens = [300]
heads = 4
head_dim = 64
passes = ["decode"]
causal = [true]
decode_tokens = 4
min_run_time_s = 0.01
min_repeats = 3
"""


def _case(variant="sdpa", N=300, T=4, **kw):
    raw = {"variants": [variant], "seq_lens": [N], "passes": ["decode"], "causal": [True],
           "decode_tokens": T, "heads": 2, "head_dim": 8, "min_run_time_s": 0.01,
           "min_repeats": 2, **kw}
    (case,) = matrix.expand(matrix.normalise(raw))
    return case


def test_a_non_causal_decode_case_is_bad_input():
    with pytest.raises(UsageError, match="causal"):
        matrix.normalise({"passes": ["decode"], "causal": [False]})
    assert run_bench.main(["run", "--preset", "quick", "--pass", "decode", "--dry-run"]) == 2


def test_decode_tokens_is_part_of_a_decode_case_only():
    a, b = _case(T=4), _case(T=8)
    assert a.case_id != b.case_id
    fwd = dict(variants=["sdpa"], seq_lens=[300], heads=2, head_dim=8)
    assert (matrix.expand(matrix.normalise({**fwd, "decode_tokens": 4}))[0].case_id
            == matrix.expand(matrix.normalise({**fwd, "decode_tokens": 8}))[0].case_id)


def test_the_streamed_reference_is_exact_attention_on_the_whole_sequence():
    """Fed the context in chunks, then the new tokens: the last T rows of float64 exact
    causal attention over context + new tokens (variants.exact_reference)."""
    g = torch.Generator().manual_seed(0)
    N, T = 37, 5
    q, k, v = (torch.randn(2, 3, N + T, 8, generator=g) for _ in range(3))
    ref = accuracy.DecodeReference(q[:, :, N:])
    for a, b in ((0, 10), (10, 11), (11, 37)):
        ref.add(k[:, :, a:b], v[:, :, a:b])
    got = ref.finish(k[:, :, N:], v[:, :, N:])
    want = variants.exact_reference(q, k, v, causal=True, rows=torch.arange(N, N + T))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_a_context_drawn_in_chunks_is_the_same_state_as_one_prefill(monkeypatch):
    monkeypatch.setattr(decode, "CHUNK", 64)
    case = _case("linear", N=300)
    m = variants.build("linear")
    chunks = list(decode.context_chunks(case, m, torch.float64, "cpu"))
    assert [c[1].shape[-2] for c in chunks] == [64, 64, 64, 64, 44]
    state, _ = decode.prefill(case, m, torch.float64, torch.device("cpu"))
    k = torch.cat([c[1] for c in chunks], dim=-2)
    v = torch.cat([c[2] for c in chunks], dim=-2)
    whole = m.prefill(k, v, max_len=304)
    torch.testing.assert_close(state.S, whole.S, rtol=1e-12, atol=1e-12)
    # the chunks are the distribution's own draws from (seed, chunk), not one tensor cut up
    q0, k0, _ = make_inputs("gaussian", 1, 2, 64, 8, dtype=torch.float64, seed=0)
    torch.testing.assert_close(chunks[0][1], k0)
    torch.testing.assert_close(chunks[0][0], q0)


def test_time_ms_is_per_generated_token(monkeypatch):
    """A timed repeat generates the T tokens: its time over T is the row's time_ms."""
    case = _case("sdpa", N=50, T=4)
    calls = []

    def fake(fn, setup=None, **kw):
        setup()  # the rewind to the context, untimed
        out = fn()
        calls.append(len(out))
        return timing.Timing(time_ms=80.0, time_ms_iqr=8.0, repeats=3, samples_ms=(80.0,) * 3)

    monkeypatch.setattr(timing, "time_call", fake)
    got = decode.measure(case, variants.build("sdpa"), torch.device("cpu"), "time")
    assert calls == [4]  # one repeat = the T tokens
    assert got["time_ms"] == 20.0 and got["time_ms_iqr"] == 2.0
    assert got["rel_err"] < 1e-5 and got["row_cos"] > 0.99999 and got["err_rows"] == 4
    assert got["decode_state_mib"] == 2 * 1 * 2 * 54 * 8 * 4 / memory.MIB


def test_the_guard_and_the_plan_size_a_decode_case_by_its_state():
    case = _case("sdpa", N=1_048_576, T=16, heads=8, head_dim=64)
    b = memory.decode_bytes(case, variants.build("sdpa"))
    cache = 2 * 8 * (1_048_576 + 16) * 64 * 4
    assert cache <= b <= 1.05 * cache  # the 4 GiB cache, plus one drawn chunk
    lin = memory.decode_bytes(dataclasses.replace(case, variant="linear"),
                              variants.build("linear"))
    assert lin < 2**20 * 64  # a D x D state: the 48 MiB chunk being drawn dominates
    pred, how = memory.MemoryGuard().predict_mib(case, variants.build("sdpa"))
    assert pred == b / memory.MIB and "state" in how


@pytest.mark.slow  # five decode cases in worker processes, then the report
def test_a_decode_run_writes_rows_and_the_generation_section(tmp_path):
    (tmp_path / "m.toml").write_text(TINY_TOML)
    assert run_bench.main(["run", "--config", str(tmp_path / "m.toml"), "--results-dir",
                           str(tmp_path), "--run-id", "d"]) == 0
    df = pd.read_csv(tmp_path / "d" / "results.csv").set_index("variant")
    assert set(df["pass"]) == {"decode"}
    assert df.loc["linformer", "status"] == "skipped"
    assert "non-causal" in df.loc["linformer", "reason"]
    for name in ("sdpa", "linear", "sliding_window", "gated_deltanet"):
        row = df.loc[name]
        assert row["status"] == "ok", row["reason"]
        assert row["time_ms"] > 0 and row["prefill_ms"] > 0 and row["decode_tokens"] == 4
        assert row["decode_state_mib"] > 0 and pd.isna(row["flops"])
    assert df.loc["sdpa", "rel_err"] < 1e-5  # exact: float32 rounding only
    # a recurrence against its own float64 form: rounding only, and said so
    assert df.loc["gated_deltanet", "err_ref"] == "recurrence"
    assert df.loc["gated_deltanet", "rel_err"] < 1e-4
    assert df.loc["sdpa", "err_ref"] == "softmax"
    assert df.loc["sdpa", "state_size"] == 1 * 4 * 2 * 300 * 64
    assert df.loc["sdpa", "decode_state_mib"] == pytest.approx(2 * 4 * 304 * 64 * 4 / 2**20)
    assert df.loc["linear", "decode_state_mib"] < df.loc["sdpa", "decode_state_mib"]
    md = (tmp_path / "d" / "report.md").read_text()
    assert "## Generation" in md and "### Fastest decoder at each context" in md
    assert (tmp_path / "d" / "plots" / "decode_time.png").is_file()


def test_a_sparse_decoder_reads_its_chosen_blocks_not_its_cache():
    """decode_read_size: the whole state for a dense reader; MoBA top_k blocks of b keys and
    values plus one mean per block; BigBird's row blocks of its layout."""
    D, N = 64, 65536
    assert variants.build("sdpa").decode_read_size(N, D) == 2 * N * D
    assert variants.build("mamba2").decode_read_size(N, D) == D * D
    moba = variants.build("moba", block_size=64, top_k=3)
    assert moba.decode_read_size(N, D) == (N // 64) * D + 2 * 3 * 64 * D
    quest = variants.build("quest", page_size=16, top_k=12)
    assert quest.decode_read_size(N, D) == 2 * (N // 16) * D + 2 * 12 * 16 * D
    bs = variants.build("block_sparse")  # 1 window block each side, 2 global, 3 random
    per_row = float(bs.layout(N).sum(dim=1, dtype=torch.float64).mean())
    assert 6 <= per_row <= 2 * 1 + 1 + 2 * 2 + 3  # global columns and rows, the band
    assert bs.decode_read_size(N, D) == int(2 * per_row * 64 * D)


@pytest.mark.parametrize("name", ["mamba2", "retention"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_read_bound_counts_the_state_read_and_written_in_its_own_dtype(monkeypatch, name,
                                                                           dtype):
    """A recurrence's step reads its float32 D x D state and writes it back, whatever the
    case's dtype: decode_read_mib = 2 x decode_state_mib (the state is S alone); a cache
    appends one token: its read plus 2 D per head, in the cache's dtype."""
    monkeypatch.setattr(timing, "time_call", lambda fn, setup=None, **kw: (
        setup(), fn(), timing.Timing(1.0, 0.0, 1, (1.0,)))[-1])
    case = _case(name, N=300, T=4, dtypes=[dtype], heads=4, head_dim=16)
    got = decode.measure(case, variants.build(name), torch.device("cpu"), "time")
    assert got["decode_state_mib"] == 4 * 16 * 16 * 4 / memory.MIB  # float32 S, B H D D
    assert got["decode_read_mib"] >= 1.9 * got["decode_state_mib"]
    assert got["decode_read_mib"] == pytest.approx(2 * got["decode_state_mib"])
    sdpa = decode.measure(dataclasses.replace(case, variant="sdpa"), variants.build("sdpa"),
                          torch.device("cpu"), "time")
    size = {"float32": 4, "bfloat16": 2}[dtype]
    assert sdpa["decode_read_mib"] == pytest.approx(4 * (2 * 300 * 16 + 2 * 16) * size
                                                    / memory.MIB)


@pytest.mark.parametrize("name", ["mamba2", "gated_deltanet", "kda"])
def test_a_heads_decay_rates_are_drawn_once_for_the_whole_context(monkeypatch, name):
    """A_log and dt_bias are a layer's weights: every chunk of the context, and the new
    tokens, decay at the rates a forward case of the same seed draws. Per head (per head
    and channel for kda), the median decay -g of each chunk matches the forward draw's
    within 10% (4096 tokens each: the sampling noise is ~2%); redrawn per chunk, the rates
    of two chunks differ by factors of up to 16 (A) and 100 (dt)."""
    monkeypatch.setattr(decode, "CHUNK", 2048)
    case = _case(name, N=3 * 2048, T=2048, batch=2, heads=4, head_dim=16)
    m = variants.build(name)
    per = [c[3]["g"] for c in decode.context_chunks(case, m, torch.float32, "cpu")]
    per.append(decode.new_tokens(case, m, torch.float32, "cpu")[3]["g"])
    whole = m.draw_inputs(2, 4, 2048, 16, seed=case.seed)["g"]  # a forward case's draw

    def rates(g):  # (B, H, N) or (B, H, N, D) -> median over batch and tokens
        return (-g).transpose(1, 2).flatten(0, 1).median(dim=0).values

    want = rates(whole)
    assert len(per) == 4
    for g in per:
        ratio = rates(g) / want
        assert float((ratio - 1).abs().max()) < 0.1, ratio
