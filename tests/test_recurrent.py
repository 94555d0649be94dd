"""The gated linear recurrences (variants/recurrent/) against their float64 sequential
recurrence: forward and gradients (q, k, v and each declared input) at N = 1, C - 1, C,
C + 1 and 1000, in float64 to 1e-10 and in float32 within twice the float32 sequential
recurrence's own error (flash-attention's rule); long float32 and bfloat16 runs stay
finite; the declared inputs are checked before any work."""

import dataclasses

import pytest
import torch

import variants

NAMES = ["retention", "gla", "mamba2", "deltanet", "gated_deltanet", "kda"]
C = 64  # every variant's default chunk
LENGTHS = [1, C - 1, C, C + 1, 1000]


def case(name, N, B=1, H=2, D=8, dtype=torch.float64, seed=0):
    m = variants.build(name)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, D, generator=g, dtype=torch.float64) for _ in range(3))
    ins = m.draw_inputs(B, H, N, D, seed=seed, dtype=torch.float64)
    return m, q, k, v, ins


def _grads(fn, q, k, v, ins, dtype, w):
    """Output and gradients of sum(o * w) w.r.t. q, k, v and each input, in `dtype` (zeros
    for an input the output does not depend on: a one-token sequence's decay)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    extra = {n: t.detach().to(dtype).requires_grad_() for n, t in ins.items()}
    o = fn(*leaves, **extra)
    (o.double() * w).sum().backward()
    return [o.detach().double()] + [torch.zeros_like(t, dtype=torch.float64) if t.grad is None
                                    else t.grad.double() for t in leaves + list(extra.values())]


def _rel(a, ref):
    """Relative error; absolute where the reference is exactly zero (at N = 1 the one
    token's decay multiplies an empty state: dg = 0, which rounding meets only to 1e-16)."""
    return float((a - ref).norm() / (ref.norm() if ref.norm() > 0 else 1.0))


def _labels(ins):
    return ["o", "dq", "dk", "dv"] + [f"d{n}" for n in ins]


@pytest.mark.parametrize("N", LENGTHS)
@pytest.mark.parametrize("name", NAMES)
def test_chunked_matches_the_sequential_recurrence(name, N):
    m, q, k, v, ins = case(name, N)
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref = _grads(m.reference, q, k, v, ins, torch.float64, w)
    chunked = lambda *a, **i: m(*a, causal=True, **i)  # noqa: E731
    got64 = _grads(chunked, q, k, v, ins, torch.float64, w)
    for label, a, r in zip(_labels(ins), got64, ref):
        assert _rel(a, r) <= 1e-10, (label, _rel(a, r))
    base = _grads(lambda *a, **i: _sequential(m, *a, **i), q, k, v, ins, torch.float32, w)
    got32 = _grads(chunked, q, k, v, ins, torch.float32, w)
    for label, a, b, r in zip(_labels(ins), got32, base, ref):
        e32 = _rel(b, r)
        assert _rel(a, r) <= 2 * e32 + 1e-6, (label, _rel(a, r), e32)


@pytest.mark.parametrize("N", [64, 150])
@pytest.mark.parametrize("name", ["gla", "kda"])
def test_the_per_channel_scores_backward_recomputed_or_kept(name, N, monkeypatch):
    """The per-channel scores' backward either recomputes each level's factors (large
    chunks) or reads those its forward kept (up to scores.KEEP_MAX): both give the float64
    recurrence's gradients."""
    from variants.recurrent import scores
    m, q, k, v, ins = case(name, N)
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref = _grads(m.reference, q, k, v, ins, torch.float64, w)
    run = lambda *a, **i: m(*a, causal=True, **i)  # noqa: E731
    for keep_max in (0, 1 << 30):
        monkeypatch.setattr(scores, "KEEP_MAX", keep_max)
        for label, a, r in zip(_labels(ins), _grads(run, q, k, v, ins, torch.float64, w), ref):
            assert _rel(a, r) <= 1e-10, (keep_max, label, _rel(a, r))


def _sequential(m, q, k, v, **ins):
    """The same sequential recurrence in the inputs' own dtype (the float32 baseline)."""
    from variants.recurrent import recurrence
    q2, k2, v2, g, beta = m._terms(q, k, v, ins)
    return recurrence(q2, k2, v2, g, beta)


# Per-channel decays (nats per token): mild, about 58 nats over a 64-token chunk (where an
# earlier form's one-matmul path ended), about 90, at least 320, and 20 to 40 (above 1000
# nats a chunk, where a factor against the chunk's start, e^{1000}, overflows any float).
CHANNEL_DECAYS = [(0.7, 0.9), (1.2, 1.6), (5.0, 8.0), (20.0, 40.0)]


@pytest.mark.parametrize("N", [64, 150])
@pytest.mark.parametrize("name,low,high", [(n, lo, hi) for n in ("gla", "kda")
                                           for lo, hi in CHANNEL_DECAYS]
                         + [("mamba2", 1.5, 4.5), ("gated_deltanet", 1.5, 4.5)])
def test_strong_decays_stay_exact_and_finite(name, low, high, N):
    """Decays of 0.7 to 40 nats per token (up to e^-2500 over a chunk), in one chunk (N =
    64) and chunked (150): every variant matches the recurrence, float64 to 1e-10 and
    float32 within 2 e32 + 1e-6, with no overflow; except dg in float32, held to 2e-4: the
    chunked form's dg_t is the sum over the chunk's later positions of d/db, terms of both
    signs that cancel to the few pairs straddling t, and with decays this strong their
    rounding exceeds the sequential form's 1e-7 (measured: 2e-6 to 4e-6 at 0.7 to 4.5 nats
    per token, 7.5e-5 at 5 to 8; with the benchmark's gates the test above holds dg to
    2 e32 + 1e-6). At 20 to 40 nats per token dg itself is e^-20 of the other gradients
    (only pairs straddling t carry it) while the terms that cancel to it are not: there
    its error is measured against the norm of dk, a sum of the same terms (measured:
    1e-15 of it in float64, 3e-7 in float32; against dg's own norm 3e-6 and 1e3)."""
    m, q, k, v, ins = case(name, N)
    ins["g"] = -(high - low) * torch.rand(ins["g"].shape, dtype=torch.float64,
                                          generator=torch.Generator().manual_seed(2)) - low
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref = _grads(m.reference, q, k, v, ins, torch.float64, w)
    dk = ref[_labels(ins).index("dk")]

    def err(label, a, r):
        if label == "dg" and low >= 20:
            return float((a - r).norm() / dk.norm())
        return _rel(a, r)
    chunked = lambda *a, **i: m(*a, causal=True, **i)  # noqa: E731
    for label, a, r in zip(_labels(ins), _grads(chunked, q, k, v, ins, torch.float64, w), ref):
        assert err(label, a, r) <= 1e-10, (label, err(label, a, r))
    base = _grads(lambda *a, **i: _sequential(m, *a, **i), q, k, v, ins, torch.float32, w)
    got = _grads(chunked, q, k, v, ins, torch.float32, w)
    for label, a, b, r in zip(_labels(ins), got, base, ref):
        bound = 2e-4 if label == "dg" else 2 * _rel(b, r) + 1e-6
        assert torch.isfinite(a).all() and err(label, a, r) <= bound, (label, err(label, a, r))


@pytest.mark.parametrize("N", [1, 63, 64, 65, 256])
@pytest.mark.parametrize("name", NAMES)
def test_the_one_chunk_forms_match_the_sequential_recurrence(name, N, monkeypatch):
    """A sequence that fits in one chunk (here chunk = 256) takes the one-chunk form
    (parallel.py; the chunked kernels are not called): forward and gradients against the
    float64 recurrence, float64 to 1e-10, float32 within 2 e32 + 1e-6 sqrt(N / 64): each
    entry of a one-chunk form sums up to N terms, and rounding over a sum grows as the
    square root of its length (kda's dg at N = 256 read 1.36e-6 and 1.43e-6 under two
    orders of the same products, against 2 e32 = 3.9e-7)."""
    m, q, k, v, ins = case(name, N)
    m = variants.build(name, chunk=256)
    monkeypatch.setattr(type(m), "_chunked", lambda *a, **i: pytest.fail("chunked form"))
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref = _grads(m.reference, q, k, v, ins, torch.float64, w)
    whole = lambda *a, **i: m(*a, causal=True, **i)  # noqa: E731
    for label, a, r in zip(_labels(ins), _grads(whole, q, k, v, ins, torch.float64, w), ref):
        assert _rel(a, r) <= 1e-10, (label, _rel(a, r))
    base = _grads(lambda *a, **i: _sequential(m, *a, **i), q, k, v, ins, torch.float32, w)
    for label, a, b, r in zip(_labels(ins), _grads(whole, q, k, v, ins, torch.float32, w),
                              base, ref):
        bound = 2 * _rel(b, r) + 1e-6 * max(1.0, N / 64) ** 0.5
        assert _rel(a, r) <= bound, (label, _rel(a, r), _rel(b, r))


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every aten op called (and its output shapes) under it."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        shapes = [tuple(t.shape) for t in torch.utils._pytree.tree_leaves(out)
                  if isinstance(t, torch.Tensor)]
        self.ops.append((str(func), shapes))
        return out


