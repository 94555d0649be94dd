"""The decoding form: prefill a context, then step token by token; every output must equal
that row of the variant's causal forward over the whole sequence.

Parametrised over the registry: a variant either decodes (and is held to its forward) or
declares why not, never an error. Prefill lengths 0, 1, an odd one and each side of the
variant's chunk or window boundary, then several steps that cross it.
"""

import pytest
import torch

import variants

B, H, D, T = 2, 3, 8, 6

# Settings small enough that a ring wraps and chunks turn over within a few tokens.
SETTINGS = {
    "sliding_window": {"window": 4},
    "performer": {"num_features": 16},
    "block_sparse": {"block_size": 4, "window_blocks": 1, "global_blocks": 1, "random_blocks": 2},
    "moba": {"block_size": 4, "top_k": 3},
    "scatterbrain": {"window": 4, "num_features": 16},
    "quest": {"page_size": 4, "top_k": 3},
}
# Boundaries of each variant's own blocking, so that prefill lengths straddle them.
BOUNDARIES = {"sliding_window": [5], "scatterbrain": [5, 64], "block_sparse": [4, 12], "moba": [4, 12], "quest": [4, 12], "linear": [64], "performer": [128], "retention": [64],
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
