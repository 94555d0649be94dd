"""sliding_window and block_sparse: exact softmax restricted to their pattern, at O(N) cost.

Ground truth is the float64 chunked reference with the variant's own key mask; a fast
path's error must be at most twice the plain same-dtype implementation's, plus a floor
(flash-attention's rule). Small N, fixed seeds.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import variants
from variants.core import dense_mask, exact_reference, naive_attention
from dispatch_probe import LargestOutput

CASES = [
    ("sliding_window", dict(window=0)),
    ("sliding_window", dict(window=7)),
    ("sliding_window", dict(window=40)),
    ("block_sparse", dict(block_size=16)),
    ("block_sparse", dict(block_size=7, window_blocks=2, global_blocks=1, random_blocks=2)),
    ("block_sparse", dict(block_size=8, global_blocks=0, random_blocks=1, seed=3)),
]
IDS = [f"{n}-" + "-".join(f"{k}{v}" for k, v in p.items()) for n, p in CASES]


def qkv(N, dtype=torch.float32, B=1, H=2, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(3, B, H, N, D, generator=g).unbind(0)  # each (B, H, N, D)
    return tuple(t.to(dtype) for t in (q, k, v))


def max_err(x, ref):
    return (x.double() - ref).abs().max().item()


@pytest.mark.parametrize("name,params", CASES, ids=IDS)
@pytest.mark.parametrize("N", [1, 63, 100])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_masked_reference_and_sdpa(name, params, N, causal, dtype):
    m = variants.build(name, **params)
    q, k, v = qkv(N, dtype)
    o = m(q, k, v, causal)
    assert o.shape == q.shape and o.dtype == dtype
    mask = m.key_mask(N)
    ref = exact_reference(q, k, v, causal, key_mask=mask)
    naive_err = max_err(naive_attention(q, k, v, causal, key_mask=mask), ref)
    floor = torch.finfo(dtype).eps
    assert max_err(o, ref) <= 2 * naive_err + floor
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(N, causal, mask))
    assert (o.double() - sdpa.double()).abs().max().item() <= (
        2 * naive_err + max_err(sdpa, ref) + floor)


@pytest.mark.parametrize("name,params", CASES[1:4:2], ids=IDS[1:4:2])
def test_long_odd_length(name, params):
    N = 1000
    m = variants.build(name, **params)
    q, k, v = qkv(N, B=1, H=1)
    ref = exact_reference(q, k, v, True, key_mask=m.key_mask(N))
    naive_err = max_err(naive_attention(q, k, v, True, key_mask=m.key_mask(N)), ref)
    assert max_err(m(q, k, v, True), ref) <= 2 * naive_err + torch.finfo(q.dtype).eps


@pytest.mark.parametrize("name,params", [
    ("sliding_window", dict(window=100)), ("sliding_window", dict(window=10_000)),
    ("block_sparse", dict(block_size=16, window_blocks=7)),
    ("block_sparse", dict(block_size=32, global_blocks=4, random_blocks=0)),
])
@pytest.mark.parametrize("causal", [False, True])
def test_full_pattern_is_exact_attention(name, params, causal):
    N = 100
    m = variants.build(name, **params)
    assert bool(dense_mask(N, False, m.key_mask(N)).all())
    q, k, v = qkv(N)
    ref = exact_reference(q, k, v, causal)
    naive_err = max_err(naive_attention(q, k, v, causal), ref)
    assert max_err(m(q, k, v, causal), ref) <= 2 * naive_err + torch.finfo(q.dtype).eps


@pytest.mark.parametrize("name,params", CASES, ids=IDS)
@pytest.mark.parametrize("causal", [False, True])
def test_backward_matches_float64_reference(name, params, causal):
    N = 37
    m = variants.build(name, **params)
    mask = m.key_mask(N)
    inputs = [t.requires_grad_(True) for t in qkv(N, torch.float64)]
    ref_inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    go = torch.randn(inputs[0].shape, dtype=torch.float64,
                     generator=torch.Generator().manual_seed(1))
    m(*inputs, causal).backward(go)
    # The dense form in float64 is differentiable (exact_reference works in place).
    naive_attention(*ref_inputs, causal, key_mask=mask).backward(go)
    for got, want in zip(inputs, ref_inputs):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name,params", [
    ("sliding_window", dict(window=40)),  # 10 chunks of 32 rows, the last one padded
    ("block_sparse", dict(block_size=8)),  # 38 block rows, batched in steps
])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_over_many_chunks_and_steps(name, params, causal):
    """Forward and gradients over many chunks (sliding_window) and multi-row steps
    (block_sparse: rows of equal width batched, causal ones not consecutive, each with its
    own mask), B = 2, against the dense float64 form."""
    N = 300
    m = variants.build(name, **params)
    mask = m.key_mask(N)
    inputs = [t.requires_grad_(True) for t in qkv(N, torch.float64, B=2, H=3)]
    ref_inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    go = torch.randn(inputs[0].shape, dtype=torch.float64,
                     generator=torch.Generator().manual_seed(1))
    o = m(*inputs, causal)
    o.backward(go)
    ref = naive_attention(*ref_inputs, causal, key_mask=mask)
    ref.backward(go)
    torch.testing.assert_close(o, ref, rtol=1e-9, atol=1e-10)
    for got, want in zip(inputs, ref_inputs):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-9, atol=1e-10)
    if name == "block_sparse":  # the case covers what it is meant to
        plan = m._plan(N, causal, inputs[0].device, 2 * 3, inputs[0].element_size())
        widths = [r.stop - r.start if isinstance(r, slice) else len(r) for r, _, _, _ in plan]
        assert max(widths) > 1
        if causal:
            assert any(not isinstance(r, slice) and len(r) > 1 for r, _, _, _ in plan)
            assert any(d is not None and d[1].shape[0] > 1 for _, _, _, d in plan)


@pytest.mark.parametrize("chunks", [1, 3])  # one chunk at a time (corner runs); groups of 3
@pytest.mark.parametrize("causal", [False, True])
def test_sliding_window_chunk_groups(monkeypatch, chunks, causal):
    """sliding_window takes small chunks several at a time (one matmul over a group, the
    whole mask) and large ones alone (only their masked corner runs): both, and a last
    group shorter than the rest (10 chunks in groups of 3), match the dense float64 form,
    forward and gradients."""
    import variants.sliding_window.sliding_window as sw
    N, B, H = 300, 2, 3
    m = variants.build("sliding_window", window=40)
    w, c, L = sw.band_span(40, N, causal)
    monkeypatch.setattr(sw, "_GROUP_BYTES", chunks * B * H * c * L * 8)
    assert sw.group_chunks(B, H, c, L, 8) == chunks and math.ceil(N / c) == 10
    inputs = [t.requires_grad_(True) for t in qkv(N, torch.float64, B=B, H=H)]
    ref_inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    go = torch.randn(inputs[0].shape, dtype=torch.float64,
                     generator=torch.Generator().manual_seed(4))
    o = m(*inputs, causal)
    o.backward(go)
    ref = naive_attention(*ref_inputs, causal, key_mask=m.key_mask(N))
    ref.backward(go)
    torch.testing.assert_close(o, ref, rtol=1e-9, atol=1e-10)
    for got, want in zip(inputs, ref_inputs):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-9, atol=1e-10)


# -- block_sparse layout -------------------------------------------------------------------

def bigbird_rule(nb, window_blocks, global_blocks):
    """Window and global parts of BigBird's layout, entry by entry."""
    fixed = torch.zeros(nb, nb, dtype=torch.bool)
    for i in range(nb):
        for j in range(nb):
            fixed[i, j] = abs(i - j) <= window_blocks or i < global_blocks or j < global_blocks
    return fixed


