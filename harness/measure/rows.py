"""A case's row before anything is measured: its descriptive columns (`case_row`) and the
reasons, known beforehand, that it is `skipped` (`skip_reasons`: declared by the variant,
a missing device, a captured input without the variant's gates). The runner knows no
variant by name: it asks the case's module for each (harness.measure.layers.build: a
variant, or a layer pattern's stack, whose forward passes are skipped with the reason).
"""

from __future__ import annotations

import torch

from harness.models import capture
from harness.measure import layers
from harness.measure.inputs import DISTRIBUTIONS
from harness.measure.matrix import Case

STATUSES = ("ok", "skipped", "oom", "timeout", "error", "nonfinite")
NO_CUDA = "CUDA is not available on this machine"


def case_row(case: Case, module) -> dict:
    """The descriptive columns of a case (everything but the measurements)."""
    shape = case.shape
    flops = module.flops_at(shape, case.causal)
    if case.backward:
        flops *= 3  # backward counted as twice the forward (two matmuls per forward matmul)
    if case.decode:
        flops = None  # the forward's count says nothing of one token's step
    state = module.state_size_at(case.seq_len, shape)
    return {"case_id": case.case_id, "variant": case.variant, "family": module.family,
            "params": case.params, "exact": module.exact_at(case.seq_len, case.causal),
            "err_ref": module.contract.err_ref,
            "device": case.device, "dtype": case.dtype,
            "batch": case.batch, "heads": case.heads, "head_dim": case.head_dim,
            "seq_len": case.seq_len, "causal": case.causal, "pass": case.pass_,
            "input": case.input, "flops": flops, "seed": case.seed, "threads": case.threads,
            "state_size": None if state is None else case.batch * state,
            "decode_tokens": case.decode_tokens if case.decode else None,
            "keys_per_query": module.keys_per_query(case.seq_len, case.causal),
            "kv_heads": case.kv_heads, "value_heads": case.value_heads,
            "value_dim": case.value_dim}


def skip_reasons(case: Case, module) -> list[str]:
    """Reasons, known before running, that a case cannot run here (declared by the variant)."""
    reasons = []
    if case.device == "cuda" and not torch.cuda.is_available():
        reasons.append(NO_CUDA)
    if isinstance(module, layers.Stack) and not case.decode:
        return reasons + [layers.FORWARD_REASON]
    reasons += module.unsupported_reasons(device=case.device, dtype=getattr(torch, case.dtype),
                                          causal=case.causal, seq_len=case.seq_len,
                                          head_dim=case.head_dim, backward=case.backward)
    if case.shape.grouped or case.shape.Dv != case.head_dim:  # a grouping it refuses
        reasons += case.shape.check(module.contract.grouping, case.variant)
    if not isinstance(module, layers.Stack):  # widths its parameters fix (mla's latent)
        reasons += [r for r in module.shape_reasons(case.shape) if r not in reasons]
    if case.decode and module.contract.supports_causal:  # (a non-causal one's reason is above)
        reasons += module.decode_reasons()
        if case.input not in DISTRIBUTIONS:
            reasons.append(f"decode draws its context from a synthetic distribution, chunk by "
                           f"chunk; {case.input} is a captured input")
    if module.contract.inputs and case.input not in DISTRIBUTIONS:  # nothing to draw them from
        reasons.append(f"{case.input} is a captured input without "
                       f"{', '.join(s.name for s in module.contract.inputs)} ({case.variant}'s "
                       "inputs beyond q, k, v: the captured model has no gates)")
    return reasons + capture.skip_reasons(case)
