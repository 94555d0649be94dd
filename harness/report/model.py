"""The report's "Model drift" section, from a run folder's model.csv (the `model` command).

Reads model.csv (and model_meta.json) only. One table per (model, N): each variant's
drift against the model under its own exact attention (encoders: emb_cos, hidden_rel_err;
causal LMs: kl, ppl_ratio), its whole-forward time, that time over sdpa's, and its peak
memory; then the skipped cases with their reasons.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from harness.errors import UsageError
from harness.files import MODEL_CSV, MODEL_META
from harness.files import MODEL_COLUMNS as COLUMNS
from harness.report.folder import variant_label

TITLE = "Model drift"


def _fmt(v, spec: str) -> str:
    return "–" if pd.isna(v) else format(v, spec)


def _ms(v) -> str:
    """Whole milliseconds from 100 ms up, else 3 significant digits."""
    return _fmt(v, ".0f" if not pd.isna(v) and v >= 100 else ".3g")


def read_model_csv(path: Path) -> pd.DataFrame:
    try:
        df = pd.read_csv(path, dtype={"params": str, "reason": str})
    except pd.errors.EmptyDataError:
        raise UsageError(f"{path} is empty") from None
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise UsageError(f"{path} lacks column(s): {', '.join(missing)}")
    df["params"] = df["params"].fillna("{}")
    df["reason"] = df["reason"].fillna("")
    return df


def _labels(df: pd.DataFrame) -> list[str]:
    """A variant's name, with its parameters only where the table holds several of its settings."""
    several = df.groupby("variant")["params"].nunique()
    return [variant_label(v, p) if several[v] > 1 else v
            for v, p in zip(df["variant"], df["params"])]


def drift_table(g: pd.DataFrame) -> pd.DataFrame:
    ok = g[g["status"] == "ok"]
    sdpa = ok.loc[ok["variant"] == "sdpa", "time_ms"]
    base = sdpa.iloc[0] if len(sdpa) else None
    causal = bool(g["causal"].astype(str).str.lower().eq("true").any())
    cols = (("kl", ".3g"), ("ppl_ratio", ".4f")) if causal else \
        (("emb_cos", ".6f"), ("hidden_rel_err", ".3g"))
    out = pd.DataFrame({"variant": _labels(ok)})
    for col, spec in cols:
        out[col] = [_fmt(v, spec) for v in ok[col]]
    out["time_ms"] = [_ms(v) for v in ok["time_ms"]]
    out["× sdpa time"] = [_fmt(v / base, ".3g") if base else "–" for v in ok["time_ms"]]
    out["peak_mem_mib"] = [_fmt(v, ".3g") for v in ok["peak_mem_mib"]]
    return out


def drift_blocks(run_dir: Path) -> list[tuple]:
    """The section as report blocks; [] when the folder holds no model.csv."""
    path = Path(run_dir) / MODEL_CSV
    if not path.is_file():
        return []
    df = read_model_csv(path)
    blocks: list[tuple] = [
        ("h", 2, TITLE),
        ("p", "Each variant replaces the attention inside a pretrained model (through "
              "transformers.AttentionInterface; the model's projections, norms and MLPs are "
              "unchanged) and is compared with the same model under its own exact attention on "
              "the same token windows. Encoders: emb_cos is the cosine similarity of the pooled "
              "sentence embeddings (1 = unchanged), hidden_rel_err is ||h - h_ref||_F / "
              "||h_ref||_F of the last hidden state. Causal LMs: kl is the mean next-token "
              "KL(p_exact || p_variant) in nats, ppl_ratio the perplexity under the variant "
              "over the exact model's. time_ms: one whole-model forward of one window "
              "(median); peak_mem_mib: its peak memory above what was resident before.")]
    for (model, n), g in df.groupby(["model", "seq_len"], sort=True):
        windows = int(g["windows"].max())
        blocks += [("h", 3, f"{model}, N = {int(n)}, windows: {windows}"),
                   ("table", drift_table(g))]
    skipped = df[df["status"] != "ok"]
    if not skipped.empty:
        blocks += [("p", "Cases not measured:"),
                   ("table", pd.DataFrame({"model": skipped["model"], "N": skipped["seq_len"],
                                           "variant": _labels(skipped),
                                           "status": skipped["status"],
                                           "reason": skipped["reason"]}))]
    return blocks


def environment_blocks(run_dir: Path) -> list[tuple]:
    """The environment of a folder that holds model drift and no benchmark matrix
    (model_meta.json)."""
    meta_path = Path(run_dir) / MODEL_META
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    env = {k: json.dumps(v) if isinstance(v, (dict, list)) else str(v) for k, v in meta.items()}
    return [("h", 2, "Environment"),
            ("table", pd.DataFrame({"key": list(env), "value": list(env.values())}))]
