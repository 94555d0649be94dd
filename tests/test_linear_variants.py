"""linear (elu+1) and performer (FAVOR+) against plain float64 quadratic forms of their kernels.

The naive references here are written independently of variants/linear/ (linear.py,
noncausal.py and causal.py): the N x N kernel matrix
phi(q) phi(k)^T, masked, normalised row by row (flash-linear-attention's habit of a plain
ground truth for every fast op, forward and backward, at odd lengths).
"""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import variants
from variants import exact_reference
from variants.linear.causal import causal_linear_attention
from variants.linear.noncausal import kernel_attention


def qkv(B=1, H=2, N=100, D=16, dtype=torch.float64, seed=0, scale=1.0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(3, B, H, N, D, generator=g, dtype=torch.float64).unbind(0)
    q, k = q * scale, k * scale
    return [t.to(dtype).requires_grad_(requires_grad) for t in (q, k, v)]


def quadratic_form(fq, fk, v, causal, eps):
    """sum_j a_ij v_j / (sum_j a_ij + eps), a = fq fk^T (masked j <= i when causal), float64."""
    a = fq.double() @ fk.double().transpose(-1, -2)  # (B, H, N, N)
    if causal:
        N = a.shape[-1]
        a = a.masked_fill(~torch.ones(N, N, dtype=torch.bool).tril(), 0.0)
    return (a @ v.double()) / (a.sum(dim=-1, keepdim=True) + eps)


def elu1(x):
    return torch.where(x > 0, x + 1, torch.exp(x))


def naive_linear(q, k, v, causal, eps=1e-6):
    return quadratic_form(elu1(q.double()), elu1(k.double()), v, causal, eps)


def rel_err(o, ref):
    return float((o.double() - ref).norm() / ref.norm())


# -- linear ---------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("N", [1, 63, 100, 1000, 2500])  # 2500: ragged blocks of 1024 rows
def test_linear_matches_naive_float64(N, causal):
    q, k, v = qkv(N=N, seed=N)
    o = variants.build("linear")(q, k, v, causal=causal)
    torch.testing.assert_close(o, naive_linear(q, k, v, causal), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("causal", [False, True])
def test_linear_low_precision(dtype, tol, causal):
    q, k, v = qkv(N=130, dtype=dtype)
    o = variants.build("linear")(q, k, v, causal=causal)
    assert o.dtype == dtype and o.shape == q.shape
    assert rel_err(o, naive_linear(q, k, v, causal)) < tol


@pytest.mark.parametrize("causal", [False, True])
def test_linear_gradients_match_naive(causal):
    q, k, v = qkv(N=150, seed=3, requires_grad=True)
    g_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(9), dtype=q.dtype)
    o = variants.build("linear")(q, k, v, causal=causal)
    grads = torch.autograd.grad(o, (q, k, v), g_out)
    ref = naive_linear(q, k, v, causal)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g_out)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11)


def test_linear_eps_zero_has_finite_gradients_at_a_ragged_length():
    q, k, v = qkv(N=100, seed=2, requires_grad=True)
    o = variants.build("linear", eps=0.0)(q, k, v, causal=True)
    grads = torch.autograd.grad(o.square().sum(), (q, k, v))
    ref = torch.autograd.grad(naive_linear(q, k, v, True, eps=0.0).square().sum(), (q, k, v))
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("N,chunk", [(100, 7), (64, 64), (65, 64), (5, 16)])
def test_chunked_prefix_sum_any_chunk(N, chunk):
    """Many chunks, a remainder chunk, exactly one chunk, and a chunk longer than N."""
    q, k, v = qkv(N=N, seed=chunk, requires_grad=True)
    o = causal_linear_attention(elu1(q), elu1(k), v, 1e-6, chunk)
    ref = quadratic_form(elu1(q), elu1(k), v, True, 1e-6)
    torch.testing.assert_close(o, ref, rtol=1e-10, atol=1e-12)
    g = torch.autograd.grad(o.square().sum(), (q, k, v))
    r = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, b in zip(g, r):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("name", ["linear", "performer"])
@pytest.mark.parametrize("N,chunk,rows", [(100, 7, 21), (100, 8, 16), (64, 64, 64), (5, 16, 16),
                                          (130, 8, 7)])