@pytest.mark.parametrize("N", [64, 300])
@pytest.mark.parametrize("name", NAMES)
def test_the_kernels_path_does_not_depend_on_the_gates(name, N):
    """The same aten ops, with the same shapes, forward and backward, for the benchmark's
    mild gates and for decays of 20 to 40 nats per token, and none that reads a value
    back to the host (a `float(...)` or `.item()` a branch could hang on): the kernels'
    time depends on the shapes only (N = 300: chunked, several chunks)."""
    def ops(scale):
        m, q, k, v, ins = case(name, N, dtype=torch.float32)
        q, k, v = (t.float() for t in (q, k, v))
        ins = {n: t.float() for n, t in ins.items()}
        if "g" in ins and scale:
            ins["g"] = -20 - 20 * torch.rand(ins["g"].shape,
                                             generator=torch.Generator().manual_seed(3))
        leaves = [t.requires_grad_() for t in (q, k, v, *ins.values())]
        terms = m._in(*leaves[:3], dict(zip(ins, leaves[3:])), torch.float32)
        with _Ops() as rec:
            o = m._whole(*terms) if N <= m.params.chunk else m._chunked(*terms)[0]
            o.sum().backward()
        return rec.ops
    mild, extreme = ops(False), ops(True)
    assert mild == extreme
    assert not any("_local_scalar_dense" in op for op, _ in mild)


