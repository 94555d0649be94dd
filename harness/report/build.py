"""The report of a run folder: report.md, a self-contained report.html and plots/*.png.

Reads results.csv and meta.json only (docs/results.md); the document
is built once as a list of blocks, then rendered to Markdown (DataFrame.to_markdown) and to
HTML (DataFrame.to_html, plots inlined as base64 PNG).
"""

from __future__ import annotations

import base64
import html
import json
import re
from pathlib import Path

import pandas as pd

from harness.report import generation
from harness.report import plots
from harness.report import captured as RC
from harness.report import maps as report_maps
from harness.report import model as report_model
from harness.report import trained as report_trained
from harness.report import tables as T
from harness.report import provenance
from harness.report.implementations import implementations_blocks
from harness.report.rounds import rounds_blocks
from harness.files import RESULTS
from harness.report.folder import SETTING, load_run, short_labels

SECTIONS = ("Attention maps", "Answers", "Timing drift between rounds", "Error per layer on captured inputs",
            "Empirical complexity", "Crossover lengths", "Implementations",
            "Time, memory and error by length",
            "Scaling plots", "Pareto front: error against time", "Achieved GFLOP/s",
            "Cases not measured", "Variant settings", "Environment")


def _varying(df: pd.DataFrame) -> list[str]:
    """The setting columns that take more than one value in this run (pass, input always)."""
    return [c for c in SETTING if c in ("pass", "input") or df[c].nunique() > 1]


def _with_lines(df: pd.DataFrame) -> pd.DataFrame:
    """Add `line`: the label, plus the setting columns the plot facets do not separate."""
    extra = [c for c in _varying(df) if c not in ("pass", "input")]
    suffix = [" ".join(("causal" if r["causal"] else "non-causal") if c == "causal" else str(r[c])
                       for c in extra) for _, r in df[extra].iterrows()] if extra else [""] * len(df)
    return df.assign(line=[f"{lb} [{s}]" if s else lb for lb, s in zip(df["label"], suffix)])


def _primary(df: pd.DataFrame) -> pd.DataFrame:
    """One shape/pass slice for the Pareto and GFLOP/s views: forward, non-causal, most rows."""
    ok = T.against_softmax(T.ok_rows(df))  # error axes: never two references in one view
    if ok.empty:
        return ok
    if (ok["pass"] == "forward").any():
        ok = ok[ok["pass"] == "forward"]
    if (~ok["causal"]).any():
        ok = ok[~ok["causal"]]
    shape = ["device", "dtype", "batch", "heads", "head_dim"]
    top = ok.groupby(shape).size().idxmax()
    return ok[(ok[shape] == pd.Series(top, index=shape)).all(axis=1)]


def _pareto_lengths(view: pd.DataFrame) -> list[int]:
    lengths = sorted(set(view["seq_len"].astype(int)))
    wanted = [lengths[-1]] + [n for n in (16384, 4096) if n in lengths]
    return sorted(set(wanted))


def _answers(df, view, blocks):
    column, text = T.criterion(df)
    captured = RC.captured_inputs(df)
    blocks += [("h", 2, "Answers"),
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
               ("table", T.fastest_accurate(T.against_softmax(df), _varying(df)))]
    if column == "row_cos":
        blocks.append(("p", RC.WHY_CRITERION))
    if view.empty:
        return
    first = view.iloc[0]
    summary = T.slope_table(df)
    setting_rows = df[df["setting"] == first["setting"]]
    cross = T.crossover_table(setting_rows)
    if not cross.empty and not summary.empty:
        summary = summary.merge(cross, on="variant", how="left").fillna("–")
    blocks += [("p", "Each variant: its empirical complexity (log-log slope k of time and of "
                     "peak memory against N, median over input distributions) and the length "
                     f"from which it beats the exact paths (setting: {first['setting']})."),
               ("table", summary)]


