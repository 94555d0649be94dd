"""Linformer and Nyströmformer: exact limits, error against budget, declared limits, memory shape."""

from __future__ import annotations

import pytest
import torch

import variants
from harness.measure.inputs import make_inputs
from variants.low_rank import segment_means, segment_sizes
from variants.nystrom import iterative_pinv
from variants.core import exact_reference


def rel_err(o: torch.Tensor, ref: torch.Tensor) -> float:
    return float((o.double() - ref).norm() / ref.norm())


def loop_segments(N: int, m: int) -> list[tuple[int, int]]:
    """[start, end) of m contiguous segments, as equal as possible, by a plain loop."""
    bounds, start = [], 0
    for i in range(m):
        size = N // m + (1 if i < N % m else 0)
        bounds.append((start, start + size))
        start += size
    return bounds


# -- exact limits ----------------------------------------------------------------------

@pytest.mark.parametrize("N", [37, 64, 2500])  # 2500: query blocks of 1024, a ragged one
def test_linformer_mean_pool_with_k_equal_n_is_exact(N):
    q, k, v = make_inputs("sharp", 2, 3, N, 16, dtype=torch.float64, seed=1)
    o = variants.build("linformer", k=N, projection="mean_pool")(q, k, v)
    assert rel_err(o, exact_reference(q, k, v)) < 1e-12


@pytest.mark.parametrize("N", [37, 64])
def test_nystrom_with_all_landmarks_and_exact_pinv_is_exact(N):
    q, k, v = make_inputs("gaussian", 2, 3, N, 16, dtype=torch.float64, seed=2)
    o = variants.build("nystrom", num_landmarks=N, pinv_iterations=0)(q, k, v)
    assert rel_err(o, exact_reference(q, k, v)) < 1e-9


def test_iterative_pinv_converges_to_linalg_pinv():
    g = torch.Generator().manual_seed(0)
    m = 16
    # A softmax matrix with a dominant diagonal: well conditioned, like nearby landmarks.
    a = torch.softmax(3 * torch.eye(m) + 0.5 * torch.randn(4, m, m, generator=g), dim=-1)
    a = a.double()
    exact = torch.linalg.pinv(a)
    errs = [float((iterative_pinv(a, it) - exact).norm() / exact.norm()) for it in (1, 3, 6, 12)]
    assert all(a > b for a, b in zip(errs, errs[1:])), errs  # strictly: each count counts
    assert errs[-1] < 1e-10


def test_nystrom_error_at_every_landmark_falls_with_pinv_iterations():
    """With one landmark per token F A^+ B = A A^+ A, so against float64 exact attention
    the only error left is the pseudo-inverse's: it falls with every doubling of the
    iterations (measured 0.60, 0.45, 0.16, 8.6e-3, 2.8e-10) and is 0 with the SVD (0).
    An iteration count that is ignored reads the same error at every count."""
    N = 64
    q, k, v = make_inputs("gaussian", 1, 2, N, 16, dtype=torch.float64, seed=2)
    ref = exact_reference(q, k, v)

    def err(it):
        return rel_err(variants.build("nystrom", num_landmarks=N, pinv_iterations=it)(q, k, v),
                       ref)

    errs = [err(it) for it in (1, 2, 4, 8, 16)]
    assert all(a > 1.2 * b for a, b in zip(errs, errs[1:])), errs
    assert errs[0] > 0.1 and errs[-1] < 1e-8, errs
    assert err(0) < 1e-12


def test_iterative_pinv_normalises_each_matrix_on_its_own():
    g = torch.Generator().manual_seed(1)
    a = torch.softmax(torch.randn(3, 8, 8, generator=g) * torch.tensor([0.5, 2.0, 4.0])[:, None, None],
                      dim=-1).double()
    batched = iterative_pinv(a, 6)
    alone = torch.stack([iterative_pinv(a[i], 6) for i in range(3)])
    torch.testing.assert_close(batched, alone)


# -- agreement with plain dense constructions ------------------------------------------

