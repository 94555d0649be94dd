"""Attention sinks (gpt-oss: a logit per head in the softmax's denominator, its column
dropped) on standard, sdpa and sliding_window, and StreamingLLM's `streaming` pattern.

References are independent of the variants' code: torch's SDPA in float64 with an explicit
mask, the sink as one more key whose score is S_h (an extra width of q and k carries it)
and whose value is zero; autograd through that gives the float64 gradients.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import variants
from harness.measure import accuracy, decode, matrix
from harness.measure.worker import run_case
import variants.core.sinks as sinks_mod

SINK_VARIANTS = [("standard", {}), ("sdpa", {}), ("sliding_window", {"window": 5})]


def _qkv(B=2, H=4, N=23, D=8, Hk=None, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, D, generator=g, dtype=dtype)
    k = torch.randn(B, Hk or H, N, D, generator=g, dtype=dtype)
    v = torch.randn(B, Hk or H, N, D, generator=g, dtype=dtype)
    return q, k, v


def _sinks(H, seed=1, dtype=torch.float64):
    return torch.randn(H, generator=torch.Generator().manual_seed(seed), dtype=dtype) * 2


def sdpa_with_sink_key(q, k, v, sinks, causal, window=None):
    """Float64 reference by torch's SDPA with an explicit mask: one more key, at the end,
    whose score is S_h for every query (q gains a column of ones, that key holds
    S_h sqrt(D) there and zeros elsewhere; real keys hold 0 there) and whose value is 0."""
    B, H, N, D = q.shape
    k, v = (t.repeat_interleave(H // t.shape[1], dim=1) for t in (k, v))
    scale = 1 / math.sqrt(D)
    qa = torch.cat([q, torch.ones(B, H, N, 1, dtype=q.dtype)], dim=-1)
    sink_key = torch.zeros(B, H, 1, D + 1, dtype=q.dtype)
    sink_key[..., -1] = (sinks.to(q.dtype) / scale).view(1, H, 1).expand(B, H, 1)
    ka = torch.cat([torch.cat([k, torch.zeros(B, H, N, 1, dtype=q.dtype)], dim=-1), sink_key], 2)
    va = torch.cat([v, torch.zeros(B, H, 1, v.shape[-1], dtype=q.dtype)], dim=2)
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    allowed = torch.ones(N, N, dtype=torch.bool)
    if causal:
        allowed &= j <= i
    if window is not None:
        allowed &= (j - i).abs() <= window
    mask = torch.cat([allowed, torch.ones(N, 1, dtype=torch.bool)], dim=1)
    return F.scaled_dot_product_attention(qa, ka, va, attn_mask=mask, scale=scale)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name,params", SINK_VARIANTS)
def test_a_sinked_forward_and_its_gradients_match_float64_softmax_with_the_sink_column(
        name, params, causal):
    m = variants.build(name, sink=True, **params)
    assert [s.name for s in m.contract.inputs] == ["sinks"]
    q, k, v = (t.float().requires_grad_() for t in _qkv())
    s = _sinks(4).float().requires_grad_()
    o = m(q, k, v, causal=causal, sinks=s)
    do = torch.randn_like(o)
    (o * do).sum().backward()
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v, s)]
    ref = sdpa_with_sink_key(*ref_in, causal, params.get("window"))
    (ref * do.double()).sum().backward()
    torch.testing.assert_close(o.double(), ref, rtol=0, atol=2e-6)
    for got, want in zip((q, k, v, s), ref_in):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=0, atol=5e-5)
    # The float64 reference the harness measures against says the same.
    assert torch.allclose(variants.exact_reference(
        q.detach(), k.detach(), v.detach(), causal,
        key_mask=m.key_mask(q.shape[-2]), sinks=s.detach()), ref.detach(), atol=1e-12, rtol=0)


@pytest.mark.parametrize("name,params", SINK_VARIANTS)
def test_a_sink_of_minus_infinity_is_the_variant_without_one(name, params):
    q, k, v = (t.float() for t in _qkv())
    without = variants.build(name, **params)(q, k, v, causal=True)
    with_ = variants.build(name, sink=True, **params)(
        q, k, v, causal=True, sinks=torch.full((4,), float("-inf")))
    assert torch.equal(with_, without)


@pytest.mark.parametrize("name,params", SINK_VARIANTS)
def test_grouped_keys_with_sinks_read_their_query_heads_sink(name, params):
    q, k, v = (t.float().requires_grad_() for t in _qkv(H=8, Hk=2))
    s = _sinks(8).float().requires_grad_()
    o = variants.build(name, sink=True, **params)(q, k, v, causal=True, sinks=s)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v, s)]
    ref = sdpa_with_sink_key(*ref_in, True, params.get("window"))
    torch.testing.assert_close(o.double(), ref, rtol=0, atol=2e-6)
    do = torch.randn_like(o)
    (o * do).sum().backward()
    (ref * do.double()).sum().backward()
    for got, want in zip((q, k, v, s), ref_in):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=0, atol=5e-5)


def _planted_numerator(o, lse, sinks, view=(1, -1, 1, 1)):  # the sink's weight in every numerator
    s = sinks.to(lse.dtype).view(view)
    lse2 = torch.logaddexp(lse, s)
    return o * (1 + (s - lse).exp()) * (lse - lse2).exp(), lse2


def _planted_left_in(o, lse, sinks, view=(1, -1, 1, 1)):  # never dropped: nothing rescaled
    return o, torch.logaddexp(lse, sinks.to(lse.dtype).view(view))


@pytest.mark.parametrize("plant", [_planted_numerator, _planted_left_in])
def test_a_planted_sink_in_the_numerator_or_left_in_fails_against_the_reference(
        monkeypatch, plant):
    """The reference check above catches each planted bug in the kernels' sink step."""
    import variants.exact.sink_sdpa as ss
    import variants.sliding_window.band_rows as br
    monkeypatch.setattr(ss, "sinked", plant)
    monkeypatch.setattr(br, "sinked", plant)
    q, k, v = (t.float() for t in _qkv())
    s = _sinks(4).float()
    for name, params in SINK_VARIANTS[1:]:
        o = variants.build(name, sink=True, **params)(q, k, v, causal=True, sinks=s)
        ref = sdpa_with_sink_key(q.double(), k.double(), v.double(), s.double(), True,
                                 params.get("window"))
        assert (o.double() - ref).abs().max() > 1e-3, name


