"""DSA (variants/learned_sparse/): the lightning indexer's and the `heads` proxy's top_k
keys, exact softmax over them.

Checked against the float64 plain form (`dsa_reference`: dense indexer scores, a stable
sort for the ties, a masked softmax) and, where top_k covers every key, against exact
attention; forward and the gradients of q, k, v; the decoder against the causal forward's
rows. Each planted bug (a selection that reads the future, the bottom-k, ties to the
earlier key) makes `check` fail.
"""

import pytest
import torch

from dispatch_probe import LargestOutput

import variants
from variants.learned_sparse import dsa_reference, gathered
from variants.learned_sparse import indexer as ix

HI, DI = 4, 32  # index_heads, index_dim


def build(indexer, top_k):
    return variants.build("dsa", indexer=indexer, top_k=top_k, index_heads=HI, index_dim=DI)


def case(N, B=2, H=4, Hk=2, D=8, Dv=12, seed=0, grad=False, indexer="lightning", ties=False):
    """q, k, v (grouped keys, values of their own width) and the drawn index inputs; ties:
    indexer keys and keys from three distinct rows, so that scores tie exactly. With ties
    every input is a multiple of 1/8 and D = 4 (softmax scale 1/2): each score is then exact
    in float64 whatever order a matmul kernel sums in, so equal keys score equal bitwise
    (with arbitrary floats, BLAS kernels round equal columns differently on some CPUs)."""
    if ties:
        D = 4
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hk, N, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hk, N, Dv, generator=g, dtype=torch.float64)
    ins = {}
    if indexer == "lightning":
        ins = build("lightning", 1).draw_inputs(B, H, N, D, seed=seed, dtype=torch.float64)
    if ties:
        q, k, v = ((t * 8).round() / 8 for t in (q, k, v))
        ins = {n: (x * 8).round() / 8 for n, x in ins.items()}
        k = k[:, :, torch.arange(N) % 3].contiguous()
        if ins:
            ins["index_k"] = ins["index_k"][:, :, torch.arange(N) % 3].contiguous()
    for t in (q, k, v):
        t.requires_grad_(grad)
    return q, k, v, ins


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def check(m, q, k, v, ins, tol=1e-10):
    """m's forward and q, k, v gradients against autograd through `dsa_reference`."""
    w = torch.randn(*q.shape[:3], v.shape[-1], generator=torch.Generator().manual_seed(5),
                    dtype=torch.float64)
    o = m(q, k, v, causal=True, **ins)
    ref = dsa_reference(q, k, v, m.params.top_k, m.params.indexer, **ins)
    assert rel(o, ref) <= tol, f"forward: {rel(o, ref):.2e}"
    got = torch.autograd.grad((o * w).sum(), (q, k, v))
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for label, a, b in zip("qkv", got, want):
        assert rel(a, b) <= tol, f"d{label}: {rel(a, b):.2e}"


@pytest.mark.parametrize("indexer", ["heads", "lightning"])
@pytest.mark.parametrize("N", [1, 63, 257])
def test_top_k_covering_every_key_is_exact_attention(indexer, N):
    q, k, v, ins = case(N, indexer=indexer)
    m = build(indexer, N)
    assert m.exact_at(N, True)
    with torch.no_grad():
        o = m(q, k, v, causal=True, **ins)
    assert rel(o, variants.exact_reference(q, k, v, True)) <= 1e-12


@pytest.fixture(params=["whole", "cut"])
def cut(request, monkeypatch):
    """The chunks as a call at this size makes them, or one query row a chunk."""
    if request.param == "cut":
        monkeypatch.setattr(ix, "_CHUNK_BYTES", 1)
        monkeypatch.setattr(gathered, "_STEP_BYTES", 1)


