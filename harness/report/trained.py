"""The report's "Quality when trained" section, from a run folder's train.csv (the `train`
command), and its line in the Answers.

Reads train.csv and train_meta.json, and the folder's results.csv rows when `run` measured
in the same folder (handed in by build.py): held-out accuracy is then set against the
variants' forward time at the same N. A trained setting is the task with its parameters,
N, vocabulary, causal or not, and the model (d_model, layers, heads, MLP). A row is one
seed of a configuration; the tables of accuracy and the answers read cells, the median
over a configuration's seeds with their range (harness.report.frontier.cells), and leave
out the cells that had not settled.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from harness.errors import UsageError
from harness.files import TRAIN_COLUMNS, TRAIN_CSV, TRAIN_LATER_COLUMNS, TRAIN_META
from harness.report import curves, equal_state, frontier, trained_plots
from harness.report.folder import STATUSES, short_labels

TITLE = "Quality when trained"
RECALL = 0.9  # the Answers' "learned to recall" accuracy
# The columns that make one trained setting (everything but the variant).
SETTING = ["task", "task_params", "seq_len", "num_kv_pairs", "vocab_size", "causal",
           "d_model", "layers", "heads", "mlp"]
# Rows that describe one configuration at one seed: compare joins two sweeps on them.
KEY = ["variant", "params", *SETTING, "seed"]
_NUMERIC = ["seq_len", "vocab_size", "d_model", "layers", "heads", "accuracy", "best_lr",
            "steps", "time_to_best_s", "steps_to_0_9", "step_ms", "train_s", "final_loss",
            "n_params", "state_size", "state_bytes", "chance", "plateau", "reach", "num_kv_pairs",
            "steps_run", "seed", "val_accuracy", "bits_per_byte", "val_bits_per_byte",
            "unigram_bpb", "bigram_bpb", "hit_bpb", "other_bpb", "hit_share", "bpb_2n",
            "bpb_4n"]


def _bool(v) -> bool:
    s = str(v).strip().lower()
    if s in ("true", "1"):
        return True
    if s in ("false", "0"):
        return False
    raise UsageError(f"train.csv: expected True or False, got {v!r}")


def _flag(v):
    """True, False, or None where the file leaves it empty."""
    return None if pd.isna(v) else _bool(v)


def read_train(path: Path) -> pd.DataFrame:
    """train.csv checked against its columns, with `label` (variant and the parameters that
    tell its settings apart), `setting` and `model` (strings) added. A file from before
    TRAIN_LATER_COLUMNS existed reads them as empty, state_bytes as state_size x 4."""
    try:
        df = pd.read_csv(path, dtype={"params": str, "reason": str, "task_params": str,
                                      "lr_accuracy": str, "lrs": str})
    except pd.errors.EmptyDataError:
        raise UsageError(f"{path} is empty") from None
    for col in TRAIN_LATER_COLUMNS:
        if col not in df.columns:
            df[col] = df["state_size"] * 4 if col == "state_bytes" and "state_size" in df \
                else float("nan") if col in _NUMERIC else None
    missing = [c for c in TRAIN_COLUMNS if c not in df.columns]
    if missing:
        raise UsageError(f"{path} lacks column(s): {', '.join(missing)}")
    if df.empty:
        raise UsageError(f"{path} holds no configuration yet: nothing to report")
    df["params"] = df["params"].fillna("{}").map(lambda p: json.dumps(json.loads(p),
                                                                      sort_keys=True))
    df["reason"] = df["reason"].fillna("")
    for col in _NUMERIC:
        if not pd.api.types.is_numeric_dtype(df[col]):
            raise UsageError(f"{path}: column {col} holds non-numbers")
    df["causal"] = df["causal"].map(_bool)
    df["mlp"] = df["mlp"].map(_bool)
    df["seed"] = df["seed"].fillna(0)
    for col in ("rising", "lr_at_edge", "settled"):
        df[col] = df[col].map(_flag).astype(object)
    unknown = sorted(set(df["status"]) - set(STATUSES))
    if unknown:
        raise UsageError(f"{path}: unknown status value(s): {', '.join(map(str, unknown))}")
    df = df.drop_duplicates("config_id", keep="last").reset_index(drop=True)
    labels = short_labels(zip(df["variant"], df["params"]))
    df["label"] = [labels[(v, p)] for v, p in zip(df["variant"], df["params"])]
    model_cols = [c for c in ("d_model", "layers", "heads", "mlp") if df[c].nunique() > 1] \
        or ["d_model"]
    df["model"] = [_model_name(r, model_cols) for _, r in df.iterrows()]
    df["setting"] = [setting_name(r) for _, r in df.iterrows()]
    return df


def _model_name(row, cols: list[str]) -> str:
    names = {"d_model": "d", "layers": "L", "heads": "H"}
    parts = [("MLP" if row[c] else "no MLP") if c == "mlp" else f"{names[c]}={int(row[c])}"
             for c in cols]
    return " ".join(parts)


def setting_name(row) -> str:
    """`mqar N=64 P=8 V=64 causal · d=64` (the model part names what varies)."""
    pairs = f" P={int(row['num_kv_pairs'])}" if pd.notna(row["num_kv_pairs"]) else ""
    return (f"{row['task']} N={int(row['seq_len'])}{pairs} V={int(row['vocab_size'])} "
            f"{'causal' if row['causal'] else 'non-causal'} · {row['model']}")


def _order(df: pd.DataFrame) -> list[str]:
    """Settings: causal first, then by model, N, pairs."""
    first = df.drop_duplicates("setting")
    key = {r.setting: (not r.causal, r.model, r.seq_len, r.num_kv_pairs, r.vocab_size)
           for r in first.itertuples()}
    return sorted(key, key=key.get)


def _labels(df: pd.DataFrame) -> list[str]:
    firsts = df.drop_duplicates("label")
    key = {r.label: (r.family != "exact", r.label) for r in firsts.itertuples()}
    return sorted(key, key=key.get)


def _acc(v) -> str:
    return "–" if pd.isna(v) else f"{v:.3f}"


def _yes(v) -> str:
    return "–" if v is None or pd.isna(v) else ("yes" if v else "no")


def accuracy_table(df: pd.DataFrame) -> pd.DataFrame:
    """Variant x setting: held-out accuracy where it trained (the median over seeds, their
    range), else its status."""
    ok = frontier.cells(df)
    text = pd.concat([ok.assign(cell=[frontier.range_text(r) for _, r in ok.iterrows()]),
                      df[df["status"] != "ok"].assign(cell=lambda d: d["status"])])
    text = text.drop_duplicates(["label", "setting"])  # a cell that trained over one that did not
    wide = text.pivot(index="label", columns="setting", values="cell")
    order = _order(df)
    wide = wide.reindex(index=_labels(df), columns=order).fillna("")
    chance = df.groupby("setting")["chance"].first()
    wide.columns = [f"{s} (chance {chance[s]:.3f})" for s in order]
    return wide.rename_axis("variant").reset_index()


def detail_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per trained configuration: how it got there."""
    rows = []
    for s in _order(df):
        for _, r in df[df["setting"] == s].iterrows():
            if r["status"] != "ok":
                continue
            rows.append({"setting": s, "variant": r["label"], "seed": str(int(r["seed"])),
                         "accuracy": _acc(r["accuracy"]) + frontier.marks(r),
                         "best lr": f"{r['best_lr']:g}", "settled": _yes(r["settled"]),
                         "steps run": "–" if pd.isna(r["steps_run"])
                         else str(int(r["steps_run"])),
                         "rising": _yes(r["rising"]), "lr at edge": _yes(r["lr_at_edge"]),
                         "lrs swept": r["lrs"] if isinstance(r["lrs"], str) else "–",
                         "steps to best": int(r["steps"]),
                         "steps to 0.9": "–" if pd.isna(r["steps_to_0_9"])
                         else str(int(r["steps_to_0_9"])),
                         "step_ms": f"{r['step_ms']:.3g}", "sweep s": f"{r['train_s']:.3g}",
                         "final loss": f"{r['final_loss']:.3g}",
                         "state size": "–" if pd.isna(r["state_size"])
                         else str(int(r["state_size"])),
                         "state bytes": "–" if pd.isna(r["state_bytes"])
                         else str(int(r["state_bytes"])),
                         "reach": "–" if pd.isna(r["reach"]) else f"{r['reach']:.3f}",
                         "lr: accuracy": r["lr_accuracy"]})
    return pd.DataFrame(rows)


