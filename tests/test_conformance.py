"""The conformance kit (harness.check, the one `attnbench check` runs) over every
registered variant, with no edit here when one is added.

Each property builds the variant with its defaults, asks it first whether it can run the
case (`unsupported_reasons`) and, where it cannot, checks that `forward` refuses with that
reason instead of computing something else (n/a: passed); a reason naming something this
machine lacks (a package, CUDA, a compiler) skips. tests/test_check.py plants a bug for
each property and watches it fail.
"""

import pytest
import torch

import variants
from harness.check import decoding, groupings, kit, properties

NAMES = variants.names()


def holds(fn, name, *args):
    r = kit.run_property(fn, name, *args)
    if r.status == "skip":
        pytest.skip(f"this machine lacks what it needs: {r.detail}")
    assert r.status in ("pass", "n/a"), r.line()


@pytest.mark.parametrize("prop", [properties.spec, properties.shapes, properties.gradients,
                                  properties.batch_heads, properties.causal,
                                  properties.determinism, properties.flops,
                                  decoding.decoding, decoding.state_size,
                                  groupings.groupings],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("name", NAMES)
def test_property_holds(name, prop):
    holds(prop, name)


EXACT_NAMES = [n for n in NAMES if variants.spec(n).exact or variants.spec(n).pattern_exact]
# Variants that compile (seconds per new kernel) get two ragged multi-block lengths, in
# the generic properties' B, H, D (their kernels are reused; a length within one block, or
# batch 1, would compile a kernel of its own: dynamo specialises sizes 0 and 1): the
# same checks, fewer compiles.
EXACT_CASES = [(n, N, (1, 2, 32)) for n in EXACT_NAMES if not variants.spec(n).contract.compiled
               for N in (1, 63, 100, 1000)]
EXACT_CASES += [(n, N, (3, 3, 16)) for n in EXACT_NAMES if variants.spec(n).contract.compiled
                for N in (200, 1000)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name,N,shape", EXACT_CASES)
def test_exact_variants_match_the_float64_reference(name, N, shape, causal, dtype):
    """Flash-attention's rule: error at most twice the plain path's in the same dtype."""
    holds(properties.exact_case, name, N, shape, causal, dtype)


@pytest.mark.parametrize("name", [n for n in NAMES if variants.spec(n).err_ref != "softmax"])
def test_recurrences_match_their_float64_form(name):
    holds(properties.recurrence_case, name)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_weights_times_v_is_the_output(name, causal):
    """A map cannot lie: weights(q, k) @ v equals forward(q, k, v), causal and not; causal
    maps put no weight on the future; above the size limit every variant refuses."""
    holds(decoding.weights_case, name, causal)


def test_the_kit_runs_every_property():
    """`attnbench check` runs exactly the properties above (exactness: exact_case and
    recurrence_case; weights: weights_case)."""
    assert [f.__name__ for f in properties.ALL] == [
        "spec", "shapes", "gradients", "batch_heads", "causal", "determinism", "flops",
        "exactness", "weights", "decoding", "state_size", "groupings"]
