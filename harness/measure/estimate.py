"""The dry-run's predicted cost of a case, in seconds: `plan` prints its sum, shards balance on it.

Compute-bound, so a lower bound for variants far below their FLOP rate: 0.5 s of overhead,
the float64 reference at a quarter of the measured fp32 matmul rate, and the workers'
calls (memory: a warm-up and the probe; time: the error pass, a warm-up, then
max(min_repeats, min_run_time / t + 1) timed) of t = flops / (0.25 * matmul rate), capped
at the case's timeout; with R rounds, each round times its 1/R share after a warm-up. The rate is the fp32 matmul rate measured here for CPU cases and
GPU_ASSUMED_GFLOPS for CUDA cases (estimated even where CUDA is absent: the plan of a GPU
run made on a laptop or a login node). Variants that compile add COMPILE_ASSUMED_S (both
workers) for each new (variant, device, dtype, pass). The memory guard's extrapolated
refusals need measured peaks, so they are not known here.

A decode case is bound by drawing its context and reading its state, not by FLOPs: two
draws of the context (the memory worker's prefill and the time worker's) at
DRAW_FLOATS_PER_S, then the warm-up and timed repeats of T steps, each reading the state
(`memory.decode_bytes`) at READ_ASSUMED_GBPS; a layer pattern draws and steps each layer.
"""

from __future__ import annotations

from harness.measure.matrix import Case

SKIPPED_S = 0.01  # a declared skip writes one row and measures nothing
# No GPU is measured before a run: a dense matmul rate of a modern data-centre GPU
# (H100/H200 class: TF32/bf16 tensor cores well above this; variants run below it), and the
# seconds the first worker spends compiling a library kernel the first time it meets a
# (variant, dtype, pass); the second worker finds inductor's on-disk cache and pays the
# smaller figure. Both unmeasured on a GPU here.
GPU_ASSUMED_GFLOPS = 100_000
COMPILE_ASSUMED_S = (20.0, 5.0)
# torch.randn with a generator, float32 on this 2-core CPU: 5.4e7 numbers/s (measured on a
# loaded machine; single-threaded); and a read rate below the 25 GB/s a sum reaches here.
DRAW_FLOATS_PER_S = 5e7
READ_ASSUMED_GBPS = 10.0


def decode_seconds(case: Case, state_bytes: int | None, n_layers: int = 1) -> float:
    """Predicted wall time of one decode case (of `n_layers` layers: a stack's state_bytes
    are its whole state; each layer draws its own context and takes its own steps)."""
    s = case.shape  # q's heads, and the keys' and values' own (grouped heads draw fewer)
    draw = (2 * n_layers * case.batch * case.seq_len * (s.H * s.D + s.Hk * s.D + s.Hv * s.Dv)
            / DRAW_FLOATS_PER_S)
    step = (state_bytes or 0) / (READ_ASSUMED_GBPS * 1e9) + 1e-4 * n_layers  # + overheads
    run = case.decode_tokens * step
    timed = max(case.min_repeats, case.min_run_time_s / max(run, 1e-9) + 1)
    return min(0.5 + draw + run * (2 + timed), case.timeout_s)


def case_seconds(case: Case, flops: float, rate_flops_per_s: float,
                 compile_s: float = 0.0) -> float:
    """Predicted wall time of one measured case (flops: the case's analytic FLOPs)."""
    rate = 0.25 * rate_flops_per_s
    t = flops / rate
    rows = min(case.seq_len, case.err_rows)
    ref = 4 * case.batch * case.heads * rows * case.seq_len * case.head_dim / rate
    r = case.rounds  # each round: 1/r of the budget, ceil(min_repeats / r) timings at least
    timed = max(-(-case.min_repeats // r), case.min_run_time_s / r / max(t, 1e-9) + 1)
    first = 0.5 + ref + t * (4 + timed) + compile_s
    if first >= case.timeout_s:  # it times out in round 1: no later rounds
        return case.timeout_s
    later = min(0.1 + t * (1 + timed), case.timeout_s)  # a warm-up, then its timing
    return first + (r - 1) * later


def plan_cases(cases: list[Case], cpu_rate_flops_per_s: float
               ) -> list[tuple[Case, list[str], float]]:
    """(case, declared skip reasons, predicted seconds) for each case, in order.

    A missing CUDA device is not a skip here: the plan is of the run where it will go.
    """
    from harness.measure import layers, rows

    rates = {"cpu": cpu_rate_flops_per_s, "cuda": GPU_ASSUMED_GFLOPS * 1e9}
    out, compiled = [], set()
    for case in cases:
        module = layers.build(case)
        why = [r for r in rows.skip_reasons(case, module) if r != rows.NO_CUDA]
        if why:
            out.append((case, why, SKIPPED_S))
            continue
        kernel = (case.variant, case.device, case.dtype, case.pass_)
        compile_s = 0.0
        if module.contract.compiled and kernel not in compiled:
            compiled.add(kernel)
            compile_s = sum(COMPILE_ASSUMED_S)
        if case.decode:
            from harness.measure.memory import decode_bytes

            out.append((case, why, decode_seconds(case, decode_bytes(case, module),
                                                  len(layers.of(module)))))
            continue
        flops = rows.case_row(case, module)["flops"]
        out.append((case, why, case_seconds(case, flops, rates[case.device], compile_s)))
    return out
