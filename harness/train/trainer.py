"""One training run: a configuration at one learning rate, from data to test accuracy.

AdamW (weight decay as configured, on every parameter but A_log and dt_bias), the learning
rate of harness.train.schedule (warmup-stable-decay, or an earlier folder's cosine), batches drawn
in shuffled epochs of a fixed training set, the validation set scored every `eval_every`
steps and at the end. A run stops once validation accuracy reaches `early_stop`, or once
it has settled (`settled`: no gain above `settle_margin` in validation accuracy, nor a
relative fall above it in validation loss, over its last `settle_window` steps, in a run
at least twice that long, and its best above its plateau plus the margin), or at
max_steps, the cap; then the test set is scored once, at the weights of its best
validation accuracy (the kept checkpoint). A run can be paused and
resumed (`Run.advance`, the race of learning rates: harness.train.race): its numbers are
those of one uninterrupted run. "Accuracy" below is the task's metric (tasks.Task.metric):
on the `lm` task bits per byte, lower is better, compared as its negative (tasks.score);
an lm run draws fresh windows of its corpus at every step and scores its whole test split
(harness.train.lm). A causal configuration's model is checked for causality before its
first step (check_causal_model). Accuracy is the share of scored positions
(labels != -100) whose arg-max prediction is the label. A step minimises the
cross-entropy plus the model's auxiliary loss (`RecallModel.aux_loss`: dsa's indexer KL,
weight 1); the training loss recorded is the cross-entropy. Everything random comes from
the configuration's seeds: the validation and test sets from the cell's first seed s0, the
training set from this seed s, the three disjoint (tasks.split), the initial weights
and the batch order from s. On the same threads, the same configuration and rate give
the same numbers. ("held-out" below: the validation set.)
"""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
import time

import torch
import torch.nn.functional as F

from harness.train import lm, outcome, tasks, text_windows
from harness.train.schedule import decay_start, is_wsd, schedule, settle_decay  # noqa: F401
from harness.train.matrix import TrainConfig
from harness.train.model import RecallModel

EVAL_BATCH = 256
# `rising`: the last held-out evaluation beats every evaluation before the last two by more
# than this: one point of accuracy, about the binomial standard error of one evaluation of
# 500 held-out examples of 8 queries near 0.5 (0.008; 0.006 with 16 queries).
RISE_MARGIN = 0.01
_DATA: dict[tuple, tuple] = {}  # one worker trains every rate of a configuration on one set


@contextlib.contextmanager
def flushed_denormals():
    """Training with denormal floats flushed to zero (x86's FTZ/DAZ, `torch.set_flush_denormal`)
    on the calling thread, PyTorch's default (off) restored after; torch cannot read the
    mode, so a caller that had set it finds it off.

    A decay's factors exp(b_i - b_j) below 1.2e-38 are denormals in float32, and x86 takes
    a slow path for each operation on one: measured here (tools/step_ratios.py, one
    thread, two runs each way in turn), Mamba2's training step at N = 128 went from
    1.56-1.60x sdpa's to 1.35-1.36x with them flushed, the other mixers the same within
    the noise. The values lost are below float32's smallest normal number, beside a
    chunk's diagonal terms of order one. One thread's mode only: with more threads the
    intra-op pool keeps its own (train-cpu's workers train on one thread each)."""
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def datasets(config: TrainConfig) -> tuple[tasks.Set, tasks.Set, tasks.Set]:
    """The (train, validation, test) sets of a configuration, each (inputs, labels),
    disjoint (tasks.split), cached. The `lm` task's: (its train split's bytes, which
    windows are drawn from at every step, validation, test) (harness.train.lm)."""
    if config.task == lm.TASK:
        return lm.data(config)
    key = (config.task, config.task_params, config.seq_len, config.vocab_size,
           config.train_examples, config.test_examples, config.validation_examples,
           config.seed, config.seeds[0])
    if key not in _DATA:
        _DATA.clear()
        _DATA[key] = tasks.split(config.task, config.train_examples, config.test_examples,
                                 seed=config.seed, test_seed=config.seeds[0],
                                 val_examples=config.validation_examples,
                                 seq_len=config.seq_len, vocab_size=config.vocab_size,
                                 **config.task_param_dict)
    return _DATA[key]


def build_model(config: TrainConfig) -> RecallModel:
    torch.manual_seed(config.seed)
    return RecallModel(config.variant, config.param_dict, vocab_size=config.vocab_size,
                       d_model=config.d_model, layers=config.layers, heads=config.heads,
                       causal=config.causal, mlp=config.mlp, output_layer=config.output_layer)


