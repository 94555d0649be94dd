"""Issue 54's answers on the report side: one test of "accurate against a softmax"
(tables.softmax_like) for every decode answer, so an own_softmax row (mla) qualifies in
the fastest-decoder table as in the served one; the decode Answers list the recurrences
beside the exact decoder, marked where the folder did not measure their recall; the
trained Answers' best at equal state, a tie named where the seeds' ranges overlap."""

import json

import pandas as pd

from harness.report import decoders, equal_state
from harness.report.build import write_report
from harness.report import run as report_run
from harness.report import tables as T
from harness.report.trained import read_train
from report_synth import (CONTEXTS, DECODE_META, READ_GBPS, decode_row, decode_rows,
                          write_run, write_train)


def _dec(folder, rows):
    return report_run.read(write_run(folder, rows, DECODE_META)).dec


def _mla(n, **over):
    """An mla decode row: its error against the exact softmax of its own keys and values."""
    r = decode_row("sliding_window", n, family="mla", params="{}", err_ref="own_softmax",
                   row_cos=0.9999, time_ms=0.05)
    return r | {"variant": "mla"} | over


def test_softmax_like_counts_own_softmax_and_not_a_recurrence():
    rows = pd.DataFrame({"err_ref": ["softmax", "own_softmax", "recurrence", None]})
    assert list(T.softmax_like(rows)) == [True, True, False, False]
    assert T.softmax_like(rows.iloc[1]) and not T.softmax_like(rows.iloc[2])
    assert T.softmax_like(pd.DataFrame({"x": [1]})).all()  # a run before err_ref


def test_an_own_softmax_row_reaching_the_criterion_qualifies_in_fastest_table(tmp_path):
    n = 65536
    dec = _dec(tmp_path, [decode_row("sdpa", n), _mla(n)])
    (r,) = decoders.fastest_table(dec, {}, None).to_dict("records")
    assert r["fastest decoder"] == "mla"
    assert r["accuracy"] == "row_cos 0.9999 (own softmax)"
    assert r["approximate decoders"] == "mla is faster beyond the spread"


def test_an_own_softmax_row_below_the_criterion_does_not(tmp_path):
    n = 65536
    dec = _dec(tmp_path, [decode_row("sdpa", n), _mla(n, row_cos=0.9)])
    (r,) = decoders.fastest_table(dec, {}, None).to_dict("records")
    assert r["fastest decoder"] == "sdpa"
    assert r["approximate decoders"] == "none reaches row_cos ≥ 0.995"


# -- the decode Answers list the recurrences beside the exact decoder ------------------

def _train(**accuracy):
    return pd.DataFrame({"variant": list(accuracy), "status": ["ok"] * len(accuracy),
                         "accuracy": list(accuracy.values())})


def _tables(blocks) -> dict[str, pd.DataFrame]:
    """Each table of the blocks under the heading before it."""
    out, head = {}, None
    for b in blocks:
        if b[0] == "h":
            head = b[2]
        elif b[0] == "table":
            out[head] = b[1]
    return out


RECURRENCES = "Recurrences beside the exact decoder"


def test_without_train_csv_each_recurrence_is_listed_marked_recall_not_measured(tmp_path):
    dec = _dec(tmp_path, decode_rows())
    t = _tables(decoders.blocks(dec, None, READ_GBPS))[RECURRENCES]
    assert list(t["context"]) == [n for n in CONTEXTS for _ in range(2)]
    assert list(t["recurrence"]) == ["gated_deltanet", "mamba2"] * len(CONTEXTS)
    assert set(t["recall"]) == {"recall not measured in this run"}
    assert set(t["exact path"]) == {"sdpa"}
    m = t[(t["recurrence"] == "mamba2") & (t["context"] == 1048576)].iloc[0]
    sdpa, mamba2 = decode_row("sdpa", 1048576), decode_row("mamba2", 1048576)
    assert m["ms / token"] == T.fmt_num(mamba2["time_ms"])
    assert m["state MiB"] == T.fmt_num(mamba2["decode_state_mib"])
    assert m["its ms / token"] == T.fmt_num(sdpa["time_ms"])
    assert m["× faster than exact"] == f"{sdpa['time_ms'] / mamba2['time_ms']:.1f}"
    assert m["× smaller state"] == T.fmt_num(sdpa["decode_state_mib"]
                                             / mamba2["decode_state_mib"])


def test_without_train_csv_a_faster_recurrence_is_never_the_fastest_accurate_decoder(
        tmp_path):
    """mamba2 decodes faster than sdpa at every context here (0.093 ms a token), and its
    row_cos against its own form is 1.0: without a measured recall it is listed, not
    named."""
    dec = _dec(tmp_path, decode_rows(names=("sdpa", "mamba2")))
    t = _tables(decoders.blocks(dec, None, READ_GBPS))
    fastest = t["Fastest decoder at each context"]
    assert set(fastest["fastest decoder"]) == {"sdpa"}
    assert set(fastest["approximate decoders"]) == {"none reaches row_cos ≥ 0.995"}
    assert set(t[RECURRENCES]["recurrence"]) == {"mamba2"}


