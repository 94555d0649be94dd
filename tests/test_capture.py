"""harness.models.capture: captured q, k, v against an independent recomputation from the model's
own weights, the model unchanged by capturing, the matrix's captured cases and their bad
input, the error columns, and a small real run through the runner."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import torch

import run_bench
from harness.measure import accuracy
from harness.models import capture
from harness.measure import runner
from harness.models import source as hf
from harness.measure import matrix as mx
from harness.measure.store import RunStore

N, WINDOWS, SEED = 64, 2, 3


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory):
    """A fresh capture cache for this module (workers inherit the variable)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("ATTNBENCH_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield
    mp.undo()


@pytest.fixture(scope="module")
def minilm():
    path = str(hf.minilm_path())
    ids = hf.token_windows(hf.load_tokenizer(path), hf.default_text(), N, WINDOWS, SEED)
    return path, ids


def test_captured_qkv_are_the_layers_projections_of_their_hidden_states(minilm):
    path, ids = minilm
    model, _ = capture.load_capturing(path)
    q, k, v = capture.capture(model, ids, layers=6)
    assert q.shape == k.shape == v.shape == (6 * WINDOWS, 12, N, 32)
    plain, _ = hf.load_model(path)  # transformers' default attention, no capture
    with torch.no_grad():
        out = plain(input_ids=ids, output_hidden_states=True)
        for layer, block in enumerate(plain.encoder.layer):
            h = out.hidden_states[layer]  # (B, N, 384): what enters this layer
            att = block.attention.self
            for got, proj in ((q, att.query), (k, att.key), (v, att.value)):
                want = proj(h).view(WINDOWS, N, 12, 32).transpose(1, 2)  # (B, H, N, D)
                torch.testing.assert_close(got[layer * WINDOWS:(layer + 1) * WINDOWS], want,
                                           rtol=1e-5, atol=1e-5)
        # Capturing leaves the model's computation as it was.
        again = model(input_ids=ids).last_hidden_state
    torch.testing.assert_close(again, out.last_hidden_state, rtol=1e-6, atol=1e-6)
    assert (q[:WINDOWS] - q[WINDOWS:2 * WINDOWS]).abs().max() > 0.1  # layers differ


def test_error_columns_row_cos_and_per_layer():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 3 * 2, 2, 40, 8, generator=g).unbind(0)  # 3 layers x 2 windows
    ref = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5, -1) @ v
    scaled = accuracy.error(2 * ref, q, k, v, False)
    assert abs(scaled.rel_err - 1) < 1e-5 and abs(scaled.row_cos - 1) < 1e-6  # scale-free
    bad = ref.clone()
    bad[2:4] = torch.randn(bad[2:4].shape, generator=g)  # layer 1 only
    e = accuracy.error(bad, q, k, v, False, layers=3)
    assert e.layer_rel_err[0] < 1e-5 and e.layer_rel_err[2] < 1e-5 and e.layer_rel_err[1] > 0.5
    assert e.row_cos < 0.9 and accuracy.error(ref, q, k, v, False).layer_rel_err is None


def test_matrix_cases_record_the_models_shape_and_declare_positions():
    m = mx.normalise({"variants": ["sdpa"], "inputs": ["minilm", "gaussian"], "batch": [1, 2],
                      "heads": 4, "head_dim": 64, "seq_lens": [128, 1024]})
    cases = mx.expand(m)
    got = {(c.input, c.batch, c.heads, c.head_dim, c.seq_len) for c in cases}
    assert ("minilm", 6, 12, 32, 128) in got and ("minilm", 12, 12, 32, 1024) in got
    assert ("gaussian", 2, 4, 64, 128) in got and len(cases) == 8
    far = [c for c in cases if c.input == "minilm" and c.seq_len == 1024]
    assert all(capture.skip_reasons(c) == ["N=1024 is above the 512 positions of model minilm"]
               for c in far)


def _main(tmp_path, capsys, toml: str):
    cfg = tmp_path / "m.toml"
    cfg.write_text(toml)
    code = run_bench.main(["run", "--config", str(cfg), "--results-dir", str(tmp_path / "res"),
                           "--run-id", "x"])
    err = capsys.readouterr().err
    return code, err


def _toml(model, text, extra=""):
    return (f'variants = ["sdpa"]\nseq_lens = [64]\ninputs = ["mine"]\n{extra}\n'
            f'[captures.mine]\nmodel = "{model}"\n' + (f'text = "{text}"\n' if text else ""))


