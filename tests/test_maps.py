"""Attention maps: what harness.measure.maps computes and saves, what the report draws from
the file alone, and the `maps` command."""

from __future__ import annotations


import matplotlib.image
import numpy as np
import pytest
import torch

import run_bench
import variants
from harness.files import MAPS
from harness.measure import accuracy
from harness.measure import maps
from harness.measure import matrix as mx
from harness.measure.inputs import make_inputs
from harness.report import maps as report_maps
from harness.report.build import write_report
from report_synth import synthetic_rows, write_run

SETTINGS = [("sliding_window", {"window": 4}), ("performer", {"num_features": 32}),
            ("linformer", {"k": 8}), ("nystrom", {"num_landmarks": 8}),
            ("scatterbrain", {"window": 4, "num_features": 16})]


@pytest.mark.parametrize("causal", [False, True])
def test_compute_gives_each_variants_own_map_difference_and_row_cosine(causal):
    N = 64
    q, k, v = make_inputs("local", 1, 1, N, 16, seed=1)
    exact, records, arrays = maps.compute(q, k, v, causal, SETTINGS)
    assert exact.shape == (N, N) and exact.dtype == np.float16
    np.testing.assert_allclose(exact.astype(np.float64).sum(-1), 1, atol=3e-3)
    for (name, params), rec in zip(SETTINGS, records):
        m = variants.build(name, **params)
        if causal and not m.contract.supports_causal:  # declared, with the variant's own reason
            assert rec["status"] == "skipped" and "non-causal only" in rec["reason"]
            continue
        assert rec["status"] == "ok", rec
        w = m.weights(q, k, causal)[0, 0].double()
        np.testing.assert_allclose(arrays[rec["map"]], w.numpy(), atol=1e-3, rtol=1e-2)
        want = (w - torch.softmax(((q @ k.transpose(-1, -2)).double() / 4).masked_fill(
            torch.ones(N, N, dtype=torch.bool).triu(1) & causal, -torch.inf), -1)[0, 0]).abs()
        np.testing.assert_allclose(arrays[rec["diff"]], want.numpy(), atol=1e-4, rtol=1e-2)
        with torch.no_grad():
            o = m(q, k, v, causal=causal)
        assert rec["row_cos"] == pytest.approx(accuracy.error(o, q, k, v, causal).row_cos)
    signed = {r["variant"]: r.get("neg_mass") for r in records}
    assert signed["sliding_window"] == 0 and signed["performer"] == 0
    if not causal:
        assert signed["linformer"] > 0.1  # a Gaussian projection gives signed weights


def test_maps_above_the_drawn_size_are_block_means():
    N = 600  # blocks of 3 x 3 tokens: 200 x 200
    q, k, v = make_inputs("gaussian", 1, 1, N, 16)
    exact, records, arrays = maps.compute(q, k, v, False, SETTINGS[:1])
    assert exact.shape == arrays["map_0"].shape == (200, 200)
    # block means of rows summing to 1: each block row sums to 1 / 3
    np.testing.assert_allclose(exact.astype(np.float64).sum(-1), 1 / 3, atol=2e-3)


def test_a_runs_settings_skip_exact_variants_and_library_twins():
    _, cases = mx.load("cpu", {"inputs": ["gaussian"]})
    drawn = maps.settings_of(cases)
    names = [n for n, _ in drawn]
    assert not {"standard", "sdpa", "xformers"} & set(names)
    # library kernels with block_sparse's defaults / sliding_window's window=256: our map
    assert "block_sparse_flex" not in names and "sliding_window_sdpa_mask" not in names
    assert [p["window"] for n, p in drawn if n == "sliding_window"] == [64, 256]
    assert {"scatterbrain", "longshort", "performer", "nystrom"} <= set(names)