def test_streamed_causal_path_equals_the_quadratic_form(name, N, chunk, rows):
    """Without autograd the causal path runs in blocks of `rows` carrying its state (many
    blocks, a short last block, one chunk, a chunk longer than N, rows below a chunk). Keys
    scaled by 3 spread FAVOR+'s key weights over many orders of magnitude, so a later block
    raises the stabiliser and the carried state must be rescaled. Against the float64
    quadratic form of the same features, and against the differentiable path."""
    from variants.linear import EluFeatures
    from variants.linear.causal import causal_kernel_attention
    from variants.linear.noncausal import sequence_features
    q, k, v = qkv(N=N, seed=N + chunk, scale=3.0)
    if name == "linear":
        fmap, eps = EluFeatures(), 1e-6
    else:
        fmap, eps = variants.build("performer", num_features=24).feature_map(16, q.dtype,
                                                                            q.device), 0.0
    with torch.no_grad():
        o = causal_kernel_attention(q, k, v, fmap, eps, chunk, rows)
        fq, fk = sequence_features(q, k, fmap)
    torch.testing.assert_close(o, quadratic_form(fq, fk, v, True, eps), rtol=1e-10, atol=1e-12)
    qg = q.clone().requires_grad_(True)
    graph = causal_kernel_attention(qg, k, v, fmap, eps, chunk, rows)
    assert graph.requires_grad
    torch.testing.assert_close(o, graph.detach(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["linear", "performer"])
def test_causal_output_ignores_the_future(name):
    q, k, v = qkv(N=300, dtype=torch.float32, seed=5)
    m = variants.build(name)
    for i in (0, 100, 127, 128, 250):  # inside and at the edges of chunks
        k2, v2 = k.clone(), v.clone()
        k2[:, :, i + 1:] = torch.randn_like(k2[:, :, i + 1:]) * 3
        v2[:, :, i + 1:] = torch.randn_like(v2[:, :, i + 1:]) * 3
        o, o2 = m(q, k, v, causal=True), m(q, k2, v2, causal=True)
        torch.testing.assert_close(o2[:, :, :i + 1], o[:, :, :i + 1], rtol=1e-5, atol=1e-6)
        assert not torch.allclose(o2[:, :, i + 1:], o[:, :, i + 1:])


# -- performer ------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("N", [1, 63, 100, 1000, 2500])
def test_performer_equals_quadratic_form_of_its_features(N, causal):
    """The chunked path is checked exactly: same features, plain masked N x N form."""
    q, k, v = qkv(N=N, seed=N)
    m = variants.build("performer", num_features=48)
    fq, fk = m.feature_maps(q, k)
    assert fq.shape == (1, 2, N, 48) and (fq > 0).all() and (fk > 0).all()
    ref = quadratic_form(fq, fk, v, causal, torch.finfo(torch.float64).tiny)
    torch.testing.assert_close(m(q, k, v, causal=causal), ref, rtol=1e-10, atol=1e-12)


def naive_performer(q, k, v, w, causal):
    """FAVOR+ without stabilisers, from the module's own projection w (m, D), float64."""
    D = q.shape[-1]
    x, y = q.double() * D ** -0.25, k.double() * D ** -0.25
    fq = torch.exp(x @ w.T - x.square().sum(-1, keepdim=True) / 2) / w.shape[0] ** 0.5
    fk = torch.exp(y @ w.T - y.square().sum(-1, keepdim=True) / 2) / w.shape[0] ** 0.5
    return quadratic_form(fq, fk, v, causal, 0.0)


@pytest.mark.parametrize("causal", [False, True])
def test_performer_stabilisers_cancel_forward_and_backward(causal):
    """Output and gradients equal the unstabilised form: the shifts are per-row/per-head."""
    q, k, v = qkv(N=150, seed=4, requires_grad=True)
    m = variants.build("performer", num_features=40)
    g_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(9), dtype=q.dtype)
    o = m(q, k, v, causal=causal)
    ref = naive_performer(q, k, v, m.projection, causal)
    torch.testing.assert_close(o, ref, rtol=1e-9, atol=1e-11)
    grads = torch.autograd.grad(o, (q, k, v), g_out)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g_out)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-8, atol=1e-10)


