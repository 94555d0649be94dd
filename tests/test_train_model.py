"""The small model around a variant: its convolution and the causal flag it hands the
variant keep the future out; the variant is the registry's, called through its interface.

Planted bugs: a symmetric (centred) convolution, or a block that calls the variant
non-causally, lets a later token move an earlier logit (causality); a model that ignores
causal=False cannot tell (the non-causal check); a mixer not built from the registry, or
built with other parameters (the build check); an untied head counted twice (parameters).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import variants
from harness.train.model import RecallModel, ShortConv


def _model(variant="sdpa", params=None, causal=True, layers=2, mlp=True):
    torch.manual_seed(0)
    return RecallModel(variant, params or {}, vocab_size=40, d_model=32, layers=layers,
                       heads=2, causal=causal, mlp=mlp)


def test_short_conv_sees_its_own_and_the_two_previous_positions_only():
    torch.manual_seed(0)
    conv = ShortConv(8)
    x = torch.randn(1, 12, 8)
    i = 6
    for j, moves in ((i + 1, False), (i + 5, False), (i - 3, False), (i - 2, True),
                     (i - 1, True), (i, True)):
        y = x.clone()
        y[0, j] += 1.0
        changed = not torch.allclose(conv(x)[0, i], conv(y)[0, i])
        assert changed == moves, f"output {i} after changing input {j}"


@pytest.mark.parametrize("variant,params", [("sdpa", {}), ("linear", {}),
                                            ("sliding_window", {"window": 3})])
def test_a_causal_model_never_reads_a_later_token(variant, params):
    model = _model(variant, params)
    tokens = torch.randint(0, 40, (2, 24), generator=torch.Generator().manual_seed(1))
    i = 10
    later = tokens.clone()
    later[:, i + 1:] = (later[:, i + 1:] + 7) % 40
    with torch.no_grad():
        a, b = model(tokens), model(later)
    torch.testing.assert_close(a[:, :i + 1], b[:, :i + 1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(a[:, i + 1:], b[:, i + 1:])


def test_a_non_causal_model_reads_later_tokens():
    model = _model(causal=False)
    tokens = torch.randint(0, 40, (2, 24), generator=torch.Generator().manual_seed(1))
    later = tokens.clone()
    later[:, 20:] = (later[:, 20:] + 7) % 40
    with torch.no_grad():
        assert not torch.allclose(model(tokens)[:, :10], model(later)[:, :10])


def test_the_mixer_is_the_registered_variant_with_its_parameters():
    model = _model("performer", {"num_features": 16, "seed": 3}, layers=1)
    mixer = model.blocks[0].mixer
    assert type(mixer) is type(variants.build("performer"))
    assert mixer.params == variants.make_params("performer", num_features=16, seed=3)
    with pytest.raises(ValueError, match="unknown variant"):
        _model("no_such_variant")
    with pytest.raises(ValueError, match="num_features"):
        _model("performer", {"num_features": 0})


def test_a_causal_call_of_a_non_causal_variant_raises_its_reason():
    model = _model("linformer", {"k": 8}, causal=True, layers=1)
    with pytest.raises(ValueError, match="non-causal only"):
        model(torch.zeros(1, 16, dtype=torch.long))


def test_scored_positions_only_and_a_tied_head():
    model = _model(layers=1, mlp=False)
    tokens = torch.randint(0, 40, (3, 16), generator=torch.Generator().manual_seed(2))
    where = torch.zeros(3, 16, dtype=torch.bool)
    where[0, 3] = where[2, 15] = True
    with torch.no_grad():
        full, some = model(tokens), model(tokens, where)
    torch.testing.assert_close(some, full[where])
    d, V = 32, 40
    expected = V * d + 3 * d * d + d * d + (3 * d + d) + 2 * (2 * d)  # emb, qkv, out, conv, 2 norms
    assert model.n_params() == expected


def test_state_size_grows_with_n_only_for_a_full_cache():
    """Based's axis: exact attention keeps every key and value, a window only its own, a
    linear map a fixed state; a non-causal map what a new query would need (Linformer's
    projected keys and values, Nystrom's landmarks and their product with the values)."""
    D = 16
    exact, window = variants.build("sdpa"), variants.build("sliding_window", window=8)
    linear, perf = variants.build("linear"), variants.build("performer", num_features=32)
    assert exact.state_size(512, D) == 4 * exact.state_size(128, D) == 2 * 512 * D
    assert window.state_size(4096, D) == window.state_size(64, D) == 2 * 9 * D
    assert window.state_size(4, D) == 2 * 4 * D  # shorter than the window: what is there
    assert linear.state_size(64, D) == linear.state_size(8192, D) == D * D + D
    assert perf.state_size(64, D) == 32 * D + 32
    assert variants.build("linformer").state_size(64, D) == 2 * 64 * D  # E K, F V; k <= N
    assert variants.build("linformer").state_size(4096, D) == 2 * 256 * D
    assert variants.build("nystrom").state_size(64, D) == 2 * 64 * D  # landmarks, A^+ S V
    assert variants.build("gated_deltanet").state_size(8192, D) == D * D



def _reach(variant, params, causal=True, layers=1, N=64):
    import json

    from harness.train.matrix import TrainConfig
    from harness.train.runner import reach

    c = TrainConfig("mqar", json.dumps({"num_kv_pairs": 8, "power_a": 0.01,
                                        "random_non_queries": False}, sort_keys=True),
                    variant, json.dumps(params), N, 64, causal, 32, layers, 2, False, (1e-3,),
                    8, 10, 0.1, 0.1, 5, 0.99, 50, 200, 0, "cpu", 1, 10.0, 0)
    return reach(c, variants.build(variant, **params))


def test_reach_is_the_share_of_answers_a_pattern_can_see():
    """Independent of the pattern code: a one-layer window model can read an answer d
    positions back iff d <= window + 1 (the position after the answer carries it, with its
    key, through the kernel-3 convolution)."""
    from harness.train.tasks import mqar

    x, y = mqar(200, 64, 64, 8, seed=1)  # the held-out set of seed 0
    dist = []
    for row, lab in zip(x.tolist(), y.tolist()):
        first = {}
        for i, t in enumerate(row):
            first.setdefault(t, i)
        dist += [i - first[row[i]] - 1 for i, label in enumerate(lab) if label != -100]
    for w in (0, 4, 16):
        share = sum(d <= w + 1 for d in dist) / len(dist)
        assert _reach("sliding_window", {"window": w}) == pytest.approx(share)
    assert _reach("sliding_window", {"window": 64}) == 1.0
    assert _reach("sliding_window", {"window": 4}, causal=False) == _reach(
        "sliding_window", {"window": 4})  # answers are never ahead of their query
    assert _reach("sdpa", {}) is None and _reach("linear", {}) is None
    assert _reach("sliding_window", {"window": 4}, layers=2) is None


def _mixer_call(name, d_model=32, heads=2, N=12):
    """One block of a recall model around `name`: what its mixer was called with (q, k, v
    and the inputs), the unscaled v of the block's own projection, and the normed hidden
    state x the gate layers read."""
    torch.manual_seed(0)
    model = RecallModel(name, {}, vocab_size=40, d_model=d_model, layers=1, heads=heads,
                        causal=True, mlp=False)
    block, seen = model.blocks[0], {}
    unchecked = block.mixer.unchecked

    def spy(*args, **kwargs):  # the block calls the mixer's unchecked method (after its check)
        seen.update(args=args, kwargs=kwargs)
        return unchecked(*args, **kwargs)

    block.mixer.unchecked = spy
    block.qkv.register_forward_hook(lambda mod, args, out: seen.update(x=args[0], qkv=out))
    with torch.no_grad():
        model(torch.randint(0, 40, (2, N), generator=torch.Generator().manual_seed(1)))
    B, d = 2, d_model
    v = seen["qkv"][..., 2 * d:].view(B, N, heads, d // heads).transpose(1, 2)  # unscaled
    return block, seen["args"], seen["kwargs"], v, seen["x"]


def test_the_mamba2_layer_writes_v_scaled_by_its_dt():
    """SSD writes dt_t B_t^T x_t (mamba_ssm's ssd_minimal_discrete(X * dt, A * dt, B, C)):
    the mixer's v is the projection's v times the same dt, dt = softplus(W x + dt_bias),
    that makes the decay g = -exp(A_log) dt. Gated DeltaNet's gate scales nothing."""
    block, args, kwargs, v, x = _mixer_call("mamba2")
    layer = block.inputs["g"]
    dt = F.softplus(x @ layer.proj.weight.T + layer.dt_bias).transpose(1, 2)  # (B, H, N)
    torch.testing.assert_close(kwargs["g"], -layer.A_log.exp()[:, None] * dt)
    torch.testing.assert_close(args[2], v * dt[..., None])
    assert not torch.allclose(args[2], v)
    _, args, _, v, _ = _mixer_call("gated_deltanet")
    torch.testing.assert_close(args[2], v)


def test_the_mixer_gets_the_projections_thirds_split_into_heads_and_contiguous():
    """q, k, v are the first, second and last third of W_qkv x, channel c of a third in
    head c // (d / H) at position c % (d / H), each (B, H, N, d / H) and contiguous: the
    recurrences' products ran slower on the strided views of the projection (a copy
    before each bmm, forward and backward). Planted: a permute that takes heads for the
    three thirds, or the views without the copy, fail."""
    d, H, N = 32, 2, 12
    block, args, _, _, x = _mixer_call("deltanet", d_model=d, heads=H, N=N)
    W = block.qkv.weight  # (3 d, d)
    for i, t in enumerate(args[:3]):
        assert t.is_contiguous(), ("q", "k", "v")[i]
        want = (x @ W[i * d:(i + 1) * d].T).view(x.shape[0], N, H, d // H).transpose(1, 2)
        torch.testing.assert_close(t, want)


def _gate_layer(name, d_model=256, heads=64, seed=0):
    torch.manual_seed(seed)
    model = RecallModel(name, {}, vocab_size=40, d_model=d_model, layers=1, heads=heads,
                        causal=True, mlp=False)
    return model.blocks[0].inputs["g"]


def test_each_gate_layers_initial_draw_follows_its_paper():
    """At initialisation, as the papers' layers draw them: Mamba2 (mamba_ssm) A ~ U(1, 16)
    and dt = softplus(dt_bias) log-uniform in [1e-3, 1e-1] per head; Gated DeltaNet (fla)
    A ~ U(0, 16), the same dt; KDA (fla) A ~ U(1, 16) per head and dt per channel; GLA
    (fla) logsigmoid(W2 W1 x + b) / 16 with W1 of rank 16 and b = 0, so about -ln 2 / 16 at
    the start. 64 heads (256 channels): a draw from another range shows in its extremes or
    its log-mean."""
    lo, hi = math.log(1e-3), math.log(1e-1)
    for name, A_lo, per in (("mamba2", 1, 64), ("gated_deltanet", 0, 64), ("kda", 1, 256)):
        layer = _gate_layer(name)
        A = layer.A_log.detach().exp()
        dt = F.softplus(layer.dt_bias.detach())
        assert A.shape == (64,) and dt.shape == (per,), name
        assert bool((A >= A_lo).all() and (A <= 16).all()), name
        assert float(A.min()) < A_lo + 1 and float(A.max()) > 15, name  # fills its range
        assert float(A.mean()) == pytest.approx((A_lo + 16) / 2, abs=1.5), name
        ldt = dt.log()
        assert bool((ldt >= lo - 1e-5).all() and (ldt <= hi + 1e-5).all()), name
        assert float(ldt.mean()) == pytest.approx((lo + hi) / 2, abs=0.6), name  # log-uniform
    gla = _gate_layer("gla", d_model=64, heads=2)
    assert [tuple(p.shape) for p in gla.proj.parameters()] == [(16, 64), (64, 16), (64,)]
    assert float(gla.proj[1].bias.detach().abs().max()) == 0
    g, scale = gla(torch.randn(4, 20, 64))
    assert scale is None and g.shape == (4, 2, 20, 32)
    assert float(g.detach().mean()) == pytest.approx(-math.log(2) / 16, abs=2e-3)


def test_a_block_checks_its_mixers_call_once_per_signature_then_calls_it_unchecked():
    """The gates come from the block's own layers (in range by construction): the block
    runs the mixer's `check_call` on the first call of each signature (a training batch,
    an evaluation batch of another size) and `unchecked` on every call. The variant
    called directly still refuses a gate out of range with its one-line reason."""
    torch.manual_seed(0)
    model = RecallModel("gated_deltanet", {}, vocab_size=40, d_model=32, layers=1, heads=2,
                        causal=True, mlp=False)
    mixer, counts = model.blocks[0].mixer, {"check": 0, "unchecked": 0}
    check, unchecked = mixer.check_call, mixer.unchecked

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return call

    mixer.check_call, mixer.unchecked = counted("check", check), counted("unchecked", unchecked)
    tokens = torch.randint(0, 40, (4, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        model(tokens).sum().backward()
    assert counts == {"check": 1, "unchecked": 3}
    with torch.no_grad():  # another signature: no autograd, another batch
        model(tokens[:2])
        model(tokens[:2])
    assert counts == {"check": 2, "unchecked": 5}
    q = k = v = torch.randn(2, 2, 16, 16)
    g, beta = -torch.rand(2, 2, 16), torch.rand(2, 2, 16) * 0.5 + 0.25
    mixer(q, k, v, True, g=g, beta=beta)
    with pytest.raises(ValueError, match="input 'g' must lie in <= 0"):
        mixer(q, k, v, True, g=-g, beta=beta)