def test_segment_means_use_every_position_with_uneven_segments():
    N, m = 100, 7
    sizes = segment_sizes(N, m)
    assert sum(sizes) == N and max(sizes) - min(sizes) <= 1
    x = torch.randn(2, 3, N, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    want = torch.stack([x[:, :, s:e].mean(dim=-2) for s, e in loop_segments(N, m)], dim=-2)
    torch.testing.assert_close(segment_means(x, m), want)
    # The last position moves the last landmark: nothing is dropped.
    y = x.clone()
    y[:, :, -1] += 1.0
    assert not torch.allclose(segment_means(y, m)[:, :, -1], segment_means(x, m)[:, :, -1])


@pytest.mark.parametrize("N, m", [(100, 7), (128, 64), (64, 64), (10, 3)])
def test_segment_means_backward_is_its_own_derivative(N, m):
    """segment_means' written-out backward (each position gets its segment's gradient over
    the segment's size) against finite differences, with runs of two segment sizes."""
    x = torch.randn(2, 3, N, 5, generator=torch.Generator().manual_seed(N), dtype=torch.float64,
                    requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: segment_means(t, m), (x,))


def _averaging_matrix(N: int, m: int) -> torch.Tensor:
    P = torch.zeros(m, N, dtype=torch.float64)
    for r, (s, e) in enumerate(loop_segments(N, m)):
        P[r, s:e] = 1.0 / (e - s)
    return P


def test_nystrom_matches_dense_construction_at_uneven_segments():
    N, m, D = 100, 7, 8
    q, k, v = make_inputs("local", 1, 2, N, D, dtype=torch.float64, seed=3)
    P = _averaging_matrix(N, m)
    ql, kl = P @ q, P @ k
    sm = lambda x: torch.softmax(x / D ** 0.5, dim=-1)  # noqa: E731
    f, a, b = sm(q @ kl.mT), sm(ql @ kl.mT), sm(ql @ k.mT)
    want = f @ torch.linalg.pinv(a) @ b @ v
    o = variants.build("nystrom", num_landmarks=m, pinv_iterations=0)(q, k, v)
    torch.testing.assert_close(o, want)
    want_it = f @ iterative_pinv(a, 6) @ b @ v
    torch.testing.assert_close(variants.build("nystrom", num_landmarks=m)(q, k, v), want_it)


def test_linformer_matches_dense_construction():
    N, kk, D = 100, 7, 8
    q, k, v = make_inputs("local", 1, 2, N, D, dtype=torch.float64, seed=4)
    P = _averaging_matrix(N, kk)
    offset = torch.tensor(segment_sizes(N, kk), dtype=torch.float64).log()
    want = torch.softmax(q @ (P @ k).mT / D ** 0.5 + offset, dim=-1) @ (P @ v)
    o = variants.build("linformer", k=kk, projection="mean_pool")(q, k, v)
    torch.testing.assert_close(o, want)

    m = variants.build("linformer", k=kk, projection="gaussian", seed=5)
    E, F = m.projections(N, "cpu", torch.float64)
    want = torch.softmax(q @ (E @ k).mT / D ** 0.5, dim=-1) @ (F @ v)
    torch.testing.assert_close(m(q, k, v), want)


def test_gaussian_projection_scaling_and_sharing():
    kk, N = 64, 4096
    E, F = variants.build("linformer", k=kk).projections(N, "cpu", torch.float32)
    assert E.shape == F.shape == (kk, N)
    assert abs(float(E.var()) * kk - 1.0) < 0.02  # entries ~ N(0, 1/k)
    assert not torch.equal(E, F)
    Es, Fs = variants.build("linformer", k=kk, share_kv=True).projections(N, "cpu", torch.float32)
    assert Fs is Es and torch.equal(Es, E)


# -- error falls as the budget grows ---------------------------------------------------

def _mean_err(name, key, value, dist, seeds=(0, 1, 2), N=512, **extra):
    total = 0.0
    for s in seeds:
        q, k, v = make_inputs(dist, 1, 2, N, 32, seed=s)
        seeded = {"seed": s} if extra.get("projection") == "gaussian" else {}
        m = variants.build(name, **{key: value}, **extra, **seeded)
        total += rel_err(m(q, k, v), exact_reference(q, k, v))
    return total / len(seeds)


@pytest.mark.parametrize("name,key,values,extra", [
    ("nystrom", "num_landmarks", (8, 32, 128), {}),
    ("linformer", "k", (16, 64, 256), {"projection": "mean_pool"}),
    ("linformer", "k", (16, 64, 256), {"projection": "gaussian"}),
])
def test_error_falls_with_budget_on_local_attention(name, key, values, extra):
    errs = [_mean_err(name, key, val, "local", **extra) for val in values]
    assert errs[0] > errs[1] > errs[2], errs


# -- declared limits -------------------------------------------------------------------

@pytest.mark.parametrize("name", ["linformer", "nystrom"])
def test_causal_is_refused_with_reason(name):
    m = variants.build(name)
    reasons = m.unsupported_reasons(device="cpu", dtype=torch.float32, causal=True,
                                    seq_len=1024, head_dim=64)
    assert reasons and "non-causal" in reasons[0]
    assert not variants.spec(name).supports_causal
    q, k, v = make_inputs("gaussian", 1, 1, 300, 8)
    with pytest.raises(ValueError, match="non-causal"):
        m(q, k, v, causal=True)


@pytest.mark.parametrize("name,params", [("linformer", {"k": 64}),
                                         ("linformer", {"k": 64, "projection": "mean_pool"}),
                                         ("nystrom", {"num_landmarks": 64})])
def test_budget_longer_than_sequence_is_a_reason(name, params):
    m = variants.build(name, **params)
    reasons = m.unsupported_reasons(device="cpu", dtype=torch.float32, causal=False,
                                    seq_len=63, head_dim=8)
    assert reasons and "exceeds the sequence length" in reasons[0]
    q, k, v = make_inputs("gaussian", 1, 1, 63, 8)
    with pytest.raises(ValueError, match="exceeds the sequence length"):
        m(q, k, v)
    assert not m.unsupported_reasons(device="cpu", dtype=torch.float32, causal=False,
                                     seq_len=64, head_dim=8)


@pytest.mark.parametrize("bad", [{"projection": "svd"}, {"k": 0}, {"share_kv": 1}])
def test_linformer_rejects_invalid_parameters(bad):
    with pytest.raises(ValueError, match="linformer"):
        variants.build("linformer", **bad)


def test_nystrom_rejects_negative_iterations():
    with pytest.raises(ValueError, match="pinv_iterations"):
        variants.build("nystrom", pinv_iterations=-1)


# -- determinism ------------------------------------------------------------------------

def test_gaussian_projection_is_seeded():
    q, k, v = make_inputs("gaussian", 1, 2, 200, 16)
    a = variants.build("linformer", k=32, seed=7)(q, k, v)
    b = variants.build("linformer", k=32, seed=7)(q, k, v)
    c = variants.build("linformer", k=32, seed=8)(q, k, v)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)


