"""The `model` command: a variant inside a pretrained model, through run_bench.main.

Exact paths and exact limits must leave the model unchanged; approximate variants must
not; bad input ends with one line and exit 2 before anything is written.
"""

import shutil

import pandas as pd
import pytest
import torch

import run_bench
from harness.models import source as hf
from harness.drift.store import COLUMNS


def _main(capsys, *argv):
    code = run_bench.main(["model", "--threads", "1", *map(str, argv)])
    return code, capsys.readouterr()


def _rows(folder):
    df = pd.read_csv(folder / "model.csv")
    assert list(df.columns) == COLUMNS
    return df.set_index("variant")


@pytest.fixture(scope="module")
def tokenizer():
    return hf.load_tokenizer(str(hf.minilm_path()))


@pytest.fixture(scope="module")
def short_text(tmp_path_factory, tokenizer):
    """About 1100 tokens of the shipped text: enough for N = 1024, too short for N = 2048."""
    path = tmp_path_factory.mktemp("text") / "short.txt"
    path.write_text(" ".join(hf.default_text().split()[:700]))
    assert 1022 <= len(tokenizer(path.read_text())["input_ids"]) < 2046
    return path


def test_minilm_exact_paths_keep_the_model_and_approximations_do_not(tmp_path, capsys,
                                                                      short_text):
    args = ("--text", short_text, "--seq-lens", "64,1024,2048", "--windows", "2",
            "--variants", "sdpa,sliding_window(window=64),linformer(k=16),linear",
            "--results-dir", tmp_path, "--run-id", "r")
    code, out = _main(capsys, *args)
    assert code == 0, out.err
    df = _rows(tmp_path / "r")
    n64, n1024, n2048 = (df[df["seq_len"] == n] for n in (64, 1024, 2048))
    assert (n64["status"] == "ok").all() and (n64["model"] == "minilm").all()
    for exact in ("sdpa", "sliding_window"):  # window 64 >= N: every key in every row
        assert n64.loc[exact, "emb_cos"] >= 0.99999
        assert n64.loc[exact, "hidden_rel_err"] <= 1e-5
    for approx in ("linformer", "linear"):
        assert n64.loc[approx, "hidden_rel_err"] > 1e-2
        assert n64.loc[approx, "emb_cos"] < 0.999
    assert (n64["time_ms"] > 0).all() and (n64["peak_mem_mib"] > 0).all()
    assert n64[["kl", "ppl_ratio"]].isna().all().all()  # an encoder: no next-token columns
    # N = 1024 is above MiniLM's positions; the text is too short for N = 2048 (too).
    assert (n1024["status"] == "skipped").all() and (n2048["status"] == "skipped").all()
    assert n1024["reason"].str.contains("exceeds the model's 512 positions").all()
    assert n2048["reason"].str.contains(r"has \d+ tokens, fewer than the 2046").all()

    before = (tmp_path / "r" / "model.csv").read_bytes()
    code, out = _main(capsys, *args)  # the same run again: nothing measured, nothing lost
    assert code == 0 and "done earlier" in out.out
    assert (tmp_path / "r" / "model.csv").read_bytes() == before


