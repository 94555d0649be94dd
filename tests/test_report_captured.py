"""The report of a run with captured inputs: answers on real attention first, by row_cos;
the per-layer error table; short labels with a settings key; readable HTML."""

import json

import pytest

from harness.report.build import write_report
from report_synth import row, write_run

LAYERS = [0.3, 0.1, 0.2, 0.05, 0.4, 0.6]


def _captured(variant, n, rel, cos, time_ms, **over):
    """A minilm row (6 layers x 1 window, 12 heads, head dim 32) built from a synthetic one."""
    layers = None if rel is None else json.dumps([round(x * rel / 0.3, 4) for x in LAYERS])
    return row(variant, n, "gaussian", time_ms=time_ms, input="minilm", batch=6, heads=12,
               head_dim=32, rel_err=rel, row_cos=cos, layer_rel_err=layers, **over)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    rows = []
    for n in (128, 512):
        rows += [_captured("sdpa", n, 2e-7, 1.0, 1.0), _captured("standard", n, 2e-7, 1.0, 3.0),
                 _captured("nystrom", n, 0.3, 0.97, 0.8),
                 _captured("sliding_window", n, 0.05, 0.998, 2.0,
                           params=json.dumps({"window": 64})),
                 _captured("sliding_window", n, 0.01, 0.9999, 4.0,
                           params=json.dumps({"window": 256}))]
        rows += [row(v, n, "gaussian", row_cos=c) for v, c in
                 (("sdpa", 1.0), ("standard", 1.0), ("nystrom", 0.9996), ("performer", 0.6))]
    rows.append(_captured("sdpa", 1024, None, None, None, status="skipped",
                          reason="N=1024 is above the 512 positions of model minilm"))
    folder = write_run(tmp_path_factory.mktemp("runs") / "cap", rows)
    return folder, write_report(folder).read_text(), (folder / "report.html").read_text()


def _section(md, title):
    start = md.index(f"## {title}\n")
    end = md.find("\n## ", start + 1)
    return md[start:end if end > 0 else None]


def _table_rows(text):
    return [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines()
            if line.startswith("|") and not line.startswith("|:")]


def test_answers_lead_with_real_attention_and_use_row_cos(report):
    _, md, _ = report
    answers = _section(md, "Answers")
    first_table = answers[:answers.index("Why the row cosine")]
    header, first = _table_rows(first_table)[:2]
    assert "fastest with row_cos ≥ 0.995" in header and "most accurate approximate" in header
    # minilm first, at 512 (1024 is above its positions: no case ran there).
    cell = dict(zip(header, first))
    assert (cell["input"], cell["N"], cell["heads"]) == ("minilm", "512", "12")
    assert cell["fastest with row_cos ≥ 0.995"] == "sdpa"  # sliding_window(64) is 2x slower
    assert cell["most accurate approximate"] == "sliding_window(window=256)"
    table = [dict(zip(header, r)) for r in _table_rows(first_table)[1:]]
    assert [r["input"] for r in table] == ["minilm", "gaussian"]
    gauss = next(r for r in table if r["input"] == "gaussian" and r["N"] == "512")
    assert gauss["fastest with row_cos ≥ 0.995"] == "sdpa"  # nystrom is slower at 512
    assert (gauss["most accurate approximate"], gauss["its row_cos"]) == ("nystrom", "0.9996")
    assert "near-uniform attention of i.i.d. inputs" in answers


def test_error_per_layer_table(report):
    _, md, _ = report
    section = _section(md, "Error per layer on captured inputs")
    assert "### minilm · non-causal · cpu float32 B6 H12 D32 · N = 512" in section
    rows = _table_rows(section[section.index("N = 512"):])
    header = rows[0]
    assert header[:7] == ["variant"] + [f"layer {i}" for i in range(6)]
    nys = dict(zip(header, next(r for r in rows if r[0] == "nystrom")))
    assert nys["layer 5"] == "6.00e-01" and nys["layer 3"] == "5.00e-02"
    assert nys["row_cos"] == "0.9700"


def test_short_labels_and_their_key(report):
    _, md, _ = report
    settings = _section(md, "Variant settings")
    assert "| sliding_window(window=64)" in settings and "| nystrom " in settings
    assert "landmarks=64" in settings  # the full parameters of the bare `nystrom` label
    assert "nystrom(landmarks=64)" not in md


def test_html_is_styled_without_stray_columns(report):
    folder, _, html = report
    assert "th{background" in html and "nth-child(even)" in html
    assert "<th>col</th>" not in html
    assert (folder / "plots" / "pareto_captured.png").is_file()
    assert (folder / "plots" / "pareto.png").is_file()