# -- dtypes, odd lengths, backward --------------------------------------------------------

CASES = [("linformer", {"k": 16}), ("linformer", {"k": 16, "projection": "mean_pool"}),
         ("linformer", {"k": 16, "share_kv": True}), ("nystrom", {"num_landmarks": 16}),
         ("nystrom", {"num_landmarks": 16, "pinv_iterations": 0})]


@pytest.mark.parametrize("name,params", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_odd_length_shape_dtype_and_backward(name, params, dtype):
    q, k, v = (t.requires_grad_() for t in make_inputs("local", 2, 3, 101, 8, dtype=dtype))
    o = variants.build(name, **params)(q, k, v)
    assert o.shape == q.shape and o.dtype == dtype and torch.isfinite(o).all()
    o.float().square().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


def test_flops_count_the_computed_matmuls():
    B, H, N, D = 2, 3, 1000, 64
    assert variants.build("linformer", k=100).flops(B, H, N, D) == B * H * 8 * N * 100 * D
    pooled = variants.build("linformer", k=100, projection="mean_pool").flops(B, H, N, D)
    assert pooled == B * H * (2 * N * D + 4 * N * 100 * D)
    ny = variants.build("nystrom", num_landmarks=10, pinv_iterations=2).flops(B, H, N, D)
    m = 10
    assert ny == B * H * (2 * N * D + 8 * N * m * D + 4 * m * m * D + 2 * 8 * m ** 3)


# -- memory structure: nothing N x N is kept for backward ----------------------------------

@pytest.mark.parametrize("name,params", CASES)
def test_no_n_by_n_tensor_saved_for_backward(name, params):
    N = 2048
    q, k, v = (t.requires_grad_() for t in make_inputs("gaussian", 1, 1, N, 16))
    params = {**params, ("k" if name == "linformer" else "num_landmarks"): 64}
    m = variants.build(name, **params)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o = m(q, k, v)
    o.sum().backward()
    assert saved and max(saved) < N * N, max(saved)


# -- the hand-written backward passes --------------------------------------------------------

@pytest.mark.parametrize("Nq,Nk,budget", [(100, 7, 1 << 20), (100, 7, 64 * 7 * 8), (5, 300, 8)])
@pytest.mark.parametrize("bias", [False, True])
def test_softmax_attention_forward_and_backward_match_plain_autograd(Nq, Nk, budget, bias):
    """Blocks of one head and a few rows (tiny budgets), or all heads and rows at once."""
    from variants.low_rank import softmax_attention
    g = torch.Generator().manual_seed(Nq + Nk)
    q = torch.randn(2, 3, Nq, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, Nk, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 3, Nk, 5, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(Nk, generator=g, dtype=torch.float64) if bias else None
    g_out = torch.randn(2, 3, Nq, 5, generator=g, dtype=torch.float64)
    o = softmax_attention(q, k, v, b, budget=budget)
    s = q @ k.mT + (0 if b is None else b)
    ref = torch.softmax(s, dim=-1) @ v
    torch.testing.assert_close(o, ref, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(o, (q, k, v), g_out)
    for a, r in zip(grads, torch.autograd.grad(ref, (q, k, v), g_out)):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(softmax_attention(q, k, v, b, budget=budget), ref)


@pytest.mark.parametrize("name,params", [("linformer", {"k": 7, "projection": "mean_pool"}),
                                         ("linformer", {"k": 7}),
                                         ("nystrom", {"num_landmarks": 7})])
def test_gradients_match_the_dense_construction(name, params):
    N, D = 100, 8
    q, k, v = (t.requires_grad_() for t in make_inputs("local", 1, 2, N, D, dtype=torch.float64,
                                                       seed=6))
    m = variants.build(name, **params)
    sm = lambda x: torch.softmax(x / D ** 0.5, dim=-1)  # noqa: E731
    if name == "nystrom":
        P = _averaging_matrix(N, 7)
        ql, kl = P @ q, P @ k
        want = sm(q @ kl.mT) @ iterative_pinv(sm(ql @ kl.mT), 6) @ sm(ql @ k.mT) @ v
    elif params.get("projection") == "mean_pool":
        P = _averaging_matrix(N, 7)
        offset = torch.tensor(segment_sizes(N, 7), dtype=torch.float64).log()
        want = torch.softmax(q @ (P @ k).mT / D ** 0.5 + offset, dim=-1) @ (P @ v)
    else:
        E, F = m.projections(N, "cpu", torch.float64)
        want = sm(q @ (E @ k).mT) @ (F @ v)
    g_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=q.dtype)
    o = m(q, k, v)
    torch.testing.assert_close(o, want, rtol=1e-10, atol=1e-12)
    for a, r in zip(torch.autograd.grad(o, (q, k, v), g_out),
                    torch.autograd.grad(want, (q, k, v), g_out)):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-11)
