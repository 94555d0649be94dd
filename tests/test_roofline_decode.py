"""The roofline bound of a decode row: a step's FLOPs (`decode_flops_at`, the decode_flops
column) beside the bytes it moves, and the report's bound, the larger of the two times
(FlashAttention's hopper/benchmark_mla_decode.py: ideal = max(memory time, FLOP time)).

The FLOPs are checked against torch.utils.flop_counter.FlopCounterMode around one
`decode_step`, an independent count of the products the step runs (2 m k n each), with
the elementwise updates of a state matrix (which the counter does not count: it counts
products only) counted by a dispatch mode of their own, one FLOP an output element."""

import json

import pandas as pd
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import run_bench
import variants
from harness.measure import decode, layers, matrix, timing
from harness.report import generation
from harness.report import run as report_run
from report_synth import DECODE_META, READ_GBPS, decode_row, decode_rows, write_run

aten = torch.ops.aten


def shape(N=0, B=1, H=4, D=16, **kw):
    return variants.Shape(B, H, N, D, **kw)


# -- decode_flops_at by its formula ----------------------------------------------------------

@pytest.mark.parametrize("name", ["sdpa", "standard"])
def test_exact_attention_does_4_N_D_a_query_head(name):
    m = variants.build(name)
    assert m.decode_flops_at(1000, shape(H=4, D=16)) == 4 * 1000 * 16 * 4
    # Grouped keys: eight query heads over two key-value heads still do eight heads' dot
    # products (counting Hk gives a quarter of it).
    assert m.decode_flops_at(1000, shape(H=8, D=16, kv_heads=2)) == 4 * 1000 * 16 * 8
    if name == "standard":  # values of their own width: q k^T over Dk, p v over Dv
        assert m.decode_flops_at(1000, shape(H=4, D=16, value_dim=48)) == \
            2 * 1000 * (16 + 48) * 4


@pytest.mark.parametrize("N", [10, 64, 65, 5000])
def test_a_window_does_the_work_of_exact_attention_over_its_ring(N):
    """sliding_window(window=w) holds the last w + 1 keys: exact's FLOPs at min(w + 1, N)."""
    w, s = 64, shape(H=8, D=16, kv_heads=4)
    got = variants.build("sliding_window", window=w).decode_flops_at(N, s)
    assert got == variants.build("sdpa").decode_flops_at(min(w + 1, N), s)


def test_streaming_counts_its_sink_tokens_and_its_window():
    m = variants.build("streaming", window=32, sink_tokens=4)
    assert m.decode_flops_at(1000, shape()) == 4 * 36 * 16 * 4
    assert m.decode_flops_at(20, shape()) == 4 * 20 * 16 * 4


def test_a_stack_sums_its_layers():
    stack = layers.build_mixer("mamba2*3+sdpa", {})
    s = shape(N=100)
    want = 3 * variants.build("mamba2").decode_flops_at(100, s) + \
        variants.build("sdpa").decode_flops_at(100, s)
    assert stack.decode_flops_at(100, s) == want


# -- decode_flops_at against the products a step runs ----------------------------------------

