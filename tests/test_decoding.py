"""The decoding form: prefill a context, then step token by token; every output must equal
that row of the variant's causal forward over the whole sequence.

Parametrised over the registry: a variant either decodes (and is held to its forward) or
declares why not, never an error. Prefill lengths 0, 1, an odd one and each side of the
variant's chunk or window boundary, then several steps that cross it.
"""

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import variants
from variants import exact_reference
from variants.exact import cache as exact_cache

B, H, D, T = 2, 3, 8, 6

# Settings small enough that a ring wraps and chunks turn over within a few tokens.
SETTINGS = {
    "sliding_window": {"window": 4},
    "performer": {"num_features": 16},
    "block_sparse": {"block_size": 4, "window_blocks": 1, "global_blocks": 1, "random_blocks": 2},
    "moba": {"block_size": 4, "top_k": 3},
    "scatterbrain": {"window": 4, "num_features": 16},
    "quest": {"page_size": 4, "top_k": 3},
    "dsa": {"top_k": 5},
    "nsa": {"block": 4, "stride": 2, "select_block": 4, "top_n": 2, "window": 3},
}
# Boundaries of each variant's own blocking, so that prefill lengths straddle them.
BOUNDARIES = {"sliding_window": [5], "scatterbrain": [5, 64], "block_sparse": [4, 12], "moba": [4, 12], "quest": [4, 12], "dsa": [5], "nsa": [4, 9], "linear": [64], "performer": [128], "retention": [64],
              "gla": [64], "mamba2": [64], "deltanet": [64], "gated_deltanet": [64]}


def _decoders(runnable: bool = True) -> list[str]:
    """Variants with a decoding form; `runnable`: and that run here in float64 (xformers
    decodes too, on CUDA only)."""
    out = []
    for n in variants.names():
        m = variants.build(n, **SETTINGS.get(n, {}))
        if not m.decode_reasons() and not (runnable and m.unsupported_reasons(
                device="cpu", dtype=torch.float64, causal=True, seq_len=256, head_dim=D)):
            out.append(n)
    return out


def _qkv(N, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, N, D, generator=g, dtype=torch.float64).to(dtype)
            for _ in range(3)]


def _inputs(m, N, dtype, seed=0):
    """The variant's declared inputs (gates) for N tokens, as the benchmark draws them."""
    return m.draw_inputs(B, H, N, D, seed=seed, dtype=dtype)


def _at(inputs, a, b):
    return {n: x[:, :, a:b] for n, x in inputs.items()}


def _generate(m, q, k, v, P, inputs=None):
    """Prefill P tokens, then step through the rest: the outputs (B, H, N - P, D)."""
    N = q.shape[-2]
    inputs = inputs or {}
    state = m.prefill(k[:, :, :P], v[:, :, :P], max_len=N, **_at(inputs, 0, P))
    out = []
    for t in range(P, N):
        o, state = m.step(state, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                          **_at(inputs, t, t + 1))
        assert o.shape == (B, H, 1, D) and o.dtype == q.dtype
        out.append(o)
    return torch.cat(out, dim=-2), state


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_what_decodes_and_what_says_why_not():
    decoders = set(_decoders(runnable=False))
    assert {"standard", "sdpa", "sliding_window", "block_sparse", "linear", "performer",
            "retention", "gla",
            "mamba2", "deltanet", "gated_deltanet"} <= decoders
    for name in variants.names():
        m = variants.build(name, **SETTINGS.get(name, {}))
        if name in decoders:
            continue
        reasons = m.decode_reasons()
        assert reasons and all(isinstance(r, str) and r for r in reasons)
        with pytest.raises(ValueError, match=name):
            m.prefill(*_qkv(4, torch.float32)[1:], max_len=8)
    if "xformers" in decoders and not torch.cuda.is_available():  # declared, not an error
        with pytest.raises(ValueError, match="CUDA"):
            variants.build("xformers").prefill(*_qkv(4, torch.float32)[1:], max_len=8)
    assert "non-causal" in variants.build("linformer").decode_reasons()[0]
    assert "redraw" in variants.build("performer", redraw=True).decode_reasons()[0]


