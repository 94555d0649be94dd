"""Softmax as it is served (issue 52): the exact decoder's cache dtypes, the grouped cache
against the multi-head one, the decode-served preset and its served baseline, and the
report's answer against it.

References are independent of the code under test: float64 exact attention over the keys
and values rounded as the format defines them (bfloat16; fp8 E4M3 with a float32 scale per
token row, largest magnitude to 448, written out here), and a first-order bound, computed
from the rounding errors themselves, on how far a narrow cache may move the float32
decoder's output. Planted bugs (a cache that stores float32 anyway; fp8 read back without
its scales) fail the same checks.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

import run_bench
import variants
from harness.measure import matrix as mx
from harness.measure.memory import decode_bytes
from harness.report import decoders
from harness.report.answers import blocks as answers_blocks
from report_synth import DECODE_META, decode_row, write_run
from variants.core import cache_dtype
from variants.exact import cache as exact_cache

REPO = Path(__file__).resolve().parent.parent
OLD = REPO / "results" / "decode-quiet"
B, H, HK, D, P, T = 1, 4, 2, 16, 150, 5  # a grouped case; P context tokens, T steps


def _qkv(dtype, N=P + T, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, HK, N, D, generator=g, dtype=torch.float64) * 1.5
    v = torch.randn(B, HK, N, D, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _stored(x: torch.Tensor, name: str) -> torch.Tensor:
    """x rounded as the format defines it, in float64 (written here, not the code's)."""
    if name == "bfloat16":
        return x.to(torch.bfloat16).double()
    amax = x.float().abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))  # float32, a row
    return (x.float() / scale).to(torch.float8_e4m3fn).double() * scale.double()


def _decode(m, q, k, v, **sinks):
    """The T generated tokens' outputs after a prefill of P, and the state."""
    state = m.prefill(k[:, :, :P], v[:, :, :P], max_len=P + T, q_heads=H, **sinks)
    outs = []
    for t in range(P, P + T):
        o, state = m.step(state, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], **sinks)
        outs.append(o)
    return torch.cat(outs, dim=2), state


def _exact64(q, k, v, **sinks):
    """float64 exact causal attention, rows P..P+T-1, grouped keys repeated."""
    g = H // HK
    return variants.exact_reference(q.double(), k.double().repeat_interleave(g, 1),
                                    v.double().repeat_interleave(g, 1), causal=True,
                                    **sinks)[:, :, P:]


def check_narrow_cache(name: str) -> None:
    """What a narrow cache must do, float32 compute: (1) its tokens are float64 exact
    attention over the keys and values as the format stores them, to float32 rounding;
    (2) they move from the float32 decoder's by no more than the rounding allows; (3) the
    state is the format's bytes exactly."""
    q, k, v = _qkv(torch.float32)
    narrow, narrow_state = _decode(variants.build("sdpa", cache_dtype=name), q, k, v)
    full, full_state = _decode(variants.build("sdpa"), q, k, v)
    ks, vs = _stored(k, name), _stored(v, name)
    ref = _exact64(q, ks, vs)
    assert (narrow.double() - ref).abs().max() <= 2e-6 * ref.abs().max(), name  # (1)
    # (2) |o' - o| <= max|dv| + (exp(2 max|ds|) - 1) max|v - c| (softmax's weights move by
    # at most a factor exp(+-2 max|ds|) when every score moves by at most max|ds|).
    g = H // HK
    dk = (ks - k.double()).repeat_interleave(g, 1)[:, :, :P + T]
    ds = (q.double() @ dk.transpose(-1, -2)).abs().max() / D ** 0.5
    vd = v.double()
    dv = (vs - vd).abs().max()
    spread = (vd.amax(dim=2) - vd.amin(dim=2)).max() / 2
    bound = dv + (torch.exp(2 * ds) - 1) * spread
    moved = (narrow.double() - full.double()).abs().max()
    assert 0 < moved <= bound + 1e-5, (name, float(moved), float(bound))
    # (3) K and V at the format's width; fp8 adds 4 bytes a token row and head for each
    rows = 2 * B * HK * (P + T)  # key rows and value rows held
    width = {"bfloat16": 2, "float8_e4m3fn": 1}[name]
    want = rows * D * width + (4 * rows if name.startswith("float8") else 0)
    assert variants.build("sdpa").state_nbytes(full_state) == rows * D * 4
    assert variants.build("sdpa").state_nbytes(narrow_state) == want, name
    assert narrow_state.k.element_size() * narrow_state.k.numel() == B * HK * (P + T) * D * width


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn"])
def test_a_narrow_cache_decodes_exact_attention_over_what_it_stores(name, monkeypatch):
    monkeypatch.setattr(exact_cache, "_CHUNK", 3 * 64 * HK * D)  # several chunks, a partial last
    check_narrow_cache(name)


