"""Where the time of one dsa decode step goes at a long context, and whether another layout
of the lightning indexer's product is faster (issue 53's "within 2x of its roofline bound").

The step at context n (64 indexer heads of 128, one 128-wide indexer key a token, top_k
2,048) is the indexer's product (64 x 128 by 128 x n), its ReLU and weighted sum over the
heads, then the top-k: this times each part as `variants.learned_sparse.indexer` runs it,
the product alone in four layouts and five chunk sizes, a oneDNN matmul with the ReLU
fused, and a square 2,048 matmul in the same process (the rate the roofline bound uses).
Medians of 7 calls. Run it on a quiet machine:

    python tools/dsa_indexer_profile.py [n]      # n defaults to 2**20
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from profile_common import matmul_rate, median_ms  # tools/: the harness's timer and rates

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from variants.learned_sparse import indexer as ix  # noqa: E402


def main(n: int) -> None:
    torch.manual_seed(0)
    Hi, di, kk = 64, 128, 2048
    iq = torch.randn(1, Hi, 1, di)
    ik = torch.nn.functional.layer_norm(torch.randn(1, 1, n, di), (di,))
    iw = torch.randn(1, Hi, 1) / (Hi * di) ** 0.5
    flops = 2 * Hi * di * n
    rate = lambda ms: flops / ms / 1e6  # GFLOP/s of the product  # noqa: E731
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, n = {n}")
    rate_sq = matmul_rate(torch.get_num_threads())  # the run's own rate
    print(f"square 2048 matmul: {rate_sq:.0f} GFLOP/s")
    sc = ix.lightning_scores(iq, ik, iw)
    print(f"lightning_scores (product, ReLU, weighted sum): {median_ms(lambda: ix.lightning_scores(iq, ik, iw)):.1f} ms")
    print(f"top_later (top-k, ties to the later): {median_ms(lambda: ix.top_later(sc, kk)):.1f} ms")
    q, K = iq[0, :, 0], ik[0, 0]
    KT = K.t().contiguous()
    print("the product alone, ms (GFLOP/s), by key chunk:")
    print("  chunk | q K_c^T (as run) | q (K^T)_c, keys stored transposed | "
          "blocks stored transposed | K_c q^T")
    for m in (1024, 2048, 4096, 8192, 16384):
        buf, bufT = torch.empty(Hi, m), torch.empty(m, Hi)
        KB = K.view(n // m, m, di).transpose(1, 2).contiguous()
        forms = (
            lambda: [torch.mm(q, K[s:s + m].t(), out=buf) for s in range(0, n, m)],
            lambda: [torch.mm(q, KT[:, s:s + m], out=buf) for s in range(0, n, m)],
            lambda: [torch.mm(q, KB[i], out=buf) for i in range(n // m)],
            lambda: [torch.mm(K[s:s + m], q.t(), out=bufT) for s in range(0, n, m)],
        )
        cells = [median_ms(f) for f in forms]
        print(f"  {m:5d} | " + " | ".join(f"{c:.1f} ({rate(c):.0f})" for c in cells))
    try:
        lp = torch.ops.mkldnn._linear_pointwise
        out = torch.empty(n)

        def fused():
            for s in range(0, n, 4096):
                y = lp(K[s:s + 4096], q, None, "relu", [], "")
                torch.mv(y, iw[0, :, 0], out=out[s:s + y.shape[0]])
        fused()
        err = (out - sc[0, 0]).abs().max().item()
        print(f"oneDNN matmul with the ReLU fused, then the weighted sum: "
              f"{median_ms(fused):.1f} ms (largest difference {err:.1e})")
    except (RuntimeError, AttributeError) as e:
        print(f"oneDNN linear_pointwise unavailable: {e}".splitlines()[0])


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2**20)
