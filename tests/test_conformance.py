"""The conformance kit: every registered variant, with no edit here when one is added.

Each test builds the variant with its defaults, asks it first whether it can run the case
(`unsupported_reasons`) and, where it cannot, checks that `forward` refuses with that
reason instead of computing something else.
"""

import dataclasses

import pytest
import torch

import variants
from variants import exact_reference, naive_attention

NAMES = variants.names()
N_GENERIC = 300  # above every default budget (landmarks, projection rank, windows)


def causal_of(name: str) -> bool:
    """The generic tests' causal flag: False, except for causal-only variants (a recurrence)."""
    return variants.spec(name).causal_only


def extra(m, q) -> dict:
    """The inputs beyond q, k, v the variant declares, drawn as the benchmark draws them."""
    B, H, N, D = q.shape
    return m.draw_inputs(B, H, N, D, seed=0, dtype=q.dtype, device=q.device)


def qkv(B=3, H=3, N=N_GENERIC, D=16, dtype=torch.float32, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, N, D, generator=g).to(dtype).requires_grad_(requires_grad)
            for _ in range(3)]


# Reasons that name something this machine lacks (a package, a device, a compiler): the
# only ones a test skips for. Any other declared reason (non-causal only, no backward on
# CPU) is the variant's documented behaviour: the test checks the refusal and passes.
MACHINE_LACKS = ("not installed", "CUDA is not available", "C++ compiler", "needs Triton")


def lacks(reasons: list[str]) -> bool:
    return any(word in r for r in reasons for word in MACHINE_LACKS)


def runnable(m, q, causal=False, backward=False) -> bool:
    """True when the variant can run the case. Otherwise checks that forward refuses the
    case with the declared reason, then returns False (the test ends there, passed), or
    skips naming what the machine lacks when that is the reason."""
    reasons = m.unsupported_reasons(device=q.device, dtype=q.dtype, causal=causal,
                                    seq_len=q.shape[-2], head_dim=q.shape[-1],
                                    backward=backward)
    if reasons:
        k, v = torch.zeros_like(q), torch.zeros_like(q)
        with pytest.raises(ValueError) as e:
            m(q.detach().requires_grad_(backward), k, v, causal=causal)
        assert reasons[0] in str(e.value)
        if lacks(reasons):
            pytest.skip(f"this machine lacks what it needs: {'; '.join(reasons)}")
        return False
    return True


@pytest.mark.parametrize("name", NAMES)
def test_spec_describes_the_variant(name):
    s = variants.spec(name)
    assert s.name == name and s.family and s.paper.startswith("http") and s.summary
    m = variants.build(name, **s.defaults)
    assert isinstance(m, torch.nn.Module)
    assert dataclasses.asdict(m.params) == s.defaults
    with pytest.raises(ValueError, match=rf"{name}.*no_such_param.*allowed"):
        variants.build(name, no_such_param=1)
    for p in s.params:  # a value of the wrong type is refused with the parameter's name
        bad = "x" if p.type != "str" else 3
        with pytest.raises(ValueError, match=rf"{name}.*{p.name}"):
            variants.build(name, **{p.name: bad})


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_output_shape_dtype_finite(name, causal):
    m = variants.build(name)
    q, k, v = qkv()
    if not runnable(m, q, causal):
        return
    with torch.no_grad():
        o = m(q, k, v, causal=causal, **extra(m, q))
    assert o.shape == q.shape and o.dtype == q.dtype and o.device == q.device
    assert torch.isfinite(o).all()


@pytest.mark.parametrize("name", NAMES)
def test_gradients_flow_to_q_k_v(name):
    m = variants.build(name)
    q, k, v = qkv(requires_grad=True)
    causal = causal_of(name)
    if not runnable(m, q, causal, backward=True):
        return
    ins = {n: t.requires_grad_() for n, t in extra(m, q).items()}
    m(q, k, v, causal=causal, **ins).square().sum().backward()
    for t in (q, k, v, *ins.values()):
        assert t.grad is not None and torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0


