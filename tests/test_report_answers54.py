"""Issue 54's answers on the report side: one test of "accurate against a softmax"
(tables.softmax_like) for every decode answer, so an own_softmax row (mla) qualifies in
the fastest-decoder table as in the served one."""

import pandas as pd

from harness.report import decoders
from harness.report import run as report_run
from harness.report import tables as T
from report_synth import DECODE_META, decode_row, write_run


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