class StateUpdates(TorchDispatchMode):
    """FLOPs of the elementwise ops whose output has at least `numel` elements (a state
    matrix's updates: a decay's S * a, S + phi(k)^T v), one an element. Ops on smaller
    tensors (a head's D or Dv numbers: features, gates, the normaliser) are what
    `decode_flops_at` leaves out, and are left out here too."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.flops = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch.Tag.pointwise in func.tags and isinstance(out, torch.Tensor) \
                and out.numel() >= self.numel:
            self.flops += out.numel()
        return out


def _inplace_baddbmm(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs):
    # The counter's own rule for baddbmm (the product, 2 b m k n), which it registers for
    # the out-of-place op only; a recurrence's write is S.baddbmm_(k^T, w).
    b, m, k = a_shape
    return 2 * b * m * k * b_shape[-1]


def counted_step(name, N, B=2, H=4, D=16, params=None, **grouping):
    """(FLOPs FlopCounterMode counts in one decode_step at context N, elementwise FLOPs
    on state-matrix-sized tensors, the module, the case's Shape)."""
    m = variants.build(name, **(params or {}))
    s = variants.Shape(B, H, N, D, **grouping)
    Hq, Hk, Hv = s.H, s.Hk, s.Hv
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, Hq, N + 1, D, generator=g)
    k = torch.randn(B, Hk, N + 1, D, generator=g)
    v = torch.randn(B, Hv, N + 1, s.Dv, generator=g)
    inputs = m.draw_inputs(B, s.out_heads, N + 1, D, seed=0)
    first = {n: (x[:, :, :N] if x.dim() > 2 else x) for n, x in inputs.items()}
    last = {n: (x[:, :, N:] if x.dim() > 2 else x) for n, x in inputs.items()}
    with torch.no_grad():
        state = m.prefill(k[:, :, :N], v[:, :, :N], max_len=N + 1, q_heads=Hq, **first)
        tok = m._expand_token(q[:, :, N:], k[:, :, N:], v[:, :, N:])
        # The state matrices of every head: the largest state tensor (one per output head,
        # or a recurrence's packed (B, H, Dk, r Dv) holding its value heads' side by side).
        big = max(t.numel() for t in state.tensors() if t.dim() >= 3)
        counter = FlopCounterMode(display=False, custom_mapping={aten.baddbmm_:
                                                                 _inplace_baddbmm})
        with counter, StateUpdates(big) as updates:
            m.decode_step(state, *tok, **last)
    return counter.get_total_flops(), updates.flops, m, s


RECURRENCES = ["retention", "gla", "mamba2", "deltanet", "gated_deltanet", "kda"]


@pytest.mark.parametrize("name", RECURRENCES)
def test_a_recurrences_flops_are_those_its_step_computes(name):
    """Per value head: the write and the read (2 D Dv each), the decay's D Dv where the
    step decays (all but deltanet), the delta rule's k S (2 D Dv: deltanet,
    gated_deltanet, kda). A count that forgets the decay, the erase or the value heads
    misses by D Dv or more per head."""
    products, updates, m, s = counted_step(name, 37)
    assert m.decode_flops_at(37, s) * s.B == products + updates
    assert updates > 0 or name == "deltanet"  # the decay scales S elementwise


@pytest.mark.parametrize("name", ["mamba2", "gated_deltanet"])
def test_grouped_value_heads_count_a_state_per_value_head(name):
    products, updates, m, s = counted_step(name, 20, H=2, value_heads=8)
    assert m.decode_flops_at(20, s) * s.B == products + updates
    assert m.decode_flops_at(20, s) == 4 * m.decode_flops_at(20, shape(H=2, D=16))


@pytest.mark.parametrize("name", ["linear", "performer"])
def test_a_kernel_decoders_flops_are_those_its_step_computes(name):
    """linear: phi(k)^T v (2 M D) added into S (M D), phi(q) S (2 M D), phi(q) z (2 M);
    performer also projects q and k onto its m features (2 D m each) and rescales S."""
    params = {"num_features": 32} if name == "performer" else None
    products, updates, m, s = counted_step(name, 25, params=params)
    assert m.decode_flops_at(25, s) * s.B == products + updates


@pytest.mark.parametrize("name, params, N", [
    ("sdpa", None, 50), ("standard", None, 50), ("sliding_window", {"window": 8}, 50),
    ("sliding_window", {"window": 64}, 30), ("streaming", {"window": 8, "sink_tokens": 2}, 50),
    ("moba", {"block_size": 8, "top_k": 3}, 70), ("quest", {"page_size": 4, "top_k": 5}, 70)])
def test_a_softmax_decoders_flops_are_those_its_step_computes(name, params, N):
    """The step at context N attends its new key too: its products are decode_flops_at's
    count of the keys it reads (exact: N + 1 keys, which decode_flops_at(N) counts as the
    context's N, as the read bound counts the cache). Routed: the gate over the complete
    blocks before the token's own, then its top blocks' keys."""
    products, updates, m, s = counted_step(name, N, params=params)
    at = N + 1 if name in ("sdpa", "standard") or (name == "sliding_window" and N <= 64) \
        else N
    assert m.decode_flops_at(at, s) * s.B == products