@pytest.mark.parametrize("name", NAMES)
def test_weights_times_v_is_the_forward(name):
    m, q, k, v, ins = case(name, 150, B=2, H=3)
    torch.testing.assert_close(m.weights(q, k, True, **ins) @ v, m(q, k, v, causal=True, **ins),
                               rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", NAMES)
def test_long_float32_is_finite_forward_and_backward(name):
    """N = 16384 with the benchmark's gates: decays compound to exp(-hundreds) over a chunk
    (Mamba2's A up to 16), which log space must carry without inf or NaN."""
    N, B, H, D = 16384, 1, 1, 16
    m = variants.build(name)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, generator=g).requires_grad_() for _ in range(3))
    ins = {n: t.requires_grad_() for n, t in m.draw_inputs(B, H, N, D, seed=0).items()}
    o = m(q, k, v, causal=True, **ins)
    assert torch.isfinite(o).all()
    o.square().sum().backward()
    for t in [q, k, v, *ins.values()]:
        assert torch.isfinite(t.grad).all()


@pytest.mark.parametrize("name", NAMES)
def test_bfloat16_is_finite_and_close(name):
    N, B, H, D = 4096, 1, 1, 16
    m = variants.build(name)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, generator=g).bfloat16() for _ in range(3))
    ins = m.draw_inputs(B, H, N, D, seed=0, dtype=torch.bfloat16)
    with torch.no_grad():
        o = m(q, k, v, causal=True, **ins)
        ref = m.reference(q, k, v, **ins)
    assert o.dtype == torch.bfloat16 and torch.isfinite(o).all()
    assert _rel(o.double(), ref) <= 3e-2