@pytest.mark.parametrize("N,params", [
    (64 * 32, {}), (1000, dict(block_size=16, window_blocks=2, global_blocks=1)),
    (100, dict(block_size=16, random_blocks=5)), (1, {}),
])
def test_layout_follows_bigbird_rule(N, params):
    m = variants.build("block_sparse", **params)
    p = m.params
    nb = math.ceil(N / p.block_size)
    lay = m.layout(N)
    assert lay.shape == (nb, nb) and lay.dtype == torch.bool
    fixed = bigbird_rule(nb, p.window_blocks, p.global_blocks)
    assert bool((lay >= fixed).all())  # every window and global block is in
    extra = lay & ~fixed
    for i in range(nb):
        expect = 0 if i < p.global_blocks else min(p.random_blocks, int((~fixed[i]).sum()))
        assert int(extra[i].sum()) == expect, f"row {i}"
    # The token predicate is the layout, read at block granularity.
    tok = dense_mask(N, False, m.key_mask(N))
    ar = torch.arange(N) // p.block_size
    assert torch.equal(tok, lay[ar[:, None], ar[None, :]])


def test_layout_random_blocks_are_seeded():
    N = 64 * 40
    a = variants.build("block_sparse").layout(N)
    assert torch.equal(a, variants.build("block_sparse").layout(N))
    assert torch.equal(a, variants.build("block_sparse", seed=0).layout(N))
    assert not torch.equal(a, variants.build("block_sparse", seed=1).layout(N))


