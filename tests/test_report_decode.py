"""The report's decode lines: the Answers name accurate decoders only (exact, row_cos >=
0.995 against exact attention, or a recurrence whose trained recall reaches 0.9), the
Generation section keeps its two references apart, and its read bound counts the bytes a
step moves (decode_read_mib) at the run's read rate, beside every "× faster than exact"."""

from pathlib import Path

import pandas as pd
import pytest

from harness.report import decoders, generation
from harness.report import run as report_run
from harness.report.build import write_report
from report_synth import (CONTEXTS, DECODE_META, READ_GBPS, decode_row, decode_rows,
                          write_run)

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20


def _dec(folder, rows):
    return report_run.read(write_run(folder, rows, DECODE_META)).dec


def _train(**accuracy):
    return pd.DataFrame({"variant": list(accuracy), "status": ["ok"] * len(accuracy),
                         "accuracy": list(accuracy.values())})


def _section(md: str, title: str) -> str:
    start = md.index(f"\n## {title}\n")
    end = md.find("\n## ", start + 1)
    return md[start:end if end > 0 else None]


def test_decode_quiet_answers_name_sdpa_or_say_nothing_approximate_qualifies():
    """results/decode-quiet (sdpa, sliding_window, linear, performer, moba and two
    recurrences, no train.csv): its window decodes 3737x faster than sdpa at 1M tokens
    with a row_cos of -0.0001; the answer is sdpa at every context."""
    run = report_run.read(REPO / "results" / "decode-quiet")
    table = decoders.fastest_table(run.dec, {}, run.meta["read_bandwidth_gbps"])
    assert sorted(table["context"]) == [4096, 65536, 1048576]
    for _, r in table.iterrows():
        assert r["fastest decoder"] == "sdpa" or "none reaches" in r["approximate decoders"]
        assert r["accuracy"].startswith("row_cos ") and float(r["accuracy"].split()[1]) >= 0.995


def test_no_accurate_approximation_names_the_exact_path_and_says_so(tmp_path):
    table = decoders.fastest_table(_dec(tmp_path, decode_rows()), {}, READ_GBPS)
    assert list(table["context"]) == list(CONTEXTS)
    assert set(table["fastest decoder"]) == {"sdpa"}
    assert set(table["approximate decoders"]) == {"none reaches row_cos ≥ 0.995"}
    assert set(table["accuracy"]) == {"row_cos 1.0000"}
    assert set(table["× faster"]) == {"1.0"}


def test_an_approximation_reaching_the_criterion_is_named_with_its_row_cos(tmp_path):
    rows = decode_rows(names=("sdpa", "linear", "mamba2"))
    rows += [decode_row("sliding_window", n, row_cos=0.9991) for n in CONTEXTS]
    table = decoders.fastest_table(_dec(tmp_path, rows), {}, READ_GBPS).set_index("context")
    assert list(table["fastest decoder"]) == ["sliding_window"] * 3
    assert list(table["accuracy"]) == ["row_cos 0.9991"] * 3
    sdpa = decode_row("sdpa", 1048576)["time_ms"]
    assert table.loc[1048576, "× faster"] == f"{sdpa / 0.065:.1f}"


def test_an_approximation_within_the_spread_of_exact_is_not_the_answer(tmp_path):
    n = 4096
    exact = decode_row("sdpa", n, time_ms=0.10, time_ms_iqr=0.004)
    close = decode_row("sliding_window", n, row_cos=0.999, time_ms=0.097, time_ms_iqr=0.004)
    (r,) = decoders.fastest_table(_dec(tmp_path, [exact, close]), {}, None).to_dict("records")
    assert r["fastest decoder"] == "sdpa"
    assert r["approximate decoders"].startswith("none faster beyond the spread (sliding_window")


def test_a_window_covering_the_context_is_an_exact_path(tmp_path):
    rows = [decode_row("sdpa", 4096), decode_row("sliding_window", 4096, exact=True,
                                                 row_cos=1.0, params='{"window": 4096}')]
    (r,) = decoders.fastest_table(_dec(tmp_path, rows), {}, None).to_dict("records")
    assert r["exact path"] == "sliding_window" == r["fastest decoder"]
    assert r["approximate decoders"] == "none reaches row_cos ≥ 0.995"