@pytest.mark.parametrize("name", NAMES)
def test_declared_inputs_are_checked(name):
    m, q, k, v, ins = case(name, 20)
    s = variants.spec(name)
    assert s.family == "recurrent" and s.causal_only and not s.exact
    assert [i.name for i in s.inputs] == list(ins)
    assert m.state_size(1000, 64) == 64 * 64 and not m.exact_at(20, True)
    with pytest.raises(ValueError, match="a recurrence: causal only"):
        m(q, k, v, **ins)
    assert "a recurrence: causal only" in m.unsupported_reasons(
        device="cpu", dtype=q.dtype, causal=False, seq_len=20, head_dim=8)
    with pytest.raises(ValueError, match="unknown input.*'h'"):
        m(q, k, v, causal=True, h=q[..., 0], **ins)
    for n, t in ins.items():
        rest = {o: u for o, u in ins.items() if o != n}
        with pytest.raises(ValueError, match=f"missing input.*{n}"):
            m(q, k, v, causal=True, **rest)
        with pytest.raises(ValueError, match=f"input '{n}' must be"):
            m(q, k, v, causal=True, **rest, **{n: t[:, :, :-1]})
        with pytest.raises(ValueError, match=f"input '{n}'.*dtype"):
            m(q, k, v, causal=True, **rest, **{n: t.float()})
        bad = t.clone()
        bad[0, 0, 3] = 0.5 if n == "g" else 1.0
        with pytest.raises(ValueError, match=f"input '{n}' must lie in"):
            m(q, k, v, causal=True, **rest, **{n: bad})
        with pytest.raises(ValueError, match=f"input '{n}' must lie in"):
            m.weights(q, k, True, **rest, **{n: bad})
    if "beta" in ins:
        bad = ins["beta"].clone()
        bad[0, 0, 0] = 0.0
        with pytest.raises(ValueError, match="input 'beta' must lie in"):
            m(q, k, v, causal=True, **{**ins, "beta": bad})


def test_the_draws_follow_the_papers_layers():
    """GLA's gate is logsigmoid(x) / 16 (<= 0, mean about -0.05); Mamba2's decay is
    -exp(A_log) softplus(x + dt_bias), negative; beta = sigmoid(x) in (0, 1), also in
    bfloat16 (which rounds sigmoid(5) to 1)."""
    g = variants.build("gla").draw_inputs(2, 4, 4096, 16, seed=3)["g"]
    assert g.shape == (2, 4, 4096, 16) and bool((g <= 0).all())
    assert -0.07 < float(g.mean()) < -0.03
    g2 = variants.build("mamba2").draw_inputs(2, 4, 64, 16, seed=3)["g"]
    assert g2.shape == (2, 4, 64) and bool((g2 < 0).all())
    beta = variants.spec("deltanet").contract.inputs[0]
    gate = variants.spec("gla").contract.inputs[0]
    assert beta.range_text == "(0, 1)" and gate.range_text == "<= 0"
    assert torch.tensor(0.999).bfloat16() == 1  # sigmoid(7) rounds to 1 in bfloat16 ...
    wide = dataclasses.replace(beta, sample=lambda gen, B, H, N, D: torch.full((B, H, N), 0.999))
    b = wide.draw(1, 1, 10, 8, seed=0, dtype=torch.bfloat16)
    assert bool((b < 1).all()) and bool((b > 0.99).all())  # ... and the draw stays inside


@pytest.mark.parametrize("pass_", ["forward", "forward_backward"])
def test_the_worker_draws_the_inputs_and_measures_against_the_recurrence(pass_):
    """A benchmark case: the worker draws g and beta from the case's seed and the error is
    the chunked float32 output's against the float64 recurrence (rounding-sized), where
    against softmax it would be of order one."""
    import json

    from harness.measure.matrix import Case
    from harness.measure.rows import case_row
    from harness.measure.worker import run_case
    case = Case("gated_deltanet", json.dumps({"chunk": 64}), "cpu", "float32", 1, 2, 16, 200,
                True, pass_, "gaussian", 0, 0.01, 2, 60.0, 1, 64, 0)
    out = run_case(case, "time")
    assert out["status"] == "ok", out
    assert out["rel_err"] < 1e-5 and out["row_cos"] > 0.99999
    assert case_row(case, variants.build("gated_deltanet"))["err_ref"] == "recurrence"


FLA = [f"{n}_fla" for n in NAMES]


@pytest.mark.parametrize("name", FLA)
def test_fla_kernels_are_refused_with_the_reason_where_they_cannot_run(name):
    m = variants.build(name)
    assert variants.spec(name).family == "recurrent" and m.contract.err_ref == "recurrence"
    reasons = m.unsupported_reasons(device="cpu", dtype=torch.bfloat16, causal=True,
                                    seq_len=128, head_dim=16)
    assert reasons and any("not installed" in r or "CUDA only" in r for r in reasons)
    q = torch.randn(1, 2, 128, 16).bfloat16()
    with pytest.raises(ValueError, match=reasons[0].split(":")[0]):
        m(q, q, q, causal=True, **m.draw_inputs(1, 2, 128, 16, dtype=torch.bfloat16))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("name", FLA)