def test_bf16_keeps_half_and_fp8_a_quarter_of_the_float32_cache_plus_its_scales():
    q, k, v = _qkv(torch.float32)
    nbytes = {n: variants.build("sdpa").state_nbytes(
        _decode(variants.build("sdpa", cache_dtype=n), q, k, v)[1])
        for n in ("float32", "bfloat16", "float8_e4m3fn")}
    assert nbytes["bfloat16"] * 2 == nbytes["float32"]
    scales = 2 * B * HK * (P + T) * 4
    assert (nbytes["float8_e4m3fn"] - scales) * 4 == nbytes["float32"]
    s = variants.Shape(B, H, P + T, D, HK)
    for n, m in ((n, variants.build("sdpa", cache_dtype=n)) for n in nbytes):
        assert m.state_bytes_at(P + T, s, torch.float32) == nbytes[n], n


@pytest.mark.parametrize("plant", ["stores float32 anyway", "fp8 read back unscaled"])
def test_a_planted_cache_bug_fails_the_checks(plant, monkeypatch):
    if plant == "stores float32 anyway":
        monkeypatch.setattr(cache_dtype, "narrows", lambda name, dtype: False)
        name = "bfloat16"
    else:
        monkeypatch.setattr(cache_dtype, "dequantise_",
                            lambda out, stored, scale: out.copy_(stored))
        name = "float8_e4m3fn"
    with pytest.raises(AssertionError):
        check_narrow_cache(name)


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("variant", ["sdpa", "standard"])
def test_in_float64_a_narrow_cache_decodes_its_forwards_rows(variant, name):
    """The forward attends to what the cache stores, so that the decoder's rows are its
    causal forward's (1e-10), and that is exact attention over the rounded keys and values
    (sdpa with gpt-oss's sinks, standard without)."""
    q, k, v = _qkv(torch.float64)
    sink = variant == "sdpa"
    m = variants.build(variant, cache_dtype=name, sink=sink)
    sinks = {"sinks": torch.randn(H, dtype=torch.float64)} if sink else {}
    out, _ = _decode(m, q, k, v, **sinks)
    fwd = m(q, k, v, causal=True, **sinks)[:, :, P:]
    assert (out - fwd).abs().max() <= 1e-10
    ref = _exact64(q, _stored(k, name), _stored(v, name), **sinks)
    assert (fwd - ref).abs().max() <= 1e-12
    assert not m.exact_at(P) and variants.build(variant).exact_at(P)


def test_a_grouped_cache_of_8_kv_heads_keeps_a_quarter_of_32s():
    """H = 32, D = 128: kv_heads 8 keeps exactly a quarter of kv_heads 32's state, and a step
    reads a quarter; the harness's state bytes agree."""
    N = 32
    g = torch.Generator().manual_seed(0)
    m = variants.build("sdpa")
    nbytes, reads = {}, {}
    for hk in (32, 8):
        k, v = (torch.randn(1, hk, N, 128, generator=g) for _ in range(2))
        nbytes[hk] = m.state_nbytes(m.prefill(k, v, max_len=N, q_heads=32))
        s = variants.Shape(1, 32, N, 128, None if hk == 32 else hk)
        reads[hk] = m.decode_read_size_at(N, s)
        assert m.state_bytes_at(N, s, torch.float32) == nbytes[hk]
    assert nbytes[8] * 4 == nbytes[32] == 2 * 32 * N * 128 * 4
    assert reads[8] * 4 == reads[32]