def build_blocks(df: pd.DataFrame, meta: dict, run_dir: Path) -> list[tuple]:
    """The report as blocks: ("h", level, text), ("p", text), ("table", df), ("img", path, alt),
    ("code", text). Writes the plots into run_dir/plots as it goes."""
    df = RC.captured_first(df)
    labels = short_labels(zip(df["variant"], df["params"]))  # only what varies, per variant
    df["label"] = [labels[(v, p)] for v, p in zip(df["variant"], df["params"])]
    df, dec = generation.split(df)  # decode rows: the Generation section alone reads them
    if df.empty:
        return _decode_only_blocks(dec, meta, run_dir)
    captured = df["input"].isin(RC.captured_inputs(df))
    views = [v for v in (_with_lines(_primary(df[captured])), _with_lines(_primary(df[~captured])))
             if not v.empty]
    view = views[0] if views else _with_lines(_primary(df))
    counts = df["status"].value_counts()
    blocks: list[tuple] = [
        ("h", 1, f"attnbench report: {run_dir.name}"),
        ("p", f"{len(df)} cases, {df['label'].nunique()} variant configurations, lengths "
              f"{', '.join(str(n) for n in sorted(df['seq_len'].unique()))}. Status: "
              + ", ".join(f"{s} {n}" for s, n in counts.items()) + ". Times are medians (ms), "
              "memory is the peak above the inputs (MiB), error is ||o - o_ref||_F / ||o_ref||_F "
              "(rel_err) and row_cos the mean cosine of o's rows to o_ref's.")]
    blocks += report_maps.maps_blocks(run_dir)
    _answers(df, view, blocks)
    if not T.against_own(df).empty:
        blocks.append(("p", T.OWN_REFERENCE))
    blocks += generation.answers_lines(dec, report_trained.load(run_dir))
    blocks += rounds_blocks(df, meta)

    tables = RC.layer_tables(T.against_softmax(df))
    blocks += [("h", 2, "Error per layer on captured inputs"),
               ("p", "rel_err of each variant on each model layer's own q, k, v (layers "
                     "differ: attention sharpens or spreads with depth), then over all "
                     "layers, and the mean row cosine." if tables else
                     "No captured inputs in this run (inputs = [\"minilm\"] adds them).")]
    for title, table in tables:
        blocks += [("h", 3, title), ("table", table)]

    blocks += [("h", 2, "Empirical complexity"),
               ("p", "Least-squares slope k of log(metric) against log(N) over each variant's "
                     "ok lengths (time ~ N^k); median over input distributions."),
               ("table", T.slope_table(df))]

    blocks += [("h", 2, "Crossover lengths"),
               ("p", "Smallest N from which the variant stays faster (lighter) than each exact "
                     "path, interpolated in log-log space between measured lengths. "
                     "\"always\": at every measured length; \"beyond range (> N)\": not yet at "
                     "the largest measured length.")]
    for setting, g in df.groupby("setting", sort=False):
        table = T.crossover_table(g)
        if not table.empty:
            blocks += [("h", 3, setting), ("table", table)]

    blocks += generation.generation_blocks(dec, meta, run_dir)
    blocks += implementations_blocks(df)

    blocks += [("h", 2, "Time, memory and error by length"),
               ("p", "Cells hold the median where the case ran, else its status. Ratio tables "
                     "hold the value over sdpa's / over standard's in the same setting.")]
    for setting, g in df.groupby("setting", sort=False):
        blocks += [("h", 3, setting),
                   ("p", "time_ms"), ("table", T.metric_pivot(g, "time_ms")),
                   ("p", "time ratio"), ("table", T.ratio_pivot(g, "time_ms")),
                   ("p", "peak_mem_mib"), ("table", T.metric_pivot(g, "peak_mem_mib")),
                   ("p", "memory ratio"), ("table", T.ratio_pivot(g, "peak_mem_mib"))]
        if (T.ok_rows(g)["state_mib"] > 0.5).any():  # a variant keeps a mask or features
            blocks += [("p", "state_mib (kept between calls, beside each call's peak)"),
                       ("table", T.metric_pivot(g, "state_mib"))]
        for rows, ref in ((T.against_softmax(g), "float64 exact attention"),
                          (T.against_own(g), "each variant's own float64 recurrence")):
            if rows.empty:
                continue
            blocks += [("p", f"rel_err against {ref}"),
                       ("table", T.metric_pivot(rows, "rel_err", T.fmt_err))]
            if "row_cos" in rows.columns and rows["row_cos"].notna().any():
                blocks += [("p", f"row_cos against {ref}"),
                           ("table", T.metric_pivot(rows, "row_cos", lambda x: f"{x:.4f}"))]

    ok = _with_lines(T.ok_rows(df))
    blocks.append(("h", 2, "Scaling plots"))
    if not ok.empty:
        pdir = run_dir / "plots"
        for metric, ylabel, band, name in (
                ("time_ms", "time (ms), band: IQR", "time_ms_iqr", "time"),
                ("peak_mem_mib", "peak memory of a call (MiB);\n× dotted: state kept", None,
                 "memory"),
                ("rel_err", "relative error", None, "error")):
            rows = T.against_softmax(ok) if metric == "rel_err" else ok
            if rows.empty:
                continue
            path = plots.scaling_plot(rows, metric, ylabel, pdir / f"{name}_vs_length.png", band,
                                      also="state_mib" if metric == "peak_mem_mib" else None)
            blocks.append(("img", path, f"{name} against sequence length"))
        own = T.against_own(ok)
        if not own.empty:  # a plot of its own: another reference, never on the same axes
            path = plots.scaling_plot(own, "rel_err", "relative error against\nits own float64 "
                                      "recurrence", pdir / "error_recurrence_vs_length.png")
            blocks.append(("img", path, "error against its own recurrence, by length"))

    blocks += _budget_blocks(df, run_dir)

    blocks.append(("h", 2, "Pareto front: error against time"))
    for v in views:  # captured inputs first
        lengths = _pareto_lengths(v)
        kind = "captured" if v["input"].isin(RC.captured_inputs(df)).all() else "synthetic"
        name = "pareto_captured.png" if kind == "captured" else "pareto.png"
        errv, err, ylabel = T.error_axis(v)
        path = plots.pareto_plot(errv, lengths, run_dir / "plots" / name, err, ylabel)
        blocks += [("h", 3, f"{kind} inputs"),
                   ("p", f"Setting: {v.iloc[0]['setting'].split(' · ', 1)[0]} · "
                         f"{v.iloc[0]['setting'].rsplit(' · ', 1)[1]}, non-causal where "
                         "measured. The front: no other variant is both faster and more "
                         "accurate."), ("img", path, f"error against time, {kind} inputs")]
        for n in lengths:
            blocks += [("h", 4, f"N = {n}"), ("table", T.pareto_table(v, n))]

    rates = T.matmul_rates(meta)
    gflops = T.gflops_table(df, rates)
    slow = int((gflops["flag"] != "").sum()) if "flag" in gflops else 0
    blocks += [("h", 2, "Achieved GFLOP/s"),
               ("p", "Analytic FLOPs over the median time, best over lengths, set against "
                     "the matmul rate measured on the same device in the same dtype: "
                     + (T.matmul_note(meta) + "." if rates else "not recorded in meta.json.")
                     + (f" {slow} of {len(gflops)} rows run below half of it (flagged)."
                        if rates else "")),
               ("table", gflops)]
    if not view.empty:
        key = f"{view.iloc[0]['device']} {view.iloc[0]['dtype']}"
        blocks.append(("img", plots.gflops_plot(ok, rates.get(key), run_dir / "plots" / "gflops.png",
                                                f"{key} matmul"), "achieved GFLOP/s"))

    blocks += _closing_blocks(pd.concat([df, dec], ignore_index=True), meta)
    return blocks