@pytest.mark.parametrize("name,params", SINK_VARIANTS + [("streaming",
                                                          {"window": 6, "sink_tokens": 3})])
def test_decoding_with_sinks_gives_the_causal_forwards_rows(name, params):
    sink = name != "streaming"
    m = variants.build(name, **({"sink": True} if sink else {}), **params)
    q, k, v = (t.float() for t in _qkv(N=40))
    ins = {"sinks": _sinks(4).float()} if sink else {}
    full = m(q, k, v, causal=True, **ins)
    P = 30
    state = m.prefill(k[:, :, :P], v[:, :, :P], max_len=40, **ins)
    for t in range(P, 40):
        o, state = m.step(state, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], **ins)
        torch.testing.assert_close(o, full[:, :, t:t + 1], rtol=0, atol=2e-6)


@pytest.mark.parametrize("name,params", SINK_VARIANTS)
def test_grouped_keys_with_sinks_decode_a_context_taken_in_pieces(name, params):
    """Sinks are one a query head; a grouped cache keeps fewer key heads. A context taken in
    pieces (prefill, then extend) sizes the later piece's sinks by the query heads the
    prefill was given (decode-served's windowed rows failed on it at 64K: the ring said 8
    heads, the sinks 32)."""
    m = variants.build(name, sink=True, **params)
    q, k, v = _qkv(N=40, Hk=2)
    s = _sinks(4)
    full = m(q, k, v, causal=True, sinks=s)
    state = m.prefill(k[:, :, :20], v[:, :, :20], max_len=40, q_heads=4, sinks=s)
    state = m.extend(state, k[:, :, 20:30], v[:, :, 20:30], sinks=s)
    for t in range(30, 40):
        o, state = m.step(state, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], sinks=s)
        assert (o - full[:, :, t:t + 1]).abs().max() <= 1e-10


def test_gpt_oss_windowed_layer_keeps_a_constant_state():
    m = variants.build("sliding_window", window=127, sink=True)
    sizes = set()
    for N in (200, 1000, 3000):
        q, k, v = (t.float() for t in _qkv(B=1, H=2, N=N + 1, D=8))
        ins = {"sinks": _sinks(2).float()}
        state = m.prefill(k[:, :, :N], v[:, :, :N], max_len=N + 1, **ins)
        o, state = m.step(state, q[:, :, N:], k[:, :, N:], v[:, :, N:], **ins)
        ref = sdpa_with_sink_key(q[:, :, N - 127:].double(), k[:, :, N - 127:].double(),
                                 v[:, :, N - 127:].double(), ins["sinks"].double(), True)
        torch.testing.assert_close(o.double(), ref[:, :, -1:], rtol=0, atol=2e-6)
        sizes.add(m.state_nbytes(state))
    assert len(sizes) == 1