def test_the_memory_guard_counts_a_narrow_cache_at_its_width():
    _, cases = mx.load("decode-served", {"seq_lens": [65536]})
    by = {json.loads(c.params).get("cache_dtype", "float32"): c for c in cases
          if c.variant == "sdpa" and c.kv_heads == 8}
    sizes = {n: decode_bytes(c, variants.build("sdpa", **json.loads(c.params)))
             for n, c in by.items()}
    cache32 = 8 * 65552 * 256 * 4  # kv heads, N + T, Dk + Dv, bytes
    assert sizes["float32"] - sizes["bfloat16"] == cache32 // 2
    assert sizes["float32"] - sizes["float8_e4m3fn"] == cache32 * 3 // 4 - 8 * 65552 * 8


def _bad_run(tmp_path, capsys, flags) -> str:
    folder = tmp_path / "old"
    shutil.copytree(OLD, folder)
    files = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    args = ["run", "--preset", "quick", "--results-dir", str(tmp_path), "--run-id", "old",
            "--seq-lens", "64", "--inputs", "gaussian"]
    assert run_bench.main(args + flags) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == files
    return err


def test_an_unknown_cache_dtype_exits_2_with_one_line_and_loses_nothing(tmp_path, capsys):
    err = _bad_run(tmp_path, capsys, ["--variants", "sdpa(cache_dtype=float16)"])
    assert "'cache_dtype' must be one of" in err


def test_a_cache_dtype_torch_lacks_exits_2(tmp_path, capsys, monkeypatch):
    monkeypatch.delattr(torch, "float8_e4m3fn")
    err = _bad_run(tmp_path, capsys, ["--variants", "sdpa(cache_dtype=float8_e4m3fn)"])
    assert "has no such dtype" in err


def test_a_cache_dtype_the_device_lacks_exits_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cache_dtype, "missing_on",
                        lambda name, device: f"cache_dtype {name} is not available on {device}")
    err = _bad_run(tmp_path, capsys, ["--variants", "sdpa(cache_dtype=bfloat16)"])
    assert "sdpa: cache_dtype bfloat16 is not available on cpu" in err
    m = variants.build("sdpa", cache_dtype="bfloat16")  # and a direct call refuses it
    with pytest.raises(ValueError, match="not available on cpu"):
        m(*_qkv(torch.float32), causal=True)


def test_decode_served_names_its_baseline_and_runs_every_decoder():
    matrix, cases = mx.load("decode-served")
    assert matrix["baseline"] == {"variant": "sdpa", "params": "{}", "kv_heads": 8,
                                  "value_heads": None, "value_dim": None}
    got = {(c.variant, c.params, c.kv_heads, c.seq_len) for c in cases}
    assert ("sdpa", "{}", None, 1 << 20) in got  # the multi-head cache to 1M (the guard's)
    for p in ("{}", '{"cache_dtype": "bfloat16"}', '{"cache_dtype": "float8_e4m3fn"}'):
        assert {n for v, q, hk, n in got if v == "sdpa" and q == p and hk == 8} == \
            {4096, 65536, 262144, 1 << 20}
    assert ("sliding_window", '{"sink": true, "window": 127}', 8, 1 << 20) in got
    assert {c.batch for c in cases} == {1} and {c.heads for c in cases} == {32}
    assert {c.dtype for c in cases} == {"float32"}
    served = [c for c in cases if c.variant == "dsa" and '"lightning"' in c.params]
    assert {c.head_dim for c in cases if c.variant != "mla" and c not in served} == {128}
    # dsa as served: the lightning indexer over MLA's MQA-form cache (576-wide key, the
    # 512-wide latent as value, one key-value head), to 1M
    assert {(c.head_dim, c.kv_heads, c.value_dim, c.seq_len) for c in served} == \
        {(576, 1, 512, n) for n in (4096, 65536, 262144, 1 << 20)}
    assert {c.variant for c in cases} == {"sdpa", "sliding_window", "dsa", "gated_deltanet",
                                          "mla"}
    # mla: the rotary query and key (64), one latent of 512 for all heads, to 1M
    assert {(c.head_dim, c.kv_heads, c.value_dim, c.seq_len) for c in cases
            if c.variant == "mla"} == {(64, 1, 512, n) for n in (4096, 65536, 262144, 1 << 20)}