@pytest.mark.parametrize("indexer, N", [("lightning", 40), ("lightning", 9), ("heads", 40)])
def test_dsas_flops_are_its_indexer_and_its_top_k_keys(indexer, N):
    """The indexer scores every key of the cache (N + 1 after the step's own), then softmax
    over min(top_k, N + 1) of them. A count that leaves out the indexer, or counts top_k
    keys where fewer exist, misses."""
    params = {"top_k": 12, "indexer": indexer, "index_heads": 4, "index_dim": 8}
    products, _, m, s = counted_step("dsa", N, H=8, kv_heads=2, params=params)
    assert m.decode_flops_at(N + 1, s) * s.B == products


def test_grouped_keys_count_every_query_head_in_the_step():
    products, _, m, s = counted_step("sdpa", 40, H=8, kv_heads=2)
    assert m.decode_flops_at(41, s) * s.B == products


# -- the column, written by a run --------------------------------------------------------------

TINY = """
variants = ["sdpa", "mamba2", "mamba2+sdpa"]
seq_lens = [96]
batch = 2
heads = 2
head_dim = 8
passes = ["decode"]
causal = [true]
decode_tokens = 2
min_run_time_s = 0.01
min_repeats = 2
"""


@pytest.mark.slow  # three decode cases in worker processes
def test_a_decode_run_writes_decode_flops(tmp_path, monkeypatch):
    from harness.measure import maps, runner
    for rate in ("matmul_fp32_gflops", "read_bandwidth_gbps"):  # the machine's: not read here
        monkeypatch.setattr(runner, rate, lambda threads: 1.0)
    monkeypatch.setattr(runner, "matmul_rates", lambda *a: {"cpu float32": 1.0})
    monkeypatch.setattr(maps, "write", lambda folder, cases: None)
    (tmp_path / "m.toml").write_text(TINY)
    assert run_bench.main(["run", "--config", str(tmp_path / "m.toml"), "--results-dir",
                           str(tmp_path), "--run-id", "d", "--no-report"]) == 0
    df = pd.read_csv(tmp_path / "d" / "results.csv").set_index("variant")
    s = shape(N=96, B=2, H=2, D=8)
    sdpa, mamba2 = (variants.build(n).decode_flops_at(96, s) for n in ("sdpa", "mamba2"))
    assert sdpa == 4 * 96 * 8 * 2 and mamba2 == 5 * 8 * 8 * 2  # a decay per step
    assert df.loc["sdpa", "decode_flops"] == 2 * sdpa  # batch 2
    assert df.loc["mamba2", "decode_flops"] == 2 * mamba2
    assert df.loc["mamba2+sdpa", "decode_flops"] == 2 * (sdpa + mamba2)


def test_measure_writes_decode_flops_beside_decode_read_mib(monkeypatch):
    monkeypatch.setattr(timing, "time_call", lambda fn, setup=None, **kw: (
        setup(), fn(), timing.Timing(1.0, 0.0, 1, (1.0,)))[-1])
    raw = {"variants": ["gla"], "seq_lens": [40], "passes": ["decode"], "causal": [True],
           "decode_tokens": 2, "batch": 3, "heads": 2, "head_dim": 8,
           "min_run_time_s": 0.01, "min_repeats": 1}
    (case,) = matrix.expand(matrix.normalise(raw))
    got = decode.measure(case, variants.build("gla"), torch.device("cpu"), "time")
    assert got["decode_flops"] == 3 * 2 * 5 * 8 * 8 and got["decode_read_mib"] > 0


# -- the report's bound ------------------------------------------------------------------------

RATE = 100.0  # GFLOP/s
META = {**DECODE_META, "matmul_gflops": {"cpu float32": RATE}}


def _bandwidth(tmp_path, rows, meta=META):
    dec = report_run.read(write_run(tmp_path, rows, meta)).dec
    return dec, generation.bandwidth_table(dec, READ_GBPS, meta).set_index("variant")


