"""The `lm` task and the state tasks wired into the trainer (issue 50): a metric per task,
bits per byte counted once per predicted byte, the floors, the mixer `none`, beta_max, the
causality check before training, and the inputs refused with exit 2.

Planted bugs: labels off by one against the bytes they predict (the tiling check fails);
a mixer that reads ahead (the causality check refuses it before a step); a race or a stop
that reads bits per byte as higher-is-better (the bpb race and settling tests); a unigram
model whose bits per byte is not exactly the unigram floor; beta_max not reaching the
trained layer (its range test); a bad corpus or setting found after the folder was made.
"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
import torch.nn as nn

import run_bench
import variants
from harness.train import corpus as corpora
from harness.train import lm, race, rows, tasks, text_metrics, text_windows, trainer
from harness.train import matrix as tm

WORDS = ("the of and to in is for on that with as by this be are from or an at it not which "
         "can def return class import self value key").split()


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    """A small corpus: 300 documents of 60 words and a key=value pair each."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("corpus") / "c.jsonl"
    with path.open("w") as f:
        for i in range(300):
            text = " ".join(rng.choice(WORDS) for _ in range(60)) + f" key{i}={i * 7}"
            f.write(json.dumps({"text": text}) + "\n")
    yield f"path:{path}"
    lm.clear_cache()


def _raw(corpus, **over):
    raw = {"task": "lm", "corpus": corpus, "variants": ["sdpa"], "seq_lens": 32,
           "vocab_size": 256, "d_model": 16, "heads": 2, "mlp": True, "layers": 1,
           "lrs": [3e-3], "batch": 8, "max_steps": 20, "warmup": 2, "eval_every": 10,
           "early_stop": 0.0, "val_examples": 16, "threads": 1}
    raw.update(over)
    return raw


def _config(corpus, **over):
    return tm.expand(tm.normalise(_raw(corpus, **over)))[0]


class Unigram(nn.Module):
    """Predicts the train split's add-one unigram at every position, whatever it reads."""

    blocks = ()

    def __init__(self, train):
        super().__init__()
        self.logp = text_metrics.unigram_logprobs(train)  # float64

    def forward(self, tokens, where=None):
        out = self.logp.expand(*tokens.shape, -1)
        return out[where] if where is not None else out


# -- tasks and their metric ------------------------------------------------------------------
def test_every_task_declares_its_metric_and_the_new_ones_are_registered():
    assert {"parity", "mod_sum", "permutations", "lm"} <= set(tasks.names())
    assert {n: tasks.get(n).metric for n in tasks.names()} == {
        **{n: "accuracy" for n in tasks.names()}, "lm": "bits_per_byte"}
    assert tasks.get("lm").higher_is_better is False and tasks.get("mqar").higher_is_better
    assert tasks.get("parity").plateau(16, 2) == 0.5
    assert tasks.get("mod_sum").plateau(16, 5, m=5) == pytest.approx(0.2)
    assert tasks.score("bits_per_byte", 2.5) == -2.5 and tasks.score("accuracy", 0.5) == 0.5
    with pytest.raises(ValueError, match="metric must be one of"):
        tasks.Task(**{**tasks.get("mqar").__dict__, "name": "x", "metric": "perplexity"})


# -- bits per byte: exact, every byte once --------------------------------------------------
def test_a_unigram_model_scores_exactly_unigram_bpb_on_test_and_validation(jsonl):
    config = _config(jsonl)
    train, (vx, vy), _ = lm.data(config)
    model = Unigram(train)
    got = lm.test_scores(model, config, "cpu")
    assert got["bits_per_byte"] == pytest.approx(got["unigram_bpb"], rel=1e-12)
    assert got["bigram_bpb"] < got["unigram_bpb"]
    _, _, (_, ty) = lm.data(config)  # it always guesses train's commonest byte
    top = int(model.logp.argmax())
    assert got["accuracy"] == pytest.approx(float((ty == top).sum() / (ty != -100).sum()))
    # the trainer's validation number is the same definition (mean nats / ln 2)
    _, loss = trainer.evaluate(model, vx, vy, torch.device("cpu"))
    assert loss / math.log(2) == pytest.approx(text_metrics.unigram_bpb(train, vy), rel=1e-6)
    assert rows.plateau_of(config)[0] == pytest.approx(text_metrics.unigram_bpb(train, vy))