@torch.no_grad()
def evaluate(model: RecallModel, inputs: torch.Tensor, labels: torch.Tensor,
             device: torch.device) -> tuple[float, float]:
    """(accuracy, loss) on a held-out set: the share of the scored positions predicted
    right (arg-max over the vocabulary), and the mean cross-entropy there."""
    was = model.training
    model.eval()
    right = total = 0
    nll = 0.0
    for s in range(0, len(inputs), EVAL_BATCH):
        x, y = inputs[s:s + EVAL_BATCH].to(device), labels[s:s + EVAL_BATCH].to(device)
        where = y != tasks.IGNORE
        logits = model(x, where)
        right += int((logits.argmax(-1) == y[where]).sum())
        nll += float(F.cross_entropy(logits, y[where], reduction="sum"))
        total += int(where.sum())
    model.train(was)
    return right / max(total, 1), nll / max(total, 1)


def accuracy(model: RecallModel, inputs: torch.Tensor, labels: torch.Tensor,
             device: torch.device) -> float:
    """Share of the scored positions predicted right (arg-max over the vocabulary)."""
    return evaluate(model, inputs, labels, device)[0]


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


def settled(history: list, window: int, margin: float, early_stop: float,
            losses: list | None = None, floor: float | None = None) -> bool:
    """Whether a run whose held-out evaluations are `history` [[step, accuracy], ...] has
    settled: it reached `early_stop`, or it has run at least 2 x `window` steps, the best
    accuracy of its last `window` steps is no more than `margin` above the best before
    them, and (with `losses`, the held-out loss at each evaluation) the least held-out
    loss of those steps is no more than `margin` (relative) below the least before. A
    plateau shorter than the window is never settled: the window then still holds the
    gain into it (or the run is too short); nor is one on which the held-out loss still
    falls, as it does on MQAR's plateau before the sudden rise (where the held-out
    accuracy sits at what the short convolution alone answers); a run flat in both for
    longer than the window is. The window is in steps, not evaluations; the extrema on
    both sides carry the evaluations' noise alike. Held-out loss, not training loss: a
    model that memorises its training set keeps lowering the one, not the other. A run
    whose best accuracy is at most `floor` (its plateau plus the margin,
    harness.train.outcome) has not settled, however flat: it has learned nothing yet."""
    if not history:
        return False
    if max(a for _, a in history) >= early_stop:
        return True
    if floor is not None and max(a for _, a in history) <= floor:
        return False
    last = history[-1][0]
    if window < 1 or last < 2 * window:
        return False
    before = [a for s, a in history if s <= last - window]
    inside = [a for s, a in history if s > last - window]
    if not (before and inside and max(inside) <= max(before) + margin):
        return False
    if not losses or any(v is None for _, v in losses):
        return True
    lost_before = [v for s, v in losses if s <= last - window]
    lost_inside = [v for s, v in losses if s > last - window]
    return bool(lost_before) and bool(lost_inside) and \
        min(lost_inside) >= (1 - margin) * min(lost_before)