def _budget_blocks(df: pd.DataFrame, run_dir: Path) -> list[tuple]:
    """Row cosine against the keys a query attends to, for every sparse row (fixed and
    content-routed patterns: those with a keys_per_query that are not exact there)."""
    rows = T.against_softmax(T.ok_rows(df))
    if "row_cos" not in rows.columns:
        return []
    rows = rows[(rows["pass"] == "forward") & rows["keys_per_query"].notna()
                & rows["row_cos"].notna() & (rows["exact"] != True)]  # noqa: E712
    if rows.empty:
        return []
    path = plots.budget_plot(rows, run_dir / "plots" / "error_vs_budget.png")
    return [("h", 2, "Error against the budget of keys"),
            ("p", "Each sparse variant, fixed pattern (a window, a block layout) or routed by "
                  "content (top-k blocks, pages, keys), at the mean number of keys a query "
                  "attends to (results.csv keys_per_query) over the keys it could see; "
                  "forward rows. topk, the oracle, is the ceiling a k-sparse method can reach."),
            ("img", path, "error against the budget of keys")]


def _decode_only_blocks(dec: pd.DataFrame, meta: dict, run_dir: Path) -> list[tuple]:
    """A run of decode cases alone: its Generation section and the closing sections."""
    counts = dec["status"].value_counts()
    blocks: list[tuple] = [
        ("h", 1, f"attnbench report: {run_dir.name}"),
        ("p", f"{len(dec)} decode cases, contexts "
              f"{', '.join(str(n) for n in sorted(dec['seq_len'].unique()))}. Status: "
              + ", ".join(f"{s} {n}" for s, n in counts.items()) + "."),
        ("h", 2, "Answers")]
    blocks += generation.answers_lines(dec, report_trained.load(run_dir))
    blocks += generation.generation_blocks(dec, meta, run_dir)
    return blocks + _closing_blocks(dec, meta)