def _counts_every_byte_once(data, inputs, labels):
    scored = labels != text_windows.IGNORE
    assert torch.equal(labels[scored], data[1:]), "the labels are not the split's bytes 1.."
    assert torch.equal(inputs[:, 1:][scored[:, :-1]], labels[:, :-1][scored[:, :-1]]), \
        "a label is not the next input"


def test_the_test_set_predicts_every_byte_but_the_first_once_and_the_next_one(jsonl):
    config = _config(jsonl)
    _, _, (tx, ty) = lm.data(config)
    _counts_every_byte_once(text_windows.split_tensor(lm.corpus_of(config), "test"), tx, ty)
    x, y = text_windows.train_windows(text_windows.split_tensor(lm.corpus_of(config), "train"),
                                      4, 32, torch.Generator().manual_seed(0))
    assert torch.equal(x[:, 1:], y[:, :-1])


@pytest.mark.parametrize("shift", [1, -1])
def test_a_planted_off_by_one_in_the_targets_fails(jsonl, shift):
    config = _config(jsonl)
    data = text_windows.split_tensor(lm.corpus_of(config), "test")
    tx, ty = text_windows.eval_windows(data, 32)
    planted = torch.roll(ty.flatten(), shift).view_as(ty)  # every label a byte off
    with pytest.raises(AssertionError):
        _counts_every_byte_once(data, tx, planted)


# -- the trainer's lm path -------------------------------------------------------------------
def test_an_lm_run_trains_on_fresh_windows_and_reports_its_text_columns(jsonl):
    config = _config(jsonl, variants=["none"])
    run = trainer.Run(config, 3e-3, plateau=rows.plateau_of(config)[0])
    got = run.advance(config.max_steps)
    assert got["metric"] == "bits_per_byte" and got["score"] == -got["value"]
    assert [s for s, _ in got["history"]] == [10, 20]
    assert got["value"] == min(v for _, v in got["history"])
    row = rows.combine(config, [(3e-3, got, 1.0)])
    for col in rows.TEXT_FIELDS + ("val_bits_per_byte", "accuracy", "metric"):
        assert row[col] is not None, col
    assert row["metric"] == "bits_per_byte" and 0 < row["hit_share"] < 1
    assert row["bits_per_byte"] < 8.0 and row["unigram_bpb"] > row["bigram_bpb"]
    assert json.loads(row["lr_accuracy"]) == {"0.003": round(got["value"], 5)}


def test_none_is_the_block_without_its_mixer_and_no_benchmark_variant():
    m = variants.build("none")
    q = torch.randn(1, 2, 8, 4)
    assert torch.equal(m(q, q, q, causal=True), torch.zeros_like(q))
    assert m.state_size(64, 32) == 0
    assert "none" not in variants.names() and "none" in variants.names(private=True)


# -- the metric in the race, the stop and the outcome ----------------------------------------
def _bpb(value, stopped="settled", plateau=4.0):
    return {"status": "ok", "metric": "bits_per_byte", "score": -value, "value": value,
            "accuracy": 0.3, "plateau": plateau, "val_scored": 1000, "stopped": stopped,
            "steps_run": 100}


def test_the_race_keeps_the_lowest_bits_per_byte_and_cuts_only_beyond_the_margin():
    results = {1e-3: _bpb(2.50, None), 3e-3: _bpb(2.40, None), 1e-2: _bpb(2.41, None)}
    assert race.keep(list(results), results) == [3e-3, 1e-2]  # 2.50 is 0.1 bits behind
    on_plateau = {1e-3: _bpb(3.99, None), 3e-3: _bpb(3.995, None)}
    assert race.keep(list(on_plateau), on_plateau) == [1e-3, 3e-3]
    assert race.beyond([1e-3, 3e-3], {1e-3: _bpb(2.2), 3e-3: _bpb(2.5)}, early_stop=0.0) \
        == pytest.approx(3.3e-4)