@pytest.mark.parametrize("indexer", ["heads", "lightning"])
@pytest.mark.parametrize("N,top_k,Hk", [(63, 16, 2), (300, 40, 1), (100, 7, 4)])
def test_forward_and_gradients_match_the_float64_reference(indexer, N, top_k, Hk, cut):
    check(build(indexer, top_k), *case(N, Hk=Hk, grad=True, indexer=indexer))


@pytest.mark.parametrize("indexer", ["heads", "lightning"])
def test_exact_ties_go_to_the_later_key(indexer):
    q, k, v, ins = case(90, grad=True, indexer=indexer, ties=True)
    s = ix.lightning_scores(ins["index_q"], ins["index_k"], ins["index_w"]) if ins else \
        ix.heads_scores(q.detach(), k.detach())
    assert bool((s[..., 3:] == s[..., :-3]).all())  # ties, and across every threshold
    check(build(indexer, 10), q, k, v, ins)


def _ignores_causal(q, k, top_k, indexer, **ins):
    """Planted: the best keys over the whole sequence, the future among them."""
    s = (ix.lightning_scores(ins["index_q"], ins["index_k"], ins["index_w"]) if ins
         else ix.heads_scores(q, k))
    return ix.top_later(s, top_k).to(torch.int32)


_TOP = ix.top_later


@pytest.mark.parametrize("plant,ties", [
    (_ignores_causal, False),
    (lambda s, kk: _TOP(torch.where(s > float("-inf"), -s, s), kk), False),  # bottom-k
    (lambda s, kk: (s.shape[-1] - 1 - _TOP(s.flip(-1), kk)).masked_fill(  # earlier ties
        _TOP(s.flip(-1), kk) < 0, -1), True)], ids=["future", "wrong_sign", "earlier_ties"])
@pytest.mark.parametrize("indexer", ["heads", "lightning"])
def test_planted_selection_bugs_fail(plant, ties, indexer, monkeypatch):
    q, k, v, ins = case(90, grad=True, indexer=indexer, ties=ties)
    m = build(indexer, 10)
    check(m, q, k, v, ins)
    monkeypatch.setattr(ix, "select" if plant is _ignores_causal else "top_later", plant)
    with pytest.raises(AssertionError, match="forward"):
        check(m, q, k, v, ins)