def test_performer_kernel_is_unbiased_for_softmax():
    """m phi(q).phi(k) times the stabiliser constants estimates exp(q.k / sqrt(D))."""
    D = 8
    q, k, _ = qkv(N=4, D=D, scale=0.5)
    m = variants.build("performer", num_features=200_000, orthogonal=False)
    x, y = q * D ** -0.25, k * D ** -0.25
    w = m._projection(D, q.device, torch.float64)
    fq = torch.exp(x @ w.T - x.square().sum(-1, keepdim=True) / 2)  # unstabilised
    fk = torch.exp(y @ w.T - y.square().sum(-1, keepdim=True) / 2)
    est = fq @ fk.transpose(-1, -2) / w.shape[0]
    torch.testing.assert_close(est, torch.exp(q @ k.transpose(-1, -2) / D ** 0.5), rtol=0.02,
                               atol=0)


def _mean_err(num_features, orthogonal, causal=False, seeds=8):
    """rel_err against exact softmax, averaged over feature seeds and input seeds."""
    errs = []
    for s in range(seeds):
        # Small-norm q, k: FAVOR+'s variance grows like exp(|q + k|^2 / sqrt(D)).
        q, k, v = qkv(N=64, D=16, seed=100 + s, scale=0.5)
        m = variants.build("performer", num_features=num_features, orthogonal=orthogonal,
                           seed=s)
        errs.append(rel_err(m(q, k, v, causal=causal), exact_reference(q, k, v, causal)))
    return sum(errs) / len(errs)


@pytest.mark.parametrize("causal", [False, True])
def test_performer_error_falls_with_features(causal):
    e16, e64, e256 = (_mean_err(n, True, causal) for n in (16, 64, 256))
    assert e16 > e64 > e256, (e16, e64, e256)
    assert e256 < 0.6 * e16


@pytest.mark.parametrize("num_features", [16, 32])
def test_orthogonal_features_beat_iid(num_features):
    """Performer paper Fig. 4 / Thm 2: orthogonal blocks lower the error at equal m."""
    orth, iid = _mean_err(num_features, True, seeds=10), _mean_err(num_features, False, seeds=10)
    assert orth < iid, (orth, iid)


def test_orthogonal_rows_are_orthogonal_within_blocks():
    m = variants.build("performer", num_features=40)
    w = m._projection(16, torch.device("cpu"), torch.float64)  # (40, 16): blocks 16, 16, 8
    for lo, hi in ((0, 16), (16, 32), (32, 40)):
        u = w[lo:hi] / w[lo:hi].norm(dim=-1, keepdim=True)
        torch.testing.assert_close(u @ u.T, torch.eye(hi - lo, dtype=torch.float64))


def test_performer_determinism_and_cache():
    q, k, v = qkv(N=70, dtype=torch.float32)
    a = variants.build("performer", seed=3)
    b = variants.build("performer", seed=3)
    oa = a(q, k, v)
    w = a.projection
    assert a(q, k, v).equal(oa) and a.projection is w  # drawn once, cached
    assert b(q, k, v).equal(oa)
    assert not variants.build("performer", seed=4)(q, k, v).equal(oa)


def test_performer_redraw_draws_each_call_reproducibly():
    q, k, v = qkv(N=70, dtype=torch.float32)
    a = variants.build("performer", redraw=True)
    b = variants.build("performer", redraw=True)
    o1, o2 = a(q, k, v), a(q, k, v)
    assert not torch.allclose(o1, o2)
    assert b(q, k, v).equal(o1) and b(q, k, v).equal(o2)


# -- both -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("N", [1, 63, 100, 1000])
@pytest.mark.parametrize("name", ["linear", "performer"])
def test_odd_lengths_and_dtypes(name, N, dtype):
    q, k, v = qkv(N=N, dtype=dtype, requires_grad=True)
    m = variants.build(name, num_features=32) if name == "performer" else variants.build(name)
    for causal in (False, True):
        o = m(q, k, v, causal=causal)
        assert o.shape == q.shape and o.dtype == dtype and torch.isfinite(o).all()
        o.float().sum().backward()
        assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["linear", "performer"])
