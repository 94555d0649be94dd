"""The papers' output layers in the recall model's block, and the decay parameters kept out
of weight decay (issue 49, item 5).

Each layer is checked against a plain float64 form written here from the papers and fla's
layers (PAPER below), on the block's own mixer output o, its normed hidden state x and
the layer's parameters (norm weights drawn at random, so that they count).

Planted bugs: a layer without its norm, or without its gate, or with the gate after the
norm in Mamba2 (or before it elsewhere), or one norm over all heads instead of one per
head, or a GroupNorm where RMSNorm belongs (or the reverse), or a swish gate where KDA's is
a sigmoid: the layer test. A gate made from the residual h instead of the normed x: the
layer test. A new recurrence that declares no output layer: the declaration test. An
`output_layer = "none"` block that differs in any way from the block before the layers
(a norm left in, another order of parameters, and so another initial draw): the pinned
test. AdamW decaying A_log or dt_bias, or the trainer building AdamW on
`model.parameters()`: the weight-decay tests. output_layer in the id of a default
configuration (the committed folders' ids change), or missing from a "none" one (its rows
mixed with the paper's): the id tests.
"""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import variants
from harness.errors import UsageError
from harness.train import matrix as tm
from harness.train.matrix import TrainConfig
from harness.train.model import RecallModel
from harness.train.trainer import Run, build_model

EPS = 1e-5  # fla's and mamba_ssm's norm_eps
ROOT = Path(__file__).resolve().parent.parent

# The paper's layer after each mixer: (norm per head, output gate, gate before the norm).
PAPER = {
    "retention": ("group", "swish", False),  # RetNet: swish(X W_G) * GroupNorm_h(Y)
    "gla": ("rms", "swish", False),  # fla GatedLinearAttention: g_norm_swish_gate
    "mamba2": ("rms", "swish", True),  # mamba_ssm RMSNormGated(norm_before_gate=False)
    "deltanet": ("rms", None, False),  # fla DeltaNet, use_gate=False
    "gated_deltanet": ("rms", "swish", False),  # fla GatedDeltaNet, use_gate=True
    "kda": ("rms", "sigmoid", False),  # fla KimiDeltaAttention: o_norm, sigmoid, low rank
    "linear": ("rms", None, False),  # fla LinearAttention, output_norm="rmsnorm"
    "performer": ("rms", None, False),
}


def _model(name, output_layer="paper", d_model=16, heads=2, vocab=24):
    torch.manual_seed(0)
    return RecallModel(name, {}, vocab_size=vocab, d_model=d_model, layers=1, heads=heads,
                       causal=True, mlp=False, output_layer=output_layer)