@pytest.mark.parametrize("N", [5, 64, 300])
def test_streaming_is_exact_softmax_on_the_first_tokens_and_the_recent_window(N):
    w, s = 16, 4
    m = variants.build("streaming", window=w, sink_tokens=s)
    q, k, v = (t.requires_grad_() for t in _qkv(N=N))
    o = m(q, k, v, causal=True)
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    mask = (j <= i) & ((j < s) | (j > i - w))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(o, ref, rtol=0, atol=1e-12)
    do = torch.randn_like(o)
    got = torch.autograd.grad(o, (q, k, v), do)
    want = torch.autograd.grad(ref, (q, k, v), do)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert m.keys_per_query(N, True) == pytest.approx(float(mask.sum(dim=1).double().mean()))


def test_streaming_keeps_a_constant_state_and_refuses_non_causal():
    m = variants.build("streaming", window=8, sink_tokens=2)
    k = torch.randn(1, 2, 500, 4)
    small, big = (m.prefill(k[:, :, :n], k[:, :, :n], max_len=n) for n in (20, 500))
    assert m.state_nbytes(small) == m.state_nbytes(big) == 2 * 2 * 10 * 4 * 4
    with pytest.raises(ValueError, match="causal"):
        m(k, k, k, causal=False)


def test_a_sink_on_a_variant_without_one_is_refused_with_one_line():
    with pytest.raises(ValueError, match="unknown parameter.*'sink'"):
        variants.build("linear", sink=True)
    q, k, v = (t.float() for t in _qkv())
    with pytest.raises(ValueError, match="unknown input"):
        variants.build("sdpa")(q, k, v, sinks=torch.zeros(4))
    with pytest.raises(ValueError, match="missing input"):
        variants.build("sdpa", sink=True)(q, k, v)
    # stored ids of the settings without a sink are unchanged
    assert variants.stored_params("sliding_window", window=5) == {"window": 5}


def _run(variant, pass_, N=96, **params):
    raw = {"variants": {variant: [params]}, "seq_lens": [N], "passes": [pass_],
           "causal": [True], "heads": 2, "head_dim": 16, "min_run_time_s": 0.01,
           "min_repeats": 2, "decode_tokens": 3}
    (case,) = matrix.expand(matrix.normalise(raw))
    return run_case(case, "time")


@pytest.mark.parametrize("pass_", ["forward_backward", "decode"])
def test_the_harness_measures_a_sinked_variant_against_softmax_with_its_sink(pass_):
    out = _run("sdpa", pass_, sink=True)
    assert out["status"] == "ok", out
    assert out["rel_err"] < 1e-5 and out["row_cos"] > 0.99999, out


@pytest.mark.parametrize("window,N", [(3, 50), (40, 300)])  # grouped chunks and single chunks
def test_the_band_kernel_reads_grouped_keys_as_their_repeat(window, N):
    """band_rows takes Hk key-value heads for Hq query heads (no repeat): its output and
    gradients equal the kernel's on the keys repeated to one per query head."""
    from variants.sliding_window import band_span, band_drop_mask, group_chunks, mask_runs
    from variants.sliding_window.band_rows import band_rows_attention
    q, k, v = (t.float().requires_grad_() for t in _qkv(B=2, H=6, Hk=2, N=N))
    s = _sinks(6).float().requires_grad_()
    w, c, L = band_span(window, N, True)
    G = group_chunks(2, 6, c, L, 4)
    drop = band_drop_mask(N, w, c, L, True)
    drop = drop if G > 1 else mask_runs(drop, "cpu")
    o = band_rows_attention(q, k, v, w, c, L, True, drop, G, s)[:, :, :N]
    ins = [t.detach().clone().requires_grad_() for t in (q, k, v, s)]
    kr, vr = (t.repeat_interleave(3, dim=1) for t in ins[1:3])
    ref = band_rows_attention(ins[0], kr, vr, w, c, L, True, drop, G, ins[3])[:, :, :N]
    torch.testing.assert_close(o, ref, rtol=0, atol=1e-6)
    do = torch.randn_like(o)
    (o * do).sum().backward()
    (ref * do).sum().backward()
    for a, b in zip((q, k, v, s), ins):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-5)