def test_a_run_without_capture_maps_the_local_input(tmp_path):
    _, cases = mx.load("quick", {"inputs": ["gaussian"], "variants": ["sdpa", "linear"]})
    path = maps.write(tmp_path, cases)
    assert path == tmp_path / MAPS
    meta, arrays = report_maps.load(path)
    assert meta["input"] == "local" and meta["seq_len"] == 512 and meta["layer"] is None
    assert [r["variant"] for r in meta["variants"]] == ["linear"]
    assert set(arrays) == {"exact", "map_0", "diff_0"}


def test_the_report_opens_with_the_grid_read_from_the_file(tmp_path):
    folder = write_run(tmp_path / "run", synthetic_rows((1024, 4096)))
    md = write_report(folder).read_text()
    assert "## Attention maps\n\nNo maps.npz" in md  # none yet: said, not hidden
    q, k, v = make_inputs("local", 1, 1, 96, 16)
    exact, records, arrays = maps.compute(q, k, v, False, SETTINGS[:2])
    maps.save(folder / MAPS, exact, records, arrays,
              {"input": "local", "layer": None, "head": 0, "seq_len": 96, "causal": False})
    md = write_report(folder).read_text()
    first = md.index("\n## ")
    assert md[first:].startswith("\n## Attention maps\n")
    assert "![attention maps" in md and "row cosine" in md
    img = matplotlib.image.imread(folder / "plots" / "attention_maps.png")
    w, h = report_maps.grid_size_px(2)
    assert img.shape[:2] == (h, w) and img[..., :3].std() > 0.05
    html = (folder / "report.html").read_text()
    assert html.index("<h2>Attention maps</h2>") < html.index("<h2>Answers</h2>")


def test_maps_command_draws_a_chosen_head_into_a_file(tmp_path, capsys):
    out = tmp_path / "m.png"
    assert run_bench.main(["maps", "--input", "local", "--seq-len", "80", "--causal",
                           "--variants", "sliding_window(window=4),nystrom(num_landmarks=8)",
                           "--output", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"maps: {out}" in said and "no map for nystrom" in said
    meta, arrays = report_maps.load(out.with_suffix(".npz"))
    assert meta["causal"] and meta["seq_len"] == 80 and arrays["exact"].shape == (80, 80)
    assert np.triu(arrays["map_0"].astype(np.float32), 1).max() == 0
    assert matplotlib.image.imread(out).shape[:2] == report_maps.grid_size_px(1)[::-1]


@pytest.mark.parametrize("argv,message", [
    (["--seq-len", "600"], "at most 512"),
    (["--layer", "6"], "layers 0..5"),
    (["--input", "local", "--head", "1"], "one head"),
    (["--input", "nope"], "--input"),
    (["--seq-len", "5000", "--input", "local"], "<= 4096"),
    (["--variants", "nope"], "unknown variant"),
    (["--output", "x.jpg", "--input", "local", "--seq-len", "16"], ".png"),
])
def test_maps_command_refuses_bad_input_with_status_2(argv, message, capsys):
    assert run_bench.main(["maps", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_run_with_a_capture_maps_its_layer_and_head_nearest_512(tmp_path, monkeypatch):
    from harness.models import capture

    monkeypatch.setenv("ATTNBENCH_CACHE", str(tmp_path / "cache"))
    _, cases = mx.load("quick", {"inputs": ["gaussian", "minilm"], "seq_lens": [64, 96],
                                 "variants": ["sdpa", "sliding_window"], "batch": [2]})
    capture.prepare(cases)
    (q, k, v), about = maps.head_inputs(cases, layer=4, head=7)
    assert about == {"input": "minilm", "layer": 4, "head": 7, "seq_len": 96, "causal": False}
    case = next(c for c in cases if c.input == "minilm" and c.seq_len == 96)
    full = capture.load_inputs(case, torch.float32, "cpu")  # (6 layers x 2 windows, 12, N, 32)
    for got, want in zip((q, k, v), full):
        assert torch.equal(got, want[4 * 2:4 * 2 + 1, 7:8])  # layer-major: layer 4, window 0
