"""Read a results folder (results.csv + meta.json, docs/results.md) into one DataFrame.

The report and compare only read what `run` wrote; they never measure. Columns added since
the first runs (`exact`, `state_mib`, `keys_per_query`) are optional: an older folder still
reads, with them empty. Adds two derived columns: `label` (variant plus its parameters, e.g. `sliding_window(window=256)`; the
report shortens it with `short_labels`) and
`setting` (the case dimensions other than the variant and the length, as one string).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from harness.errors import UsageError
from harness.files import EXACT_PATHS  # noqa: F401 (re-exported to the report)

REQUIRED = ["variant", "family", "params", "device", "dtype", "batch", "heads", "head_dim",
            "seq_len", "causal", "pass", "input", "status", "reason", "time_ms", "time_ms_iqr",
            "repeats", "peak_mem_mib", "rel_err", "max_abs_err", "flops", "gflops_per_s"]
NUMERIC = ["batch", "heads", "head_dim", "seq_len", "time_ms", "time_ms_iqr", "repeats",
           "peak_mem_mib", "rel_err", "max_abs_err", "flops", "gflops_per_s"]
# One measured case; compare joins two runs on it.
CASE_KEY = ["variant", "params", "device", "dtype", "batch", "heads", "head_dim", "seq_len",
            "causal", "pass", "input", "kv_heads", "value_heads", "value_dim"]
# Heads and widths of their own (empty: the default, heads and head_dim): a row at another
# grouping is labelled with it (`grouping_suffix`), so that it never shares a table row or a
# plot line with the default; a run without such rows (every run before them) reads as
# before.
GROUPING = ("kv_heads", "value_heads", "value_dim")
# What is held fixed along one line of a plot or one row group of a table.
SETTING = ["device", "dtype", "batch", "heads", "head_dim", "pass", "input", "causal"]
STATUSES = ("ok", "skipped", "oom", "timeout", "error", "nonfinite")


def _fmt_value(v) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def variant_label(variant: str, params: str) -> str:
    """`variant(k=v, ...)` from the params JSON; bare `variant` when it has none."""
    parsed = json.loads(params) if params.strip() else {}
    if not parsed:
        return variant
    return f"{variant}({', '.join(f'{k}={_fmt_value(parsed[k])}' for k in sorted(parsed))})"


def short_labels(pairs) -> dict[tuple[str, str], str]:
    """(variant, params JSON) -> label naming only the parameters that differ between that
    variant's settings here: unambiguous, since two settings always differ in some key."""
    by_variant: dict[str, list[dict]] = {}
    for variant, params in dict.fromkeys(pairs):
        by_variant.setdefault(variant, []).append(json.loads(params) if params.strip() else {})
    out = {}
    for variant, settings in by_variant.items():
        keys = sorted({k for s in settings for k in s})
        varying = [k for k in keys if len({json.dumps(s.get(k)) for s in settings}) > 1]
        for s in settings:
            shown = {k: s[k] for k in varying if k in s}
            out[(variant, json.dumps(s, sort_keys=True))] = (
                f"{variant}({', '.join(f'{k}={_fmt_value(v)}' for k, v in shown.items())})"
                if shown else variant)
    return out


def _canonical_params(params: str) -> str:
    return json.dumps(json.loads(params) if params.strip() else {}, sort_keys=True)


def _as_bool(v, column: str = "causal") -> bool:
    s = str(v).strip().lower()
    if s in ("true", "1", "1.0"):
        return True
    if s in ("false", "0", "0.0"):
        return False
    raise UsageError(f"{column} must be True or False, got {v!r}")


def layer_name(row) -> str:
    """A setting less its head width, e.g. `decode · gaussian · causal · cpu float32 B1 H32`:
    the layer a decoder serves, whatever widths its heads have (the served tables)."""
    causal = "causal" if row["causal"] else "non-causal"
    return (f"{row['pass']} · {row['input']} · {causal} · {row['device']} {row['dtype']} "
            f"B{int(row['batch'])} H{int(row['heads'])}")


def setting_name(row) -> str:
    """One readable string for a setting, e.g. `forward · gaussian · causal · cpu float32 B1 H8 D64`."""
    return f"{layer_name(row)} D{int(row['head_dim'])}"


def grouping_suffix(row) -> str:
    """` [kv_heads=1]`, ` [value_heads=16, value_dim=128]`: a row's grouping where it is not
    the default; "" at the default."""
    shown = [f"{c}={int(getattr(row, c))}" for c in GROUPING if pd.notna(getattr(row, c))]
    return f" [{', '.join(shown)}]" if shown else ""


def read_results(csv_path: Path) -> pd.DataFrame:
    """results.csv checked against the contract, with `label` and `setting` added."""
    try:
        df = pd.read_csv(csv_path, dtype={"params": str, "reason": str, "variant": str},
                         keep_default_na=True)
    except pd.errors.EmptyDataError:
        raise UsageError(f"{csv_path} is empty") from None
    missing = [c for c in REQUIRED if c not in df.columns]
    if missing:
        raise UsageError(f"{csv_path} lacks column(s): {', '.join(missing)}")
    if df.empty:
        raise UsageError(f"{csv_path} holds no case yet: nothing to report")
    df["params"] = df["params"].fillna("{}")
    df["reason"] = df["reason"].fillna("")
    try:
        df["params"] = df["params"].map(_canonical_params)
    except json.JSONDecodeError as e:
        raise UsageError(f"{csv_path}: a params field is not JSON ({e})") from None
    for col in NUMERIC:
        if not pd.api.types.is_numeric_dtype(df[col]):
            raise UsageError(f"{csv_path}: column {col} holds non-numbers")
    df["causal"] = df["causal"].map(_as_bool)
    # Optional columns: empty (unknown) in runs written before they existed.
    for col in ("state_mib", "keys_per_query", *GROUPING):
        if col not in df.columns:
            df[col] = float("nan")
        if not pd.api.types.is_numeric_dtype(df[col]):
            raise UsageError(f"{csv_path}: column {col} holds non-numbers")
    df["exact"] = (df["exact"].map(lambda v: None if pd.isna(v) else _as_bool(v, "exact"))
                   if "exact" in df.columns else None)
    # What the error columns were measured against; runs written before the column: softmax.
    # Empty in a run that has it: no single reference (a layer pattern's decode row).
    df["err_ref"] = df["err_ref"] if "err_ref" in df.columns else "softmax"
    unknown = sorted(set(df["status"]) - set(STATUSES))
    if unknown:
        raise UsageError(f"{csv_path}: unknown status value(s): {', '.join(map(str, unknown))}")
    # A resumed run may hold a case twice; its last row is the one that counts.
    df = df.drop_duplicates(CASE_KEY, keep="last").reset_index(drop=True)
    df["label"] = [variant_label(v, p) + grouping_suffix(r)
                   for v, p, r in zip(df["variant"], df["params"], df[list(GROUPING)].itertuples())]
    df["setting"] = [setting_name(r) for _, r in df[SETTING].iterrows()]
    return df


def load_run(path) -> tuple[pd.DataFrame, dict]:
    """(results, meta) of a run folder; UsageError when the folder is not one."""
    folder = Path(path)
    csv_path, meta_path = folder / "results.csv", folder / "meta.json"
    if not folder.is_dir():
        raise UsageError(f"{folder} is not a folder")
    lacking = [p.name for p in (csv_path, meta_path) if not p.is_file()]
    if lacking:
        raise UsageError(f"{folder} is not a results folder (no {' or '.join(lacking)})")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"{meta_path} is not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise UsageError(f"{meta_path} does not hold a JSON object")
    return read_results(csv_path), meta