class Run:
    """One training run of a configuration at one rate, advanced in segments.

    `advance(until)` trains to step `until` (at most max_steps) unless the run stops
    sooner, and returns the run's result so far (`result`). Between segments the run keeps
    its model, optimiser, schedule, batch order and the process's torch random state, so
    a run advanced 0 -> 200 -> 400 gives the numbers of one advanced 0 -> 400.
    """

    def __init__(self, config: TrainConfig, lr: float, plateau: float | None = None,
                 check_causal: bool = True):
        torch.set_num_threads(config.threads)
        self.config, self.lr = config, lr
        self.device = device = torch.device(config.device)
        self.sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" \
            else (lambda: None)
        self.metric = tasks.metric_of(config.task)
        self.sign = tasks.METRICS[self.metric]
        self.text = config.task == lm.TASK  # windows drawn from a corpus at every step
        if self.text:
            self.train_bytes, (self.val_x, self.val_y), self.test = datasets(config)
            self.train_x = self.train_y = None
        else:
            (train_x, train_y), (self.val_x, self.val_y), self.test = datasets(config)
            self.train_x, self.train_y = train_x.to(device), train_y.to(device)  # once
        self.model = build_model(config).to(device)
        if config.causal and check_causal:  # before any step: a mixer that reads ahead
            check_causal_model(self.model, config, device)  # is an error row
        self.opt = torch.optim.AdamW(self.model.param_groups(config.weight_decay), lr=lr)
        self.decay = None  # (start, end) of a settled run's decay; None: the cap's
        self.checkpoint = None  # the run's state from before its decay (`extend`)
        self.settles = True  # an extended run goes on to its new cap
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: schedule(s, self.config.max_steps, self.config.warmup,
                                         self.decay))
        self.order = torch.Generator().manual_seed(config.seed)
        self.perm = None if self.text else torch.randperm(len(self.train_x), generator=self.order)
        self.at = 0
        self.rng = torch.get_rng_state()
        self.best_accuracy = None  # the validation accuracy at the best score
        self.kept = None  # the model's weights at its best validation accuracy
        self.tested = None  # (accuracy, loss) on the test set at `kept`, once it ends
        # validation score (tasks.score), step, seconds; below any score before the first
        self.best = (-1.0 if self.metric == "accuracy" else -1e9, 0, 0.0)
        self.text_scores = None  # an lm run's test numbers (harness.train.lm.test_scores)
        self.to_0_9, self.history, self.losses, self.step_s = None, [], [], []
        self.held_out_loss = []  # [[step, held-out loss], ...]
        self.final_loss, self.step, self.seconds = None, 0, 0.0
        self.stopped = None  # "early_stop", "settled", "cap" or "nonfinite" once it ends
        self.failure = ""
        # The settling rule's floor: the plateau (the task's, or the caller's for a variant
        # of limited reach, harness.train.rows.plateau_of) plus the margin on this set.
        self.scored = int((self.val_y != tasks.IGNORE).sum())
        if plateau is None:
            plateau = lm.plateau(config) if self.text else tasks.get(config.task).plateau(
                config.seq_len, config.vocab_size, **config.task_param_dict)
        self.plateau = plateau  # in the metric's units (bits per byte: the train unigram's)
        # The settling rule's floor and the target, as scores (higher is better).
        self.floor = self.sign * plateau + outcome.metric_margin(self.metric, plateau,
                                                                 self.scored)
        self.target = target_score(config)

    @property
    def done(self) -> bool:
        return self.stopped is not None

    def advance(self, until: int) -> dict:
        """Train to step `until` (or until the run stops); the result so far."""
        c = self.config
        until = min(until, c.max_steps)
        rng = torch.get_rng_state()
        torch.set_rng_state(self.rng)  # this run's random state, whatever ran between
        start = time.perf_counter() - self.seconds
        try:
            with flushed_denormals():
                while not self.done and self.step < until:
                    if self.step == decay_start(c.max_steps) and self.decay is None \
                            and is_wsd(c.warmup):
                        self._keep_checkpoint()
                    self._one_step()
                    if self.done:
                        break
                    step = self.step
                    if step % c.eval_every == 0 or step == c.max_steps:
                        self._evaluate(time.perf_counter() - start)
            if self.done and self.stopped != "nonfinite" and self.tested is None:
                self._test()
        finally:
            self.seconds = time.perf_counter() - start
            self.rng = torch.get_rng_state()
            torch.set_rng_state(rng)
        return self.result()

    def _test(self) -> None:
        """The test set scored once, at the kept checkpoint (best validation score); an lm
        run's test numbers too (harness.train.lm.test_scores)."""
        if self.kept is not None:
            self.model.load_state_dict(self.kept)
        self.tested = evaluate(self.model, *self.test, self.device)
        if self.text:
            self.text_scores = lm.test_scores(self.model, self.config, self.device)

    def value(self, accuracy: float, loss: float) -> float:
        """A held-out evaluation's value in the task's metric: accuracy, or bits per byte
        (the mean cross-entropy in nats over every predicted byte / ln 2)."""
        return accuracy if self.metric == "accuracy" else loss / math.log(2)

    def scores(self, history: list) -> list:
        """[[step, score], ...] of a history in the metric's units (tasks.score)."""
        return [[s, self.sign * v] for s, v in history]

    def _one_step(self) -> None:
        c = self.config
        if self.text:  # fresh windows of the train split, from the batch-order generator
            x, y = text_windows.train_windows(self.train_bytes, c.batch, c.seq_len, self.order)
            x, y = x.to(self.device), y.to(self.device)
        else:
            if self.at + c.batch > len(self.perm):  # a new epoch, reshuffled
                self.perm, self.at = torch.randperm(len(self.train_x), generator=self.order), 0
            idx = self.perm[self.at:self.at + c.batch].to(self.device)
            self.at += c.batch
            x, y = self.train_x[idx], self.train_y[idx]
        self.sync()
        t0 = time.perf_counter()
        where = y != tasks.IGNORE
        loss = F.cross_entropy(self.model(x, where), y[where])
        aux = self.model.aux_loss()  # dsa's indexer KL; its layers learn from it alone
        self.opt.zero_grad(set_to_none=True)
        (loss if aux is None else loss + aux).backward()
        self.opt.step()
        self.sched.step()
        self.sync()
        self.step_s.append(time.perf_counter() - t0)
        self.step += 1
        value = float(loss.detach())  # the cross-entropy: the indexer's KL not in it
        kl = None if aux is None else float(aux.detach())
        if not math.isfinite(value) or not math.isfinite(0.0 if kl is None else kl):
            self.stopped = "nonfinite"
            self.failure = (f"training loss is {value}{'' if kl is None else f', indexer KL {kl}'}"
                            f" at step {self.step} (lr={self.lr:g})")
            return
        self.losses.append(value)

    def _evaluate(self, elapsed: float) -> None:
        c = self.config
        acc, loss = evaluate(self.model, self.val_x, self.val_y, self.device)
        value = self.value(acc, loss)
        score = self.sign * value
        self.history.append([self.step, value])
        self.held_out_loss.append([self.step, loss])
        if score > self.best[0]:
            self.best = (score, self.step, elapsed)
            self.best_accuracy = acc
            self.kept = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        if self.to_0_9 is None and self.metric == "accuracy" and acc >= 0.9:
            self.to_0_9 = self.step
        self.final_loss, self.losses = statistics.fmean(self.losses), []
        if score >= self.target:
            self.stopped = "early_stop"
        elif self.decay is not None and self.step >= self.decay[1]:
            self.stopped = "settled"  # the end of its decay
        elif self.decay is None and self.settles and settled(
                self.scores(self.history), c.settle_window, c.settle_margin, self.target,
                self.held_out_loss, self.floor):
            if is_wsd(c.warmup) and self.step < decay_start(c.max_steps):
                self._keep_checkpoint()  # then decay before the test evaluation
                self.decay = (self.step, min(c.max_steps,
                                             self.step + settle_decay(self.step, c.eval_every)))
            else:
                self.stopped = "settled"
        elif self.step >= c.max_steps:
            self.stopped = "cap"

    def _keep_checkpoint(self) -> None:
        """The run's state now, before its decay: model, optimiser, batch order, random
        state and what it recorded; `extend` continues from it."""
        self.checkpoint = copy.deepcopy({
            "step": self.step, "model": self.model.state_dict(),
            "opt": self.opt.state_dict(), "sched": self.sched.state_dict(),
            "perm": self.perm, "at": self.at, "order": self.order.get_state(),
            "rng": torch.get_rng_state(), "best": self.best, "kept": self.kept,
            "best_accuracy": self.best_accuracy,
            "to_0_9": self.to_0_9, "history": self.history, "losses": self.losses,
            "held_out_loss": self.held_out_loss, "final_loss": self.final_loss})

    @classmethod
    def extend(cls, checkpoint: dict, config: TrainConfig, lr: float,
               plateau: float | None = None) -> "Run":
        """A run continued from `checkpoint` (another run's, from before its decay) under
        `config`, whose cap is larger: the run that cap would have trained, to its
        decay. It goes on to its cap without settling."""
        run = cls(config, lr, plateau)
        k = copy.deepcopy(checkpoint)
        run.model.load_state_dict(k["model"])
        run.opt.load_state_dict(k["opt"])
        run.sched.load_state_dict(k["sched"])
        run.order.set_state(k["order"])
        run.perm, run.at, run.rng, run.step = k["perm"], k["at"], k["rng"], k["step"]
        run.best, run.kept, run.to_0_9 = k["best"], k["kept"], k["to_0_9"]
        run.best_accuracy = k.get("best_accuracy", k["best"][0])
        run.history, run.held_out_loss = k["history"], k["held_out_loss"]
        run.losses, run.final_loss = k["losses"], k["final_loss"]
        run.settles = False
        return run

    def result(self) -> dict:
        """status "ok" with: accuracy (best validation accuracy), test_accuracy (the test
        set's at that checkpoint, scored once the run has ended; None before), steps and
        time_to_best_s (when the best was reached), steps_to_0_9 (first evaluation at >=
        0.9, else None), step_ms (median time of a training step: forward, backward,
        optimiser), final_loss (mean training loss since the previous evaluation),
        train_s (the run's wall time), steps_run, n_params, history [[step, accuracy],
        ...], held_out_loss [[step, loss], ...], rising (still_rising of that history),
        settled (the settling rule on both), stopped (early_stop, settled, cap, or None
        while it may go on), plateau (the settling rule's) and val_scored (the scored
        positions of the held-out set); `metric`, `score` (the best validation value as a
        score, higher is better), `value` (it in the metric's units); an lm run's
        `test_text` (harness.train.lm.test_scores). status "nonfinite" when the training
        loss turned NaN or Inf."""
        if self.stopped == "nonfinite":
            return {"status": "nonfinite", "reason": self.failure, "steps_run": self.step,
                    "train_s": self.seconds}
        c = self.config
        scores = self.scores(self.history)
        out = {"status": "ok", "reason": "", "metric": self.metric, "score": self.best[0],
                "value": self.sign * self.best[0] if self.history else None,
                "accuracy": self.best_accuracy if self.history else -1.0,
                "steps": self.best[1],
                "time_to_best_s": self.best[2], "steps_to_0_9": self.to_0_9,
                "step_ms": 1e3 * statistics.median(self.step_s) if self.step_s else None,
                "final_loss": self.final_loss, "train_s": self.seconds,
                "steps_run": self.step, "n_params": self.model.n_params(),
                "history": self.history, "held_out_loss": self.held_out_loss,
                "rising": still_rising(scores, self.target,
                                       outcome.metric_margin(self.metric, None, None)
                                       if self.metric != "accuracy" else RISE_MARGIN),
                "settled": self.stopped in ("early_stop", "settled") or settled(
                    scores, c.settle_window, c.settle_margin, self.target,
                    self.held_out_loss, self.floor),
                "stopped": self.stopped, "plateau": self.plateau, "val_scored": self.scored,
                "test_accuracy": None if self.tested is None else self.tested[0]}
        if self.text:
            out["test_text"] = self.text_scores
        return out