def _closing_blocks(df: pd.DataFrame, meta: dict) -> list[tuple]:
    """Cases not measured, the variant settings and the environment."""
    blocks: list[tuple] = []
    status = T.status_table(df)
    blocks += [("h", 2, "Cases not measured"),
               ("p", "Every skipped, oom, timeout, error and nonfinite case, with its reason."
                     if not status.empty else "None: every case ran."), ("table", status)]

    blocks += [("h", 2, "Variant settings"),
               ("p", "Labels name only the parameters that tell a variant's settings in this "
                     "run apart; here is each one in full."), ("table", RC.settings_table(df))]

    env = {k: v for k, v in meta.items() if k not in ("matrix", "shards")}
    blocks += [("h", 2, "Environment")]
    # a sharded run (meta.json's shard records): where its cases ran, and warnings about it
    blocks += [("p", note) for note in provenance.environment_notes(meta, set(df["device"]))]
    if meta.get("shards"):
        blocks.append(("table", pd.DataFrame(provenance.shard_rows(meta["shards"]))))
    blocks += [("table", pd.DataFrame({"key": list(env), "value": [
                   json.dumps(v) if isinstance(v, (dict, list)) else str(v) for v in env.values()]})),
               ("p", "The matrix as run:"), ("code", json.dumps(meta.get("matrix"), indent=1))]
    return blocks


def to_markdown(blocks: list[tuple], run_dir: Path) -> str:
    out = []
    for b in blocks:
        if b[0] == "h":
            out.append(f"{'#' * b[1]} {b[2]}")
        elif b[0] == "p":
            out.append(b[1])
        elif b[0] == "table" and not b[1].empty:
            out.append(b[1].fillna("–").to_markdown(index=False, disable_numparse=True))
        elif b[0] == "img":
            out.append(f"![{b[2]}]({b[1].relative_to(run_dir).as_posix()})")
        elif b[0] == "code":
            out.append(f"```json\n{b[1]}\n```")
    return "\n\n".join(out) + "\n"


_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1d1d1f;
  max-width:1400px;margin:2em auto;padding:0 1.5em;line-height:1.45}