def test_a_baseline_the_matrix_does_not_run_is_an_error():
    raw = {"variants": ["sdpa"], "heads": 4, "kv_heads": [4, 2], "passes": ["decode"],
           "causal": [True]}
    assert mx.normalise({**raw, "baseline": {"variant": "sdpa", "kv_heads": 2}})["baseline"]
    # an override may leave the baseline out of a run (its report says so), not the TOML
    assert mx.normalise({**raw, "baseline": {"variant": "sdpa", "kv_heads": 2}},
                        {"kv_heads": [4]})["baseline"]["kv_heads"] == 2
    for bad, words in (({"variant": "sdpa", "kv_heads": 1}, "no group of the matrix runs"),
                       ({"variant": "linear"}, "no group of the matrix runs"),
                       ({"variant": "sdpa", "params": {"windo": 3}}, "unknown parameter"),
                       ("sdpa", "a table with variant")):
        with pytest.raises(mx.UsageError, match=words):
            mx.normalise({**raw, "baseline": bad})


def _served_folder(tmp_path):
    """Decode rows of a served run: the multi-head cache, the grouped baseline (kv 8), its
    bf16 cache, a window far from exact, a recurrence, the multi-head cache skipped at 1M."""
    base = {"kv_heads": 8}
    bf16 = json.dumps({"cache_dtype": "bfloat16"})
    rows = []
    for n in (4096, 65536, 1 << 20):
        s = n / 4096
        rows += [decode_row("sdpa", n, time_ms=4.0 * s, decode_state_mib=64 * s),
                 decode_row("sdpa", n, time_ms=1.0 * s, decode_state_mib=16 * s, **base),
                 decode_row("sdpa", n, params=bf16, exact=False, row_cos=0.9999,
                            time_ms=0.6 * s, decode_state_mib=8 * s, **base),
                 decode_row("sliding_window", n, time_ms=0.05, **base),
                 decode_row("gated_deltanet", n)]
    rows[-5].update(status="skipped", reason="memory guard: predicted peak 33152 MiB",
                    time_ms=None)
    meta = {**DECODE_META, "matrix": {"groups": [], "baseline": {
        "variant": "sdpa", "params": "{}", "kv_heads": 8,
        "value_heads": None, "value_dim": None}}}
    return write_run(tmp_path / "served", rows, meta)


def test_the_served_answer_names_the_fastest_accurate_decoder_and_every_ratio(tmp_path):
    folder = _served_folder(tmp_path)
    from harness.report.run import read

    run = read(folder)
    answers, every, label = decoders.served_tables(run.dec, run.meta, {})
    assert label == "sdpa [kv_heads=8]"
    a = answers.set_index("context")
    # the bf16 cache: fastest of those that reach row_cos 0.995 (the window does not, the
    # recurrence has no recall here)
    assert set(a["fastest decoder"]) == {"sdpa(cache_dtype=bfloat16) [kv_heads=8]"}
    assert a.loc[65536, "× faster than the baseline"] == f"{1 / 0.6:.1f}"
    assert a.loc[65536, "× faster than multi-head"] == f"{4 / 0.6:.1f}"
    assert a.loc[1 << 20, "multi-head exact ms / token"] == "–"  # skipped there
    e = every.set_index(["context", "decoder"])
    assert e.loc[(65536, "sliding_window [kv_heads=8]"), "× faster than the baseline"] == \
        f"{16 / 0.05:.1f}"
    assert e.loc[(65536, "sdpa [kv_heads=8]"), "× faster than the baseline"] == "1.0"
    assert e.loc[(1 << 20, "sdpa"), "status"].startswith("skipped: memory guard")
    assert set(e["bound"]) <= {"read", "compute", "–"}
    assert ("h", 3, "Against the served baseline: sdpa [kv_heads=8]") in answers_blocks(run)
    assert not [b for b in answers_blocks(run) if "no measured row" in str(b[-1])]
    gone = run.dec[run.dec["kv_heads"].isna() | (run.dec["variant"] != "sdpa")]
    lines = decoders.served_blocks(gone, run.meta)
    assert ("p", "sdpa has no measured row in this run: its ratios read –.") in lines
    # a folder whose matrix names no baseline (every one before it): no such lines
    run.meta["matrix"].pop("baseline")
    assert not [b for b in answers_blocks(run) if "served baseline" in str(b[-1])]