def _run_block(model, N=10):
    """One forward of a one-block model: the mixer's output o (B, H, N, dh), the normed
    hidden state x (the q, k, v projection's input), the output projection's input, the
    logits."""
    block, seen = model.blocks[0], {}
    unchecked = block.mixer.unchecked

    def spy(*args, **kwargs):
        seen["o"] = unchecked(*args, **kwargs)
        return seen["o"]

    block.mixer.unchecked = spy
    block.qkv.register_forward_hook(lambda mod, args, out: seen.update(x=args[0]))
    block.out_proj.register_forward_hook(lambda mod, args, out: seen.update(merged=args[0]))
    tokens = torch.randint(0, 24, (2, N), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(tokens)
    return seen["o"], seen["x"], seen["merged"], logits


def _rms(t, w):
    return t * torch.rsqrt(t.square().mean(-1, keepdim=True) + EPS) * w


def _group(t, w, b):  # each head's vector standardised, then a weight and bias per channel
    mean, var = t.mean(-1, keepdim=True), t.var(-1, unbiased=False, keepdim=True)
    return (t - mean) * torch.rsqrt(var + EPS) * w + b


@pytest.mark.parametrize("name", sorted(PAPER))
def test_each_output_layer_is_its_papers_norm_and_gate_on_each_head(name):
    norm_kind, gate_kind, gate_first = PAPER[name]
    model = _model(name)
    layer = model.blocks[0].output
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # weights and biases away from 1 and 0, so that they count
        for p in layer.norm.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
        if gate_kind == "sigmoid":
            layer.gate[1].bias.copy_(torch.randn(layer.gate[1].bias.shape, generator=g))
    o, x, merged, _ = _run_block(model)
    B, H, N, dh = o.shape
    o, x = o.double().transpose(1, 2), x.double()  # (B, N, H, dh), (B, N, d)
    w = layer.norm.weight.double().view(H, dh) if norm_kind == "group" \
        else layer.norm.weight.double()
    if gate_kind == "swish":
        gate = F.silu(x @ layer.gate.weight.double().T).view(B, N, H, dh)
    elif gate_kind == "sigmoid":  # low rank, d -> dh -> d, a bias on the second
        W1, W2, b2 = (p.double() for p in (layer.gate[0].weight, layer.gate[1].weight,
                                           layer.gate[1].bias))
        assert W1.shape == (dh, H * dh)
        gate = torch.sigmoid(x @ W1.T @ W2.T + b2).view(B, N, H, dh)
    else:
        assert layer.gate is None
        gate = torch.ones_like(o)
    if gate_first:
        want = _rms(o * gate, w)
    elif norm_kind == "group":
        want = _group(o, w, layer.norm.bias.double().view(H, dh)) * gate
    else:
        want = _rms(o, w) * gate
    torch.testing.assert_close(merged.double(), want.reshape(B, N, H * dh), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["deltanet", "linear"])
def test_without_a_gate_each_heads_output_has_unit_rms(name):
    """At initialisation (norm weight 1) the output projection reads, per head and
    token, a vector of root mean square 1 (just under it: the norm's eps), whatever the
    mixer's own scale."""
    o, _, merged, _ = _run_block(_model(name, d_model=32, heads=4))
    rms = merged.view(*merged.shape[:2], 4, 8).square().mean(-1).sqrt()
    assert bool((rms <= 1 + 1e-6).all() and (rms > 0.95).all())
    assert float(o.square().mean().sqrt()) < 0.7  # the mixer's own is not


def test_every_recurrence_and_linear_map_declares_an_output_layer_and_softmax_none():
    """The registry says which layer a mixer gets (`output_layer`, declared on the variant):
    every recurrence and kernel linear map has one, fla's kernels the same as ours; softmax
    attention has none (the papers' transformer block has no norm after attention)."""
    for name in variants.names():
        family = variants.spec(name).family
        declared = variants.spec(name).contract.output_layer
        if family in ("recurrent", "linear"):
            assert declared, name
        else:
            assert not declared, name
    fla, ours = variants.spec("gla_fla").contract, variants.spec("gla").contract
    assert fla.output_layer == ours.output_layer
    assert _model("sdpa").blocks[0].output is None


# Measured on the block before the output layers (commit 71ba4d4, the model above, tokens
# of seed 3): parameters, then (mean square, linspace-weighted sum) of the output
# projection's input and of the logits. sdpa: the same with output_layer = "paper".
BEFORE = {
    "retention": (1536, 3.5056943, -1.4330726, 0.0062085554, 0.63989252),
    "gla": (2064, 8.5357326, -26.228462, 0.0063077754, 2.0546907),
    "mamba2": (1572, 0.0056204224, -0.16447928, 0.0094203106, -0.76000021),
    "deltanet": (1570, 0.018037029, 0.56577458, 0.0086026839, 0.50732269),
    "gated_deltanet": (1606, 0.0051211741, -0.68489335, 0.0095882362, -0.12917029),
    "kda": (1844, 0.0094312777, 0.2956109, 0.0086134853, -0.61628537),
    "linear": (1536, 0.25550431, -13.102582, 0.0075004275, 1.1552397),
    "sdpa": (1536, 0.2937048, -14.863069, 0.0078607879, 1.8588313),
}


def _pin(t):
    t = t.double()
    w = torch.linspace(-1, 1, t.numel(), dtype=torch.float64).view_as(t)
    return float(t.square().mean()), float((t * w).sum())


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_output_layer_none_is_the_block_from_before(name):
    model = _model(name, "paper" if name == "sdpa" else "none")
    assert model.blocks[0].output is None
    _, _, merged, logits = _run_block(model)
    got = (model.n_params(), *_pin(merged), *_pin(logits))
    assert got[0] == BEFORE[name][0]
    assert got[1:] == pytest.approx(BEFORE[name][1:], rel=1e-4)


def test_decay_parameters_are_outside_weight_decay_and_every_matrix_inside():
    model = RecallModel("mamba2+gated_deltanet+kda+gla", {}, vocab_size=24, d_model=16,
                        layers=4, heads=2, causal=True, mlp=True)
    decay, keep = model.param_groups(0.1)
    assert decay["weight_decay"] == 0.1 and keep["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    kept = sorted(names[id(p)] for p in keep["params"])
    assert kept == sorted(n for n in names.values() if n.endswith(("A_log", "dt_bias")))
    assert len(kept) == 6  # A_log and dt_bias of mamba2, gated_deltanet and kda
    decayed = {id(p) for p in decay["params"]}
    assert all(id(p) in decayed for p in model.parameters() if p.dim() >= 2)
    assert len(decayed) + len(kept) == len(names)


def _config(variant, output_layer="paper", **kw):
    base = dict(task="mqar", task_params=json.dumps(
        {"num_kv_pairs": 2, "power_a": 0.01, "random_non_queries": False}, sort_keys=True),
        variant=variant, params="{}", seq_len=16, vocab_size=16, causal=True, d_model=16,
        layers=1, heads=2, mlp=False, lrs=(1e-2,), batch=8, max_steps=20, warmup=0.1,
        weight_decay=0.1, eval_every=5, early_stop=0.99, train_examples=64, test_examples=40,
        seed=0, device="cpu", threads=1, timeout_s=60.0, mem_limit_mib=0,
        output_layer=output_layer)
    return TrainConfig(**{**base, **kw})


def test_the_trainers_adamw_decays_the_weights_and_not_the_decay_parameters():
    """One AdamW step with zero gradients moves a parameter only by its weight decay."""
    run = Run(_config("gated_deltanet"), 1e-2)
    before = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    for p in run.model.parameters():
        p.grad = torch.zeros_like(p)
    run.opt.step()
    lr = run.opt.param_groups[0]["lr"]
    for n, p in run.model.named_parameters():
        if n.endswith(("A_log", "dt_bias")):
            assert torch.equal(p, before[n]), n
        elif p.dim() >= 2:
            torch.testing.assert_close(p.detach(), before[n] * (1 - lr * 0.1))


def test_the_trainer_builds_the_matrixs_output_layer():
    assert build_model(_config("gla")).blocks[0].output is not None
    assert build_model(_config("gla", "none")).blocks[0].output is None


def _old_id(config, fields):  # the hash as it was before output_layer
    key = {f: getattr(config, f) for f in fields}
    return hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def test_output_layer_is_in_the_ids_only_when_not_the_bare_block():
    """The bare block ("none", what every folder before the key trained) keeps the old
    ids; the papers' layers get ids of their own, so an old row is never taken for one."""
    paper, none = _config("gla"), _config("gla", "none")
    assert none.config_id == _old_id(none, tm.KEY_FIELDS)
    assert none.cell_id == _old_id(none, tm.CELL_FIELDS)
    assert paper.config_id != none.config_id and paper.cell_id != none.cell_id
    assert TrainConfig.from_json(paper.to_json()).config_id == paper.config_id
    stored = {k: v for k, v in paper.to_json().items() if k != "output_layer"}
    assert TrainConfig.from_json(stored).output_layer == "none"  # a config from before


@pytest.mark.parametrize("folder", ["train-cpu", "train-cpu-v4", "train-cpu-v5", "hybrid-cpu",
                                    "mad-cpu"])
def test_committed_folders_keep_their_config_ids(folder):
    path = ROOT / "results" / folder
    meta = json.loads((path / "train_meta.json").read_text())
    ids = {c.config_id for c in tm.expand(meta["matrix"])}
    with open(path / "train.csv", newline="") as f:
        rows = [r["config_id"] for r in csv.DictReader(f)]
    assert rows and set(rows) <= ids


def test_the_matrix_key_takes_paper_or_none_and_refuses_anything_else():
    [default] = tm.expand(tm.normalise({"variants": ["gla"]}))
    assert default.output_layer == "paper"
    [none] = tm.expand(tm.normalise({"variants": ["gla"], "output_layer": "none"}))
    assert none.output_layer == "none"
    with pytest.raises(UsageError, match="output_layer must be one of paper, none, got 'rms'"):
        tm.normalise({"output_layer": "rms"})
