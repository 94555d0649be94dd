"""The report's "Generation" section: time and state per generated token (pass `decode`).

Reads only the decode rows of results.csv and the read bandwidth in meta.json; the other
sections never see those rows (a time per token is not a forward's time).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from harness.files.columns import EXACT_PATHS
from harness.report import plots
from harness.report import tables as T

MIB = 2**20


def split(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(rows of every other pass, decode rows)."""
    dec = df["pass"] == "decode"
    return df[~dec].reset_index(drop=True), df[dec].reset_index(drop=True)


def _lines(df: pd.DataFrame) -> pd.DataFrame:
    df = df.copy()
    df["line"] = df["label"]
    return df


def faster_than_exact_from(g: pd.DataFrame) -> pd.DataFrame:
    """Per variant: the smallest measured context from which it decodes faster than the
    fastest exact path at every longer measured context ("never" within the range)."""
    ok = T.ok_rows(g)
    exact = ok[ok["variant"].isin(EXACT_PATHS)].groupby("seq_len")["time_ms"].min()
    rows = []
    for label, h in ok[~ok["variant"].isin(EXACT_PATHS)].groupby("label", sort=False):
        h = h.set_index("seq_len")["time_ms"].sort_index()
        common = [n for n in h.index if n in exact.index]
        faster = [h[n] < exact[n] for n in common]
        start = "never"
        for i in range(len(common)):
            if all(faster[i:]):
                start = "always" if i == 0 else f"N = {common[i]}"
                break
        rows.append({"variant": label, "faster than exact from": start,
                     "contexts compared": ", ".join(str(n) for n in common)})
    return pd.DataFrame(rows)


def bandwidth_table(dec: pd.DataFrame, read_gbps: float | None) -> pd.DataFrame:
    """Bytes a step reads over the time per token (a step reads its whole state, or a
    sparse decoder its chosen blocks): the bandwidth it achieves, against the read rate."""
    ok = T.ok_rows(dec)
    if ok.empty or "decode_state_mib" not in ok:
        return pd.DataFrame()
    read = ok["decode_read_mib"] if "decode_read_mib" in ok else ok["decode_state_mib"]
    read = read.fillna(ok["decode_state_mib"])
    gbps = read * MIB / (ok["time_ms"] / 1e3) / 1e9
    out = pd.DataFrame({"variant": ok["label"], "context": ok["seq_len"].astype(int),
                        "batch": ok["batch"].astype(int),
                        "state MiB": ok["decode_state_mib"].map(T.fmt_num),
                        "read MiB": read.map(T.fmt_num),
                        "ms / token": ok["time_ms"].map(T.fmt_num),
                        "GB/s read": gbps.map(lambda x: f"{x:.2f}")})
    if read_gbps:
        out["of the read rate"] = (gbps / read_gbps).map(lambda x: f"{x:.0%}")
        out["read bound ms"] = (read * MIB / (read_gbps * 1e9) * 1e3).map(T.fmt_num)
    return out.sort_values(["variant", "batch", "context"]).reset_index(drop=True)


def generation_blocks(dec: pd.DataFrame, meta: dict, run_dir: Path) -> list[tuple]:
    if dec.empty:
        return []
    read = meta.get("read_bandwidth_gbps")
    blocks: list[tuple] = [
        ("h", 2, "Generation"),
        ("p", "Pass `decode`: after a prefill of N context tokens, each variant generates "
              "decode_tokens more, one at a time; time_ms is the median time per token, "
              "decode_state_mib the state it keeps to take the next step (a key-value cache "
              "grows with N, a window or a recurrent state does not). rel_err and row_cos "
              "compare the generated tokens' outputs with float64 exact causal attention "
              "over the same context.")]
    for setting, g in dec.groupby("setting", sort=False):
        blocks += [("h", 3, setting),
                   ("p", "ms per generated token"), ("table", T.metric_pivot(g, "time_ms")),
                   ("p", "decoding state (MiB)"),
                   ("table", T.metric_pivot(g, "decode_state_mib")),
                   ("p", "row_cos of the generated tokens"),
                   ("table", T.metric_pivot(g, "row_cos", lambda x: f"{x:.4f}")),
                   ("p", "Decodes faster than exact attention from"),
                   ("table", faster_than_exact_from(g))]
    ok = _lines(T.ok_rows(dec))
    if not ok.empty:
        pdir = run_dir / "plots"
        blocks.append(("img", plots.scaling_plot(ok, "time_ms", "time per token (ms)",
                                                 pdir / "decode_time.png", "time_ms_iqr"),
                       "time per generated token against context"))
        blocks.append(("img", plots.scaling_plot(ok, "decode_state_mib", "decoding state (MiB)",
                                                 pdir / "decode_state.png"),
                       "decoding state against context"))
    blocks += [("h", 3, "Achieved bandwidth"),
               ("p", "Decoding is memory-bound: a step reads its whole state (a sparse decoder "
                     "only its chosen blocks: read MiB). GB/s read is those bytes over the time "
                     "per token; a state small enough for the CPU's caches reads faster than "
                     "memory does, so the comparison means something for large states only"
                     + (f", set against the read rate measured in this run ({read:.1f} GB/s, "
                        "a sum over a 1 GiB float32 tensor); the read bound is the state's "
                        "bytes at that rate." if read else
                        "; this run's meta.json has no read rate to set it against.")),
               ("table", bandwidth_table(dec, read))]
    return blocks
