"""One run folder as the report's sections read it (`Run`), and the slices of its rows that
several sections share (the plotted lines, the primary shape and pass).

Reads results.csv and meta.json (folder.load_run) and train.csv (trained.load); whether
the folder holds model.csv is all the drift section needs to know here.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import pandas as pd

from harness.files import MODEL_CSV, RESULTS
from harness.report import captured as RC
from harness.report import generation
from harness.report import tables as T
from harness.report import trained as report_trained
from harness.report.folder import GROUPING, SETTING, grouping_suffix, load_run, short_labels


@dataclass
class Run:
    """A run folder: `df` the results.csv rows of every pass but decode (captured inputs
    first, labels naming only what varies per variant), `dec` the decode rows, `results`
    results.csv as read (None without it), `train` train.csv (None without it)."""

    dir: Path
    meta: dict
    results: pd.DataFrame | None
    df: pd.DataFrame
    dec: pd.DataFrame
    train: pd.DataFrame | None
    has_model: bool
    # train.csv's rows scored in bits per byte (the `lm` task): "Quality on text" reads
    # them; `train` keeps the others (accuracy), which the recall sections read.
    text: pd.DataFrame | None = None

    @property
    def name(self) -> str:
        return self.dir.name

    @property
    def rows(self) -> pd.DataFrame:
        """Every row of results.csv with the report's labels (the closing sections)."""
        return pd.concat([self.df, self.dec], ignore_index=True) if len(self.df) else self.dec

    @cached_property
    def timed(self) -> pd.DataFrame:
        """The trained rows with the forward time results.csv holds for them."""
        return report_trained.forward_times(self.train, self.results)

    @cached_property
    def views(self) -> list[pd.DataFrame]:
        """The primary slice of captured inputs, then of synthetic ones (those measured)."""
        captured = self.df["input"].isin(RC.captured_inputs(self.df))
        return [v for v in (with_lines(primary(self.df[captured])),
                            with_lines(primary(self.df[~captured]))) if not v.empty]

    @cached_property
    def view(self) -> pd.DataFrame:
        """The first of `views` (captured inputs where measured)."""
        return self.views[0] if self.views else with_lines(primary(self.df))


def read(run_dir) -> Run:
    """The run folder; a UsageError when it holds none of results.csv, model.csv, train.csv."""
    run_dir = Path(run_dir)
    has_model = (run_dir / MODEL_CSV).is_file()
    train = report_trained.load(run_dir)  # None without train.csv
    results, meta = None, {}
    if (run_dir / RESULTS).exists() or not (has_model or train is not None):
        results, meta = load_run(run_dir)  # the usual error when the folder holds none of them
        df = RC.captured_first(results)
        labels = short_labels(zip(df["variant"], df["params"]))  # only what varies, per variant
        df["label"] = [labels[(v, p)] + grouping_suffix(r) for v, p, r in
                       zip(df["variant"], df["params"], df[list(GROUPING)].itertuples())]
        df, dec = generation.split(df)  # decode rows: the Generation section alone reads them
    else:
        df = dec = pd.DataFrame()
    train, text = split_text(train)
    return Run(run_dir, meta, results, df, dec, train, has_model, text)


def split_text(train: pd.DataFrame | None) -> tuple:
    """(rows scored by accuracy, rows scored in bits per byte), each None when empty."""
    if train is None:
        return None, None
    bpb = train["metric"] == "bits_per_byte"
    return (None if bpb.all() else train[~bpb].reset_index(drop=True),
            None if not bpb.any() else train[bpb].reset_index(drop=True))


def varying(df: pd.DataFrame) -> list[str]:
    """The setting columns that take more than one value in this run (pass, input always)."""
    return [c for c in SETTING if c in ("pass", "input") or df[c].nunique() > 1]


def with_lines(df: pd.DataFrame) -> pd.DataFrame:
    """Add `line`: the label, plus the setting columns the plot facets do not separate."""
    extra = [c for c in varying(df) if c not in ("pass", "input")]
    suffix = [" ".join(("causal" if r["causal"] else "non-causal") if c == "causal" else str(r[c])
                       for c in extra) for _, r in df[extra].iterrows()] if extra else [""] * len(df)
    return df.assign(line=[f"{lb} [{s}]" if s else lb for lb, s in zip(df["label"], suffix)])


def primary(df: pd.DataFrame) -> pd.DataFrame:
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
