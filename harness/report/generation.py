"""The report's "Generation" section: time and state per generated token (pass `decode`).

Reads only the decode rows of results.csv and the read bandwidth in meta.json; the other
sections never see those rows (a time per token is not a forward's time). The error of a
decode row has one of two references (err_ref), each in tables of its own: float64 exact
causal attention (softmax), or a recurrence's own float64 form (recurrence). The read
bound is the bytes a step moves (decode_read_mib: the state in its own dtype, read, and
written back where the step rewrites it) at the read rate measured in the same run.

The roofline bound (`roofline`) is the larger of the read bound and the compute bound, the
step's FLOPs (decode_flops) at the matmul rate of the row's device and dtype that
meta.json records (FlashAttention's hopper/benchmark_mla_decode.py sets a decode step
against ideal = max(time at the memory rate, time at the FLOP rate)); `bound` names the
larger. It is computed here, from results.csv and meta.json, not when the row is written:
the matmul rate is the median of samples taken through the run, known only at its end,
and a folder written before decode_flops keeps its read bound: its tables and text render
as they did (`has_roofline`).
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


def moved_mib(ok: pd.DataFrame) -> pd.Series:
    """The MiB a step moves (decode_read_mib; the whole state in runs before the column)."""
    if "decode_read_mib" not in ok:
        return ok["decode_state_mib"]
    return ok["decode_read_mib"].fillna(ok["decode_state_mib"])


def bound_ms(ok: pd.DataFrame, read_gbps: float | None) -> pd.Series:
    """The read bound of each decode row (ms): the bytes it moves at the read rate; NaN
    without a read rate."""
    if not read_gbps or "decode_state_mib" not in ok:
        return pd.Series(float("nan"), index=ok.index)
    return moved_mib(ok) * MIB / (read_gbps * 1e9) * 1e3


def has_roofline(dec: pd.DataFrame) -> bool:
    """Whether the decode rows count their steps' FLOPs (decode_flops): a folder written
    before the column has its read bound alone."""
    return "decode_flops" in dec and bool(dec["decode_flops"].notna().any())


def compute_ms(ok: pd.DataFrame, meta: dict) -> pd.Series:
    """The compute bound of each decode row (ms): decode_flops at the matmul rate meta.json
    records for the row's device and dtype (tables.matmul_rates); NaN where the row has no
    FLOP count (a variant that does not say) or the run no rate for its device and dtype."""
    if "decode_flops" not in ok:
        return pd.Series(float("nan"), index=ok.index)
    rates = T.matmul_rates(meta)
    rate = pd.Series([rates.get(f"{d} {t}", float("nan"))
                      for d, t in zip(ok["device"], ok["dtype"])], index=ok.index, dtype=float)
    return ok["decode_flops"].astype(float) / (rate * 1e9) * 1e3


def roofline(ok: pd.DataFrame, meta: dict) -> tuple[pd.Series, pd.Series]:
    """(bound ms, bound) of each decode row: the larger of its read bound (bound_ms) and its
    compute bound (compute_ms), and which of the two it is, "read" or "compute"; a row
    without a compute bound keeps its read bound, "read"."""
    read = bound_ms(ok, meta.get("read_bandwidth_gbps"))
    comp = compute_ms(ok, meta)
    over = comp > read  # False where either is NaN
    return read.where(~over, comp), over.map({True: "compute", False: "read"})


def _roofline_columns(out: pd.DataFrame, ok: pd.DataFrame, meta: dict) -> None:
    """The roofline's columns of a table of `ok` rows, in place: both bounds, which binds,
    the time over it."""
    bound, which = roofline(ok, meta)
    out["read bound ms"] = bound_ms(ok, meta.get("read_bandwidth_gbps")).map(T.fmt_num).values
    out["compute bound ms"] = compute_ms(ok, meta).map(T.fmt_num).values
    out["bound"] = which.values
    out["time / bound"] = (ok["time_ms"] / bound).map(lambda x: f"{x:.2f}").values


def bandwidth_table(dec: pd.DataFrame, read_gbps: float | None,
                    meta: dict | None = None) -> pd.DataFrame:
    """Bytes a step moves over the time per token: the bandwidth it achieves, against the
    read rate, and its time over its read bound; with `meta` (a run whose rows count their
    FLOPs), its FLOPs a byte and its time over its roofline bound instead."""
    ok = T.ok_rows(dec)
    if ok.empty or "decode_state_mib" not in ok:
        return pd.DataFrame()
    moved = moved_mib(ok)
    gbps = moved * MIB / (ok["time_ms"] / 1e3) / 1e9
    out = pd.DataFrame({"variant": ok["label"], "context": ok["seq_len"].astype(int),
                        "batch": ok["batch"].astype(int),
                        "state MiB": ok["decode_state_mib"].map(T.fmt_num),
                        "moved MiB": moved.map(T.fmt_num),
                        "ms / token": ok["time_ms"].map(T.fmt_num),
                        "GB/s moved": gbps.map(lambda x: f"{x:.2f}")})
    if meta is not None:
        out["FLOPs / byte"] = (ok["decode_flops"].astype(float) / (moved * MIB)).map(T.fmt_num)
    if read_gbps:
        out["of the read rate"] = (gbps / read_gbps).map(lambda x: f"{x:.0%}")
        if meta is not None:
            _roofline_columns(out, ok, {**meta, "read_bandwidth_gbps": read_gbps})
        else:
            bound = bound_ms(ok, read_gbps)
            out["read bound ms"] = bound.map(T.fmt_num)
            out["time / read bound"] = (ok["time_ms"] / bound).map(lambda x: f"{x:.2f}")
    return out.sort_values(["variant", "batch", "context"]).reset_index(drop=True)


def exact_bound_table(g: pd.DataFrame, read_gbps: float,
                      meta: dict | None = None) -> pd.DataFrame:
    """Per context: the fastest exact path's time per token over its read bound, the
    baseline every "× faster than exact" divides by; with `meta` (a run whose rows count
    their FLOPs), over its roofline bound, with both bounds and which binds."""
    ok = T.ok_rows(g)
    ok = ok[T.is_exact(ok)].assign(bound_ms=lambda d: bound_ms(d, read_gbps))
    rows = []
    for n, h in ok.groupby("seq_len", sort=True):
        ex = h.loc[[h["time_ms"].idxmin()]]
        row = {"context": int(n), "exact path": ex["label"].iloc[0],
               "ms / token": T.fmt_num(ex["time_ms"].iloc[0])}
        if meta is None:
            row.update({"read bound ms": T.fmt_num(ex["bound_ms"].iloc[0]),
                        "time / read bound":
                        f"{ex['time_ms'].iloc[0] / ex['bound_ms'].iloc[0]:.2f}"})
        else:
            cols = pd.DataFrame(index=[0])
            _roofline_columns(cols, ex, {**meta, "read_bandwidth_gbps": read_gbps})
            row.update(cols.iloc[0].to_dict())
        rows.append(row)
    return pd.DataFrame(rows)


INTRO = (
    "Pass `decode`: after a prefill of N context tokens, each variant generates "
    "decode_tokens more, one at a time; time_ms is the median time per token, "
    "decode_state_mib the state it keeps to take the next step (a key-value cache "
    "grows with N, a window or a recurrent state does not). The error of the generated "
    "tokens' outputs has one of two references (err_ref), never in one table: for exact "
    "and approximate attention (err_ref softmax), float64 exact causal attention over the "
    "same context; for a recurrence (err_ref recurrence), which approximates no softmax, "
    "its own float64 reference over the same context and tokens (its sequential "
    "recurrence, or its causal forward in float64), not exact attention: there rel_err "
    "and row_cos say whether the decoder computes its own algorithm, not whether it "
    "recalls like attention.")


def _error_blocks(g: pd.DataFrame) -> list[tuple]:
    blocks: list[tuple] = []
    cos = (lambda x: f"{x:.4f}")
    soft, own = T.against_softmax(g), T.against_own(g)
    if not soft.empty:
        blocks += [("p", "row_cos of the generated tokens against float64 exact causal "
                         "attention (err_ref softmax)"),
                   ("table", T.metric_pivot(soft, "row_cos", cos))]
    if not own.empty:
        label = ("each recurrence's own float64 reference (err_ref recurrence)"
                 if set(own["err_ref"]) == {"recurrence"} else
                 "each variant's own float64 form (err_ref recurrence: its recurrence; "
                 "own_softmax: the exact softmax of its own definition)")
        blocks += [("p", f"rel_err of the generated tokens against {label}"),
                   ("table", T.metric_pivot(own, "rel_err", T.fmt_err)),
                   ("p", "row_cos against the same reference" + (
                       " (err_ref recurrence)" if set(own["err_ref"]) == {"recurrence"}
                       else "")),
                   ("table", T.metric_pivot(own, "row_cos", cos))]
    return blocks


def generation_blocks(dec: pd.DataFrame, meta: dict, run_dir: Path) -> list[tuple]:
    if dec.empty:
        return []
    read = meta.get("read_bandwidth_gbps")
    blocks: list[tuple] = [("h", 2, "Generation"), ("p", INTRO)]
    for setting, g in dec.groupby("setting", sort=False):
        blocks += [("h", 3, setting),
                   ("p", "ms per generated token"), ("table", T.metric_pivot(g, "time_ms")),
                   ("p", "decoding state (MiB)"),
                   ("table", T.metric_pivot(g, "decode_state_mib")),
                   *_error_blocks(g),
                   ("p", "Decodes faster than exact attention from"),
                   ("table", faster_than_exact_from(g))]
        roof = has_roofline(g)
        bound = exact_bound_table(g, read, meta if roof else None) if read else pd.DataFrame()
        blocks += [("p", "How far the exact path, the baseline of every × faster than exact, "
                         "is from its roofline bound in this run (time per token over the "
                         "larger of the time to move its cache at the read rate and the time "
                         "of its FLOPs at the matmul rate; 1 is the machine's limit, below "
                         "it the cache fits the CPU's caches; above it, a × faster is that "
                         "much larger than against a baseline at the bound):" if read and roof
                    else "How far the exact path, the baseline of every × faster than exact, "
                         "is from its read bound in this run (time per token over the time "
                         "to move its cache at the read rate; 1 is the memory's limit, below "
                         "it the cache fits the CPU's caches; above it, a × faster is that "
                         "much larger than against a baseline at the bound):" if read else
                         "This run's meta.json has no read rate: how far the exact path, "
                         "the baseline of every × faster than exact, is from its read bound "
                         "is not known here."), ("table", bound)]
    ok = _lines(T.ok_rows(dec))
    if not ok.empty:
        pdir = run_dir / "plots"
        blocks.append(("img", plots.scaling_plot(ok, "time_ms", "time per token (ms)",
                                                 pdir / "decode_time.png", "time_ms_iqr"),
                       "time per generated token against context"))
        blocks.append(("img", plots.scaling_plot(ok, "decode_state_mib", "decoding state (MiB)",
                                                 pdir / "decode_state.png"),
                       "decoding state against context"))
        if read:
            over = ok.assign(over_bound=ok["time_ms"] / bound_ms(ok, read))
            blocks.append(("img", plots.scaling_plot(over, "over_bound",
                                                     "time per token over\nits read bound",
                                                     pdir / "decode_bound.png"),
                           "time per generated token over its read bound, against context"))
    if read and has_roofline(dec):
        rates = ", ".join(f"matmul {k} {v:.0f} GFLOP/s"
                          for k, v in sorted(T.matmul_rates(meta).items()))
        return blocks + [
            ("h", 3, "Achieved bandwidth and the roofline bound"),
            ("p", "Each row's roofline bound is the larger of its read bound (the bytes a "
                  "step moves, decode_read_mib, at the read rate measured in this run: "
                  f"{read:.1f} GB/s, a sum over a 1 GiB float32 tensor) and its compute "
                  "bound (its FLOPs, decode_flops, at the matmul rate of its device and "
                  f"dtype measured in this run: {rates or 'none recorded'}); bound names "
                  "the larger. A key-value cache does about one FLOP a byte and is "
                  "read-bound; a grouped or latent cache, read once for several query "
                  "heads, does more and can be compute-bound. A state small enough for the "
                  "CPU's caches moves faster than memory does, so time / bound below 1 "
                  "means the state stayed in cache."),
            ("table", bandwidth_table(dec, read, meta))]
    blocks += [("h", 3, "Achieved bandwidth"),
               ("p", "Decoding is memory-bound. The read bound assumes a step moves the "
                     "state's bytes in the state's own dtype (what state_nbytes counts, "
                     "whatever the case's dtype): read once, and written back once where "
                     "the step rewrites it (a recurrence's whole state; a key-value cache "
                     "only appends the new token; a sparse decoder reads only its chosen "
                     "blocks and their statistics). moved MiB is those bytes "
                     "(decode_read_mib), GB/s moved those bytes over the time per token; "
                     "a state small enough for the CPU's caches moves faster than memory "
                     "does, so the comparison means something for large states only"
                     + (f", set against the read rate measured in this run ({read:.1f} GB/s, "
                        "a sum over a 1 GiB float32 tensor); the read bound is the moved "
                        "bytes at that rate." if read else
                        "; this run's meta.json has no read rate to set it against.")),
               ("table", bandwidth_table(dec, read, meta if has_roofline(dec) else None))]
    return blocks