def test_flops_count_layout_blocks():
    m = variants.build("block_sparse", block_size=16)
    lay = m.layout(1000)
    assert m.flops(2, 3, 1000, 8) == 4 * 2 * 3 * int(lay.sum()) * 16 * 16 * 8
    assert m.flops(2, 3, 1000, 8, causal=True) == 4 * 2 * 3 * int(lay.tril().sum()) * 16 * 16 * 8
    sw = variants.build("sliding_window", window=256)
    # Linear in N once N is past the window.
    assert sw.flops(1, 8, 16384, 64) == 2 * sw.flops(1, 8, 8192, 64)
    assert variants.spec("sliding_window").pattern_exact
    assert variants.spec("block_sparse").pattern_exact


# -- sliding_window band against xformers' definition ---------------------------------------

@pytest.mark.parametrize("N,window", [(1, 0), (17, 0), (63, 5), (100, 31), (40, 100)])
def test_band_matches_xformers_local_mask(N, window):
    attn_bias = pytest.importorskip(
        "xformers.ops.fmha.attn_bias",
        reason="xformers not installed (optional extra; runs on CUDA only)")
    # Additive bias: 0 where allowed, -inf elsewhere; square shape, so i - left <= j <= i + right.
    bias = attn_bias.LocalAttentionFromBottomRightMask(window, window).materialize((N, N))
    m = variants.build("sliding_window", window=window)
    assert torch.equal(bias == 0, dense_mask(N, False, m.key_mask(N)))


# -- memory structure: nothing of N x N size, forward or backward -----------------------------

@pytest.mark.parametrize("name,params", [
    ("sliding_window", dict(window=32)),
    ("block_sparse", dict(block_size=32)),
])
@pytest.mark.parametrize("causal", [False, True])
def test_no_n_by_n_tensor(name, params, causal):
    N = 2048
    m = variants.build(name, **params)
    q, k, v = (t.requires_grad_(True) for t in qkv(N, B=1, H=1, D=16))
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    mode = LargestOutput()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mode:
        m(q, k, v, causal).sum().backward()
    # Each query scores <= ~260 keys here; an N x N implementation makes (and saves for
    # backward) at least one tensor of N * N = 4.2M elements.
    assert mode.largest < N * N // 16
    assert sum(saved) < N * N // 2