def test_a_recurrence_is_named_only_where_it_learned_to_recall(tmp_path):
    dec = _dec(tmp_path, decode_rows())
    recall = decoders.recall_of(_train(mamba2=0.95, gated_deltanet=0.5, sliding_window=0.97))
    assert recall == {"mamba2": 0.95, "sliding_window": 0.97}
    table = decoders.fastest_table(dec, recall, READ_GBPS)
    assert set(table["fastest decoder"]) == {"mamba2"}  # 0.093 ms against sdpa's
    assert set(table["accuracy"]) == {"trained recall 0.950"}
    # the window recalls but its tokens are far from attention's: only the recall line has it
    blocks = decoders.blocks(dec, _train(mamba2=0.95, sliding_window=0.97), READ_GBPS)
    tables = [b[1] for b in blocks if b[0] == "table"]  # fastest, recurrences, by recall
    assert set(tables[-1]["fastest decoder"]) == {"sliding_window"}
    assert set(tables[-1]["accuracy"]) == {"trained recall 0.970"}
    assert list(tables[-1]["× faster"]) == [f"{decode_row('sdpa', n)['time_ms'] / 0.065:.1f}"
                                           for n in CONTEXTS]
    heads = [b[2] for b in decoders.blocks(dec) if b[0] == "h"]
    assert not any("trained recall" in h for h in heads)  # no train.csv: no recall line


def test_the_recall_line_counts_an_exact_path_that_recalls(tmp_path):
    """At a short context the cache is small: sdpa, which recalls, decodes fastest."""
    dec = _dec(tmp_path, [decode_row("sdpa", 1024, time_ms=0.05),
                          decode_row("sliding_window", 1024)])
    (r,) = decoders.fastest_table(dec, {"sdpa": 1.0, "sliding_window": 0.97}, None,
                                  by_recall=True).to_dict("records")
    assert r["fastest decoder"] == "sdpa" and r["accuracy"] == "trained recall 1.000"


def test_beside_each_faster_than_exact_the_exact_paths_time_over_its_read_bound(tmp_path):
    rows = decode_rows(names=("sdpa", "linear"))
    rows += [decode_row("sliding_window", n, row_cos=0.999) for n in CONTEXTS]
    dec = _dec(tmp_path, rows)
    table = decoders.fastest_table(dec, {}, READ_GBPS).set_index("context")
    for n in CONTEXTS:
        sdpa = decode_row("sdpa", n)
        bound = sdpa["decode_read_mib"] * MIB / (READ_GBPS * 1e9) * 1e3
        want = f"{sdpa['time_ms'] / bound:.2f}"
        assert table.loc[n, "exact's time / read bound"] == want
        gen = generation.exact_bound_table(dec, READ_GBPS).set_index("context")
        assert gen.loc[n, "time / read bound"] == want and gen.loc[n, "exact path"] == "sdpa"
    assert set(decoders.fastest_table(dec, {}, None)["exact's time / read bound"]) == {"–"}


def test_the_read_bound_counts_the_bytes_a_step_moves(tmp_path):
    """A recurrence rewrites its state each step: decode_read_mib (read + write) is twice
    its state, and the bound is those bytes at the read rate."""
    table = generation.bandwidth_table(_dec(tmp_path, decode_rows()), READ_GBPS)
    m = table[(table["variant"] == "mamba2") & (table["context"] == 4096)].iloc[0]
    r = decode_row("mamba2", 4096)
    moved = 2 * r["decode_state_mib"]
    assert m["moved MiB"] == f"{moved:.3g}" and m["state MiB"] == f"{moved / 2:.3g}"
    assert m["read bound ms"] == f"{moved * MIB / (READ_GBPS * 1e9) * 1e3:.3g}"
    assert m["time / read bound"] == f"{r['time_ms'] / (moved * MIB / (READ_GBPS * 1e6)):.2f}"


@pytest.fixture(scope="module")
def decode_report(tmp_path_factory):
    folder = write_run(tmp_path_factory.mktemp("dec") / "d", decode_rows(), DECODE_META)
    return write_report(folder).read_text()


def test_the_answers_of_a_decode_run_name_no_inaccurate_decoder(decode_report):
    answers = _section(decode_report, "Answers")
    fastest = answers[:answers.index("### Recurrences beside the exact decoder")]
    rows = [line for line in fastest.splitlines() if line.startswith("| decode")]
    assert len(rows) == 3
    assert all(line.split("|")[3].strip() == "sdpa" for line in rows)


def test_generation_keeps_the_two_references_apart_and_says_which_is_which(decode_report):
    gen = _section(decode_report, "Generation")
    soft = gen[gen.index("against float64 exact causal attention (err_ref softmax)"):]
    soft = soft[:soft.index("err_ref recurrence")]
    own = gen[gen.index("each recurrence's own float64 reference (err_ref recurrence)"):]
    own = own[:own.index("Decodes faster")]
    assert "| sdpa " in soft and "| linear " in soft and "| mamba2 " not in soft
    assert "| mamba2 " in own and "| gated_deltanet " in own and "| sdpa " not in own
    assert "its sequential recurrence, or its causal forward in float64" in gen
    assert "not exact attention" in gen


def test_generation_says_what_the_read_bound_assumes(decode_report):
    gen = _section(decode_report, "Generation")
    assert "in the state's own dtype" in gen and "written back" in gen
    assert "(decode_read_mib)" in gen
    assert "baseline of every × faster than exact" in gen

