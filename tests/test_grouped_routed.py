"""Grouped keys, run natively, in block_sparse (variants/sparse/) and moba, quest
(variants/routed/) (issue 51): q (B, Hq, N, D), k (B, Hk, N, D), v (B, Hk, N, Dv), query
head h reads kv head h // (Hq / Hk) (SDPA's enable_gqa).

Each is held, in float64, to the same variant on k and v explicitly repeated to one head
per query head (`variants.expand_heads`), forward and gradients, causal and not, through
both of moba's and quest's forms (the routed kernel and the dense masked form); block_sparse
also to float64 exact attention under its key pattern. The kit's groupings property (its
repeat watch) passes; a decoder keeps one cache per kv head.
"""

import pytest
import torch

import variants
from harness.check import groupings, kit
from variants.core.contract import Shape
from variants.routed import blocks, routed_rows

NAMES = ("block_sparse", "moba", "quest")
# Small settings whose blocks do not divide N = 50 (a partial last block), with several
# blocks a query reads and several it does not.
SETTINGS = {"block_sparse": {"block_size": 8, "window_blocks": 1, "global_blocks": 1,
                             "random_blocks": 1},
            "moba": {"block_size": 7, "top_k": 3},
            "quest": {"page_size": 5, "top_k": 4}}
HQ = 4


def qkv(Hk, N=50, Dv=None, B=2, D=8, dtype=torch.float64, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed + 10 * Hk)
    shapes = ((B, HQ, N, D), (B, Hk, N, D), (B, Hk, N, Dv or D))
    return [torch.randn(*s, generator=g).to(dtype).requires_grad_(grad) for s in shapes]


# moba's and quest's two forms: the routed kernel (the dense form's threshold at 0) and
# the dense masked form (above every length here); block_sparse has one.
FORMS = [("block_sparse", "kernel"), ("moba", "kernel"), ("moba", "dense"),
         ("quest", "kernel"), ("quest", "dense")]


def _against_repeated(m, q, k, v, causal):
    """The grouped call and its gradients against the call on repeated k, v (whose
    gradients autograd sums over each group), to 1e-12."""
    o = m(q, k, v, causal=causal)
    qe, ke, ve = variants.expand_heads(q, k, v)
    assert ke.shape[1] == HQ and ve.shape[1] == HQ
    want = m(qe, ke, ve, causal=causal)
    assert o.shape == (q.shape[0], HQ, q.shape[2], v.shape[-1])
    torch.testing.assert_close(o, want, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(o)
    for a, w in zip(torch.autograd.grad(o, (q, k, v), g),
                    torch.autograd.grad(want, (q, k, v), g)):
        torch.testing.assert_close(a, w, rtol=1e-11, atol=1e-11)
    return o


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Hk,Dv", [(4, None), (2, None), (1, None), (2, 12), (1, 5)])
@pytest.mark.parametrize("name,form", FORMS)
def test_grouped_keys_equal_the_call_on_repeated_heads(name, form, Hk, Dv, causal,
                                                        monkeypatch):
    """Planted bugs it catches: query head h reading kv head h % Hk (a tile) instead of
    h // r, in the kernel's slices or the gate; the causal mask of a grouped row taken at
    its row index rather than its position (x % N); the drop mask not broadcast over a
    block row's r heads; values sliced at Dk wide."""
    monkeypatch.setattr(blocks, "DENSE_MAX", 0 if form == "kernel" else 10**6)
    m = variants.build(name, **SETTINGS[name])
    q, k, v = qkv(Hk, Dv=Dv, grad=True)
    o = _against_repeated(m, q, k, v, causal)
    if name == "block_sparse":  # and against float64 exact attention on its pattern
        ref = variants.exact_reference(q, k, v, causal, key_mask=m.key_mask(q.shape[2]))
        torch.testing.assert_close(o, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["moba", "quest"])
def test_grouped_tiles_that_cross_a_query_head_boundary(name, causal, monkeypatch):
    """The routed kernel's slice is a kv head's r N query rows; small tiles start inside
    one query head and end in the next. A causal tile that wraps must mask its blocks
    from position 0 (planted: from q0 % N, a later block, leaves future keys in)."""
    monkeypatch.setattr(blocks, "DENSE_MAX", 0)
    monkeypatch.setattr(routed_rows, "_CHUNK", 5)
    monkeypatch.setattr(routed_rows, "_TILE_PAIRS", 67)  # tiles of 26 (moba), 25 (quest) rows
    monkeypatch.setattr(routed_rows, "_STEP_BYTES", 1)
    m = variants.build(name, **SETTINGS[name])
    q, k, v = qkv(1, grad=True)
    _against_repeated(m, q, k, v, causal)


@pytest.mark.parametrize("name", NAMES)
def test_the_kit_passes_them_as_native(name):
    """The groupings property at kv_heads 4, 2, 1 and Dv != Dk: float64 references, the
    call on repeated heads, the repeat watch (a kernel that repeats k, v to Hq heads while
    declaring native fails it: tests/test_contract.py's planted `_RepeatedKeys`), the
    decoder's rows and its state against `state_size_at`."""
    r = kit.run_property(groupings.groupings, name)
    assert r.status == "pass" and "kv native" in r.detail and "kv_heads 1" in r.detail \
        and "Dv 12" in r.detail, r.line()


@pytest.mark.parametrize("Dv", [None, 6])
@pytest.mark.parametrize("name", NAMES)
def test_a_decoder_keeps_one_cache_per_kv_head(name, Dv):
    """Prefill 30 tokens, step 20 at kv_heads 4 and 1: the causal forward's rows, and the
    state at kv_heads 1 a quarter of kv_heads 4's, as `state_size_at` says (planted: a
    cache or block statistics kept per query head hold 4x)."""
    m = variants.build(name, **SETTINGS[name])
    nbytes, N, P = {}, 50, 30
    for Hk in (HQ, 1):
        q, k, v = qkv(Hk, Dv=Dv, seed=5)
        with torch.no_grad():
            o = m(q, k, v, causal=True)
            state = m.prefill(k[:, :, :P], v[:, :, :P], max_len=N, q_heads=HQ)
            rows = [m.step(state, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1])[0]
                    for t in range(P, N)]
        torch.testing.assert_close(torch.cat(rows, 2), o[:, :, P:], rtol=1e-12, atol=1e-12)
        nbytes[Hk] = m.state_nbytes(state)
        s = Shape(2, HQ, N, 8, kv_heads=Hk, value_dim=Dv)
        cache = 2 * m.state_size_at(N, s) * 8  # both batch elements, float64
        assert cache <= nbytes[Hk] <= 1.25 * cache
    assert nbytes[1] * HQ == nbytes[HQ]


