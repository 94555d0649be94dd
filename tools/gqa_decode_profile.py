"""Why a grouped cache's decode step sits further from its read bound than a multi-head
one (issue 52: GQA-8's time over its roofline bound against MHA's).

One decode step of exact attention, B = 1, float32, over a cache of Hk key-value heads of
width 128 at context n: the g query heads of each cached head packed as g rows of one head
(what variants/exact/cache.py does: the cache is read once), timed with torch's fused CPU
kernel for g = 1, 2, 4, 8 at Hk = 8, and the multi-head case (Hk = 32, g = 1). The cache's
bytes are the same for every g at Hk = 8; what grows with g is the arithmetic per byte. The
read rate is a sum over a 1 GiB float32 tensor, as the harness measures it. Then, at Hk = 8
and g = 4 (GQA-8 of 32 query heads), the same step in other forms: two products (q K^T then
p V, or K q^T then p^T V), the two products a key chunk at a time with a running softmax,
and the fused kernel on two halves of the keys joined by their log-sum-exp. Medians of 7
calls. Run it on a quiet machine:

    python tools/gqa_decode_profile.py [n]      # n defaults to 65536
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from profile_common import median_ms, rates  # tools/: the harness's timer and rates


def main(n: int) -> None:
    torch.manual_seed(0)
    D = 128
    threads = torch.get_num_threads()
    gbps, gf = rates(threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, n = {n}; "
          f"read rate {gbps:.1f} GB/s, square matmul {gf:.0f} GFLOP/s")
    print("Hk | g | query heads | cache MiB | ms | GB/s of cache | GFLOP/s | time / read bound")
    for Hk, gs in ((8, (1, 2, 4, 8)), (32, (1,))):
        K, V = torch.randn(1, Hk, n, D), torch.randn(1, Hk, n, D)
        nbytes = 2 * Hk * n * D * 4
        for g in gs:
            q = torch.randn(1, Hk, g, D)
            ms = median_ms(lambda: F.scaled_dot_product_attention(q, K, V))
            flops = 4 * Hk * g * n * D
            bound = nbytes / gbps / 1e6
            print(f"{Hk} | {g} | {Hk * g} | {nbytes / 2**20:.0f} | {ms:.2f} | "
                  f"{nbytes / ms / 1e6:.1f} | {flops / ms / 1e6:.1f} | {ms / bound:.2f}")
        del K, V
    Hk, g = 8, 4
    K, V, q = torch.randn(Hk, n, D), torch.randn(Hk, n, D), torch.randn(Hk, g, D)
    sc = D ** -0.5
    ref = F.scaled_dot_product_attention(q[None], K[None], V[None])[0]

    def products():
        return torch.bmm(torch.softmax(torch.bmm(q * sc, K.transpose(1, 2)), -1), V)

    def products_t():
        p = torch.softmax(torch.bmm(K, (q * sc).transpose(1, 2)), 1)
        return torch.bmm(p.transpose(1, 2), V)

    def chunked(m=8192):
        qs, top = q * sc, torch.full((Hk, g, 1), float("-inf"))
        den, acc = torch.zeros(Hk, g, 1), torch.zeros(Hk, g, D)
        for a in range(0, n, m):
            s = torch.bmm(qs, K[:, a:a + m].transpose(1, 2))
            new = torch.maximum(top, s.amax(-1, keepdim=True))
            corr, p = torch.exp(top - new), torch.exp(s - new)
            den = den * corr + p.sum(-1, keepdim=True)
            acc = acc * corr + torch.bmm(p, V[:, a:a + m])
            top = new
        return acc / den

    def halves():
        h = n // 2
        (o1, l1), (o2, l2) = (
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q[None], K[None, :, a:a + h], V[None, :, a:a + h], 0.0, False, scale=sc)[:2]
            for a in (0, h))
        lse = torch.logaddexp(l1, l2)[..., None]
        return (o1 * torch.exp(l1[..., None] - lse) + o2 * torch.exp(l2[..., None] - lse))[0]

    print("Hk 8, g 4, other forms: ms (largest difference from the fused kernel)")
    forms = (("fused kernel, rows packed (as run)",
              lambda: F.scaled_dot_product_attention(q[None], K[None], V[None])[0]),
             ("q K^T, then p V", products), ("K q^T, then p^T V", products_t),
             ("chunks of 8,192 keys, running softmax", chunked),
             ("fused kernel on two halves, joined by log-sum-exp", halves))
    for name, f in forms:
        print(f"  {name}: {median_ms(f):.2f} ({(f() - ref).abs().max().item():.0e})")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 65536)