def forward_times(tr: pd.DataFrame, results: pd.DataFrame | None) -> pd.DataFrame:
    """Each ok trained row with `time_ms`: the median forward time results.csv holds for the
    same variant, parameters and N (the same causal flag when measured, else the other),
    and `timed` saying which rows of results.csv it is the median of."""
    if results is None or results.empty:
        return tr.iloc[0:0].assign(time_ms=[], timed=[])
    ok = results[(results["status"] == "ok") & (results["pass"] == "forward")]
    out = []
    for _, r in tr[tr["status"] == "ok"].iterrows():
        same = ok[(ok["variant"] == r["variant"]) & (ok["params"] == r["params"])
                  & (ok["seq_len"] == r["seq_len"])]
        if same.empty:
            continue
        form = same[same["causal"] == r["causal"]]
        same = form if len(form) else same
        out.append({**r.to_dict(), "time_ms": float(same["time_ms"].median()),
                    "timed": f"{len(same)} case(s): " + ", ".join(sorted(set(
                        f"{i} {'causal' if c else 'non-causal'} B{int(b)} H{int(h)} D{int(d)}"
                        for i, c, b, h, d in zip(same["input"], same["causal"], same["batch"],
                                                 same["heads"], same["head_dim"]))))})
    return pd.DataFrame(out)


