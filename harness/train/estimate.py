"""The dry-run's predicted cost of a training configuration, in seconds (`train --dry-run`
prints the sum; shards balance on it).

An upper bound on purpose: every learning rate runs to max_steps (early stopping ends most
runs sooner), each step costing its analytic FLOPs (forward: the projections, the short
convolution, the MLP, the variant's own `flops`, the head at the scored positions;
backward: twice the forward) at EFFICIENCY of the measured fp32 matmul rate, plus
STEP_OVERHEAD_S of Python and optimiser per step; each held-out evaluation a forward over
the held-out set; each configuration WORKER_S to start its data and model. Declared skips
cost nothing. CUDA configurations use harness.measure.estimate's assumed GPU rate.
"""

from __future__ import annotations

from harness.measure.estimate import GPU_ASSUMED_GFLOPS
from harness.measure.rows import NO_CUDA
from harness.train.matrix import TrainConfig

# The share of the matmul rate a tiny model's step reaches, and the fixed cost per step
# (autograd, AdamW, the Python loop). Measured on this 2-core machine, one thread, d = 64,
# batch 64, N = 64..256, against the matmul rate measured in the same process: sdpa and
# linear steps ran at 0.31-0.36 of it, performer 0.40-0.56, block_sparse and
# sliding_window 0.18-0.29. Checked again at two layers (train-cpu's model: d = 64, batch
# 32, N = 64 and 128, on a shared machine, so rough): sdpa and block_sparse took 1.0-1.1x
# the predicted step, sliding_window, mamba2, gla and moba 1.2-1.6x, the chunked delta
# rules and KDA at head dimension 16-32 2.2-2.5x (many small matmuls); a model of width 128
# took 0.7x. So the bound holds on the number of steps, not on each step's cost: a sweep
# of slow variants that never stops early can outrun it, and a preset keeps headroom.
EFFICIENCY = 0.25
STEP_OVERHEAD_S = 0.002
WORKER_S = 3.0  # start a worker process, import torch, generate the data


def forward_flops(config: TrainConfig, module, batch: int) -> float:
    """Analytic FLOPs of one forward of `batch` examples (2 per multiply-add)."""
    d, N, L = config.d_model, config.seq_len, config.layers
    tokens = batch * N
    per_token = 8 * d * d + 2 * 3 * d + (16 * d * d if config.mlp else 0)  # qkv+out, conv, mlp
    attention = module.flops(batch, config.heads, N, config.head_dim, config.causal)
    scored = batch * config.task_param_dict.get("num_kv_pairs", N)  # the head's rows
    return L * (tokens * per_token + attention) + scored * 2 * d * config.vocab_size


def plan_seconds(configs: list[TrainConfig], rate_flops_per_s: float,
                 skip_reasons) -> list[tuple[TrainConfig, float, list[str]]]:
    """(config, predicted seconds, declared skips) per configuration, as `--dry-run` sums
    them: a configuration declared unsupported costs nothing (CUDA missing here aside, so a
    GPU preset is planned on a CPU machine). `skip_reasons(config, module)` is the
    runner's."""
    import variants

    out = []
    for c in configs:
        module = variants.build(c.variant, **c.param_dict)
        why = [r for r in skip_reasons(c, module) if r != NO_CUDA]
        out.append((c, 0.0 if why else config_seconds(c, module, rate_flops_per_s), why))
    return out


def config_seconds(config: TrainConfig, module, rate_flops_per_s: float) -> float:
    """Predicted wall time of a configuration's whole sweep (every rate to max_steps)."""
    rate = GPU_ASSUMED_GFLOPS * 1e9 if config.device == "cuda" else rate_flops_per_s
    rate *= EFFICIENCY
    step = 3 * forward_flops(config, module, config.batch) / rate + STEP_OVERHEAD_S
    evals = -(-config.max_steps // config.eval_every)
    evaluation = forward_flops(config, module, config.test_examples) / rate
    per_lr = min(config.max_steps * step + evals * evaluation, config.timeout_s)
    return WORKER_S + len(config.lrs) * per_lr