@pytest.fixture(scope="module")
def tiny_causal_lm(tmp_path_factory, tokenizer):
    """A 2-layer random Llama with grouped-query attention (4 heads, 2 kv heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, initializer_range=0.3)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_causal_lm_exact_path_has_no_kl_and_linear_has(tmp_path, capsys, tiny_causal_lm):
    code, out = _main(capsys, "--model", tiny_causal_lm, "--seq-lens", "64", "--windows", "2",
                      "--variants", "sdpa,linear,nystrom", "--results-dir", tmp_path,
                      "--run-id", "r")
    assert code == 0, out.err
    df = _rows(tmp_path / "r")
    assert df["causal"].all()
    sdpa, linear = df.loc["sdpa"], df.loc["linear"]
    assert sdpa["status"] == linear["status"] == "ok"
    assert abs(sdpa["kl"]) <= 1e-9 and sdpa["ppl_ratio"] == pytest.approx(1, abs=1e-6)
    assert linear["kl"] > 1e-2 and abs(linear["ppl_ratio"] - 1) > 1e-3
    assert df[["emb_cos", "hidden_rel_err"]].isna().all().all()  # an LM: no embedding columns
    assert df.loc["nystrom", "status"] == "skipped"
    assert "non-causal only" in df.loc["nystrom", "reason"]


def _bad(capsys, tmp_path, *argv, match):
    folder = tmp_path / "runs"
    code, out = _main(capsys, *argv, "--seq-lens", "64", "--results-dir", folder, "--run-id", "r")
    assert code == 2
    assert out.err.startswith("attnbench: error:") and out.err.count("\n") == 1, out.err
    assert match in out.err, out.err
    assert not (folder / "r" / "model.csv").exists()


def test_bad_models(tmp_path, capsys):
    from transformers import BloomConfig, BloomForCausalLM

    _bad(capsys, tmp_path, "--model", tmp_path / "nope", match="no such directory")
    no_weights = tmp_path / "no-weights"  # MiniLM's config and tokenizer, no weights
    shutil.copytree(hf.minilm_path(), no_weights,
                    ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    _bad(capsys, tmp_path, "--model", no_weights, match="cannot load it")
    bloom = tmp_path / "bloom"  # BLOOM computes attention in its own code
    BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=2)) \
        .save_pretrained(bloom)
    _bad(capsys, tmp_path, "--model", bloom, match="cannot be swapped")


def test_bad_texts_variants_and_folders(tmp_path, capsys):
    _bad(capsys, tmp_path, "--text", tmp_path / "missing.txt", match="does not exist")
    (tmp_path / "empty.txt").write_text("\n")
    _bad(capsys, tmp_path, "--text", tmp_path / "empty.txt", match="is empty")
    (tmp_path / "few.txt").write_text("only a few words here")
    _bad(capsys, tmp_path, "--text", tmp_path / "few.txt", match="too short for every")
    _bad(capsys, tmp_path, "--variants", "nosuch", match="unknown variant")
    _bad(capsys, tmp_path, "--variants", "linformer(k=0)", match="'k'")
    _bad(capsys, tmp_path, "--windows", "1,2", match="one integer")
    other = tmp_path / "runs" / "r"  # a folder that is not a run: untouched
    other.mkdir(parents=True)
    (other / "notes.txt").write_text("mine")
    _bad(capsys, tmp_path, match="not an attnbench run")
    assert [p.name for p in other.iterdir()] == ["notes.txt"]


def test_attention_function_grouped_heads_causal_and_refusals():
    """The adapter on its own: GQA against torch's repeat_interleave and SDPA, refusals."""
    import types

    import variants
    from harness.models.attention import attention_function

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 10, 16, generator=g)
    k, v = torch.randn(2, 1, 2, 10, 16, generator=g).unbind(0)  # 2 kv heads for 4 heads
    fn = attention_function(variants.build("sdpa"))
    layer = types.SimpleNamespace(is_causal=True)
    out, weights = fn(layer, q, k, v, None, scaling=16 ** -0.5)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), is_causal=True)
    assert weights is None and out.shape == (1, 10, 4, 16)  # (B, N, H, D)
    torch.testing.assert_close(out, ref.transpose(1, 2))
    with pytest.raises(ValueError, match="attention mask"):
        fn(layer, q, k, v, torch.zeros(1, 1, 10, 10))
    with pytest.raises(ValueError, match="scaling"):
        fn(layer, q, k, v, None, scaling=0.5)
    with pytest.raises(ValueError, match="dropout"):
        fn(layer, q, k, v, None, dropout=0.1)


def test_default_job_runs_the_drift_into_the_matrix_folder(tmp_path, monkeypatch):
    from harness.cli import model as cli_model
    from harness.cli import report as cli_report
    from harness.cli import run as cli_run

    calls = []
    folder = tmp_path / "results" / "20260101-000000"
    monkeypatch.setattr(cli_run, "run_default", lambda: calls.append("run") or folder)
    monkeypatch.setattr(cli_model, "run_model", lambda args: calls.append(
        ("model", args.model, args.seq_lens, args.windows, args.results_dir, args.run_id)))
    monkeypatch.setattr(cli_report, "report_dir", lambda d: calls.append(("report", d)) or 0)
    assert run_bench.main([]) == 0
    assert calls == ["run", ("model", "minilm", "512", "1", folder.parent, folder.name),
                     ("report", folder)]
