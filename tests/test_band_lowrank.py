"""scatterbrain and longshort: exact band plus a low-rank far field, at O(N) cost.

Ground truths, written here from the papers' formulas, dense and in float64 (the
flash-linear-attention habit of a naive form beside the fast one): Scatterbrain's
estimator (exp of the scores in the band, FAVOR+ features phi(q).phi(k) computed plainly
from the same seeded projection outside it, one normalisation), and Long-Short's one
softmax over band keys and segment-mean summaries. The float64 exact reference, with the
band as an explicit key mask, checks the band part; at window >= N both are exact.
"""

from __future__ import annotations

import math

import pytest
import torch

import variants
from dispatch_probe import LargestOutput
from variants.linear import random_projection
from variants.low_rank import segment_sizes
from variants.core import exact_reference, naive_attention
from variants.sliding_window import band_mask

NAMES = ("scatterbrain", "longshort")


def qkv(N, dtype=torch.float64, B=1, H=2, D=16, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(3, B, H, N, D, generator=g).unbind(0)  # each (B, H, N, D)
    return tuple(t.to(dtype) for t in (q * scale, k, v))


def band(N, w, causal):
    i = torch.arange(N)
    d = i[None, :] - i[:, None]  # (N, N): j - i
    return (d >= -w) & (d <= (0 if causal else w))


def naive_scatterbrain(q, k, v, window, num_features, seed, causal):
    """a_ij = exp(q_i.k_j / sqrt D) in the band, phi(q_i).phi(k_j) outside (FAVOR+ features
    exp(w.x - |x|^2 / 2) / sqrt(m), x scaled by D^-1/4); o = a v / a 1. Float64, N x N."""
    N, D = q.shape[-2:]
    W = random_projection(num_features, D, True, torch.Generator().manual_seed(seed))  # (m, D)

    def phi(x):
        x = x * D ** -0.25
        return torch.exp(x @ W.T - x.square().sum(-1, keepdim=True) / 2) / math.sqrt(num_features)

    near = band(N, window, causal)
    a = torch.where(near, torch.exp(q @ k.transpose(-1, -2) / math.sqrt(D)),
                    phi(q) @ phi(k).transpose(-1, -2))
    if causal:
        a = a.tril()
    return (a @ v) / a.sum(-1, keepdim=True)


def naive_longshort(q, k, v, window, segment, causal):
    """One softmax over the band's keys and the summaries (key mean, score + log size; value
    mean) of the segments wholly outside the band (causal: ending before i - window)."""
    N, D = q.shape[-2:]
    sizes = segment_sizes(N, min(segment, N))
    first = torch.tensor([sum(sizes[:g]) for g in range(len(sizes))])
    last = first + torch.tensor(sizes) - 1
    kbar = torch.stack([k[..., f:l + 1, :].mean(-2) for f, l in zip(first, last)], -2)
    vbar = torch.stack([v[..., f:l + 1, :].mean(-2) for f, l in zip(first, last)], -2)
    i = torch.arange(N)[:, None]
    seen = (last[None, :] < i - window) | (~torch.tensor(causal) & (first[None, :] > i + window))
    s = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~band(N, window, causal), -math.inf)
    ss = (q @ kbar.transpose(-1, -2) / math.sqrt(D) + torch.tensor(sizes, dtype=q.dtype).log()).masked_fill(
        ~seen, -math.inf)
    p = torch.softmax(torch.cat([s, ss], -1), -1)
    return p[..., :N] @ v + p[..., N:] @ vbar


def naive(name, q, k, v, params, causal):
    if name == "scatterbrain":
        return naive_scatterbrain(q, k, v, params["window"], params["num_features"],
                                  params["seed"], causal)
    return naive_longshort(q, k, v, params["window"], params["segment"], causal)


CASES = [
    ("scatterbrain", dict(window=0, num_features=8, seed=0)),
    ("scatterbrain", dict(window=7, num_features=32, seed=3)),
    ("scatterbrain", dict(window=40, num_features=16, seed=1)),
    ("longshort", dict(window=0, segment=5)),
    ("longshort", dict(window=7, segment=9)),
    ("longshort", dict(window=40, segment=64)),
]
IDS = [f"{n}-" + "-".join(f"{k}{v}" for k, v in p.items()) for n, p in CASES]


@pytest.mark.parametrize("name,params", CASES, ids=IDS)
@pytest.mark.parametrize("N", [1, 63, 100, 257])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_the_dense_float64_formula(name, params, N, causal):
    m = variants.build(name, **params)
    q, k, v = qkv(N)
    ref = naive(name, q, k, v, params, causal)
    torch.testing.assert_close(m(q, k, v, causal), ref, rtol=1e-9, atol=1e-10)
    # float32: the same, to float32 rounding of a normalised output
    o32 = m(*(t.float() for t in (q, k, v)), causal)
    assert o32.dtype == torch.float32
    assert (o32.double() - ref).abs().max() <= 1e-4


