"""One training run: a configuration at one learning rate, from data to held-out accuracy.

AdamW (weight decay as configured, applied to every parameter as Zoology does), a linear
warm-up over `warmup` x max_steps steps then cosine decay to 0 at max_steps, batches drawn
in shuffled epochs of a fixed training set, the held-out set scored every `eval_every` steps
and at the end; the run stops early once held-out accuracy reaches `early_stop`.
Accuracy is the share of scored positions (labels != -100) whose arg-max prediction is the
label. Everything random comes from the configuration's seed: the training set from
2 seed, the held-out set from 2 seed + 1 with any example also in the training set
replaced by a further draw (tasks.split: the two are disjoint), the initial weights and
the batch order from seed. On the same threads, the same configuration and rate give
the same numbers.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.nn.functional as F

from harness.train import tasks
from harness.train.matrix import TrainConfig
from harness.train.model import RecallModel

EVAL_BATCH = 256
# `rising`: the last held-out evaluation beats every evaluation before the last two by more
# than this: one point of accuracy, about the binomial standard error of one evaluation of
# 500 held-out examples of 8 queries near 0.5 (0.008; 0.006 with 16 queries).
RISE_MARGIN = 0.01
_DATA: dict[tuple, tuple] = {}  # one worker trains every rate of a configuration on one set


def datasets(config: TrainConfig) -> tuple[tuple[torch.Tensor, torch.Tensor],
                                          tuple[torch.Tensor, torch.Tensor]]:
    """((train inputs, labels), (held-out inputs, labels)) of a configuration, cached."""
    key = (config.task, config.task_params, config.seq_len, config.vocab_size,
           config.train_examples, config.test_examples, config.seed)
    if key not in _DATA:
        _DATA.clear()
        _DATA[key] = tasks.split(config.task, config.train_examples, config.test_examples,
                                 seed=config.seed, seq_len=config.seq_len,
                                 vocab_size=config.vocab_size, **config.task_param_dict)
    return _DATA[key]


def build_model(config: TrainConfig) -> RecallModel:
    torch.manual_seed(config.seed)
    return RecallModel(config.variant, config.param_dict, vocab_size=config.vocab_size,
                       d_model=config.d_model, layers=config.layers, heads=config.heads,
                       causal=config.causal, mlp=config.mlp)


def schedule(step: int, max_steps: int, warmup: float) -> float:
    """The learning-rate factor at `step` (0-based): linear warm-up, then cosine to 0."""
    warm = int(round(warmup * max_steps))
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(max_steps - warm, 1)))


@torch.no_grad()
def accuracy(model: RecallModel, inputs: torch.Tensor, labels: torch.Tensor,
             device: torch.device) -> float:
    """Share of the scored positions predicted right (arg-max over the vocabulary)."""
    was = model.training
    model.eval()
    right = total = 0
    for s in range(0, len(inputs), EVAL_BATCH):
        x, y = inputs[s:s + EVAL_BATCH].to(device), labels[s:s + EVAL_BATCH].to(device)
        where = y != tasks.IGNORE
        right += int((model(x, where).argmax(-1) == y[where]).sum())
        total += int(where.sum())
    model.train(was)
    return right / max(total, 1)


def still_rising(history: list, early_stop: float, margin: float = RISE_MARGIN) -> bool | None:
    """Whether a run was still learning when its step budget ran out: it did not stop
    early (its last evaluation is below `early_stop`) and its last held-out accuracy beats
    the best of the evaluations before its last two by more than `margin`. So a run that
    climbs over the last two evaluations (eval_every x 2 steps) counts, and one whose last
    evaluation merely matches an earlier peak, or wobbles by noise, does not. None with
    fewer than three evaluations (nothing to compare against)."""
    accs = [a for _, a in history]
    if len(accs) < 3:
        return None
    if accs[-1] >= early_stop:
        return False
    return accs[-1] > max(accs[:-2]) + margin


def train(config: TrainConfig, lr: float) -> dict:
    """Train one model at one learning rate; returns the result fields of that run.

    status "ok" with: accuracy (best held-out), steps and time_to_best_s (when the best was
    reached), steps_to_0_9 (first evaluation at >= 0.9, else None), step_ms (median time of
    a training step: forward, backward, optimiser), final_loss (mean training loss since the
    previous evaluation), train_s (the run's wall time), steps_run, n_params, history
    [[step, accuracy], ...], rising (still_rising of that history). status "nonfinite" when
    the training loss turns NaN or Inf.
    """
    torch.set_num_threads(config.threads)
    device = torch.device(config.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    (train_x, train_y), (test_x, test_y) = datasets(config)
    train_x, train_y = train_x.to(device), train_y.to(device)  # once, not per step
    model = build_model(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=config.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: schedule(s, config.max_steps, config.warmup))
    order = torch.Generator().manual_seed(config.seed)
    perm, at = torch.randperm(len(train_x), generator=order), 0
    best = (-1.0, 0, 0.0)  # accuracy, step, seconds
    to_0_9, history, losses, step_s = None, [], [], []
    start = time.perf_counter()
    step = 0
    for step in range(1, config.max_steps + 1):
        if at + config.batch > len(perm):  # a new epoch, reshuffled
            perm, at = torch.randperm(len(train_x), generator=order), 0
        idx = perm[at:at + config.batch].to(device)
        at += config.batch
        x, y = train_x[idx], train_y[idx]
        sync()
        t0 = time.perf_counter()
        where = y != tasks.IGNORE
        loss = F.cross_entropy(model(x, where), y[where])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        sync()
        step_s.append(time.perf_counter() - t0)
        value = float(loss.detach())
        if not math.isfinite(value):
            return {"status": "nonfinite",
                    "reason": f"training loss is {value} at step {step} (lr={lr:g})",
                    "steps_run": step, "train_s": time.perf_counter() - start}
        losses.append(value)
        if step % config.eval_every == 0 or step == config.max_steps:
            acc = accuracy(model, test_x, test_y, device)
            history.append([step, acc])
            elapsed = time.perf_counter() - start
            if acc > best[0]:
                best = (acc, step, elapsed)
            if to_0_9 is None and acc >= 0.9:
                to_0_9 = step
            final_loss, losses = statistics.fmean(losses), []
            if acc >= config.early_stop:
                break
    return {"status": "ok", "reason": "", "accuracy": best[0], "steps": best[1],
            "time_to_best_s": best[2], "steps_to_0_9": to_0_9,
            "step_ms": 1e3 * statistics.median(step_s), "final_loss": final_loss,
            "train_s": time.perf_counter() - start, "steps_run": step,
            "n_params": model.n_params(), "history": history,
            "rising": still_rising(history, config.early_stop)}