def test_settling_and_the_outcome_read_bits_per_byte_as_lower_is_better(jsonl):
    falling = [[s, 3.0 - s / 1000] for s in range(100, 2100, 100)]  # still improving
    flat = [[s, 2.0] for s in range(100, 2100, 100)]
    sc = lambda h: [[s, -v] for s, v in h]  # noqa: E731
    assert not trainer.settled(sc(falling), 500, 0.02, 0.0, floor=-3.98)
    assert trainer.settled(sc(flat), 500, 0.02, 0.0, floor=-3.98)
    config = _config(jsonl)
    plateau = rows.plateau_of(config)[0]
    assert rows.run_outcome(config, _bpb(plateau - 0.5, plateau=plateau)) == "learned"
    assert rows.run_outcome(config, _bpb(plateau - 0.01, plateau=plateau)) == "not_learned"
    config = _config(jsonl, early_stop=0.5)  # a target in bits per byte
    assert trainer.target_score(config) == -0.5


# -- causality before training ---------------------------------------------------------------
@variants.register
class _Peek(variants.Variant):
    """Planted: each position reads the mean of the values from there to the end."""
    name = "_peek_ahead"
    family = "test"

    def attend(self, q, k, v, causal):
        return v.flip(-2).cumsum(-2).flip(-2) / v.shape[-2]

    def state_size(self, N, D):
        return 0


def test_a_mixer_that_reads_ahead_fails_the_causality_check_before_any_step(jsonl,
                                                                           monkeypatch):
    monkeypatch.setattr(trainer.Run, "_one_step", lambda self: pytest.fail("trained"))
    with pytest.raises(trainer.NotCausal, match="_peek_ahead is not causal"):
        trainer.Run(_config(jsonl, variants=["_peek_ahead"]), 1e-3, plateau=4.0)
    for name in ("sdpa", "none", "gated_deltanet"):  # causal mixers pass
        trainer.check_causal_model(trainer.build_model(_config(jsonl, variants=[name])),
                             _config(jsonl, variants=[name]), "cpu")


# -- beta_max --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["deltanet", "gated_deltanet"])
def test_beta_max_2_declares_its_range_reaches_the_layer_and_matches_the_recurrence(name):
    m = variants.build(name, beta_max=2.0)
    beta = next(s for s in m.contract.inputs if s.name == "beta")
    assert (beta.low, beta.high) == (0.0, 2.0)
    ins = m.draw_inputs(1, 2, 100, 8, seed=0, dtype=torch.float64)
    assert ins["beta"].max() > 1.0 and beta.in_range(ins["beta"])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 100, 8, generator=g, dtype=torch.float64) for _ in range(3))
    ref = m.reference(q, k, v, **ins)
    assert float((m(q, k, v, causal=True, **ins) - ref).norm() / ref.norm()) < 1e-10
    from harness.train.input_layers import InputLayer
    layer = InputLayer(beta, 16, 2)
    nn.init.constant_(layer.proj.weight, 1.0)
    out, _ = layer(torch.full((1, 4, 16), 3.0))
    assert 1.9 < float(out.detach().max()) < 2.0
    assert variants.build(name).contract.inputs[-1].high == 1.0


# -- refused before anything runs: exit 2, one line ------------------------------------------
def _cli(tmp_path, body, capsys):
    config = tmp_path / "m.toml"
    config.write_text(body)
    out = tmp_path / "results"
    rc = run_bench.main(["train", "--config", str(config), "--results-dir", str(out),
                         "--run-id", "r"])
    err = capsys.readouterr().err
    return rc, err, out


def _tv(v) -> str:
    """A TOML value."""
    if isinstance(v, dict):
        return "{" + ", ".join(f'"{k}" = {_tv(x)}' for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_tv(x) for x in v) + "]"
    return json.dumps(v)


def _toml(**over) -> str:
    raw = {k: v for k, v in _raw("python-docs").items()}
    raw.update(over)
    return "".join(f"{k} = {_tv(v)}\n" for k, v in raw.items())