def answer_table(tr: pd.DataFrame, timed: pd.DataFrame) -> pd.DataFrame:
    """Per trained setting: the fastest settled cell whose median over seeds reaches
    RECALL held-out accuracy, by the median training step (train.csv) and by forward time
    (results.csv, when there)."""
    rows = []
    settled = frontier.answerable(frontier.cells(tr))
    keep = set(zip(settled["variant"], settled["params"], settled["setting"]))
    for s in _order(tr):
        g = settled[settled["setting"] == s]
        good = g[g["accuracy"] >= RECALL]
        row = {"trained setting": s}
        if good.empty:
            best = g.loc[g["accuracy"].idxmax()] if len(g) else None
            row["fastest training step reaching 0.9"] = (
                "none reached 0.9" + (f" (best: {best['label']} {frontier.range_text(best)})"
                                      if best is not None else " (no settled cell)"))
        else:
            fast = good.loc[good["step_ms"].idxmin()]
            row |= {"fastest training step reaching 0.9": fast["label"],
                    "accuracy": frontier.range_text(fast),
                    "step_ms": f"{fast['step_ms']:.3g}"}
        if not timed.empty:
            t = timed[(timed["setting"] == s) & (timed["accuracy"] >= RECALL)]
            t = t[[k in keep for k in zip(t["variant"], t["params"], t["setting"])]]
            if len(t):
                f = t.loc[t["time_ms"].idxmin()]
                row |= {"fastest forward reaching 0.9": f["label"],
                        "its forward time_ms": f"{f['time_ms']:.3g}"}
            else:
                row["fastest forward reaching 0.9"] = "none timed in results.csv"
        rows.append(row)
    return pd.DataFrame(rows)


def answer_blocks(tr: pd.DataFrame, timed: pd.DataFrame) -> list[tuple]:
    text = (f"Fastest variant that learned to recall (held-out accuracy ≥ {RECALL}) at each "
            "trained setting: by the median time of one training step of the whole model "
            "(train.csv)")
    if not timed.empty:
        text += ", and by the variant's forward time at that N in this folder's results.csv"
    blocks = [("p", text + "; over the settled cells, each the median over its seeds."),
              ("table", answer_table(tr, timed))]
    small = frontier.smallest_state_table(tr)
    if not small.empty:
        blocks += [("p", f"Smallest state reaching {RECALL} held-out accuracy (the median "
                         "over seeds) at each task setting (bytes per example, float32; of "
                         "equal states the more accurate), over every settled variant and "
                         "size trained there:"),
                   ("table", small)]
    blocks += equal_state.blocks(tr)
    ok = frontier.cells(tr)
    return blocks + frontier.unsettled_note(tr) + (frontier.footnote(ok) if len(ok) else [])