@pytest.mark.parametrize("name", NAMES)
def test_what_a_step_reads_is_counted_per_kv_head(name):
    """At kv_heads = H the count is the per-head one times H (the rows measured before
    grouping keep their numbers); grouped, the kv heads' reads: block_sparse's shared
    layout reads 1/H of it at kv_heads 1, a router reads its block statistics once per kv
    head and at most every query head's chosen blocks (planted: per query head, H times
    the statistics)."""
    m = variants.build(name, **SETTINGS[name])
    N, D = 4096, 8
    full = m.decode_read_size_at(N, Shape(1, HQ, N, D, kv_heads=HQ))
    one = m.decode_read_size_at(N, Shape(1, HQ, N, D, kv_heads=1))
    assert full == HQ * m.decode_read_size(N, D)
    if name == "block_sparse":
        assert one * HQ == full
    else:
        nb = -(-N // m.block)
        stats = nb * D * (1 if m.block_stat == "sum" else 2)
        kk = min(m.params.top_k, nb)
        assert one == stats + HQ * kk * m.block * 2 * D < full
    wide = m.decode_read_size_at(N, Shape(1, HQ, N, D, kv_heads=1, value_dim=3 * D))
    assert wide > one  # the values' own width read


@pytest.mark.parametrize("name", NAMES)
def test_flops_count_the_values_own_width(name):
    """2 (Dk + Dv) per score read, the grouping sharing keys and not work."""
    m = variants.build(name, **SETTINGS[name])
    s = Shape(1, HQ, 300, 8, kv_heads=1)
    assert m.flops_at(s) == m.flops(1, HQ, 300, 8)
    wide = m.flops_at(Shape(1, HQ, 300, 8, kv_heads=1, value_dim=24))
    gate = 0 if name == "block_sparse" else \
        HQ * m.gate_flops * 300 * -(-300 // m.block) * 8
    assert wide - gate == 2 * (m.flops(1, HQ, 300, 8) - gate)