@pytest.mark.parametrize("name", _decoders())
def test_decoding_equals_the_causal_forward_in_float64(name):
    m = variants.build(name, **SETTINGS.get(name, {}))
    lengths = {0, 1, 7} | {b + d for b in BOUNDARIES.get(name, []) for d in (-1, 0, 1)}
    for P in sorted(lengths):
        q, k, v = _qkv(P + T, torch.float64, seed=P)
        inputs = _inputs(m, P + T, torch.float64, seed=P)
        full = m(q, k, v, causal=True, **inputs)  # (B, H, P + T, D)
        got, _ = _generate(m, q, k, v, P, inputs)
        assert _rel(got, full[:, :, P:]) < 1e-10, (name, P)


@pytest.mark.parametrize("name", _decoders())
def test_decoding_in_float32_is_within_twice_the_forward_rounding(name):
    m = variants.build(name, **SETTINGS.get(name, {}))
    P = 70
    q, k, v = _qkv(P + T, torch.float32, seed=1)
    inputs = _inputs(m, P + T, torch.float32, seed=1)
    ref = m(*(t.double() for t in (q, k, v)), causal=True,
            **{n: x.double() for n, x in inputs.items()})[:, :, P:]
    e = _rel(m(q, k, v, causal=True, **inputs)[:, :, P:], ref)
    got, _ = _generate(m, q, k, v, P, inputs)
    assert _rel(got, ref) <= 2 * e + 1e-6, name


@pytest.mark.parametrize("name", _decoders())
def test_a_rewound_state_decodes_the_same_tokens_again(name):
    m = variants.build(name, **SETTINGS.get(name, {}))
    q, k, v = _qkv(20 + T, torch.float64, seed=2)
    inputs = _inputs(m, 20 + T, torch.float64, seed=2)
    state = m.prefill(k[:, :, :20], v[:, :, :20], max_len=20 + T, **_at(inputs, 0, 20))
    mark = state.mark()
    runs = []
    for _ in range(2):
        out = []
        for t in range(20, 20 + T):
            o, state = m.step(state, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                              **_at(inputs, t, t + 1))
            out.append(o)
        runs.append(torch.cat(out, dim=-2))
        state.rewind(mark)
    assert torch.equal(runs[0], runs[1]), name


def test_the_exact_cache_is_preallocated_and_written_in_place():
    m = variants.build("sdpa")
    q, k, v = _qkv(10 + T, torch.float32)
    state = m.prefill(k[:, :, :10], v[:, :, :10], max_len=10 + T)
    ptr, nbytes = state.k.data_ptr(), m.state_nbytes(state)
    assert nbytes == 2 * B * H * (10 + T) * D * 4
    for t in range(10, 10 + T):
        _, state = m.step(state, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1])
    assert state.k.data_ptr() == ptr and m.state_nbytes(state) == nbytes
    with pytest.raises(ValueError, match="full"):
        m.step(state, q[:, :, :1], k[:, :, :1], v[:, :, :1])


def test_fixed_states_do_not_grow_with_the_context():
    """A window keeps window + 1 tokens, a kernel state M (D + 1) numbers and a shift, a
    recurrence its D x D state, whatever the context's length."""
    for name, kept in (("gated_deltanet", B * H * D * D * 8),
                       ("sliding_window", 2 * B * H * 5 * D * 8),
                       ("linear", B * H * (D * D + D + 1) * 8),
                       ("performer", B * H * (16 * D + 16 + 1) * 8)):
        m = variants.build(name, **SETTINGS.get(name, {}))
        for N in (3, 40):
            k, v = _qkv(N, torch.float64)[1:]
            state = m.prefill(k, v, max_len=N + 1, **_inputs(m, N, torch.float64))
            expect = kept if name != "sliding_window" else 2 * B * H * min(5, N + 1) * D * 8
            assert m.state_nbytes(state) == expect, (name, N)


def test_step_refuses_anything_but_one_token():
    m = variants.build("standard")
    q, k, v = _qkv(4, torch.float32)
    state = m.prefill(k, v, max_len=8)
    with pytest.raises(ValueError, match="one token"):
        m.step(state, q, k, v)
    with pytest.raises(ValueError, match="max_len"):
        m.prefill(k, v, max_len=2)


@pytest.mark.parametrize("name", [n for n in _decoders()
                                  if variants.build(n, **SETTINGS.get(n, {})).has_extend()])
