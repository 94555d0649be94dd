"""Our variants against this machine's fp32 matmul rate, measured in one process.

    python -m harness.measure.roofline                       # defaults, N = 8192, H = 8, D = 64
    python -m harness.measure.roofline --seq-lens 4096,8192,16384 --causal
    python -m harness.measure.roofline --variants block_sparse,block_sparse_flex --heads 4 \
        --seq-lens 16384 --causal --passes forward

For each variant at its default parameters and each pass, the achieved rate is the
variant's analytic FLOPs (`flops()`; forward+backward counted as 3x the forward) over its
median time, set against the fp32 matmul rate of an n x n matmul measured right before
and right after that case (their mean: the machine's speed drifts between minutes, so a
single rate from the start would misstate later cases). Inputs are N(0, 1), built outside
the timed region; the variant's `prepare` (a compile, a mask) runs before timing.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import variants
from harness.measure import timing



def default_variants() -> list[str]:
    """Our approximate variants: the quick preset's non-exact ones (data, not a list here)."""
    from harness.measure.matrix import read_toml

    return [n for n in read_toml("quick")["variants"] if not variants.spec(n).exact]


def matmul_gflops(n: int = 2048, min_run_time: float = 0.3) -> float:
    """fp32 n x n matmul: 2 n^3 over the median time, in GFLOP/s (the current threads)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    t = timing.time_call(lambda: a @ b, min_run_time=min_run_time, min_repeats=5, warmup=2)
    return 2 * n**3 / (t.time_ms * 1e6)


def measure(name: str, B: int, H: int, N: int, D: int, causal: bool, backward: bool,
            min_run_time: float, seed: int = 0) -> dict:
    """One case: time, achieved GFLOP/s and the matmul rate around it."""
    module = variants.build(name)
    why = module.unsupported_reasons(device="cpu", dtype=torch.float32, causal=causal,
                                     seq_len=N, head_dim=D, backward=backward)
    row = {"variant": name, "N": N, "causal": causal,
           "pass": "forward_backward" if backward else "forward"}
    if why:
        return {**row, "skipped": "; ".join(why)}
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, D, generator=g) for _ in range(3))
    module.prepare(q, k, v, causal, backward=backward)
    if backward:
        for t in (q, k, v):
            t.requires_grad_(True)
        fn = timing.forward_backward_fn(module, q, k, v, causal)
    else:
        fn = timing.forward_fn(module, q, k, v, causal)
    before = matmul_gflops()
    t = timing.time_call(fn, min_run_time=min_run_time, min_repeats=5, warmup=1)
    after = matmul_gflops()
    flops = module.flops(B, H, N, D, causal) * (3 if backward else 1)
    rate = flops / (t.time_ms * 1e6)
    matmul = (before + after) / 2
    return {**row, "time_ms": t.time_ms, "iqr_ms": t.time_ms_iqr, "gflops": rate,
            "matmul_gflops": matmul, "matmul_spread": abs(before - after) / matmul,
            "fraction": rate / matmul}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m harness.measure.roofline",
                                description=__doc__.splitlines()[0])
    p.add_argument("--variants", default=None,
                   help="comma-separated (default: the quick preset's approximate variants)")
    p.add_argument("--seq-lens", default="8192")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--passes", default="forward,forward_backward")
    p.add_argument("--causal", action="store_true", help="causal cases (else non-causal)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--min-run-time", type=float, default=1.0, help="seconds per case")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [n for n in (args.variants or ",".join(default_variants())).split(",") if n]
    unknown = [n for n in names if n not in variants.names(private=True)]
    if unknown:
        p.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(variants.names())}")
    print(f"threads {torch.get_num_threads()}, B={args.batch} H={args.heads} D={args.head_dim}, "
          f"float32, {'causal' if args.causal else 'non-causal'}")
    print(f"{'variant':16s} {'N':>6s} {'pass':17s} {'time_ms':>9s} {'IQR':>7s} "
          f"{'GFLOP/s':>8s} {'matmul':>7s} {'of matmul':>9s}")
    fractions = []
    for N in (int(x) for x in args.seq_lens.split(",")):
        for name in names:
            for pass_ in args.passes.split(","):
                r = measure(name, args.batch, args.heads, N, args.head_dim, args.causal,
                            pass_ == "forward_backward", args.min_run_time)
                if "skipped" in r:
                    print(f"{name:16s} {N:6d} {pass_:17s} skipped: {r['skipped']}")
                    continue
                fractions.append(r["fraction"])
                print(f"{name:16s} {N:6d} {pass_:17s} {r['time_ms']:9.1f} {r['iqr_ms']:7.1f} "
                      f"{r['gflops']:8.1f} {r['matmul_gflops']:7.1f} {r['fraction']:8.0%}"
                      + (f"  (matmul moved {r['matmul_spread']:.0%})"
                         if r["matmul_spread"] > 0.1 else ""), flush=True)
    if fractions:
        print(f"median {statistics.median(fractions):.0%} of the matmul rate, "
              f"lowest {min(fractions):.0%}")


if __name__ == "__main__":
    main()
