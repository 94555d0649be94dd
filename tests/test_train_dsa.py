"""DSA's lightning indexer in the trained model (DeepSeek-V3.2, arXiv:2512.02556, Sec.
2.1.1, the sparse training stage): its layers read the block's normed hidden state
detached and learn only from the KL toward the main attention's summed distribution over
the selected keys, which the trainer adds to the cross-entropy.

Planted bugs: the indexer's layers reading x without detach (the KL reaches the
embedding, the convolution and the norm), or the target computed from q, k with autograd
(the KL reaches the q, k, v projection) (the gradient test); the KL taken the other way,
KL(softmax(I) || p) (the float64 reference); the trainer leaving the KL out of the step's
loss (the training test: the indexer never learns).
"""

from __future__ import annotations

import json
import math

import torch
import torch.nn.functional as F

import variants
from harness.train import tasks
from harness.train.matrix import TrainConfig
from harness.train.model import RecallModel
from harness.train.trainer import Run
from variants.learned_sparse.dsa import indexer_kl

LIGHTNING = {"indexer": "lightning", "index_heads": 4, "index_dim": 16, "top_k": 4}
MQAR4 = json.dumps({"num_kv_pairs": 4, "power_a": 0.01, "random_non_queries": False},
                   sort_keys=True)


def _model(layers=2):
    torch.manual_seed(0)
    return RecallModel("dsa", LIGHTNING, vocab_size=32, d_model=32, layers=layers, heads=2,
                       causal=True, mlp=True)


def _grads(model) -> set[str]:
    return {n for n, p in model.named_parameters()
            if p.grad is not None and bool((p.grad != 0).any())}  # NaN counts


def test_the_indexer_learns_from_its_kl_alone_and_the_kl_reaches_nothing_else():
    model = _model()
    model.train()
    x = torch.randint(0, 32, (4, 32), generator=torch.Generator().manual_seed(1))
    ce = F.cross_entropy(model(x).flatten(0, 1), x.roll(-1, 1).flatten())
    kl = model.aux_loss()
    assert kl is not None and float(kl.detach()) > 0 and model.aux_loss() is None  # taken, cleared
    indexer = {n for n, _ in model.named_parameters() if ".inputs.index_" in n}
    assert len(indexer) == 2 * 5  # W_q, W_k, its LayerNorm's two, W_w; a layer each
    ce.backward(retain_graph=True)
    from_ce = _grads(model)
    assert not from_ce & indexer
    assert {"blocks.0.qkv.weight", "blocks.1.qkv.weight", "embedding.weight"} <= from_ce
    model.zero_grad(set_to_none=True)
    kl.backward()
    assert _grads(model) == indexer  # every indexer parameter, nothing else
    assert all(bool(p.grad.isfinite().all()) for n, p in model.named_parameters() if n in indexer)


def test_no_kl_is_made_out_of_training():
    model = _model()
    x = torch.randint(0, 32, (2, 32), generator=torch.Generator().manual_seed(1))
    model.eval()
    model(x)
    assert model.aux_loss() is None
    model.train()
    with torch.no_grad():
        model(x)
    assert model.aux_loss() is None


def _reference(q, k, index_q, index_k, index_w, top_k):
    """The selection and the KL by a loop over queries, float64: dense indexer scores, the
    top_k by (score, position), each head's softmax over them, summed, normalised."""
    B, H, N, D = q.shape
    r = H // k.shape[1]
    total = 0.0
    for b in range(B):
        for t in range(N):
            score = [sum(float(index_w[b, j, t]) * max(float(index_q[b, j, t] @ index_k[b, 0, s]),
                                                       0.0)
                         for j in range(index_q.shape[1])) for s in range(t + 1)]
            chosen = sorted(range(t + 1), key=lambda s: (score[s], s), reverse=True)[:top_k]
            p = [0.0] * len(chosen)
            for h in range(H):
                logits = [float(q[b, h, t] @ k[b, h // r, s]) / math.sqrt(D) for s in chosen]
                m = max(logits)
                z = sum(math.exp(v - m) for v in logits)
                for i, v in enumerate(logits):
                    p[i] += math.exp(v - m) / z
            p = [v / sum(p) for v in p]
            m = max(score[s] for s in chosen)
            lz = m + math.log(sum(math.exp(score[s] - m) for s in chosen))
            total += sum(pi * (math.log(pi) - (score[s] - lz))
                         for pi, s in zip(p, chosen) if pi > 0)
    return total / (B * N)


def test_the_kl_is_the_papers_over_the_selected_keys_float64():
    g = torch.Generator().manual_seed(5)
    B, H, N, D, hi, di, top_k = 1, 2, 12, 8, 2, 4, 4
    for Hk in (2, 1):  # a key-value head each, and one shared (DSA's MQA form)
        q = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
        k = torch.randn(B, Hk, N, D, generator=g, dtype=torch.float64)
        v = torch.randn(B, Hk, N, D, generator=g, dtype=torch.float64)
        inputs = {"index_q": torch.randn(B, hi, N, di, generator=g, dtype=torch.float64),
                  "index_k": torch.randn(B, 1, N, di, generator=g, dtype=torch.float64),
                  "index_w": torch.randn(B, hi, N, generator=g, dtype=torch.float64)}
        dsa = variants.build("dsa", indexer="lightning", index_heads=hi, index_dim=di,
                             top_k=top_k)
        want = _reference(q, k, *inputs.values(), top_k)
        o, kl = dsa.unchecked_with_loss(q, k, v, True, **inputs)
        assert kl.dtype == torch.float64 and abs(float(kl) - want) <= 1e-10 * max(want, 1)
        torch.testing.assert_close(o, dsa(q, k, v, causal=True, **inputs))
        sel = dsa.select(q, k, **inputs)
        assert abs(float(indexer_kl(q, k, sel, **inputs)) - want) <= 1e-10 * max(want, 1)
        assert want > 0.05  # the random indexer is far from the attention: a test of size


def _config(steps: int) -> TrainConfig:
    return TrainConfig("mqar", MQAR4, "dsa", json.dumps(LIGHTNING, sort_keys=True), 32, 32,
                       True, 32, 2, 2, True, (3e-3,), 16, steps, 0, 0.1, 1000, 1.0, 256, 32,
                       0, "cpu", 1, 60.0, 0, (0,), 1000, 0.02, 0)


def _kl(model, x) -> float:
    model.train()
    model(x)
    return float(model.aux_loss().detach())


def test_training_steps_lower_the_indexers_kl_on_mqar():
    x = tasks.split("mqar", 64, 32, seed=7, test_seed=7, seq_len=32, vocab_size=32,
                    **json.loads(MQAR4))[0][0]
    run = Run(_config(60), 3e-3)
    before = _kl(run.model, x)
    run.advance(60)
    after = _kl(run.model, x)
    assert run.stopped is None or run.stopped == "cap", run.failure
    assert after < 0.5 * before, (before, after)