@pytest.mark.parametrize("indexer", ["heads", "lightning"])
@pytest.mark.parametrize("P", [0, 5, 40])
def test_decoded_rows_equal_the_causal_forward(indexer, P):
    N = 60
    q, k, v, ins = case(N, indexer=indexer, ties=P == 40)
    m = build(indexer, 12)
    with torch.no_grad():
        full = m(q, k, v, causal=True, **ins)
        state = m.prefill(k[:, :, :P // 2], v[:, :, :P // 2], max_len=N, q_heads=q.shape[1],
                          **{n: x[:, :, :P // 2] for n, x in ins.items()})
        state = m.extend(state, k[:, :, P // 2:P], v[:, :, P // 2:P],
                         **{n: x[:, :, P // 2:P] for n, x in ins.items()})
        rows = [m.step(state, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                       **{n: x[:, :, t:t + 1] for n, x in ins.items()})[0] for t in range(P, N)]
    assert rel(torch.cat(rows, dim=2), full[:, :, P:]) <= 1e-12


def test_a_step_reads_the_indexer_keys_and_the_selected_tokens():
    s = variants.Shape(1, 8, 10_000, 64, kv_heads=2, value_dim=32)
    light, heads = build("lightning", 100), build("heads", 100)
    assert light.decode_read_size_at(10_000, s) == 10_000 * DI + 2 * 100 * (64 + 32)
    assert heads.decode_read_size_at(10_000, s) == 2 * 10_000 * 64 + 2 * 100 * (64 + 32)
    assert light.state_size_at(10_000, s) == 2 * 10_000 * 96 + 10_000 * DI


@pytest.mark.parametrize("indexer", ["heads", "lightning"])
def test_no_tensor_grows_as_n_squared(indexer, monkeypatch):
    """Forward and backward at N = 2048 with small chunk budgets: the largest tensor is a
    chunk's, far below one N x N map."""
    monkeypatch.setattr(ix, "_CHUNK_BYTES", 2**18)
    monkeypatch.setattr(gathered, "_STEP_BYTES", 2**18)
    N = 2048
    q, k, v, ins = case(N, B=1, H=2, Hk=1, D=8, Dv=8, grad=True, indexer=indexer)
    q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    ins = {n: x.float() for n, x in ins.items()}
    watch = LargestOutput()
    with watch:
        build(indexer, 16)(q, k, v, causal=True, **ins).sum().backward()
    assert watch.largest <= N * N // 8, watch.largest


@pytest.mark.parametrize("c", [1, 3])
def test_scores_made_in_key_chunks_equal_the_dense_sum(c, monkeypatch):
    """Both indexers' scores, a key chunk at a time (5 keys here, the last chunk short, B = 2
    looped), against the dense float64 formula. Planted: a chunk that drops its last key,
    or a weighted sum over the wrong axis, fails."""
    monkeypatch.setattr(ix, "_KEY_CHUNK_BYTES", 4 * 5)
    monkeypatch.setattr(ix, "_MIN_KEYS", 5)
    g = torch.Generator().manual_seed(3)
    B, Hi, di, n, Hq, Hk, D = 2, 4, 8, 23, 4, 2, 8
    iq = torch.randn(B, Hi, c, di, generator=g, dtype=torch.float64)
    ik = torch.randn(B, 1, n, di, generator=g, dtype=torch.float64)
    iw = torch.randn(B, Hi, c, generator=g, dtype=torch.float64)
    dense = torch.einsum("bhc,bhcn->bcn", iw, torch.relu(iq @ ik.transpose(-1, -2)))
    assert len(ix.key_chunks(1, n)) == 5
    torch.testing.assert_close(ix.lightning_scores(iq, ik, iw), dense, rtol=1e-12, atol=1e-12)
    q = torch.randn(B, Hq, c, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hk, n, D, generator=g, dtype=torch.float64)
    kr = k.repeat_interleave(Hq // Hk, dim=1)
    want = torch.relu(q @ kr.transpose(-1, -2) / D ** 0.5).sum(dim=1)
    torch.testing.assert_close(ix.heads_scores(q, k), want, rtol=1e-12, atol=1e-12)


def test_top_later_without_ties_is_top_ks_own_positions_latest_first():
    """Scores without a tie at the threshold take top-k's positions (the fast path), the
    same as the tie-breaking path's, latest first; -inf rows and ties still go the long
    way. Planted: the fast path's positions unsorted, or taken where a row ties."""
    g = torch.Generator().manual_seed(5)
    s = torch.randn(3, 2, 300, generator=g)
    got = ix.top_later(s, 40)
    thr = s.topk(40, dim=-1).values.amin(dim=-1, keepdim=True)
    assert torch.equal(got, ix._top_later_ties(s, 40, thr))
    assert bool((got[..., :-1] > got[..., 1:]).all())
    tied = s.clone()
    tied[0, 0, :50] = 9.0  # 50 equal best: the last 40 of them
    assert torch.equal(ix.top_later(tied, 40)[0, 0], torch.arange(49, 9, -1))


def test_bad_input_is_one_line():
    with pytest.raises(ValueError, match="'top_k' must be >= 1") as e:
        variants.build("dsa", top_k=0)
    assert "\n" not in str(e.value)
    q, k, v, ins = case(20)
    ins["index_q"] = ins["index_q"][:, :2]
    with pytest.raises(ValueError, match=r"input 'index_q' must be \(B, index_heads, N, "
                                         r"index_dim\) = \(2, 4, 20, 32\)") as e:
        build("lightning", 4)(q, k, v, causal=True, **ins)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="non-causal"):
        build("heads", 4)(q, k, v, causal=False)
