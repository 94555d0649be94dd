"""Compare two runs case by case: time, memory and error ratios (b / a) and regression flags.

Runs are joined on the case key (run_folder.CASE_KEY). A time change is flagged only when
it exceeds both the relative threshold and the two runs' noise (analysis.classify_change);
a case that ran in a and fails in b (oom, error, ...) is a regression. Cases present in
one run only are listed, never dropped.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd

from harness.report.analysis import classify_change
from harness.errors import UsageError
from harness.report.tables import fmt_err, fmt_num
from harness.report.folder import CASE_KEY, SETTING

_SHOWN = ["status", "time_ms", "time_ms_iqr", "peak_mem_mib", "rel_err", "label"]


@dataclasses.dataclass
class Comparison:
    joined: pd.DataFrame   # one row per common case, with `change`
    only_a: pd.DataFrame
    only_b: pd.DataFrame
    threshold: float

    @property
    def regressions(self) -> int:
        return int(self.joined["change"].str.startswith("regression").sum())

    @property
    def improvements(self) -> int:
        return int(self.joined["change"].str.startswith("improvement").sum())


def _change(r, threshold: float) -> str:
    sa, sb = r["status_a"], r["status_b"]
    if sa == "ok" and sb != "ok":
        return f"regression (now {sb})"
    if sa != "ok" and sb == "ok":
        return f"improvement (was {sa})"
    if sa != "ok":
        return "" if sa == sb else f"{sa} → {sb}"
    return classify_change(r["time_ms_a"], r["time_ms_iqr_a"], r["time_ms_b"],
                           r["time_ms_iqr_b"], threshold)


def compare_runs(a: pd.DataFrame, b: pd.DataFrame, threshold: float = 0.10) -> Comparison:
    """Join two runs' results (read_results frames) on the case key and flag changes."""
    if threshold < 0:
        raise UsageError(f"--threshold must be >= 0, got {threshold}")
    merged = a[CASE_KEY + _SHOWN].merge(b[CASE_KEY + _SHOWN], on=CASE_KEY, how="outer",
                                        suffixes=("_a", "_b"), indicator=True)
    if not (merged["_merge"] == "both").any():
        raise UsageError("the two runs have no case in common "
                         "(same variant, params, device, dtype, shape, length, causal, pass, input)")
    joined = merged[merged["_merge"] == "both"].copy()
    for m in ("time_ms", "peak_mem_mib", "rel_err"):
        with np.errstate(divide="ignore", invalid="ignore"):
            joined[f"{m} b/a"] = joined[f"{m}_b"] / joined[f"{m}_a"]
    joined["change"] = [_change(r, threshold) for _, r in joined.iterrows()]
    rank = joined["change"].map(lambda c: 0 if c.startswith("regression")
                                else 1 if c.startswith("improvement") else 2)
    joined = joined.assign(_rank=rank).sort_values("_rank", kind="stable").drop(columns="_rank")

    def only(side):
        rows = merged[merged["_merge"] == f"{side}_only"]
        return rows[CASE_KEY + [f"label_{'a' if side == 'left' else 'b'}",
                                f"status_{'a' if side == 'left' else 'b'}"]]

    return Comparison(joined.reset_index(drop=True), only("left"), only("right"), threshold)


def _varying(frames: list[pd.DataFrame]) -> list[str]:
    both = pd.concat([f[SETTING] for f in frames if len(f)])
    return [c for c in SETTING if c in ("pass", "input") or both[c].nunique() > 1]


def _ratio(x) -> str:
    return "–" if not np.isfinite(x) else f"{x:.3g}"


def to_markdown(cmp: Comparison, name_a: str, name_b: str) -> str:
    """The comparison as Markdown: a summary line, the common cases, the unmatched ones."""
    cols = _varying([cmp.joined, cmp.only_a, cmp.only_b])
    j = cmp.joined
    table = pd.DataFrame({"variant": j["label_a"]}
                         | {c: j[c].astype(str) for c in cols}
                         | {"N": j["seq_len"].astype(int).astype(str),
                            "status a → b": [s if s == t else f"{s} → {t}"
                                             for s, t in zip(j["status_a"], j["status_b"])],
                            "time_ms a": j["time_ms_a"].map(fmt_num),
                            "time_ms b": j["time_ms_b"].map(fmt_num),
                            "time b/a": j["time_ms b/a"].map(_ratio),
                            "mem b/a": j["peak_mem_mib b/a"].map(_ratio),
                            "err b/a": j["rel_err b/a"].map(_ratio),
                            "rel_err b": j["rel_err_b"].map(fmt_err),
                            "change": j["change"]})
    out = [f"# attnbench compare: {name_a} → {name_b}",
           f"{len(j)} common cases; {cmp.regressions} regression(s), {cmp.improvements} "
           f"improvement(s). A time change is flagged when it exceeds {cmp.threshold:.0%} "
           "AND the sum of the two runs' IQRs; a case that stopped running is a regression. "
           "Ratios are b / a.",
           table.to_markdown(index=False, disable_numparse=True)]
    for title, rows, side in ((f"Only in {name_a}", cmp.only_a, "a"),
                              (f"Only in {name_b}", cmp.only_b, "b")):
        out.append(f"## {title}")
        if rows.empty:
            out.append("None.")
            continue
        t = pd.DataFrame({"variant": rows[f"label_{side}"]}
                         | {c: rows[c].astype(str) for c in cols}
                         | {"N": rows["seq_len"].astype(int).astype(str),
                            "status": rows[f"status_{side}"]})
        out.append(t.to_markdown(index=False, disable_numparse=True))
    return "\n\n".join(out) + "\n"


