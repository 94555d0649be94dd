"""The decays within a chunk against float64 on the same b: Γ_ij = exp(b_i - b_j) (j <= i,
else 0) times a matrix, of the scalar-gate and delta-rule forms (variants/recurrent/chunked
.decayed), and the per-channel scores of gla and kda (variants/recurrent/scores.py)."""

import math

import pytest
import torch

from variants.recurrent.chunked import decayed, lower_mask
from variants.recurrent.reference import dense_weights
from variants.recurrent.scores import channel_scores


@pytest.mark.parametrize("C", [1, 7, 64])
def test_the_decayed_products_are_exact_below_zero_above_and_finite_for_any_decay(C):
    """m ⊙ Γ for two matrices at once (the delta rule's Q K^T and K K^T), values and the
    gradients of both and of b. Steps of 0 to 50 nats: far pairs decay below float32's
    normal range (Γ keeps exp(EXP_FLOOR) at most) and the differences above the diagonal
    reach thousands of nats (e^+3000 would overflow before a mask). Planted and seen
    failing: the clamp's upper bound dropped (inf * 0 above the diagonal: NaN), the mask
    product dropped, a floor of -20 (pairs of e^-20 to e^-80 read 2e-9), the backward's
    two sums swapped, db from the first product only."""
    gen = torch.Generator().manual_seed(0)
    g = -50 * torch.rand(3, 2, C, generator=gen, dtype=torch.float64)
    g[0] = -0.05 * torch.rand(2, C, generator=gen, dtype=torch.float64)  # a mild decay too
    mats = [torch.randn(3, 2, C, C, generator=gen, dtype=torch.float64) for _ in range(2)]
    ins = [g.cumsum(-1).float().requires_grad_()] + [m.float().requires_grad_() for m in mats]
    got = decayed(ins[0], lower_mask(C, ins[0]), *ins[1:])
    w = [torch.randn(3, 2, C, C, generator=gen, dtype=torch.float64) for _ in range(2)]
    sum((o.double() * wi).sum() for o, wi in zip(got, w)).backward()

    ref_ins = [t.detach().double().requires_grad_() for t in ins]
    b64 = ref_ins[0]
    upper = torch.ones(C, C, dtype=torch.bool).triu(1)
    x = (b64[..., :, None] - b64[..., None, :]).masked_fill(upper, float("-inf"))
    ref = [m * x.exp() for m in ref_ins[1:]]
    sum((r * wi).sum() for r, wi in zip(ref, w)).backward()

    # float32's b_i - b_j rounds by up to 6e-8 |x| (b reaches -1,600): exp's relative error
    floor = math.exp(-80)  # at most this much is kept of a decay below it (not the module's
    # EXP_FLOOR: a higher floor planted there would raise the test's tolerance with it)
    rel = 1e-6 + 1.2e-7 * x.detach().abs().nan_to_num(posinf=0.0)
    for o, r, m in zip(got, ref, ref_ins[1:]):
        assert torch.isfinite(o).all() and (o[..., upper] == 0).all()
        assert ((o.double() - r).abs() <= rel * r.abs() + 2 * floor * m.abs().detach()).all()
    assert x[..., ~upper].min() < -80 or C == 1  # far pairs below the floor were there
    for a, r in zip(ins, ref_ins):
        assert torch.allclose(a.grad.double(), r.grad, rtol=1e-5, atol=1e-6 * r.grad.abs().max())


@pytest.mark.parametrize("leaf", [1, 2, 4, 8])
@pytest.mark.parametrize("C", [5, 16])
def test_the_per_channel_scores_match_float64_at_every_leaf(C, leaf):
    """P_tj = Σ_d x_td k_jd exp(b_td - b_jd) for j <= t (variants/recurrent/scores.py), its
    diagonal leaves taken explicitly for leaf > 1 (a variant's sub_chunk), against the
    float64 reference's dense weights (variants/recurrent/reference.py), values and
    gradients, decays of 0 to 50 nats a step. Planted and seen failing: the leaves' mask
    dropped (their upper part nonzero), their differences taken the wrong way round."""
    gen = torch.Generator().manual_seed(1)
    x, k = (torch.randn(3, 2, C, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    g = -50 * torch.rand(3, 2, C, 8, generator=gen, dtype=torch.float64)
    g[0] = -0.05 * torch.rand(2, C, 8, generator=gen, dtype=torch.float64)
    b = g.cumsum(-2)
    w = torch.randn(3, 2, C, C, generator=gen, dtype=torch.float64)
    ins = [t.float().requires_grad_() for t in (x, k, b)]
    got = channel_scores(*ins, leaf)
    (got.double() * w).sum().backward()

    ref_ins = [t.detach().double().requires_grad_() for t in ins]
    xr, kr, br = ref_ins
    # the float64 reference's per-channel weights, s P with s = D^-1/2, from the g whose
    # cumulative sum is this b (to float64 rounding)
    gr = torch.diff(br, dim=-2, prepend=torch.zeros_like(br[..., :1, :]))
    ref = dense_weights(xr, kr, gr) * x.shape[-1] ** 0.5  # (3, 2, C, C)
    (ref * w).sum().backward()
    lower = torch.ones(C, C, dtype=torch.bool).tril()

    assert torch.isfinite(got).all() and (got[..., ~lower] == 0).all()
    scale = ref.abs().max()
    assert (got.double() - ref).abs().max() <= 1e-5 * scale
    for a, r in zip(ins, ref_ins):
        assert torch.isfinite(a.grad).all()
        assert (a.grad.double() - r.grad).abs().max() <= 1e-4 * r.grad.abs().max()