@pytest.mark.parametrize("name,params", CASES[1:3] + CASES[4:], ids=IDS[1:3] + IDS[4:])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_matches_the_dense_float64_formula(name, params, causal):
    N = 45
    m = variants.build(name, **params)
    inputs = [t.requires_grad_(True) for t in qkv(N)]
    ref_inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    go = torch.randn(inputs[0].shape, dtype=torch.float64,
                     generator=torch.Generator().manual_seed(1))
    m(*inputs, causal).backward(go)
    naive(name, *ref_inputs, params, causal).backward(go)
    for got, want in zip(inputs, ref_inputs):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-8, atol=1e-9)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("N,window", [(1, 0), (63, 62), (100, 100), (100, 10_000)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_at_least_n_is_exact_attention(name, N, window, causal, dtype):
    """Flash-attention's rule: error at most twice the plain path's in the same dtype."""
    m = variants.build(name, window=window)
    q, k, v = qkv(N, dtype, seed=N)
    ref = exact_reference(q, k, v, causal)
    base = (naive_attention(q, k, v, causal).double() - ref).abs().max()
    err = (m(q, k, v, causal).double() - ref).abs().max()
    assert err <= 2 * base + torch.finfo(dtype).eps, (err, base)


@pytest.mark.parametrize("causal", [False, True])
def test_longshort_with_one_token_segments_is_exact_attention(causal):
    """segment >= N: every summary is one key (log 1 = 0), so the softmax is exact's."""
    N = 90
    q, k, v = qkv(N)
    for window in (0, 5):
        o = variants.build("longshort", window=window, segment=N)(q, k, v, causal)
        torch.testing.assert_close(o, exact_reference(q, k, v, causal), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name,params", [CASES[1], CASES[4]], ids=[IDS[1], IDS[4]])
@pytest.mark.parametrize("causal", [False, True])
def test_band_part_is_masked_exact_attention(name, params, causal):
    """The weights inside the band, renormalised, are exact softmax over the band: against
    the float64 reference with the band as an explicit key mask (and j <= i when causal)."""
    N = 120
    m = variants.build(name, **params)
    q, k, v = qkv(N)
    W = m.weights(q, k, causal)
    torch.testing.assert_close(W @ v, m(q, k, v, causal), rtol=1e-9, atol=1e-10)
    near = band(N, params["window"], causal)
    Wb = W * near
    o_band = (Wb / Wb.sum(-1, keepdim=True)) @ v
    ref = exact_reference(q, k, v, causal, key_mask=band_mask(params["window"]))
    torch.testing.assert_close(o_band, ref, rtol=1e-9, atol=1e-10)
    far = W * ~near
    if causal:
        assert far.triu(1).abs().max() == 0
    assert far.sum() > 0  # the far field is seen, not dropped


@pytest.mark.parametrize("causal", [False, True])
def test_scatterbrain_far_field_is_performers_estimate(causal):
    """Outside the band, scatterbrain's weights are performer's (same features, same seed),
    up to one factor per row: the low-rank part is performer's estimate, not another."""
    N, w = 150, 9
    q, k, _ = qkv(N)
    sb = variants.build("scatterbrain", window=w, num_features=24, seed=5).weights(q, k, causal)
    pf = variants.build("performer", num_features=24, seed=5).weights(q, k, causal)
    far = ~band(N, w, causal)
    if causal:
        far &= torch.ones(N, N, dtype=torch.bool).tril()
    rows = far.any(-1)  # rows with a far field (causal: i > w)
    a, b = (x * far for x in (sb, pf))
    a, b = a / a.sum(-1, keepdim=True), b / b.sum(-1, keepdim=True)
    torch.testing.assert_close(a[..., rows, :], b[..., rows, :], rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_sharp_and_large_inputs_stay_finite(name):
    """Large scores (|q| x 8: scores ~ N(0, 64)) and bfloat16: the log-space shifts keep the
    output finite and a convex mix of value rows (|o| <= max |v|)."""
    m = variants.build(name, window=5)
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = qkv(300, dtype, scale=8.0)
        for causal in (False, True):
            o = m(q, k, v, causal)
            assert torch.isfinite(o).all()
            assert o.abs().max() <= v.abs().max() * 1.01


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("causal", [False, True])
def test_memory_is_linear_in_n_forward_and_backward(name, causal):
    """What autograd keeps grows as N (4x the length: at most ~4x the saved elements; an
    N x N path would save 16x), and no op makes an N x N tensor, forward or backward."""
    m = variants.build(name, window=32, **({"num_features": 32} if name == "scatterbrain"
                                            else {"segment": 32}))
    saved, largest = {}, {}
    for N in (1024, 4096):
        q, k, v = (t.requires_grad_(True) for t in qkv(N, torch.float32, B=1, H=1))
        sizes = []
        mode = LargestOutput()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t,
                                                      lambda t: t), mode:
            m(q, k, v, causal).sum().backward()
        saved[N], largest[N] = sum(sizes), mode.largest
    assert saved[4096] < 4.4 * saved[1024], saved
    # Each query scores <= ~100 band keys and 32 features or summaries.
    assert largest[4096] < 4096 * 4096 // 32, largest


def test_flops_count_band_features_and_far_field():
    sb = variants.build("scatterbrain", window=256, num_features=256)
    ls = variants.build("longshort", window=256, segment=256)
    sw = variants.build("sliding_window", window=256)
    for m in (sb, ls):  # linear in N past the window
        assert m.flops(1, 8, 32768, 64) == 2 * m.flops(1, 8, 16384, 64)
        assert m.flops(1, 8, 16384, 64) > sw.flops(1, 8, 16384, 64)
    # causal: one far direction instead of two, a shorter span
    assert sb.flops(1, 8, 16384, 64, True) < sb.flops(1, 8, 16384, 64)
    # window >= N: no far field, the band's count plus the features alone
    small = variants.build("scatterbrain", window=100, num_features=8)
    assert small.flops(1, 1, 64, 16) == (variants.build("sliding_window", window=100)
                                         .flops(1, 1, 64, 16) + 4 * 64 * 16 * 8)
    assert variants.spec("scatterbrain").family == variants.spec("longshort").family == \
        "band_lowrank"
