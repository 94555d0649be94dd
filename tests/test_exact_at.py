"""`exact_at(N, causal)`: where an approximate variant's setting is exact attention.

A setting that covers every (query, key) pair at a length (a window >= N - 1, a block
layout holding every block, one landmark or segment per token) is exact attention under
another name there; the run records it (results.csv `exact`) and the report never offers
it as an approximation. Each claim is checked against the float64 reference, both ways:
True means the output is exact attention, False that it is not.
"""

import pytest
import torch

import variants
from variants import exact_reference

N = 300


def qkv(n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, n, 16, generator=g, dtype=torch.float64) for _ in range(3)]


def rel_err(o, ref):
    return float((o.double() - ref).norm() / ref.norm())


# (variant, params, length, causal, exact_at)
CLAIMS = [
    ("sliding_window", {"window": N - 1}, N, False, True),
    ("sliding_window", {"window": N - 1}, N, True, True),
    ("sliding_window", {"window": N - 2}, N, False, False),
    ("sliding_window_sdpa_mask", {"window": N - 1}, N, False, True),
    ("sliding_window_sdpa_mask", {"window": N - 2}, N, True, False),
    # issue 19: at N = 512 BigBird with 128-token blocks is 4 x 4 blocks, all in the layout
    ("block_sparse", {"block_size": 128}, 512, False, True),
    ("block_sparse", {"block_size": 128}, 512, True, True),
    ("block_sparse", {}, 512, False, False),  # 64-token blocks: 62 of 64 blocks
    ("block_sparse", {"block_size": 32, "window_blocks": 1, "global_blocks": 0,
                      "random_blocks": 0}, N, True, False),
    ("block_sparse_sdpa_mask", {"block_size": 128}, 512, False, True),
    ("block_sparse_sdpa_mask", {}, 512, False, False),
    ("linformer", {"k": N, "projection": "mean_pool"}, N, False, True),
    ("linformer", {"k": N}, N, False, False),  # gaussian projections mix keys at any k
    ("linformer", {"k": N - 1, "projection": "mean_pool"}, N, False, False),
    ("nystrom", {"num_landmarks": N, "pinv_iterations": 0}, N, False, True),
    ("nystrom", {"num_landmarks": N - 1, "pinv_iterations": 0}, N, False, False),
    # every token a landmark, but the pseudo-inverse iterative (6 iterations, the default;
    # 1): it only approaches A^+, so the setting is not exact (rel_err 0.09 and 0.7 here)
    ("nystrom", {"num_landmarks": N}, N, False, False),
    ("nystrom", {"num_landmarks": N, "pinv_iterations": 1}, N, False, False),
    ("linear", {}, N, False, False),
    ("performer", {"num_features": 512}, N, False, False),
    ("scatterbrain", {"window": N - 1}, N, False, True),
    ("scatterbrain", {"window": N - 1}, N, True, True),
    ("scatterbrain", {"window": N - 2}, N, False, False),
    ("longshort", {"window": N - 1}, N, True, True),
    ("longshort", {"window": N - 2, "segment": 16}, N, False, False),
    ("longshort", {"window": 5, "segment": N}, N, False, True),  # one token per segment
    ("longshort", {"window": 5, "segment": N}, N, True, True),
    ("longshort", {"window": 5, "segment": N - 1}, N, True, False),
    # issue 28: a budget of every block, page or key; one short of it is not exact
    ("moba", {"block_size": 64, "top_k": 5}, N, False, True),  # 5 blocks, the last of 44
    ("moba", {"block_size": 64, "top_k": 5}, N, True, True),
    ("moba", {"block_size": 64, "top_k": 4}, N, False, False),
    ("moba", {"block_size": 64, "top_k": 4}, N, True, False),  # the last block's queries
    ("quest", {"page_size": 16, "top_k": 19}, N, True, True),
    ("quest", {"page_size": 16, "top_k": 18}, N, False, False),
    ("topk", {"top_k": N}, N, False, True),
    ("topk", {"top_k": N}, N, True, True),
    ("topk", {"top_k": N - 1}, N, True, False),
]


@pytest.mark.parametrize("name, params, n, causal, claim", CLAIMS)
def test_exact_at_holds_against_the_reference(name, params, n, causal, claim):
    m = variants.build(name, **params)
    assert m.exact_at(n, causal) is claim
    q, k, v = qkv(n)
    with torch.no_grad():
        err = rel_err(m(q, k, v, causal=causal), exact_reference(q, k, v, causal))
    if claim:
        assert err < 1e-9, err
    else:
        assert err > 1e-6, err  # not exact: the claim is not merely conservative


@pytest.mark.parametrize("name", variants.names())
def test_exact_variants_are_exact_at_every_length(name):
    m = variants.build(name)
    spec = variants.spec(name)
    for n in (1, 64, 4096):
        for causal in (False, True):
            assert isinstance(m.exact_at(n, causal), bool)
            if spec.exact:
                assert m.exact_at(n, causal)


def test_implementations_of_one_pattern_agree():
    """Library kernels of a pattern say what our implementation says (no compile needed)."""
    pairs = [("sliding_window", ("sliding_window_flex", "sliding_window_sdpa_mask",
                                 "sliding_window_xformers"), [{"window": w} for w in (1, 7, 8)]),
             ("block_sparse", ("block_sparse_flex", "block_sparse_sdpa_mask"),
              [{"block_size": b} for b in (2, 4, 8)])]
    for ours, libs, settings in pairs:
        for p in settings:
            for n in (8, 9, 16):
                for causal in (False, True):
                    want = variants.build(ours, **p).exact_at(n, causal)
                    for lib in libs:
                        assert variants.build(lib, **p).exact_at(n, causal) == want, (lib, p, n)


def test_the_default_is_the_class_exactness():
    """A variant that does not override exact_at (issue 17's new ones until they do) is
    exact where its class says so, and nowhere else."""
    class Plain(variants.Variant):
        name, family = "_plain", "test"

    assert Plain().exact_at(10) is False
    Plain.contract = variants.Contract(exactness="exact")
    assert Plain().exact_at(10) is True
