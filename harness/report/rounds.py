"""The report's "Timing drift between rounds" section: cases whose rounds disagree
(results.csv `rounds`, `time_ms_spread`) and other work seen on the cores (meta.json `busy`).

A case timed in R rounds spread over the run has R medians minutes apart; their largest
relative difference is its spread. Above SPREAD_FLAG the machine's speed changed between
the rounds, so the case's time, and every ratio of it to another variant, is uncertain by
about that much: the section lists those cases with their spread.
"""

from __future__ import annotations

import pandas as pd

from harness.files import SPREAD_FLAG

TITLE = "Timing drift between rounds"


def rounds_blocks(df: pd.DataFrame, meta: dict) -> list[tuple]:
    """The section's blocks; df has the report's `label` and `setting` columns."""
    blocks: list[tuple] = [("h", 2, TITLE)]
    rounds, spread = (pd.to_numeric(df[c], errors="coerce") if c in df.columns
                      else pd.Series(float("nan"), index=df.index)
                      for c in ("rounds", "time_ms_spread"))  # runs before rounds lack them
    mask = (df["status"] == "ok") & (rounds > 1)
    timed = df[mask].assign(spread=spread[mask])  # (assign on an empty frame takes its index)
    if timed.empty:
        blocks.append(("p", "No case was timed in more than one round, so a drift of the "
                            "machine's speed between minutes would not show here: a run "
                            "with `--rounds 3` times each case in three rounds spread over "
                            "the run and records the spread between them."))
    else:
        flagged = timed[timed["spread"] > SPREAD_FLAG].sort_values("spread", ascending=False)
        text = (f"{len(timed)} case(s) timed in {_rounds_text(rounds[timed.index])} rounds "
                "spread over the run (round 1 of every case, then round 2, ...); `time_ms` "
                "is the median over all rounds' samples, the spread the largest relative "
                "difference between two rounds' medians: median "
                f"{timed['spread'].median():.1%}, largest {timed['spread'].max():.1%}. ")
        if flagged.empty:
            text += f"No case's spread exceeds {SPREAD_FLAG:.0%}."
            blocks.append(("p", text))
        else:
            text += (f"{len(flagged)} case(s) exceed {SPREAD_FLAG:.0%}: the machine's speed "
                     "changed between their rounds, so their times, and their ratios to "
                     "other variants, are uncertain by that much.")
            blocks += [("p", text), ("table", pd.DataFrame({
                "variant": flagged["label"], "setting": flagged["setting"],
                "N": flagged["seq_len"].astype(int),
                "time_ms": flagged["time_ms"].map(lambda x: f"{x:.3g}"),
                "spread": flagged["spread"].map(lambda x: f"{x:.0%}"),
                "ratios uncertain by": flagged["spread"].map(lambda x: f"±{x:.0%}")}))]
    blocks += [("p", note) for note in busy_notes(meta)]
    return blocks


def _rounds_text(rounds: pd.Series) -> str:
    values = sorted({int(r) for r in rounds.dropna()})
    return " or ".join(map(str, values))


def busy_notes(meta: dict) -> list[str]:
    """One line per sample in which other work used the cores (meta.json `busy`, also each
    shard's), or one line saying the samples saw none."""
    samples = [(None, s) for s in meta.get("busy") or []]
    samples += [(r.get("shard"), s) for r in meta.get("shards") or [] for s in r.get("busy") or []]
    if not samples:
        return []
    busy = [(shard, s) for shard, s in samples if s.get("warn")]
    if not busy:
        most = max(s["other_cores"] for _, s in samples)
        return [f"Other work on the cores, sampled for {samples[0][1]['window_s']:g} s at the "
                f"start and before each round ({len(samples)} samples): at most {most:.2f} "
                "cores; none warned."]
    out = []
    for shard, s in busy:
        when = f"before round {s['before_round']}" if s.get("before_round") else "at the start"
        where = f" (shard {shard})" if shard is not None else ""
        out.append(f"Warning: other work used {s['other_cores']:.1f} of {s['cores']} cores "
                   f"over {s['window_s']:g} s {when}{where}, at {s['at']}: the times measured "
                   "around then are distorted.")
    return out