CAUSAL_TOL = 1e-4  # relative: a causal model's earlier logits move by rounding at most


class NotCausal(ValueError):
    """A configuration trained causally whose model reads later positions."""


@torch.no_grad()
def check_causal_model(model: RecallModel, config: TrainConfig, device) -> None:
    """NotCausal unless the model's logits at positions before t are unchanged when the
    tokens from t on change (t = seq_len / 2, two random sequences of the configuration's
    vocabulary from its seed): run on the initial weights, before any step, so a mixer that
    reads ahead fails here, not after training on answers it could see."""
    N = config.seq_len
    if N < 2 or config.vocab_size < 2:
        return
    g = torch.Generator().manual_seed(config.seed)
    x = torch.randint(0, config.vocab_size, (2, N), generator=g)
    t = N // 2
    y = x.clone()
    y[:, t:] = (x[:, t:] + 1 + torch.randint(0, config.vocab_size - 1, (2, N - t),
                                             generator=g)) % config.vocab_size
    was = model.training
    model.eval()
    cuda = [device] if torch.device(device).type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=cuda):  # the run's random state left as it was
            a, b = model(x.to(device))[:, :t], model(y.to(device))[:, :t]
    finally:
        model.train(was)
    moved = float((a - b).abs().max())
    scale = max(float(a.abs().max()), 1e-6)
    if not (math.isfinite(moved) and math.isfinite(scale)):
        return  # a non-finite output is the training's to report (status nonfinite)
    if not moved <= CAUSAL_TOL * scale:
        raise NotCausal(f"{config.variant} is not causal in this model: its logits before "
                        f"position {t} move by {moved:.3g} (of {scale:.3g}) when the tokens "
                        f"from {t} on change; a causal task cannot be trained on it")


def target_score(config: TrainConfig) -> float:
    """`early_stop` as a score (tasks.score): the accuracy that ends a run, or on a
    bits_per_byte task the bits per byte at or below which it ends (0: never)."""
    return tasks.score(tasks.metric_of(config.task), config.early_stop)


def train(config: TrainConfig, lr: float) -> dict:
    """Train one model at one learning rate to its end (early_stop, settled or the cap);
    Run.result's fields."""
    return Run(config, lr).advance(config.max_steps)