def test_a_context_prefilled_in_pieces_decodes_as_one_prefill(name):
    """The benchmark draws a long context in chunks straight into the state: prefill the
    first piece, extend by the rest (pieces longer and shorter than a window)."""
    m = variants.build(name, **SETTINGS.get(name, {}))
    P = 40
    q, k, v = _qkv(P + T, torch.float64, seed=3)
    inputs = _inputs(m, P + T, torch.float64, seed=3)
    state = m.prefill(k[:, :, :3], v[:, :, :3], max_len=P + T, **_at(inputs, 0, 3))
    for a, b in ((3, 5), (5, 17), (17, 40)):
        state = m.extend(state, k[:, :, a:b], v[:, :, a:b], **_at(inputs, a, b))
    out = []
    for t in range(P, P + T):
        o, state = m.step(state, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                          **_at(inputs, t, t + 1))
        out.append(o)
    full = m(q, k, v, causal=True, **inputs)
    assert _rel(torch.cat(out, dim=-2), full[:, :, P:]) < 1e-10


@pytest.mark.parametrize("name", _decoders())
def test_decoding_in_bfloat16_is_within_twice_the_forward_rounding(name):
    """bfloat16 decodes as its forward computes: the same casts, normalisations and gate
    scores, so the tokens are as close to float64 as the forward's rows are."""
    m = variants.build(name, **SETTINGS.get(name, {}))
    P = 70
    q, k, v = _qkv(P + T, torch.bfloat16, seed=1)
    inputs = _inputs(m, P + T, torch.bfloat16, seed=1)
    ref = m(*(t.double() for t in (q, k, v)), causal=True,
            **{n: x.double() for n, x in inputs.items()})[:, :, P:]
    e = _rel(m(q, k, v, causal=True, **inputs)[:, :, P:], ref)
    got, _ = _generate(m, q, k, v, P, inputs)
    assert _rel(got, ref) <= 2 * e + 1e-6, (name, _rel(got, ref), e)


def test_a_retention_step_builds_no_decay(monkeypatch):
    """γ_h does not change from token to token: built once (at the prefill), not per step."""
    m = variants.build("retention")
    q, k, v = _qkv(10 + T, torch.float32, seed=4)
    state = m.prefill(k[:, :, :10], v[:, :, :10], max_len=10 + T)
    calls = []
    for fn in ("log1p", "pow", "arange"):
        real = getattr(torch, fn)
        monkeypatch.setattr(torch, fn, lambda *a, _r=real, _n=fn, **kw: calls.append(_n)
                            or _r(*a, **kw))
    for t in range(10, 10 + T):
        _, state = m.step(state, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1])
    assert calls == []
    monkeypatch.undo()
    full = m(q, k, v, causal=True)
    state = m.prefill(k[:, :, :10], v[:, :, :10], max_len=10 + T)
    got = torch.cat([m.step(state, *(x[:, :, t:t + 1] for x in (q, k, v)))[0]
                     for t in range(10, 10 + T)], dim=-2)
    assert _rel(got, full[:, :, 10:]) < 1e-5


