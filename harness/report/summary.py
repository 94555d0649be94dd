"""The report's first lines: its title and, for a benchmark run, what the run holds."""

from __future__ import annotations

from harness.report.run import Run


def blocks(run: Run) -> list[tuple]:
    """The title; then the cases, variants, lengths and statuses of results.csv."""
    out: list[tuple] = [("h", 1, f"attnbench report: {run.name}")]
    if run.results is None:
        return out
    if run.df.empty:  # decode cases alone
        counts = run.dec["status"].value_counts()
        return out + [
            ("p", f"{len(run.dec)} decode cases, contexts "
                  f"{', '.join(str(n) for n in sorted(run.dec['seq_len'].unique()))}. Status: "
                  + ", ".join(f"{s} {n}" for s, n in counts.items()) + ".")]
    df = run.df
    counts = df["status"].value_counts()
    return out + [
        ("p", f"{len(df)} cases, {df['label'].nunique()} variant configurations, lengths "
              f"{', '.join(str(n) for n in sorted(df['seq_len'].unique()))}. Status: "
              + ", ".join(f"{s} {n}" for s, n in counts.items()) + ". Times are medians (ms), "
              "memory is the peak above the inputs (MiB), error is ||o - o_ref||_F / ||o_ref||_F "
              "(rel_err) and row_cos the mean cosine of o's rows to o_ref's.")]