def test_the_bound_is_the_larger_time_and_names_it(tmp_path):
    """sdpa at 4096 moves 8 MiB (0.42 ms at 20 GB/s) for 16.8 MFLOP (0.17 ms at 100
    GFLOP/s): read. A planted row of 1e12 FLOPs (10 s at that rate): compute, its bound
    the FLOP time, 1e4 ms."""
    n = 4096
    flops = 4 * n * 64 * 8
    rows = [decode_row("sdpa", n, decode_flops=flops),
            decode_row("mamba2", n, decode_flops=1e12)]
    dec, table = _bandwidth(tmp_path, rows)
    bound, which = generation.roofline(dec, META)
    read_ms = rows[0]["decode_read_mib"] * 2**20 / (READ_GBPS * 1e9) * 1e3
    by = dict(zip(dec["variant"], zip(bound, which)))
    assert by["sdpa"] == (pytest.approx(read_ms), "read")
    assert by["mamba2"] == (pytest.approx(1e12 / (RATE * 1e9) * 1e3), "compute")
    assert list(table.loc[["sdpa", "mamba2"], "bound"]) == ["read", "compute"]
    assert table.loc["mamba2", "time / bound"] == f"{rows[1]['time_ms'] / 1e4:.2f}"
    assert table.loc["sdpa", "compute bound ms"] == \
        generation.T.fmt_num(flops / (RATE * 1e9) * 1e3)


def test_the_compute_bound_takes_the_rate_of_the_rows_device_and_dtype(tmp_path):
    rows = [decode_row("sdpa", 4096, decode_flops=1e9, dtype="bfloat16")]
    meta = {**DECODE_META, "matmul_gflops": {"cpu float32": 1e6, "cpu bfloat16": 1.0}}
    dec, table = _bandwidth(tmp_path, rows, meta)
    assert generation.compute_ms(dec, meta).iloc[0] == pytest.approx(1e3)  # 1e9 at 1 GFLOP/s
    assert table.loc["sdpa", "bound"] == "compute"


def test_a_row_without_a_flop_count_keeps_its_read_bound(tmp_path):
    rows = [decode_row("sdpa", 4096, decode_flops=1e12), decode_row("linear", 4096)]
    dec, table = _bandwidth(tmp_path, rows)
    assert table.loc["linear", "bound"] == "read"
    assert table.loc["linear", "compute bound ms"] == "–"
    bound, _ = generation.roofline(dec, META)
    assert bound.iloc[1] == pytest.approx(generation.bound_ms(dec, READ_GBPS).iloc[1])


def test_the_section_says_roofline_where_rows_count_flops_and_read_where_not(tmp_path):
    """A folder written before decode_flops renders the read bound in its old words and
    columns; one with it, the roofline bound, both bounds and which binds."""
    old = report_run.read(write_run(tmp_path / "old", decode_rows(), META))
    new_rows = [dict(r, decode_flops=1e6) for r in decode_rows()]
    new = report_run.read(write_run(tmp_path / "new", new_rows, META))
    assert not generation.has_roofline(old.dec) and generation.has_roofline(new.dec)
    texts = {}
    for name, run in (("old", old), ("new", new)):
        blocks = generation.generation_blocks(run.dec, run.meta, tmp_path / name)
        texts[name] = " ".join(b[1] for b in blocks if b[0] == "p")
        tables = [b[1] for b in blocks if b[0] == "table"]
        cols = set().union(*(t.columns for t in tables))
        if name == "old":
            assert "time / read bound" in cols and "bound" not in cols
        else:
            assert {"read bound ms", "compute bound ms", "bound", "time / bound"} <= cols
            assert "time / read bound" not in cols
    assert "Decoding is memory-bound." in texts["old"] and "roofline" not in texts["old"]
    assert "roofline bound" in texts["new"] and "memory-bound." not in texts["new"]
    assert "from its read bound" in texts["old"] and "from its read bound" not in texts["new"]
    assert f"matmul cpu float32 {RATE:.0f} GFLOP/s" in texts["new"]


def test_the_exact_bound_table_gives_the_exact_paths_roofline(tmp_path):
    rows = [decode_row("sdpa", n, decode_flops=4 * n * 64 * 8) for n in (4096, 65536)]
    dec = report_run.read(write_run(tmp_path, rows, META)).dec
    t = generation.exact_bound_table(dec, READ_GBPS, META).set_index("context")
    bound, which = generation.roofline(dec, META)
    assert list(t["bound"]) == list(which) == ["read", "read"]
    assert list(t["time / bound"]) == [f"{x:.2f}" for x in dec["time_ms"] / bound]
    assert json.dumps(list(t.columns)) == json.dumps(
        ["exact path", "ms / token", "read bound ms", "compute bound ms", "bound",
         "time / bound"])
