"""Training-step time of the recall model per variant, over sdpa's, measured in one process.

    python tools/step_ratios.py                      # N = 64 and 128, every variant below
    python tools/step_ratios.py --seq-lens 64 --variants gla,kda --rounds 21

The shape is train-cpu's (d_model 64, two layers, two heads, batch 32, MQAR with 8 pairs
at N = 64 and 16 at N = 128), one thread. Each round times one step (forward, backward,
AdamW) of every model in turn, so that a change in the machine's speed during the run
moves every variant alike; the table gives each variant's median and its ratio to sdpa's
median. `tests/benchmarks/test_recurrent_steps.py` times the same steps with
pytest-benchmark, one variant after another.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from harness.train.model import RecallModel  # noqa: E402
from harness.train.tasks import IGNORE, mqar  # noqa: E402
from harness.train.trainer import flushed_denormals  # noqa: E402

VARIANTS = {"sdpa": {}, "retention": {}, "gla": {}, "mamba2": {}, "deltanet": {},
            "gated_deltanet": {}, "kda": {}, "moba": {"block_size": 8, "top_k": 3}}
SETTINGS = {32: (4, 32), 64: (8, 64), 128: (16, 128), 256: (32, 256)}  # N: (pairs, vocab)


def step_fn(name: str, params: dict, N: int):
    """One training step (forward, backward, AdamW) of a fresh recall model at N."""
    pairs, vocab = SETTINGS[N]
    x, y = mqar(32, N, vocab, pairs, seed=0)
    where = y != IGNORE
    torch.manual_seed(0)
    model = RecallModel(name, params, vocab_size=vocab, d_model=64, layers=2, heads=2,
                        causal=True, mlp=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        with flushed_denormals():  # as the trainer steps
            loss = F.cross_entropy(model(x, where), y[where])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return step


def medians(N: int, names: list[str], rounds: int, warmup: int = 3) -> dict[str, float]:
    """name -> median step time (s) at N, every model stepped once per round in turn."""
    steps = {n: step_fn(n, VARIANTS[n], N) for n in names}
    for s in steps.values():
        for _ in range(warmup):
            s()
    times = {n: [] for n in steps}
    for _ in range(rounds):
        for n, s in steps.items():
            start = time.perf_counter()
            s()
            times[n].append(time.perf_counter() - start)
    return {n: statistics.median(t) for n, t in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-lens", default="64,128", help=f"of {sorted(SETTINGS)}")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated; sdpa is always timed (the ratios' base)")
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args(argv)
    try:
        lens = [int(n) for n in a.seq_lens.split(",")]
    except ValueError:
        ap.error(f"--seq-lens: comma-separated integers, not {a.seq_lens!r}")
    names = ["sdpa"] + [n for n in a.variants.split(",") if n and n != "sdpa"]
    bad = [n for n in names if n not in VARIANTS] + [str(n) for n in lens if n not in SETTINGS]
    if bad:
        ap.error(f"unknown: {', '.join(bad)} (variants {', '.join(VARIANTS)}; "
                 f"N {', '.join(map(str, SETTINGS))})")
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        print("| N | " + " | ".join(names) + " |")
        print("|---" * (len(names) + 1) + "|")
        for N in lens:
            t = medians(N, names, a.rounds)
            base = t["sdpa"]
            print(f"| {N} | " + " | ".join(f"{t[n] * 1e3:.1f} ms ({t[n] / base:.2f}x)"
                                           for n in names) + " |", flush=True)
    finally:
        torch.set_num_threads(threads)  # a caller's setting (a test process's) comes back
    return 0


if __name__ == "__main__":
    sys.exit(main())