def test_with_train_csv_each_recurrence_has_its_trained_recall(tmp_path):
    dec = _dec(tmp_path, decode_rows())
    blocks = decoders.blocks(dec, _train(mamba2=0.95, gated_deltanet=0.5, sdpa=1.0),
                             READ_GBPS)
    t = _tables(blocks)[RECURRENCES].drop_duplicates("recurrence").set_index("recurrence")
    assert t.loc["mamba2", "recall"] == "trained recall 0.950"
    assert t.loc["gated_deltanet", "recall"] == "trained recall 0.500 (below 0.9)"
    # the recurrence that recalls is named; the one below 0.9 is not
    fastest = _tables(blocks)["Fastest decoder at each context"]
    assert set(fastest["fastest decoder"]) == {"mamba2"}
    # a train.csv without the variant: its recall is not measured in this run
    t = _tables(decoders.blocks(dec, _train(mamba2=0.95), READ_GBPS))[RECURRENCES]
    assert set(t[t["recurrence"] == "gated_deltanet"]["recall"]) == {
        "recall not measured in this run"}


def test_a_decode_report_without_recurrences_has_no_recurrence_table(tmp_path):
    dec = _dec(tmp_path, decode_rows(names=("sdpa", "linear")))
    assert RECURRENCES not in _tables(decoders.blocks(dec, None, READ_GBPS))


def test_the_rendered_answers_of_a_decode_folder_without_train_csv_say_so(tmp_path):
    md = write_report(write_run(tmp_path / "d", decode_rows(), DECODE_META)).read_text()
    answers = md[md.index("\n## Answers\n"):md.index("\n## Generation\n")]
    recs = answers[answers.index(f"### {RECURRENCES}"):]
    assert "this folder has no train.csv" in recs
    lines = [ln for ln in recs.splitlines() if ln.startswith("| decode")]
    assert len(lines) == 2 * len(CONTEXTS)
    assert all("| recall not measured in this run |" in ln for ln in lines)


# -- the trained Answers: best at equal state ------------------------------------------

P8 = json.dumps({"num_kv_pairs": 8, "power_a": 0.01, "random_non_queries": False},
                sort_keys=True)


def _seed_row(variant, state_bytes, acc, seed, *, params=None, settled=True):
    params = json.dumps(params or {}, sort_keys=True)
    return {"config_id": f"{variant}-{params}-{seed}", "task": "mqar", "task_params": P8,
            "variant": variant, "family": "recurrent", "params": params, "seq_len": 64,
            "num_kv_pairs": 8, "vocab_size": 64, "causal": True, "d_model": 64, "layers": 1,
            "heads": 2, "mlp": False, "batch": 32, "max_steps": 1000, "device": "cpu",
            "status": "ok", "reason": "", "accuracy": acc, "best_lr": 1e-3,
            "lrs": "[0.001]", "lr_accuracy": "{}", "lr_at_edge": False, "rising": False,
            "steps": 100, "time_to_best_s": 1.0, "steps_to_0_9": None, "step_ms": 5.0,
            "train_s": 2.0, "final_loss": 0.1, "n_params": 1000,
            "state_size": state_bytes // 4, "state_bytes": state_bytes, "chance": 1 / 32,
            "reach": None, "seed": seed, "settled": settled, "steps_run": 800, "threads": 1}


def _seeds(variant, state_bytes, accs, **kw):
    return [_seed_row(variant, state_bytes, a, i, **kw) for i, a in enumerate(accs)]


def _trained(tmp_path, rows):
    return read_train(write_train(tmp_path / "t", rows) / "train.csv")


def test_equal_state_names_a_tie_where_the_seeds_ranges_overlap(tmp_path):
    """gla's median leads mamba2's, but its lowest seed (0.90) is below mamba2's highest
    (0.91): the lead is inside the seeds' spread."""
    tr = _trained(tmp_path, _seeds("gla", 8192, [0.90, 0.92, 0.94])
                  + _seeds("mamba2", 8192, [0.85, 0.88, 0.91])
                  + _seeds("linear", 8192, [0.40, 0.45, 0.50]))
    (r,) = equal_state.table(tr).to_dict("records")
    assert r["best at this state"] == "tie: gla, mamba2"
    assert r["accuracy (median [min–max])"] == "0.920 [0.900–0.940]; 0.880 [0.850–0.910]"
    assert r["next best"] == "linear 0.450 [0.400–0.500]"
    assert (r["state bytes"], r["variants settled"]) == ("8,192", "3 of 3")


def test_equal_state_names_the_winner_where_they_do_not(tmp_path):
    tr = _trained(tmp_path, _seeds("gla", 8192, [0.90, 0.92, 0.94])
                  + _seeds("mamba2", 8192, [0.80, 0.83, 0.86])
                  + _seeds("sdpa", 32768, [1.0, 1.0, 1.0]))  # alone at its state: no row
    (r,) = equal_state.table(tr).to_dict("records")
    assert r["best at this state"] == "gla"
    assert r["accuracy (median [min–max])"] == "0.920 [0.900–0.940]"
    assert r["next best"] == "mamba2 0.830 [0.800–0.860]"


def test_equal_state_ranks_no_unsettled_cell_and_is_in_the_answers(tmp_path):
    rows = (_seeds("gla", 8192, [0.90, 0.92]) + _seeds("mamba2", 8192, [0.99, 0.99],
                                                         settled=False))
    (r,) = equal_state.table(_trained(tmp_path, rows)).to_dict("records")
    assert r["best at this state"] == "only gla settled: none ranked"
    assert r["variants settled"] == "1 of 2"
    md = write_report(tmp_path / "t").read_text()
    answers = md[md.index("\n## Answers\n"):md.index("\n## Quality when trained\n")]
    assert "Best at equal state:" in answers and "| only gla settled: none ranked" in answers