@pytest.mark.parametrize("causal", [False, True])
def test_block_sparse_backward_saves_only_inputs_output_and_logsumexp(causal):
    """The recomputing backward keeps q, k, v, the output and one log-sum-exp per query,
    whatever the layout's density; plain autograd would keep every row's gathered key and
    value blocks and probabilities (~K_r b (2 D + b) per block row)."""
    N, D = 2000, 16  # not a multiple of the block: padding included
    m = variants.build("block_sparse", block_size=32, window_blocks=3, random_blocks=4)
    q, k, v = (t.requires_grad_(True) for t in qkv(N, B=1, H=1, D=D))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t,
                                                  lambda t: t):
        o = m(q, k, v, causal)
    padded = math.ceil(N / 32) * 32
    assert sum(saved) <= 4 * padded * D + padded + 2 * N * D  # + the scaling of q
    o.sum().backward()
    assert all(t.grad is not None and bool(torch.isfinite(t.grad).all()) for t in (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_in_place_softmax_matches_torch_softmax(dtype):
    """softmax_ writes over its input (the sparse kernels' score buffers): it must equal
    torch.softmax on a copy, masked (-inf) entries included, and softmax_lse_ must return
    torch.logsumexp beside it."""
    from variants.core import softmax_, softmax_lse_
    s = torch.randn(3, 5, 70, generator=torch.Generator().manual_seed(0)).mul_(4).to(dtype)
    s[..., 40:].masked_fill_(torch.rand(3, 5, 30, generator=torch.Generator().manual_seed(1))
                             < 0.5, float("-inf"))
    want, want_lse = torch.softmax(s, dim=-1), torch.logsumexp(s.double(), dim=-1, keepdim=True)
    got = s.clone()
    assert softmax_(got) is got
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    got = s.clone()
    lse = softmax_lse_(got)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(lse.double(), want_lse, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exp_in_place_is_exp_to_its_bound(dtype):
    """exp_ (exp2(x log2 e), written over x) against float64 torch.exp: within the bound
    its docstring states, |x| eps relative from rounding log2 e and x log2 e, plus two
    units in the last place; -inf gives 0, as the recomputed probabilities of masked
    scores need."""
    from variants.core import exp_
    x = torch.linspace(-80, 80, 20001, dtype=torch.float64).to(dtype)
    x[::7] = torch.randn(len(x[::7]), generator=torch.Generator().manual_seed(0),
                         dtype=torch.float64).mul_(4).to(dtype)
    want = torch.exp(x.double())
    got = x.clone()
    assert exp_(got) is got
    eps = torch.finfo(dtype).eps
    rel = (got.double() - want).abs() / want
    assert bool((rel <= x.double().abs() * eps + 2 * eps).all()), rel.max()
    assert exp_(torch.tensor([float("-inf"), 0.0], dtype=dtype)).tolist() == [0.0, 1.0]


def test_workspace_reuses_one_buffer_and_grows():
    """Views of one name share storage until a larger shape is asked for (the point: a call
    allocates each buffer once)."""
    from variants.core import Workspace
    ws = Workspace(torch.empty(0, dtype=torch.float64))
    a = ws("s", 4, 8)
    b = ws("s", 2, 8)
    assert a.dtype == torch.float64 and b.shape == (2, 8)
    assert b.data_ptr() == a.data_ptr()
    c = ws("s", 10, 8)
    assert c.shape == (10, 8) and c.data_ptr() != a.data_ptr()
    assert ws("s", 3, 3).data_ptr() == c.data_ptr()
    assert ws("other", 2).data_ptr() != c.data_ptr()


@pytest.mark.parametrize("name,params,N", [
    ("sliding_window", {"window": 0}, 40), ("sliding_window", {"window": 5}, 37),
    ("block_sparse", {"block_size": 8}, 64), ("block_sparse", {"block_size": 8}, 61)])
@pytest.mark.parametrize("causal", [False, True])
def test_strided_inputs_give_the_contiguous_answer_and_gradients(name, params, N, causal):
    """q, k, v as a model makes them, (B, N, H, D) transposed to (B, H, N, D), strided:
    the kernels work on (B H, rows, D) views of their padded copies, so a padding with
    nothing to pad (window 0, N a multiple of the block) must still copy, and the key and
    value gradients must land in the caller's layout."""
    g = torch.Generator().manual_seed(3)
    base = [torch.randn(2, N, 3, 8, generator=g, dtype=torch.float64) for _ in range(3)]
    m = variants.build(name, **params)
    outs, grads = [], []
    for strided in (True, False):
        xs = [(t.clone() if strided else t.transpose(1, 2).contiguous()).requires_grad_(True)
              for t in base]
        q, k, v = (x.transpose(1, 2) if strided else x for x in xs)
        assert q.is_contiguous() is not strided
        out = m(q, k, v, causal=causal)
        out.backward(torch.ones_like(out))
        outs.append(out.detach())
        grads.append([(x.grad.transpose(1, 2) if strided else x.grad) for x in xs])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-12, atol=1e-12)
    for a, b in zip(grads[0], grads[1]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_block_sparse_bfloat16_backward_through_gathered_rows(causal):
    """bfloat16 forward and backward at a length whose row groups are gathered by index
    (N = 1000; at 300 they are slices): the float32 log-sum-exp buffer takes bfloat16
    rows (an uncast index_copy_ raised here, as on the H200 at N = 4096). Output and
    gradients against float64 attention on the same key pattern, within bfloat16's
    rounding."""
    m = variants.build("block_sparse")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 1000, 64, generator=g).bfloat16().requires_grad_()
               for _ in range(3))
    o = m(q, k, v, causal=causal)
    o.float().pow(2).sum().backward()
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = naive_attention(qr, kr, vr, causal, key_mask=m.key_mask(1000))
    ref.pow(2).sum().backward()
    for got, want in ((o, ref), (q.grad, qr.grad), (k.grad, kr.grad), (v.grad, vr.grad)):
        assert float((got.double() - want).norm() / want.norm()) < 5e-2