@pytest.mark.parametrize("over,words", [
    ({"corpus": "path:/nonexistent/corpus"}, "does not exist"),
    ({"corpus": "hf:some/dataset"}, "needs the optional package `datasets`"),
    ({"task": "mod_sum", "m": 1, "vocab_size": 4, "corpus": None}, "m must be an integer >= 2"),
    ({"task": "parity", "seq_lens": 3, "vocab_size": 2, "corpus": None}, "no scored position"),
    ({"variants": {"deltanet": [{"beta_max": 3.0}]}}, "'beta_max' must be <= 2.0"),
    ({"variants": {"gated_deltanet": [{"beta_max": 0.5}]}}, "'beta_max' must be >= 1.0"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, monkeypatch,
                                                          over, words):
    monkeypatch.setattr("importlib.util.find_spec",
                        lambda name, *a: None if name == "datasets" else _find(name, *a))
    body = _toml(**{k: v for k, v in over.items() if v is not None})
    if over.get("corpus", "") is None:
        body = "".join(line + "\n" for line in body.splitlines() if "corpus" not in line)
    rc, err, out = _cli(tmp_path, body, capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and words in err, err
    assert not out.exists()


_find = __import__("importlib.util").util.find_spec


def test_a_path_that_holds_no_text_is_exit_2(tmp_path, capsys):
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "a.bin").write_bytes(b"\0\1\2")
    rc, err, out = _cli(tmp_path, _toml(corpus=f"path:{folder}"), capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "holds no text" in err
    assert not out.exists()


def test_train_meta_records_the_splits_and_a_changed_corpus_is_exit_2_on_resume(
        tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("harness.train.estimate.probe_all", lambda configs, *a, **k: {})
    folder = tmp_path / "docs"
    folder.mkdir()
    rng = random.Random(1)
    for i in range(120):
        (folder / f"{i:03d}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(40)))
    corpus = f"path:{folder}"
    lm.clear_cache()
    body = _toml(corpus=corpus, max_steps=10, eval_every=10, val_examples=8)
    (tmp_path / "m.toml").write_text(body)
    out = tmp_path / "results"
    from harness.cli.train import run_train  # the CLI's sweep, without the report after it
    run_train(str(tmp_path / "m.toml"), {}, out, "r")
    capsys.readouterr()
    meta = json.loads((out / "r" / "train_meta.json").read_text())
    recorded = meta["corpora"][corpus]
    assert recorded == corpora.describe(corpus)
    row = next(iter(_read_rows(out / "r")))
    assert row["metric"] == "bits_per_byte" and float(row["bits_per_byte"]) > 0
    (folder / "000.txt").write_text("edited " * 50)  # another corpus under the same name
    lm.clear_cache()
    rc, err, _ = _cli(tmp_path, body, capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "differs from the one" in err
    lm.clear_cache()


def _read_rows(folder):
    import csv
    with (folder / "train.csv").open(newline="") as f:
        return list(csv.DictReader(f))


# -- the presets -----------------------------------------------------------------------------
def test_the_lm_and_state_presets_train_what_the_issue_asks():
    from harness.measure.matrix import read_toml

    lm_cpu = tm.expand(tm.normalise({k: v for k, v in read_toml("lm-cpu").items()
                                     if k != "workers"}))
    assert {c.variant for c in lm_cpu} == {
        "none", "sdpa", "sliding_window", "linear", "retention", "gla", "mamba2", "deltanet",
        "gated_deltanet", "kda", "moba", "dsa", "nsa", "gated_deltanet*3+sdpa"}
    assert {c.task for c in lm_cpu} == {"lm"} and all(c.early_stop == 0 for c in lm_cpu)
    assert all(len(c.seeds) == 2 and c.causal for c in lm_cpu)
    state = tm.expand(tm.normalise({k: v for k, v in read_toml("state-cpu").items()
                                    if k != "workers"}))
    beta = {(c.variant, json.loads(c.params).get("beta_max", 1.0)) for c in state}
    assert beta == {("sdpa", 1.0), ("mamba2", 1.0), ("gla", 1.0), ("kda", 1.0),
                    ("deltanet", 1.0), ("deltanet", 2.0), ("gated_deltanet", 1.0),
                    ("gated_deltanet", 2.0)}
    assert {(c.task, c.seq_len) for c in state} == {
        (t, n) for t in ("parity", "mod_sum") for n in (16, 64)}
    assert all(len(c.seeds) == 2 and c.heads == 4 for c in state)
    gpu = tm.normalise({k: v for k, v in read_toml("lm-gpu").items() if k != "workers"})
    assert {c.device for c in tm.expand(gpu)} == {"cuda"}