h1{font-size:1.6em;margin-bottom:.2em}
h2{font-size:1.3em;margin-top:2em;padding-bottom:.2em;border-bottom:2px solid #d0d7de}
h3{font-size:1.05em;margin-top:1.4em;color:#333}h4{font-size:.95em;margin:1em 0 .3em;color:#555}
p{max-width:110ch}
table{max-width:100%;border-collapse:collapse;font-size:13px;margin:.6em 0 1.2em;
  font-variant-numeric:tabular-nums;box-shadow:0 1px 2px rgba(0,0,0,.06)}
th{background:#f1f3f5;font-weight:600;text-align:right;position:sticky;top:0}
td,th{border:1px solid #d8dee4;padding:4px 9px;text-align:right;overflow-wrap:break-word}
td{overflow-wrap:anywhere}td.word,th.word{white-space:nowrap}
td:first-child,th:first-child{text-align:left}
tbody tr:nth-child(even){background:#fafbfc}tbody tr:hover{background:#eef6ff}
img{max-width:100%;border:1px solid #eee;margin:.5em 0}
pre{background:#f6f8fa;padding:1em;overflow:auto;font-size:12px}
summary{cursor:pointer;color:#0969da}
""".replace("\n", "")


# A cell of one short word (a number, a variant, a pass): kept on one line, so that a
# narrow column never splits 2.61e-07 at its hyphen. Longer cells wrap (at spaces, and
# anywhere in the body if they must), so a wide table fits the page's width
# (max-width:100%) instead of running off its right edge.
_WORD = re.compile(r"<(td|th)>([^<\s]{1,16})</\1>")


def _table_html(df: pd.DataFrame) -> str:
    text = df.fillna("–").to_html(index=False, border=0, escape=True)
    return _WORD.sub(r'<\1 class="word">\2</\1>', text)


def to_html(blocks: list[tuple], title: str) -> str:
    out = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
           f"</title><style>{_CSS}</style></head><body>"]
    for b in blocks:
        if b[0] == "h":
            out.append(f"<h{b[1]}>{html.escape(b[2])}</h{b[1]}>")
        elif b[0] == "p":
            out.append(f"<p>{html.escape(b[1])}</p>")
        elif b[0] == "table" and not b[1].empty:
            out.append(_table_html(b[1]))
        elif b[0] == "img":
            data = base64.b64encode(b[1].read_bytes()).decode("ascii")
            out.append(f"<img alt='{html.escape(b[2])}' src='data:image/png;base64,{data}'>")
        elif b[0] == "code":
            out.append(f"<details><summary>matrix</summary><pre>{html.escape(b[1])}</pre></details>")
    out.append("</body></html>")
    return "\n".join(out)


def _into_answers(blocks: list[tuple], extra: list[tuple]) -> list[tuple]:
    """`extra` at the end of the Answers section (before the next section)."""
    start = next(i for i, b in enumerate(blocks) if b[:3] == ("h", 2, "Answers"))
    end = next((i for i, b in enumerate(blocks) if i > start and b[0] == "h" and b[1] == 2),
               len(blocks))
    return blocks[:end] + extra + blocks[end:]


def write_report(run_dir) -> Path:
    """Write report.md, report.html and plots/ into a run folder; returns report.md's path.

    The folder may hold a benchmark run (results.csv), model drift (model.csv) and a
    training sweep (train.csv), in any combination with at least one of them."""
    run_dir = Path(run_dir)
    drift = report_model.drift_blocks(run_dir)  # [] without model.csv
    tr = report_trained.load(run_dir)  # None without train.csv
    has_results = (run_dir / RESULTS).exists()
    df = None
    if has_results or not (drift or tr is not None):
        df, meta = load_run(run_dir)  # the usual error when the folder holds none of them
        blocks = report_model.insert_after_answers(build_blocks(df, meta, run_dir), drift)
    elif drift:  # the model command, perhaps with a sweep
        blocks = report_model.drift_only_blocks(run_dir, drift)
    else:  # a training sweep alone
        blocks = [("h", 1, f"attnbench report: {run_dir.name}")]
    if tr is not None:
        timed = report_trained.forward_times(tr, df)
        answers = report_trained.answer_blocks(tr, timed)
        if not any(b[:3] == ("h", 2, "Answers") for b in blocks):
            blocks.insert(1, ("h", 2, "Answers"))
        blocks = _into_answers(blocks, answers)
        blocks = report_model.insert_after_answers(
            blocks, report_trained.section_blocks(tr, timed, run_dir))
        if not has_results:
            blocks += report_trained.environment_blocks(run_dir)
    md = run_dir / "report.md"
    md.write_text(to_markdown(blocks, run_dir))
    (run_dir / "report.html").write_text(to_html(blocks, f"attnbench report: {run_dir.name}"))
    return md
