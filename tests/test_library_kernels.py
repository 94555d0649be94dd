"""Library kernels as variants: their pattern tables against our masks, the worker's
compile_ms, and the report's Implementations section. (Exactness against the float64
reference is the conformance kit's, for every registered variant.)"""

import importlib.util
import json

import pandas as pd
import pytest
import torch

import variants
from harness.measure.matrix import Case
from harness.report.implementations import fastest_from, implementations_blocks
from harness.measure.worker import run_case


def _dense(mask, N, causal):
    i = torch.arange(N)
    m = mask(i, i)
    return m & (i[None, :] <= i[:, None]) if causal else m


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name,params,N", [
    ("sliding_window_flex", {"window": 256}, 1000), ("sliding_window_flex", {"window": 64}, 700),
    ("sliding_window_flex", {"window": 3}, 300), ("block_sparse_flex", {}, 1000),
    ("block_sparse_flex", {"block_size": 32, "random_blocks": 1}, 999)])
def test_flex_block_tables_match_the_pattern(name, params, N, causal):
    """Touched blocks hold an allowed pair, full blocks only allowed pairs (our key_mask,
    evaluated densely here): the BlockMask skips nothing the pattern needs."""
    m = variants.build(name, **params)
    touched, full = m.tables(N, causal)
    b = m._block()
    nb = -(-N // b)
    dense = torch.nn.functional.pad(_dense(m.key_mask(N), N, causal),
                                    (0, nb * b - N, 0, nb * b - N))
    per_block = dense.view(nb, b, nb, b).transpose(1, 2).reshape(nb, nb, b * b)
    assert torch.equal(touched, per_block.any(-1))
    assert torch.equal(full, per_block.all(-1))  # padding counts as masked


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["sliding_window_sdpa_mask", "block_sparse_sdpa_mask"])
def test_sdpa_mask_is_the_pattern(name, causal):
    m = variants.build(name)
    N = 500
    assert torch.equal(m.mask(N, causal, torch.device("cpu")), _dense(m.key_mask(N), N, causal))
    assert m.memory_bytes(1, 4, 4096, 64, torch.float32) >= 4096 * 4096 * 5


@pytest.mark.skipif(importlib.util.find_spec("xformers") is None,
                    reason="xformers is not installed (its biases are checked where it is)")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window,N", [(0, 10), (3, 50), (64, 300), (400, 300)])
def test_xformers_window_bias_is_our_band(window, N, causal):
    from variants.library.xformers_bias import window_bias

    bias = window_bias(window, causal).materialize((N, N), dtype=torch.float32)
    ours = _dense(variants.build("sliding_window_xformers", window=window).key_mask(N), N, causal)
    assert torch.equal(bias == 0, ours)
    assert torch.isneginf(bias[~ours]).all()


def _case(variant):
    return Case(variant, json.dumps({"window": 16}), "cpu", "float32", 1, 2, 16, 200, False,
                "forward", "gaussian", 0, 0.01, 2, 60.0, 1, 64, 0)


def test_worker_records_compile_ms_only_for_variants_that_prepare():
    prepared = run_case(_case("sliding_window_sdpa_mask"), "time")
    plain = run_case(_case("sliding_window"), "time")
    assert prepared["status"] == plain["status"] == "ok", (prepared, plain)
    assert prepared["compile_ms"] > 0 and "compile_ms" not in plain
    # Same pattern, same inputs: the same error against full exact attention.
    assert prepared["rel_err"] == pytest.approx(plain["rel_err"], rel=1e-4)


def _row(variant, N, t, causal=False, family="sliding_window"):
    return {"variant": variant, "family": family, "params": '{"window": 256}',
            "setting": f"cpu float32 · causal={causal}", "pass": "forward", "seq_len": N,
            "time_ms": t, "status": "ok", "compile_ms": 900.0 if "flex" in variant else None}


def test_fastest_from_names_the_winner_and_where_it_starts():
    rows = [_row("sliding_window", n, t) for n, t in ((512, 1), (2048, 5), (8192, 20))]
    rows += [_row("sliding_window_flex", n, t) for n, t in ((512, 2), (2048, 4), (8192, 10))]
    rows += [_row("sliding_window_sdpa_mask", n, t) for n, t in ((512, 0.5), (2048, 30))]
    df = pd.DataFrame(rows)
    pivot = df.pivot_table(index="variant", columns="seq_len", values="time_ms")
    text = fastest_from(pivot)
    assert text.startswith("sliding_window_flex is fastest from N = 2048 on")
    assert "sliding_window_sdpa_mask at N = 512" in text and "N = 8192" in text
    blocks = implementations_blocks(df.assign(family="sliding_window"))
    tables = [b[1] for b in blocks if b[0] == "table"]
    assert len(tables) == 1 and set(tables[0]["variant"]) == set(pivot.index)
    assert list(tables[0]["compile_ms"]) == ["–", "900", "–"]


def test_a_family_with_one_implementation_has_no_group():
    df = pd.DataFrame([_row("sliding_window", 512, 1.0), _row("linear", 512, 1.0, family="linear")])
    blocks = implementations_blocks(df)
    assert [b for b in blocks if b[0] == "table"] == []


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name, params", [("sliding_window_sdpa_mask", {"window": 5}),
                                          ("block_sparse_sdpa_mask", {"block_size": 4})])
def test_sdpa_mask_built_in_row_blocks_is_the_pattern(monkeypatch, name, params, causal):
    """The N x N mask is filled a few rows at a time (no int64 N x N temporary); with
    blocks of 3 to 4 rows, a ragged last block included, it is still the whole pattern."""
    from variants import dense_mask
    from variants.library import sdpa_mask

    monkeypatch.setattr(sdpa_mask, "_BLOCK_PAIRS", 101)
    for n in (1, 33, 100):
        m = variants.build(name, **params)
        want = dense_mask(n, causal, m.key_mask(n))
        assert torch.equal(m.mask(n, causal, torch.device("cpu")), want), n