def test_saved_for_backward_is_never_quadratic(name, causal):
    """Without timing: nothing autograd keeps is N x N or N x D x D per (batch, head)."""
    B, H, N, D = 1, 2, 2048, 32
    q, k, v = qkv(B=B, H=H, N=N, D=D, dtype=torch.float32, requires_grad=True)
    m = variants.build(name, num_features=128) if name == "performer" else variants.build(name)
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o = m(q, k, v, causal=causal)
    o.sum().backward()
    assert sizes and max(sizes) // (B * H) < min(N * N, N * D * D), max(sizes)


@pytest.mark.parametrize("N", [1, 100, 512])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["linear", "performer"])
def test_flops_match_the_matmuls_run(name, causal, N):
    B, H, D = 1, 2, 16
    q, k, v = qkv(B=B, H=H, N=N, D=D, dtype=torch.float32)
    m = variants.build(name, num_features=24) if name == "performer" else variants.build(name)
    with FlopCounterMode(display=False) as fc:
        m(q, k, v, causal=causal)
    assert m.flops(B, H, N, D, causal) == fc.get_total_flops()


def test_invalid_parameters_are_refused():
    with pytest.raises(ValueError, match="performer.*num_features"):
        variants.build("performer", num_features=0)
    with pytest.raises(ValueError, match="linear.*eps"):
        variants.build("linear", eps=-1.0)
    assert variants.spec("performer").family == variants.spec("linear").family == "linear"


@pytest.mark.parametrize("scale", [1.0, 3.0])  # 3.0: block stabilisers far apart
def test_blocked_non_causal_path_is_independent_of_the_block_size(scale):
    """Per-block key stabilisers are rescaled to a common one: blocks of 37 rows give the
    output and gradients of one block of all 150 rows."""
    q, k, v = qkv(N=150, seed=5, scale=scale, requires_grad=True)
    m = variants.build("performer", num_features=40)
    fmap = m.feature_map(16, q.dtype, q.device)
    g_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(2), dtype=q.dtype)
    grads = []
    for rows in (37, 150):
        o = kernel_attention(q, k, v, fmap, 0.0, rows=rows)
        grads.append((o.detach(), *torch.autograd.grad(o, (q, k, v), g_out)))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["linear", "performer"])
@pytest.mark.parametrize("N", [1, 100, 1000])
def test_inference_path_equals_the_differentiable_path(name, N):
    """Without autograd kernel_attention writes into preallocated buffers; with it, the same
    arithmetic by differentiable ops. Both must give the same output, to the last bits."""
    q, k, v = qkv(N=N, dtype=torch.float32, seed=N, scale=2.0)
    m = variants.build(name)
    with torch.no_grad():
        fast = m(q, k, v)
    q.requires_grad_(True)
    graph = m(q, k, v)
    assert graph.requires_grad
    torch.testing.assert_close(fast, graph.detach(), rtol=1e-6, atol=0)


def test_softmax_logsumexp_matches_torch_and_its_gradient():
    """The fused feature op against torch.softmax and torch.logsumexp, values and gradients
    (float64 gradcheck, including rows whose entries are far apart)."""
    from variants.linear.linear import _SoftmaxLogSumExp
    g = torch.Generator().manual_seed(0)
    spread = torch.tensor([1.0, 30.0, 300.0], dtype=torch.float64).view(1, 3, 1, 1)
    u = torch.randn(2, 3, 7, 40, generator=g, dtype=torch.float64) * spread
    p, lse = _SoftmaxLogSumExp.apply(u)
    torch.testing.assert_close(p, torch.softmax(u, -1), rtol=1e-12, atol=0)
    torch.testing.assert_close(lse, torch.logsumexp(u, -1, keepdim=True), rtol=1e-12, atol=1e-12)
    small = u[:, :, :2, :6].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: _SoftmaxLogSumExp.apply(x), (small,))
    assert torch.autograd.gradcheck(lambda x: _SoftmaxLogSumExp.apply(x)[1], (small,))


def test_performer_with_redraw_has_no_one_map():
    """Each call draws new features: no single weights(q, k) gives the next output."""
    q, k, _ = (torch.randn(1, 1, 16, 8) for _ in range(3))
    with pytest.raises(ValueError, match="draws new features on every call"):
        variants.build("performer", redraw=True).weights(q, k)
    assert variants.build("performer").weights(q, k).shape == (1, 1, 16, 16)
