"""The report's "Answers" section: the fastest accurate variant per setting (forward and
forward+backward rows), the fastest decoder at each context (decoders.py), the fastest
variant that learned to recall (trained.py) and the fewest attention layers a stack needs
to (hybrid.py), each where the folder holds its rows."""

from __future__ import annotations

from harness.report import captured as RC
from harness.report import decoders, hybrid, text_state
from harness.report import tables as T
from harness.report import trained as report_trained
from harness.report.run import Run, varying

TITLE = "Answers"


def blocks(run: Run) -> list[tuple]:
    if run.results is None and run.train is None and run.text is None:
        return []
    out: list[tuple] = [("h", 2, TITLE)]
    if not run.df.empty:
        out += _benchmark(run)
        if not T.against_own(run.df).empty:
            out.append(("p", T.OWN_REFERENCE))
    if not run.dec.empty:
        out += decoders.blocks(run.dec, run.train, run.meta.get("read_bandwidth_gbps"))
        out += decoders.served_blocks(run.dec, run.meta, run.train)
    if run.train is not None:
        out += report_trained.answer_blocks(run.train, run.timed)
        out += hybrid.answer_blocks(run.train)
    if run.text is not None:  # the answers on text are in "Quality on text"
        out.append(("p", f"Bits per byte on text: see \"{text_state.TEXT_TITLE}\" (its "
                         "answers: the best at each state size, the fastest step within 2% "
                         "of sdpa's, the recall order against the text order)."))
    return out


def _benchmark(run: Run) -> list[tuple]:
    """The fastest accurate variant per setting, then each variant's slopes and crossover."""
    df, view = run.df, run.view
    column, text = T.criterion(df)
    captured = RC.captured_inputs(df)
    out: list[tuple] = [
        ("p", f"Fastest variant with {text} (against float64 exact attention), per "
              "setting, at the largest length every variant was run at, and at "
              "N = 16384 and 4096 when measured"
              + (f"; real attention ({', '.join(captured)}: q, k, v captured from a "
                 "pretrained model's layers) first, synthetic inputs after." if captured
                 else ".")
              + (" Beside it, the approximate variant closest to exact attention." if
                 column == "row_cos" else "")
              + " A setting that is exact attention at its length (a window or block "
                "layout covering every pair, marked [exact at N]) counts as an exact "
                "path. An approximate path is the answer only where the fastest exact "
                "path is slower by more than the two times' spread (the sum of their "
                "IQRs, or of their spreads between rounds where the run has rounds); "
                "otherwise the row says \"no faster approximate path\"."
              + (" This run predates the `exact` column: only the exact family counts "
                 "as exact here." if df["exact"].isna().all() else "")),
        ("table", T.fastest_accurate(T.against_softmax(df), varying(df)))]
    if column == "row_cos":
        out.append(("p", RC.WHY_CRITERION))
    if view.empty:
        return out
    first = view.iloc[0]
    summary = T.slope_table(df)
    setting_rows = df[df["setting"] == first["setting"]]
    cross = T.crossover_table(setting_rows)
    if not cross.empty and not summary.empty:
        summary = summary.merge(cross, on="variant", how="left").fillna("–")
    return out + [
        ("p", "Each variant: its empirical complexity (log-log slope k of time and of "
              "peak memory against N, median over input distributions) and the length "
              f"from which it beats the exact paths (setting: {first['setting']})."),
        ("table", summary)]