def test_a_decoder_of_other_widths_is_set_against_the_baseline_of_its_layer(tmp_path):
    """A decoder of another head width (mla: a rotary query of 64 beside the grouped
    baseline's 128 in decode-answers; 32 beside 64 here) decodes for the same query heads:
    its ratio is against that baseline, its label names its width, and the layer is one
    setting."""
    rows = []
    for n in (4096, 65536):
        s = n / 4096
        rows += [decode_row("sdpa", n, time_ms=1.0 * s, kv_heads=8),
                 {**decode_row("sdpa", n), "variant": "mla", "family": "latent", "exact": False,
                  "err_ref": "own_softmax", "row_cos": 1.0, "head_dim": 32, "kv_heads": 1,
                  "value_dim": 512, "time_ms": 0.5 * s, "decode_state_mib": 2 * s}]
    meta = {**DECODE_META, "matrix": {"groups": [], "baseline": {
        "variant": "sdpa", "params": "{}", "kv_heads": 8,
        "value_heads": None, "value_dim": None}}}
    from harness.report.run import read

    run = read(write_run(tmp_path / "layer", rows, meta))
    answers, every, label = decoders.served_tables(run.dec, run.meta, {})
    assert label == "sdpa [kv_heads=8]" and "setting" not in every
    mla = "mla [kv_heads=1, value_dim=512] D32"
    e = every.set_index(["context", "decoder"])
    assert e.loc[(65536, mla), "× faster than the baseline"] == "2.0"
    assert e.loc[(65536, "sdpa [kv_heads=8]"), "× faster than the baseline"] == "1.0"
    assert list(answers["fastest decoder"]) == [mla, mla]


def test_the_dry_run_plans_decode_served_and_names_the_guards_skip(capsys, monkeypatch):
    from harness.cli import run as cli_run
    from harness.measure import memory

    monkeypatch.setattr(cli_run, "matmul_fp32_gflops", lambda threads: 20.0)
    monkeypatch.setattr(memory, "mem_available_bytes", lambda: 24 * 2**30)  # the machine
    assert run_bench.main(["run", "--preset", "decode-served", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("35 cases; 0 skipped as declared unsupported")
    guard = next(line for line in out.splitlines() if "memory guard: 1 decode case" in line)
    assert "sdpa() N=1048576 decode" in guard and "kv_heads" not in guard


def test_a_step_moves_the_cache_at_the_width_it_stores():
    """decode_read_mib (decode.traffic_mib): the bytes a step reads and appends, at the
    stored width, fp8's scales included: half of float32's for bfloat16."""
    from harness.measure import decode

    _, cases = mx.load("decode-served", {"seq_lens": [64], "heads": [8], "head_dim": [16],
                                         "kv_heads": [2], "variants": ["sdpa"]})
    moved = {}
    for c in cases:
        m = variants.build("sdpa", **json.loads(c.params))
        k, v = (torch.randn(1, 2, 64, 16) for _ in range(2))
        state = m.prefill(k, v, max_len=68, q_heads=8)
        moved[json.loads(c.params).get("cache_dtype", "float32")] = \
            decode.traffic_mib(c, m, state) * 2**20
    rows = 2 * 2 * 65  # key and value rows read (64) and appended (1), 2 kv heads
    assert moved["float32"] == pytest.approx(rows * 16 * 4)
    assert moved["bfloat16"] == pytest.approx(rows * 16 * 2)
    assert moved["float8_e4m3fn"] == pytest.approx(rows * (16 + 4), rel=0.01)


@pytest.mark.parametrize("name,params", [("sliding_window", {"window": 5}), ("sdpa", {})])
def test_a_sinked_variants_weights_give_its_output(name, params):
    """The attention maps a run draws after its cases (harness.measure.maps) ask a sinked
    window for its weights: they take the sinks, and weights @ v is the output (rows
    summing to below 1)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=g, dtype=torch.float64) for _ in range(3))
    sinks = torch.randn(2, generator=g, dtype=torch.float64)
    m = variants.build(name, sink=True, **params)
    w = m.weights(q, k, True, sinks=sinks)
    assert (w @ v - m(q, k, v, causal=True, sinks=sinks)).abs().max() <= 1e-12
    assert (w.sum(-1) < 1).all()