def test_fla_kernels_match_our_float64_recurrence(name, backward):
    """On CUDA: fla's kernel forward (and gradients) against our float64 recurrence, within
    twice the error of our chunked form in the same dtype plus bfloat16's rounding."""
    m, ours = variants.build(name), variants.build(name.removesuffix("_fla"))
    reasons = m.unsupported_reasons(device="cuda", dtype=torch.bfloat16, causal=True,
                                    seq_len=1000, head_dim=64, backward=backward)
    if reasons:
        pytest.skip("; ".join(reasons))
    B, H, N, D = 2, 4, 1000, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, generator=g, dtype=torch.float64) for _ in range(3))
    ins = m.draw_inputs(B, H, N, D, seed=0, dtype=torch.float64)
    w = torch.randn(q.shape, generator=g, dtype=torch.float64)
    on = lambda t: t.cuda()  # noqa: E731
    ref = _grads(m.reference, q, k, v, ins, torch.float64, w)
    dev = {n: on(t) for n, t in ins.items()}
    fla = _grads(lambda *a, **i: m(*a, causal=True, **i), *map(on, (q, k, v)), dev,
                 torch.bfloat16, on(w))
    base = _grads(lambda *a, **i: ours(*a, causal=True, **i), *map(on, (q, k, v)), dev,
                  torch.bfloat16, on(w))
    for label, a, b, r in list(zip(_labels(ins), fla, base, ref))[:None if backward else 1]:
        err, e_ours = _rel(a.cpu(), r), _rel(b.cpu(), r)
        assert err <= 2 * e_ours + 1e-2, (label, err, e_ours)


@pytest.mark.parametrize("name", ["gla", "mamba2", "gated_deltanet", "kda"])
def test_the_recall_model_makes_the_declared_inputs_and_trains_them(name):
    """The recall model's layers make each declared input from the hidden state in its
    range and shape, and the loss reaches their weights (they are the model's)."""
    from harness.train.model import RecallModel
    torch.manual_seed(0)
    model = RecallModel(name, {}, vocab_size=16, d_model=32, layers=1, heads=2, causal=True,
                        mlp=False)
    block = model.blocks[0]
    assert set(block.inputs) == {s.name for s in variants.spec(name).inputs}
    x = torch.randn(3, 20, 32) * 30  # far from zero: sigmoid and softplus near saturation
    for spec in variants.spec(name).inputs:
        y, _ = block.inputs[spec.name](x)
        assert tuple(y.shape) == spec.shape_for(torch.empty(3, 2, 20, 16)) and spec.in_range(y)
    model(torch.randint(0, 16, (3, 20))).square().mean().backward()
    grads = [p.grad for n, p in model.named_parameters() if n.startswith("blocks.0.inputs.")]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("N", [3 * C, 1000])
@pytest.mark.parametrize("name", NAMES)
def test_the_streamed_blocks_carry_the_state(name, N, monkeypatch):
    """Sequences longer than one block (chunked.stream: 2 chunks a block here, where a
    benchmark's are thousands of tokens): forward and gradients still match the float64
    recurrence, and the no-grad forward (written block by block into one output) the
    autograd one."""
    from variants.recurrent import chunked
    m, q, k, v, ins = case(name, N)
    monkeypatch.setattr(chunked, "BLOCK_ELEMENTS", 2 * C * 2 * C)  # B H = 2, max(C, D) = C
    assert chunked.block_rows(1, 2, C, 8) == 2 * C < N
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref = _grads(m.reference, q, k, v, ins, torch.float64, w)
    got = _grads(lambda *a, **i: m(*a, causal=True, **i), q, k, v, ins, torch.float64, w)
    for label, a, r in zip(_labels(ins), got, ref):
        assert _rel(a, r) <= 1e-10, (label, _rel(a, r))
    with torch.no_grad():
        plain = m(q, k, v, causal=True, **ins)
    assert _rel(plain, ref[0]) <= 1e-10