def test_bad_capture_sources_exit_2_and_write_nothing(tmp_path, capsys):
    minilm = hf.minilm_path()
    (tmp_path / "empty.txt").write_text(" \n")
    (tmp_path / "short.txt").write_text("Only a handful of words here.")
    noweights = tmp_path / "noweights"
    noweights.mkdir()
    (noweights / "config.json").write_text(json.dumps(
        {"model_type": "bert", "hidden_size": 32, "num_attention_heads": 2,
         "num_hidden_layers": 1, "architectures": ["BertModel"]}))
    for toml, expect in [
        (_toml(tmp_path / "nope", None), "captures.mine: model "),
        (_toml(minilm, tmp_path / "missing.txt"), "does not exist"),
        (_toml(minilm, tmp_path / "empty.txt"), "is empty"),
        (_toml(noweights, None), "cannot load"),
        (_toml(minilm, tmp_path / "short.txt"), "too short for every length"),
        (_toml(minilm, tmp_path / "short.txt"), "too short for every length"),  # cached: again
        ('inputs = ["gaussian"]\n[captures.gaussian]\nmodel = "x"\n', "is taken by a built-in"),
        ('inputs = ["minilm2"]\n', "unknown 'minilm2'; allowed: gaussian, sharp, local, retrieval, minilm"),
    ]:
        code, err = _main(tmp_path, capsys, toml)
        assert code == 2 and err.count("\n") == 1 and expect in err, (expect, err)
        assert not (tmp_path / "res").exists()


def _rows(folder: Path) -> list[dict]:
    with (folder / "results.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def test_a_small_run_of_captured_cases(tmp_path):
    """minilm and a user's source (the minilm directory copied, a short text) through the runner."""
    mine = tmp_path / "mymodel"
    shutil.copytree(hf.minilm_path(), mine)
    words = hf.default_text().split()[:120]  # ~150 tokens: enough for N=64, not for N=256
    (tmp_path / "t.txt").write_text(" ".join(words))
    m = mx.normalise({"variants": ["sdpa", "linear"], "inputs": ["minilm", "mine"],
                      "seq_lens": [64, 256, 1024], "passes": ["forward"], "min_run_time_s": 0.01,
                      "min_repeats": 2, "captures": {"mine": {"model": str(mine),
                                                               "text": str(tmp_path / "t.txt")}}})
    cases = mx.expand(m)
    assert capture.prepare(cases) == 3  # minilm at 64 and 256, mine at 64; mine at 256 too short
    store = RunStore(tmp_path / "run")
    runner.run(m, cases, store, resume=False)
    rows = {(r["variant"], r["input"], int(r["seq_len"])): r for r in _rows(store.folder)}
    assert len(rows) == len(cases) == 12
    for (variant, inp, n), r in rows.items():
        if n == 1024:
            assert r["status"] == "skipped" and "above the 512 positions" in r["reason"]
        elif inp == "mine" and n == 256:
            assert r["status"] == "skipped" and "fewer than the 254 a window" in r["reason"]
        else:
            assert r["status"] == "ok", r
            assert (r["batch"], r["heads"], r["head_dim"]) == ("6", "12", "32")
            layers = json.loads(r["layer_rel_err"])
            assert len(layers) == 6
            exact = variant == "sdpa"
            assert (float(r["rel_err"]) < 1e-5) == exact and (max(layers) < 1e-5) == exact
            assert (float(r["row_cos"]) > 0.99999) == exact


def test_a_causal_models_captures_are_causal_cases(tmp_path):
    """A tiny random Llama (grouped key/value heads) with minilm's tokenizer: causal cases,
    its 4 query heads (2 key/value heads repeated), its own positions limit."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=30522, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(hf.minilm_path() / f, tmp_path / "llama" / f)
    m = mx.normalise({"variants": ["sdpa"], "inputs": ["llama"], "seq_lens": [32, 256],
                      "causal": [False], "captures": {"llama": {"model": str(tmp_path / "llama")}}})
    cases = mx.expand(m)
    assert [(c.causal, c.batch, c.heads, c.head_dim) for c in cases] == [(True, 2, 4, 8)] * 2
    assert capture.skip_reasons(cases[1]) == ["N=256 is above the 128 positions of model llama"]
    assert capture.prepare(cases) == 1
    q, k, v = capture.load_inputs(cases[0], torch.float32, "cpu")
    assert q.shape == k.shape == v.shape == (2, 4, 32, 8)
    assert torch.equal(k[:, 0], k[:, 1]) and not torch.equal(k[:, 1], k[:, 2])  # kv heads repeated
    model, tok = capture.load_capturing(str(tmp_path / "llama"))
    plain, _ = hf.load_model(str(tmp_path / "llama"))
    ids = hf.token_windows(tok, hf.default_text(), 32, 1, cases[0].seed)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits)
