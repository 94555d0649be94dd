"""The dry-run's predicted cost of a case, in seconds: `plan` prints its sum, shards balance on it.

Compute-bound, so a lower bound for variants far below their FLOP rate: 0.5 s of overhead,
the float64 reference at a quarter of the measured fp32 matmul rate, and the workers'
calls (memory: a warm-up and the probe; time: the error pass, a warm-up, then
max(min_repeats, min_run_time / t + 1) timed) of t = flops / (0.25 * matmul rate), capped
at the case's timeout. The memory guard's extrapolated refusals need measured peaks, so
they are not known here.
"""

from __future__ import annotations

from harness.matrix import Case

SKIPPED_S = 0.01  # a declared skip writes one row and measures nothing


def case_seconds(case: Case, flops: float, rate_flops_per_s: float) -> float:
    """Predicted wall time of one measured case (flops: the case's analytic FLOPs)."""
    rate = 0.25 * rate_flops_per_s
    t = flops / rate
    rows = min(case.seq_len, case.err_rows)
    ref = 4 * case.batch * case.heads * rows * case.seq_len * case.head_dim / rate
    calls = 4 + max(case.min_repeats, case.min_run_time_s / max(t, 1e-9) + 1)
    return min(0.5 + ref + t * calls, case.timeout_s)


def plan_cases(cases: list[Case], rate_flops_per_s: float) -> list[tuple[Case, list[str], float]]:
    """(case, declared skip reasons, predicted seconds) for each case, in order."""
    import variants
    from harness import runner

    out = []
    for case in cases:
        module = variants.build(case.variant, **case.param_dict)
        why = runner.skip_reasons(case, module)
        cost = SKIPPED_S if why else case_seconds(case, runner.case_row(case, module)["flops"],
                                                  rate_flops_per_s)
        out.append((case, why, cost))
    return out