# -- training sweeps (train.csv) -------------------------------------------------------------
ACC_CHANGE = 0.05  # held-out accuracy moving by more than this (absolute) is flagged


@dataclasses.dataclass
class TrainComparison:
    joined: pd.DataFrame  # one row per configuration in both sweeps, with `change`
    only_a: pd.DataFrame
    only_b: pd.DataFrame

    @property
    def regressions(self) -> int:
        return int(self.joined["change"].str.startswith("regression").sum())

    @property
    def improvements(self) -> int:
        return int(self.joined["change"].str.startswith("improvement").sum())


def _train_change(r) -> str:
    sa, sb = r["status_a"], r["status_b"]
    if sa == "ok" and sb != "ok":
        return f"regression (now {sb})"
    if sa != "ok" and sb == "ok":
        return f"improvement (was {sa})"
    if sa != "ok":
        return "" if sa == sb else f"{sa} → {sb}"
    d = r["accuracy_b"] - r["accuracy_a"]
    if d < -ACC_CHANGE:
        return f"regression (accuracy {d:+.3f})"
    if d > ACC_CHANGE:
        return f"improvement (accuracy {d:+.3f})"
    return ""


def compare_trained(a: pd.DataFrame, b: pd.DataFrame) -> TrainComparison:
    """Join two sweeps (report.trained.read_train frames) on the configuration (variant,
    parameters, task setting, model) and flag accuracy moves beyond ACC_CHANGE and
    configurations that stopped training."""
    from harness.report.trained import KEY

    shown = ["status", "accuracy", "step_ms", "label", "setting"]
    merged = a[KEY + shown].merge(b[KEY + shown], on=KEY, how="outer", suffixes=("_a", "_b"),
                                  indicator=True)
    if not (merged["_merge"] == "both").any():
        raise UsageError("the two sweeps have no configuration in common (same variant, "
                         "params, task setting and model)")
    joined = merged[merged["_merge"] == "both"].copy()
    joined["change"] = [_train_change(r) for _, r in joined.iterrows()]
    rank = joined["change"].map(lambda c: 0 if c.startswith("regression")
                                else 1 if c.startswith("improvement") else 2)
    joined = joined.assign(_rank=rank).sort_values("_rank", kind="stable").drop(columns="_rank")

    def only(side, s):
        rows = merged[merged["_merge"] == f"{side}_only"]
        return pd.DataFrame({"variant": rows[f"label_{s}"], "setting": rows[f"setting_{s}"],
                             "status": rows[f"status_{s}"]})

    return TrainComparison(joined.reset_index(drop=True), only("left", "a"), only("right", "b"))


def trained_markdown(cmp: TrainComparison, name_a: str, name_b: str) -> str:
    """The sweeps' comparison as Markdown: a summary, the common configurations, the rest."""
    j = cmp.joined

    def acc(v):
        return "–" if pd.isna(v) else f"{v:.3f}"

    table = pd.DataFrame({
        "variant": j["label_a"], "setting": j["setting_a"],
        "status a → b": [s if s == t else f"{s} → {t}"
                         for s, t in zip(j["status_a"], j["status_b"])],
        "accuracy a": j["accuracy_a"].map(acc), "accuracy b": j["accuracy_b"].map(acc),
        "step_ms b/a": (j["step_ms_b"] / j["step_ms_a"]).map(_ratio), "change": j["change"]})
    out = [f"# attnbench compare (trained quality): {name_a} → {name_b}",
           f"{len(j)} common configurations; {cmp.regressions} regression(s), "
           f"{cmp.improvements} improvement(s). Held-out accuracy moving by more than "
           f"{ACC_CHANGE} is flagged; a configuration that stopped training is a regression.",
           table.to_markdown(index=False, disable_numparse=True)]
    for title, rows in ((f"Only in {name_a}", cmp.only_a), (f"Only in {name_b}", cmp.only_b)):
        out += [f"## {title}",
                "None." if rows.empty else rows.to_markdown(index=False, disable_numparse=True)]
    return "\n\n".join(out) + "\n"