class _Fresh(TorchDispatchMode):
    """Records every tensor an op makes that aliases none of its inputs: (op, numel)."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
               if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in ins:
                self.made.append((str(func), t.numel()))
        return out


def _largest_made_by_a_step(m, N, **params):
    q, k, v = _qkv(N + 1, torch.float32, seed=5)
    state = m.prefill(k[:, :, :N], v[:, :, :N], max_len=N + 1)
    with _Fresh() as spy:
        m.step(state, q[:, :, N:], k[:, :, N:], v[:, :, N:])
    return max(spy.made, key=lambda x: x[1])


@pytest.mark.parametrize("name", ["standard", "sdpa"])
def test_an_exact_step_makes_nothing_the_size_of_its_context(name):
    """The scores live in a buffer kept with the cache and the softmax runs in place: a
    step at context n makes no tensor of n numbers a head (at 1M tokens, 32 MiB faulted
    in page by page every token)."""
    op, numel = _largest_made_by_a_step(variants.build(name), 300)
    assert numel < B * H * 300 // 4, (op, numel)


def test_a_moba_step_reads_the_block_statistics_in_place():
    """MoBA scores the complete blocks' means where the state keeps them: a step copies no
    tensor the size of the block statistics (own blocks x D a head)."""
    m = variants.build("moba", block_size=4, top_k=3)
    op, numel = _largest_made_by_a_step(m, 400)  # 100 blocks; a step reads 3 of 4 keys
    assert numel < B * H * 100 * D // 4, (op, numel)


@pytest.mark.parametrize("name", ["moba", "quest"])
def test_routed_decoding_in_bfloat16_equals_the_forward_rows(name):
    """Gates scored in the attention's dtype, in the forward and in the step alike: in
    bfloat16 every generated row picks the forward's blocks and equals its row."""
    m = variants.build(name, **{"moba": {"block_size": 4, "top_k": 3},
                                "quest": {"page_size": 4, "top_k": 3}}[name])
    P, n = 64, 64
    q, k, v = _qkv(P + n, torch.bfloat16, seed=6)
    full = m(q, k, v, causal=True)[:, :, P:]  # (B, H, n, D)
    state = m.prefill(k[:, :, :P], v[:, :, :P], max_len=P + n)
    got = torch.cat([m.step(state, *(x[:, :, t:t + 1] for x in (q, k, v)))[0]
                     for t in range(P, P + n)], dim=-2)
    diff = (got.double() - full.double()).norm(dim=-1) / full.double().norm(dim=-1)
    assert int((diff > 1e-2).sum()) == 0, (name, int((diff > 1e-2).sum()), diff.numel())


@pytest.mark.parametrize("name", ["moba", "quest"])
@pytest.mark.parametrize("P", [18, 20])
def test_a_rewound_block_state_holds_the_context_s_statistics(name, P):
    """`mark` keeps only the block the context ends in; `rewind` restores it and empties
    the blocks later tokens filled: the statistics equal a fresh prefill's."""
    m = variants.build(name, **SETTINGS[name])
    q, k, v = _qkv(P + 10, torch.float32, seed=7)
    state = m.prefill(k[:, :, :P], v[:, :, :P], max_len=P + 10)
    mark = state.mark()
    for t in range(P, P + 10):
        m.step(state, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1])
    state.rewind(mark)
    fresh = m.prefill(k[:, :, :P], v[:, :, :P], max_len=P + 10)
    assert state.n == fresh.n
    for a, b in ((state.lo, fresh.lo), (state.hi, fresh.hi)):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("name", ["standard", "sdpa"])
def test_an_exact_step_at_a_long_context_is_as_accurate_as_sdpa(name):
    """One sharp query row over 2^18 keys in float32: the decoder's error against float64
    is within 1.5x of SDPA's on the same row. aten's softmax sums the weights in SIMD
    lanes, which drifts (here 3.7x SDPA's error); the decoder divides by a cascade sum."""
    g = torch.Generator().manual_seed(8)
    N = 1 << 18
    q, k, v = (torch.randn(1, 2, n, 16, generator=g) for n in (1, N, N))
    q = 4 * q  # sharp attention: a few weights carry the row
    m = variants.build(name)
    state = m.prefill(k[:, :, :-1], v[:, :, :-1], max_len=N)
    o, _ = m.step(state, q, k[:, :, -1:], v[:, :, -1:])
    ref = torch.softmax(q.double() @ k.double().transpose(-1, -2) / 4, dim=-1) @ v.double()
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert _rel(o, ref) <= 1.5 * _rel(sdpa, ref), (_rel(o, ref), _rel(sdpa, ref))


@pytest.mark.parametrize("name", ["standard", "sdpa"])
@pytest.mark.parametrize("P", [100, 1 << 17])  # D = 8: 2^17 keys reach 2^20 values
@pytest.mark.parametrize("gemv", [False, True])
def test_exact_decoding_takes_every_value_product_exactly(name, P, gemv, monkeypatch):
    """A short row (one bmm), a long one renormalised, and with one gemv a head (from
    2^24 values a head: brought down here to the long row's)."""
    if gemv:
        monkeypatch.setattr(exact_cache, "_MV_FROM", 1 << 20)
    m = variants.build(name)
    q, k, v = _qkv(P + 2, torch.float64, seed=9)
    rows = exact_reference(q, k, v, causal=True, rows=torch.arange(P, P + 2))
    got, _ = _generate(m, q, k, v, P)
    assert _rel(got, rows) < 1e-10