def section_blocks(tr: pd.DataFrame, timed: pd.DataFrame, run_dir: Path) -> list[tuple]:
    """The "Quality when trained" section: tables and plots."""
    pdir = Path(run_dir) / "plots"
    tasks = ", ".join(sorted(tr["task"].unique()))
    blocks: list[tuple] = [
        ("h", 2, TITLE),
        ("p", f"A small model per variant, trained on {tasks} (mqar is multi-query "
              "associative recall: key-value pairs, then each key queried once; Zoology, "
              "Arora et al. 2023): token embedding, a short causal convolution and the variant as the "
              "sequence mixer in each layer, a tied output head. accuracy is the share of "
              "held-out queries answered right, the best over the learning rates whose "
              "runs finished; chance is what a model that reads nothing scores. Non-causal "
              "settings call the variant with causal=False: no answer is in the input after "
              "its query, so "
              "non-causal-only variants (Linformer, Nyström) are ranked there."),
        *frontier.frontier_blocks(tr, pdir),
        *frontier.task_blocks(tr),
        ("h", 3, "Accuracy per setting"),
        ("p", "The median over each configuration's seeds, with their range in brackets "
              "when it has several:"),
        ("table", accuracy_table(tr))]
    ok = frontier.cells(tr).assign(line=lambda d: d["label"])
    blocks += frontier.footnote(ok) if len(ok) else []
    if not ok.empty:
        blocks += [
            ("img", trained_plots.accuracy_plot(ok, "seq_len", "sequence length N",
                                        pdir / "trained_accuracy_vs_length.png"),
             "held-out accuracy against sequence length"),
            ("img", trained_plots.accuracy_plot(ok, "num_kv_pairs", "key-value pairs",
                                        pdir / "trained_accuracy_vs_pairs.png"),
             "held-out accuracy against the number of key-value pairs"),
            ("p", "Lines join the mean over settings that share an x value. How each "
                  "configuration trained, one row per seed (the winning learning rate, "
                  "whether its run settled and how many steps it ran, the steps to the best "
                  "and to 0.9, the median training step, the whole sweep's wall time, the "
                  "state a causal decoder keeps per example, and for a fixed key pattern "
                  "(windows, block layouts) in one layer its reach: the share of held-out "
                  "queries whose answer it can see, its ceiling but for guesses):"),
            ("table", detail_table(tr)),
            *curves.blocks(tr, run_dir)]
    if not timed.empty:
        blocks += [("h", 3, "Accuracy against forward time"),
                   ("p", "Held-out accuracy against the variant's median forward time at the "
                         "same N, from this folder's results.csv (the benchmark's own shape, "
                         "not the trained model's)."),
                   ("img", trained_plots.accuracy_time_plot(timed.assign(line=timed["label"]),
                                                    pdir / "trained_accuracy_vs_time.png"),
                    "held-out accuracy against forward time"),
                   ("table", pd.DataFrame({"setting": timed["setting"],
                                           "variant": timed["label"],
                                           "accuracy": timed["accuracy"].map(_acc),
                                           "forward time_ms": timed["time_ms"].map(
                                               lambda v: f"{v:.3g}"),
                                           "timed on": timed["timed"]}))]
    bad = tr[tr["status"] != "ok"]
    if not bad.empty:
        blocks += [("p", "Configurations not trained, or with no learning rate that ran:"),
                   ("table", pd.DataFrame({"setting": bad["setting"], "variant": bad["label"],
                                           "status": bad["status"],
                                           "reason": bad["reason"]}))]
    return blocks


def load(run_dir: Path) -> pd.DataFrame | None:
    """The folder's train.csv as read_train gives it; None when there is none."""
    path = Path(run_dir) / TRAIN_CSV
    return read_train(path) if path.is_file() else None


def environment_blocks(run_dir: Path) -> list[tuple]:
    """train_meta.json: the environment and the matrix of the sweep."""
    path = Path(run_dir) / TRAIN_META
    meta = json.loads(path.read_text()) if path.is_file() else {}
    env = {k: json.dumps(v) if isinstance(v, (dict, list)) else str(v)
           for k, v in meta.items() if k not in ("matrix", "shards")}
    return [("h", 2, "Training environment"),
            ("table", pd.DataFrame({"key": list(env), "value": list(env.values())})),
            ("p", "The training matrix as run:"),
            ("code", json.dumps(meta.get("matrix"), indent=1))]