@pytest.mark.parametrize("name", NAMES)
def test_batch_and_heads_are_independent(name):
    m = variants.build(name)
    q, k, v = qkv()
    causal = causal_of(name)
    if not runnable(m, q, causal):
        return
    perm = torch.tensor([2, 0, 1])
    ins = extra(m, q)
    ins_perm = {n: t[:, perm] for n, t in ins.items()}
    ins_b1 = {n: t[1:] for n, t in ins.items()}
    if getattr(m, "per_head_schedule", False):  # head h has its own fixed constant (RetNet's
        perm = torch.tensor([0, 1, 2])           # decays): heads are independent, not alike
    with torch.no_grad():
        o = m(q, k, v, causal=causal, **ins)
        o_perm = m(q[:, perm], k[:, perm], v[:, perm], causal=causal, **ins_perm)
        o_b1 = m(q[1:], k[1:], v[1:], causal=causal, **ins_b1)
    torch.testing.assert_close(o_perm, o[:, perm], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o_b1, o[1:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_causal_output_ignores_the_future(name):
    m = variants.build(name)
    q, k, v = qkv()
    if not variants.spec(name).supports_causal:
        assert m.unsupported_reasons(device="cpu", dtype=q.dtype, causal=True,
                                     seq_len=N_GENERIC, head_dim=16)
        with pytest.raises(ValueError, match="causal"):
            m(q, k, v, causal=True)
        return
    if not runnable(m, q, causal=True):
        return
    i = N_GENERIC // 2
    k2, v2 = k.clone(), v.clone()
    k2[:, :, i + 1:] = torch.randn_like(k2[:, :, i + 1:]) * 3
    v2[:, :, i + 1:] = torch.randn_like(v2[:, :, i + 1:]) * 3
    ins = extra(m, q)
    with torch.no_grad():
        o, o2 = m(q, k, v, causal=True, **ins), m(q, k2, v2, causal=True, **ins)
    torch.testing.assert_close(o2[:, :, :i + 1], o[:, :, :i + 1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(o2[:, :, i + 1:], o[:, :, i + 1:])


@pytest.mark.parametrize("name", NAMES)
def test_same_parameters_give_the_same_output(name):
    q, k, v = qkv()
    causal = causal_of(name)
    m = variants.build(name)
    if not runnable(m, q, causal):
        return
    ins = extra(m, q)
    with torch.no_grad():
        a = variants.build(name)(q, k, v, causal=causal, **ins)
        b = variants.build(name)(q, k, v, causal=causal, **ins)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("name", NAMES)
def test_flops_are_analytic_and_grow_with_length(name):
    m = variants.build(name)
    f = [m.flops(1, 8, n, 64, False) for n in (1024, 4096)]
    assert all(isinstance(x, int) and x > 0 for x in f)
    assert f[1] > f[0]
    spec = variants.spec(name)
    if spec.supports_causal:
        causal = m.flops(1, 8, 4096, 64, True)
        assert isinstance(causal, int) and causal > 0
        if spec.exact:  # FlashAttention's convention; chunked causal forms may cost more
            assert causal == f[1] // 2


def _rel_err(o, ref):
    return float((o.double() - ref).norm() / ref.norm())


EXACT_NAMES = [n for n in NAMES if variants.spec(n).exact or variants.spec(n).pattern_exact]


# Variants that compile (seconds per new kernel) get two ragged multi-block lengths, in
# the generic tests' B, H, D (their kernels are reused; a length within one block, or
# batch 1, would compile a kernel of its own: dynamo specialises sizes 0 and 1): the
# same checks, fewer compiles.
EXACT_CASES = [(n, N, (1, 2, 32)) for n in EXACT_NAMES if not variants.build(n).compiles
               for N in (1, 63, 100, 1000)]
EXACT_CASES += [(n, N, (3, 3, 16)) for n in EXACT_NAMES if variants.build(n).compiles
                for N in (200, 1000)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name,N,shape", EXACT_CASES)
def test_exact_variants_match_the_float64_reference(name, N, shape, causal, dtype):
    """Flash-attention's rule: error at most twice the plain path's in the same dtype."""
    m = variants.build(name)
    B, H, D = shape
    q, k, v = qkv(B=B, H=H, N=N, D=D, dtype=dtype, seed=N)
    if not runnable(m, q, causal):
        return
    mask = m.key_mask(N)
    with torch.no_grad():
        ref = exact_reference(q, k, v, causal, key_mask=mask)
        base = _rel_err(naive_attention(q, k, v, causal, key_mask=mask), ref)
        err = _rel_err(m(q, k, v, causal=causal), ref)
    assert err <= 2 * base + torch.finfo(dtype).eps, (err, base)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_weights_times_v_is_the_output(name, causal):
    """A map cannot lie: weights(q, k) @ v equals forward(q, k, v), causal and not, in
    float64 where the variant takes it (float32 otherwise, to its rounding); causal maps
    put no weight on the future. Above the size limit every variant refuses."""
    m = variants.build(name)
    assert any("4096" in r for r in m.weights_reasons(device="cpu", dtype=torch.float32,
                                                      causal=causal, seq_len=4097,
                                                      head_dim=16))
    wide = not m.unsupported_reasons(device="cpu", dtype=torch.float64, causal=causal,
                                     seq_len=N_GENERIC, head_dim=16)
    dtype = torch.float64 if wide else torch.float32
    q, k, v = qkv(dtype=dtype)
    reasons = m.weights_reasons(device=q.device, dtype=dtype, causal=causal,
                                seq_len=N_GENERIC, head_dim=16)
    if reasons:
        with pytest.raises(ValueError) as e:
            m.weights(q, k, causal)
        assert reasons[0] in str(e.value)
        pytest.skip(f"declared unsupported: {'; '.join(reasons)}")
    ins = extra(m, q)
    with torch.no_grad():
        w = m.weights(q, k, causal, **ins)
        o = m(q, k, v, causal=causal, **ins)
    assert w.shape == (3, 3, N_GENERIC, N_GENERIC) and w.dtype == dtype
    tol = 1e-9 if wide else 2e-5
    torch.testing.assert_close(w @ v, o, rtol=tol, atol=tol)
    if causal:
        assert bool((w.triu(1) == 0).all())
