"""Where MLA's absorbed decode step spends its time (issue 52: `mla` at 64K within 2x of its
roofline bound).

One absorbed decode step, B = 1, float32, DeepSeek-V3's widths (32 query heads, latent
R = 512, rotary 64, nope 128, value 128), over a latent cache of n rows of R + 64 = 576:
the step as variants/latent/kernels.absorbed_step runs it, then its parts alone (the score
product of the 32 absorbed queries against the cache, the softmax, the value product of
the probabilities against the cache's first R columns), then the same step in other forms:
the scores as K q^T (the cache as the GEMM's long side), the value product against the
whole 576-wide row (contiguous) with the last 64 columns dropped after, and torch's fused
kernel in FlashMLA's MQA mode (32 query heads on one key-value head, the row its own
value). Each form is checked against the step. The bound is the harness's: the step's
FLOPs (mla.decode_flops_at) at the square-matmul rate, or its bytes at the read rate,
whichever is longer, both measured in this process. Medians of at least 7 calls by the
harness's timer. Run it on a quiet machine:

    python tools/mla_decode_profile.py [n]      # n defaults to 65536
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from profile_common import median_ms, rates  # tools/: the harness's timer and rates

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import variants  # noqa: E402
from variants.core import softmax_  # noqa: E402
from variants.latent import kernels as K  # noqa: E402

H = 32
MLA = variants.build("mla")  # DeepSeek-V3's widths, the absorbed form
R, DR = MLA.params.kv_lora_rank, MLA.params.qk_rope_head_dim
DN, DV = MLA.params.qk_nope_head_dim, MLA.params.v_head_dim


def main(n: int) -> None:
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    gbps, gf = rates(threads)
    kc = torch.randn(1, n, R + DR)
    q_pe, q_nope = torch.randn(1, H, 1, DR), torch.randn(1, H, 1, DN)
    w_uk, w_uv = torch.randn(H, DN, R) * DN ** -0.5, torch.randn(H, DV, R) * R ** -0.5
    scale = MLA.softmax_scale
    shape = variants.Shape(B=1, H=H, N=n, D=DR)  # the decode case's: q is q_pe
    flops = MLA.decode_flops_at(n, shape)  # what the harness's decode rows count
    nbytes = MLA.decode_read_size_at(n, shape) * 4  # float32
    bound = max(flops / gf / 1e6, nbytes / gbps / 1e6)
    print(f"torch {torch.__version__}, {threads} threads, n = {n}; read rate {gbps:.1f} GB/s, "
          f"square matmul {gf:.0f} GFLOP/s; the step: {flops / 1e9:.2f} GFLOP, "
          f"{nbytes / 2**20:.0f} MiB, bound {bound:.2f} ms "
          f"({'compute' if flops / gf > nbytes / gbps else 'read'})")
    ref = K.absorbed_step(kc, q_pe, q_nope, w_uk, w_uv, scale)
    qa = K.absorbed_query(q_pe, q_nope, w_uk)[:, :, 0] * scale  # (1, H, 576)
    s = torch.bmm(qa, kc.transpose(1, 2))
    p = s.clone()
    softmax_(p)

    def score():
        return torch.bmm(qa, kc.transpose(1, 2))

    def score_kq():
        return torch.bmm(kc, qa.transpose(1, 2))  # (1, n, H)

    def soft():
        t = s.clone()
        softmax_(t)
        return t

    def value():
        return torch.bmm(p, kc[..., :R])

    def value_full():
        return torch.bmm(p, kc)[..., :R]

    def finish(o):
        return K.per_head(o[:, :, None], w_uv.transpose(1, 2))

    def step_kq_full():
        t = torch.bmm(kc, qa.transpose(1, 2)).transpose(1, 2)  # (1, H, n), strided
        t = t.contiguous()
        softmax_(t)
        return finish(torch.bmm(t, kc)[..., :R])

    def step_full():
        t = torch.bmm(qa, kc.transpose(1, 2))
        softmax_(t)
        return finish(torch.bmm(t, kc)[..., :R])

    def chunked(c: int = 8192):
        q0, k0 = qa[0], kc[0]
        m, l, acc = torch.full((H, 1), -float("inf")), torch.zeros(H, 1), torch.zeros(H, R + DR)
        for i in range(0, n, c):
            t = q0 @ k0[i:i + c].T  # (H, c)
            mi = torch.maximum(m, t.amax(1, keepdim=True))
            e, a = torch.exp(t - mi), torch.exp(m - mi)
            l, acc, m = l * a + e.sum(1, keepdim=True), acc * a + e @ k0[i:i + c], mi
        return finish((acc[:, :R] / l)[None])

    def fused():
        o = F.scaled_dot_product_attention(qa[:, :, None] / scale, kc[:, None], kc[:, None],
                                           scale=scale, enable_gqa=True)
        return finish(o[:, :, 0, :R])

    print("part or form | ms | GFLOP/s | time / bound | max |diff| to the step")
    rows = [("the step as run (absorbed_step)", lambda: K.absorbed_step(
                 kc, q_pe, q_nope, w_uk, w_uv, scale), flops, True),
            ("  scores q K^T", score, 2 * H * n * (R + DR), False),
            ("  scores K q^T", score_kq, 2 * H * n * (R + DR), False),
            ("  softmax", soft, 0, False),
            ("  values p K[:, :R]", value, 2 * H * n * R, False),
            ("  values p K, cut to R", value_full, 2 * H * n * (R + DR), False),
            ("step, values against the whole row", step_full, flops, True),
            ("step, K q^T and the whole row", step_kq_full, flops, True),
            ("step, 8,192-row chunks, running softmax", chunked, flops, True),
            ("step, fused kernel (MQA mode)", fused, flops, True)]
    for name, f, fl, whole in rows:
        ms = median_ms(f)
        diff = f"{(f() - ref).abs().max().item():.1e}" if whole else "-"
        rate = f"{fl / ms / 1e6:.0f}" if fl else "-"
        print(f"{name} | {ms:.2f} | {rate} | {ms / bound:.2f} | {diff}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 65536)
